"""GEAR's budget (docs/methods.md §0, §0.1, §15.7-15.8): the measured headline of a side in a
regime, fp16 buffer included, and the fit over the knob grid: the admissible points (at most 1.02 x
each target), the chosen knobs, the joint K/V fit and the message when nothing is admissible.
"""

from __future__ import annotations

import bisect
import dataclasses

from .base import Regime, Unsupported
from .budget import (AT_TARGET, describe, no_joint_pair, over_ceiling, scored_reads, side_unreachable,
                     under_ceiling, unreachable)
from .gear_codec import _EPS, SideCodec
from .joint_budget import admissible_pairs

FIT_BITS = tuple(range(1, 9))
GROUP_GRID = (32, 64, 128)
MAX_BLOCK = 256
SPARSITY_GRID = (0.0, 0.01, 0.02)
RANK_GRID = (1, 2, 3, 4)


def headline(cost: float, block: int, regime: Regime, prompt_cost: float | None = None) -> float:
    """The measured bpd of one side in ``regime`` (docs/methods.md §0): the mean over the scored
    positions of what each read, bits / tokens held, with ``cost`` bits per compressed element,
    16 per buffered one. Query p reads n_b floor(p / n_b) tokens compressed (the prefill's own
    prediction: the stored prompt). ``prompt_cost``: the one-block prompt's cost (``prompt=
    "one_block"`` after a prefill)."""
    held, quant = scored_reads(regime, block, "k")
    bits = quant * cost + (held - quant) * 16.0
    if prompt_cost is not None and regime.kind == "prefill":
        m = block * (regime.tokens // block)
        bits = bits + m * (prompt_cost - cost)
    return float((bits / held).mean())


def _side_points(side: str, target: float, heads: int, d: int, block: int, regime: Regime, opts: dict,
                 budget: str, prompt_rank: int | None) -> list:
    """(predicted, preference, knobs) of every grid point of one side at n_b = ``block``."""
    length = block if side == "k" else heads * d
    out, seen = [], set()
    for b in FIT_BITS:
        for g in GROUP_GRID:
            if length % g:
                continue
            for s in SPARSITY_GRID:
                for r in RANK_GRID:
                    if r > min(block, d):
                        continue
                    try:
                        codec = SideCodec(side, b, g, s, r, **opts)
                    except ValueError:
                        continue
                    k = codec.outliers(block, heads, d)
                    if (b, g, k, r) in seen:
                        continue
                    seen.add((b, g, k, r))
                    pred = _predict(codec, block, heads, d, regime, budget, prompt_rank)
                    miss = abs(pred - target) / target
                    out.append((pred, (b, -g, r, k, -miss), {"bits": b, "group": g, "sparsity": s, "rank": r}))
    return out


def _predict(codec: SideCodec, block: int, heads: int, d: int, regime: Regime, budget: str,
             prompt_rank: int | None) -> float:
    cost = codec.cost(block, heads, d)
    if budget == "nominal":
        return cost
    prompt_cost = None
    if prompt_rank is not None and regime.kind == "prefill" and regime.tokens >= block:
        m = block * (regime.tokens // block)
        prompt_cost = dataclasses.replace(codec, rank=min(prompt_rank, m, d)).cost(m, heads, d)
    return headline(cost, block, regime, prompt_cost)


def block_grid() -> tuple[int, ...]:
    """n_b tried by the fit: multiples of the smallest group up to :data:`MAX_BLOCK`."""
    g = min(GROUP_GRID)
    return tuple(range(g, MAX_BLOCK + 1, g))


def _best_per_family(points: list) -> list:
    """Of one side's points at one n_b, the most preferred of each (b, r), in preference order."""
    best: dict = {}
    for x in points:
        fam = (x[2]["bits"], x[2]["rank"])
        if fam not in best or x[1] > best[fam][1]:
            best[fam] = x
    return sorted(best.values(), key=lambda x: x[1], reverse=True)


def admissible_fits(target_k: float, target_v: float | None, heads: int, d: int, regime: Regime, opts: dict,
                    budget: str = "measured", prompt_rank: int | None = None) -> list[dict]:
    """The admissible grid points (predicted bpd under the ceiling of each target,
    :func:`methods.budget.under_ceiling`, docs/methods.md §0.1), one n_b for both sides, in the
    preference of docs/methods.md §15.12 (keys first, values second). With a value target, at each
    n_b the pairs of each side's most preferred point of each (b, r) (every pair would be up to
    288 x 288 per n_b)."""
    ranked = []
    for nb in block_grid():
        keys = [x for x in _side_points("k", target_k, heads, d, nb, regime, opts, budget, prompt_rank)
                if under_ceiling(x[0], target_k)]
        keys = keys if target_v is None else _best_per_family(keys)
        vals = [None] if target_v is None else _best_per_family(
            [x for x in _side_points("v", target_v, heads, d, nb, regime, opts, budget, prompt_rank)
             if under_ceiling(x[0], target_v)])
        ranked += [((k[1], () if v is None else v[1]), _fit(nb, k, v)) for k in keys for v in vals]
    ranked.sort(key=lambda x: x[0], reverse=True)
    return [fit for _, fit in ranked]


def _fit(nb: int, k, v) -> dict:
    return {"block": nb, "k": k[2], "v": None if v is None else v[2], "predicted_bpd_k": k[0],
            "predicted_bpd_v": None if v is None else v[0]}


def knob_options(fit: dict) -> dict:
    """The knobs of a fit (what ``Gear.use_knobs`` takes): n_b and each side's b, G, s, r."""
    return {"block": fit["block"], "k": fit["k"], "v": fit["v"]}


def chosen_fit(choice: dict, target_k: float, target_v: float | None, heads: int, d: int, regime: Regime,
               opts: dict, budget: str = "measured", prompt_rank: int | None = None) -> dict:
    """The fit of the knobs ``choice`` ({"block", "k", "v"}); :class:`Unsupported` unless both
    sides code a block and are under their ceilings."""
    nb = int(choice["block"])
    out = {"block": nb, "k": choice["k"], "v": choice["v"] if target_v is not None else None}
    for side, target in (("k", target_k), ("v", target_v)):
        if target is None:
            out["predicted_bpd_v"] = None
            continue
        knobs = out[side]
        try:
            codec = SideCodec(side, int(knobs["bits"]), int(knobs["group"]), float(knobs["sparsity"]),
                              int(knobs["rank"]), **opts)
            codec.check(nb, heads, d)
        except (ValueError, TypeError, KeyError) as err:
            raise Unsupported(f"gear: knobs {choice} do not code a block: {err}") from err
        pred = _predict(codec, nb, heads, d, regime, budget, prompt_rank)
        if not under_ceiling(pred, target):
            raise Unsupported(f"gear: knobs {choice} are not admissible: {side} predicts {pred:.3f} over "
                              f"{1 + AT_TARGET:g} x {target:g} in {describe(regime)}")
        out[f"predicted_bpd_{side}"] = pred
    return out


def fit_knobs(target_k: float, target_v: float | None, heads: int, d: int, regime: Regime, opts: dict,
              budget: str = "measured", prompt_rank: int | None = None, choice: dict | None = None) -> dict:
    """The knobs ``choice`` when given and admissible (:func:`chosen_fit`), else the most preferred
    admissible grid point (:func:`admissible_fits`); :class:`Unsupported` when none is."""
    if choice is not None:
        return chosen_fit(choice, target_k, target_v, heads, d, regime, opts, budget, prompt_rank)
    fits = admissible_fits(target_k, target_v, heads, d, regime, opts, budget, prompt_rank)
    if not fits:
        raise Unsupported(why_unreachable(target_k, target_v, heads, d, regime, opts, budget, prompt_rank))
    return fits[0]


def joint_fits(target_kv: float, heads: int, d: int, regime: Regime, opts: dict, budget: str = "measured",
               prompt_rank: int | None = None) -> list[dict]:
    """``joint_kv``: the (key point, value point) pairs at one n_b whose mean predicted bpd is under
    the ceiling of ``target_kv`` (1 + :data:`AT_TARGET`), in the order of
    :func:`methods.joint_budget.admissible_pairs` (within the band first, the most balanced first,
    then the cheaper pairs), then the per-side preference (keys first). Of up to 288 x 288 pairs
    per n_b, those near the band and, per key point, the dearest value point under the ceiling
    (any cheaper one ranks below it)."""
    pairs = []
    for nb in block_grid():
        keys = _side_points("k", target_kv, heads, d, nb, regime, opts, budget, prompt_rank)
        vals = _side_points("v", target_kv, heads, d, nb, regime, opts, budget, prompt_rank)
        lo, hi = 2 * target_kv * (1 - AT_TARGET) - _EPS, 2 * target_kv * (1 + AT_TARGET) + _EPS
        vals = sorted(vals, key=lambda v: v[0])
        costs = [v[0] for v in vals]
        for k in keys:
            top = bisect.bisect_right(costs, hi - k[0])
            near = bisect.bisect_left(costs, lo - k[0])
            pairs += [((k, nb), (v, nb)) for v in vals[min(near, max(0, top - 1)):top]]
    ranked = admissible_pairs(pairs, lambda p: p[0][0], target_kv, AT_TARGET, lambda kp, vp: (kp[0][1], vp[0][1]))
    return [{"block": nb, "k": k[2], "v": v[2], "predicted_bpd_k": k[0], "predicted_bpd_v": v[0]}
            for (k, nb), (v, _) in ranked]


def fit_joint(target_kv: float, heads: int, d: int, regime: Regime, opts: dict, budget: str = "measured",
              prompt_rank: int | None = None, choice: dict | None = None) -> dict:
    """The first of :func:`joint_fits`, or the pair with the knobs ``choice`` (the held-out knob
    search's); :class:`Unsupported` when none is admissible or ``choice`` is not one of them."""
    fits = joint_fits(target_kv, heads, d, regime, opts, budget, prompt_rank)
    if not fits:
        raise Unsupported(no_joint_pair("gear", target_kv, regime, " at one n_b") + "; "
                          + why_unreachable(target_kv, target_kv, heads, d, regime, opts, budget, prompt_rank))
    if choice is None:
        return fits[0]
    match = [f for f in fits if knob_options(f) == choice]
    if not match:
        raise Unsupported(f"gear: knobs {choice} are not an admissible joint pair at bpd_KV={target_kv:g} "
                          f"in {describe(regime)}")
    return match[0]


def why_unreachable(target_k, target_v, heads, d, regime, opts, budget, prompt_rank) -> str:
    """Each side's reachable range on the grid and the points nearest its target."""
    what = ("the per-block figure of docs/methods.md §15.7" if budget == "nominal" else
            f"the measured headline in {describe(regime)}, fp16 buffer included")
    parts = []
    for side, target, name in (("k", target_k, "bpd"), ("v", target_v, "v_bpd")):
        if target is None:
            continue
        pts = [(x[0], nb, x[2]) for nb in block_grid()
               for x in _side_points(side, target, heads, d, nb, regime, opts, budget, prompt_rank)]
        inside = any(under_ceiling(p[0], target) for p in pts)
        why = ("under the ceiling only at an n_b where the other side has no admissible point" if inside
               else over_ceiling(pts, target, lambda p: f"{p[0]:.3f} at (b={p[2]['bits']}, G={p[2]['group']}, "
                                 f"s={p[2]['sparsity']}, r={p[2]['rank']}, n_b={p[1]})", key=lambda x: x[0]))
        parts.append(side_unreachable(name, target, [p[0] for p in pts], f", {why}"))
    grid = (f"b in 1..8, G in {list(GROUP_GRID)}, n_b a multiple of G up to {MAX_BLOCK}, s in "
            f"{list(SPARSITY_GRID)}, r in {list(RANK_GRID)}")
    return unreachable("gear", f"({what}; grid {grid})", parts,
                       " (budget=nominal maps the per-block formula; explicit knobs run as set)")
