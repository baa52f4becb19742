"""The budget fit the methods share: when a bpd is at its target, what a regime's scored positions
read from a cache with a full-precision window, the nominal group-quantization map, and how a
method says that a target is out of reach (docs/methods.md §0, §0.1, §8).

* **At the target** (:func:`in_band`): a predicted (or measured) bpd x is at target t when
  |x - t| <= :data:`AT_TARGET` t, plus a slack ``eps`` for rounding (the tables' mark, 2 %).
  :func:`under_ceiling`: x <= (1 + :data:`AT_TARGET`) t, the admissible side of the band
  (docs/methods.md §0.1): a configuration under its target is admissible. ``band`` and ``eps``
  are parameters: each method passes its own slack, written at its call.
* **Knob candidates** (:func:`spread`): which admissible configurations the held-out knob search
  scores (``KVMethod.knob_candidates``, kvbench/fit/knob_search.py), in one stated order.
* **Scored reads** (:func:`scored_reads`): at every position the regime scores, the tokens held
  and how many of them are stored compressed, for a cache whose newest tokens wait in full
  precision (KIVI's residual R, GEAR's n_b buffer; §2.3).
* **Nominal map** (:func:`grid_choice`): the largest b + 32/G at or below the target over
  :data:`BITS_GRID` x :data:`GROUP_GRID` (KIVI's kernels; SVDq's values use the same map).
* **Messages**: :func:`describe` (the regime in words) and the parts of an ``Unsupported``
  message: :func:`unreachable`, :func:`side_unreachable`, :func:`off_band`, :func:`over_ceiling`,
  :func:`reach`, :func:`no_joint_pair`.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

import torch

from .base import Regime, Unsupported

#: relative band in which a predicted or measured bpd counts as at its target (the tables' mark)
AT_TARGET = 0.02
#: the default absolute slack of the band's comparisons (float rounding of the predictions)
EPS = 1e-9
#: the nominal map's grid: bit widths (KIVI's kernels have 2/4/8) and group sizes
BITS_GRID = (1, 2, 3, 4, 8)
GROUP_GRID = (32, 64, 128)
#: (b, G) without a target: KIVI-2
DEFAULT_BITS = 2
DEFAULT_GROUP = 32

P = TypeVar("P")


def in_band(x: float, target: float, band: float = AT_TARGET, eps: float = EPS) -> bool:
    """Whether ``x`` lies within ``band`` (relative) of ``target``, ``eps`` of absolute slack."""
    return abs(x - target) <= band * target + eps


def under_ceiling(x: float, target: float, band: float = AT_TARGET, eps: float = EPS) -> bool:
    """Whether ``x`` is at most ``band`` (relative) above ``target``, ``eps`` of absolute slack."""
    return x <= target + band * target + eps


def spread(points: Sequence[P], family: Callable[[P], Hashable], limit: int | None = None,
           first: P | None = None) -> list[P]:
    """The knob search's candidates from admissible ``points`` listed in the method's preference
    order (best first): ``first`` (the paper setting, when the caller found it admissible) leads,
    then one
    point of each family in turn, families ordered by ``family(p)`` descending (the most bits
    first), each family's points in the order given, until ``limit`` (None: all of them).
    Deterministic: the same points give the same list."""
    families: dict = {}
    for p in points:
        if first is None or p != first:
            families.setdefault(family(p), []).append(p)
    queues = [families[f] for f in sorted(families, reverse=True)]
    out = [] if first is None else [first]
    depth = 0
    while any(depth < len(q) for q in queues):
        out += [q[depth] for q in queues if depth < len(q)]
        depth += 1
    return out if limit is None else out[:limit]


def describe(regime: Regime) -> str:
    """The regime in words, as messages and knobs name it."""
    if regime.kind == "qall":
        return f"Q-all over {regime.tokens} positions"
    return f"a {regime.tokens}-token prefill + {regime.decode} decoded positions"


def scored_reads(regime: Regime, residual: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens held, of them quantized) at each position whose prediction the regime scores
    (docs/methods.md §0, §2.3), float64, for a full-precision window of ``residual`` tokens. Q-all:
    the query at p reads p + 1 tokens, keys below R floor(p/R) and values below p - R quantized.
    After a P-token exact prefill: its own prediction reads the stored prompt (keys below
    R floor(P/R), values below P - R), then each decoded query at p = P..P+D-1 reads as in Q-all."""
    r = float(residual)
    if regime.kind == "qall":
        p = torch.arange(regime.tokens, dtype=torch.float64)
    else:
        p = torch.arange(regime.tokens - 1, regime.tokens + regime.decode, dtype=torch.float64)
    held = p + 1
    if side == "k":
        quant = r * torch.floor(p / r)
    else:
        quant = (p - r).clamp(min=0)
    if regime.kind == "prefill":  # the prefill's own prediction: the stored P-token prompt
        n = float(regime.tokens)
        quant[0] = r * math.floor(n / r) if side == "k" else max(0.0, n - r)
    return held, quant


def grid_choice(
    target: float | None,
    *,
    bits: int | None = None,
    group: int | None = None,
    max_group: int | None = None,
    divides: int | None = None,
    side: str = "bpd",
    method: str = "kivi",
) -> tuple[int, int]:
    """(b, G) with the largest b + 32/G <= target over the knob grid (fixed knobs stay fixed).

    ``max_group``: G <= this (values: G <= d); ``divides``: G must divide it (keys: R;
    values: d)."""
    if target is None:
        return (bits or DEFAULT_BITS), (group or DEFAULT_GROUP)
    cands = []
    for b in (bits,) if bits is not None else BITS_GRID:
        for g in (group,) if group is not None else GROUP_GRID:
            if max_group is not None and group is None and g > max_group:
                continue
            if divides is not None and group is None and divides % g:
                continue
            cands.append((b + 32.0 / g, b, g))
    if not cands:
        raise Unsupported(f"{method}: no group size in {GROUP_GRID} fits ({side})")
    fit = [c for c in cands if c[0] <= target + EPS]
    if not fit:
        lo = min(c[0] for c in cands)
        raise Unsupported(
            f"{method}: {side}={target} is below the reachable range: b + 32/G >= {lo:g} "
            f"(b in {BITS_GRID if bits is None else (bits,)}, G in "
            f"{sorted({c[2] for c in cands})}), plus the fp16 residual share"
        )
    _, b, g = max(fit)
    return b, g


# ---- the parts of an Unsupported message ------------------------------------------------------

def reach(values: Iterable[float]) -> str:
    """``[lo, hi]`` of predicted bpd values, two decimals."""
    values = list(values)
    return f"[{min(values):.2f}, {max(values):.2f}]"


def side_unreachable(name: str, target: float, values: Iterable[float], why: str) -> str:
    """One side's part: ``bpd=3: reachable range [2.67, 10.00]`` followed by ``why``."""
    return f"{name}={target:g}: reachable range {reach(values)}{why}"


def off_band(points: Sequence[tuple], target: float, fmt: Callable[[tuple], str],
             key: Callable[[tuple], object] | None = None) -> str:
    """No grid point in the band: the points (bpd first) nearest ``target`` from below and from
    above, each written by ``fmt``; ``key`` orders points of equal bpd (default: the whole tuple)."""
    below = max((p for p in points if p[0] < target), default=None, key=key)
    above = min((p for p in points if p[0] > target), default=None, key=key)
    near = ", ".join(fmt(p) for p in (below, above) if p)
    return f"no grid point within {AT_TARGET:.0%}; nearest {near}"


def over_ceiling(points: Sequence[tuple], target: float, fmt: Callable[[tuple], str],
                 key: Callable[[tuple], object] | None = None) -> str:
    """No grid point at or under the ceiling (:func:`under_ceiling`): the cheapest point (bpd
    first), written by ``fmt``; ``key`` orders points of equal bpd (default: the whole tuple)."""
    cheapest = min(points, key=key) if key is not None else min(points)
    return f"no grid point at or under {1 + AT_TARGET:g} x the target; the cheapest {fmt(cheapest)}"


def unreachable(method: str, where: str, parts: Iterable[str], tail: str = "") -> str:
    """``<method>: not reachable <where>: <part>; <part><tail>``."""
    return f"{method}: not reachable {where}: " + "; ".join(parts) + tail


def no_joint_pair(method: str, target_kv: float, regime: Regime, shared: str = "") -> str:
    """``joint_kv`` found no pair (``shared``: the knob both sides share, e.g. " at one R")."""
    return (f"{method}: joint_kv: no pair of key and value points{shared} has a mean within "
            f"{AT_TARGET:.0%} of bpd_KV={target_kv:g} in {describe(regime)}")
