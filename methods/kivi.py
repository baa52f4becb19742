"""KIVI: tuning-free asymmetric 2-bit KV-cache quantization with a full-precision residual window.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", ICML 2024, arXiv 2402.02750; code jy-yuan/KIVI. Specification: docs/methods.md §2
(quantizer §1.1, regimes §1.3, budget map §8).

* Keys **post-RoPE**, per-channel: for each KV head and channel, groups of ``G`` consecutive tokens
  aligned at multiples of ``G`` from position 0 share (s, mn) (§2.2). Values per-token: groups of
  ``G_v`` consecutive channels of one token. Asymmetric min-max, fp16 (s, mn)
  (:mod:`methods.groupquant`).
* Residual ``R`` (§2.3): for query position t, **key s is read quantized iff s < R*floor(t/R)**,
  **value s iff s < t - R**. After n tokens the stored cache holds keys 0..R*floor(n/R)-1 and values
  0..n-R-1 as packed codes, the rest at full precision. ``prefill=True``: exact attention, then that
  storage rule with n = P. ``prefill=False``: a chunk of T new tokens is attended with the per-query
  mix of §2.3 (logits_ts from k_hat_s or k_s, outputs from v_hat_s or v_s), vectorized; it equals T
  single-token steps.
* bpd (§2.4): bpd_K(T) = [(T - n_K)(b + 32/G) + 16 n_K]/T, n_K = T mod R;
  bpd_V(T) = [(T - n_V)(b_v + 32/G_v) + 16 n_V]/T, n_V = min(T, R). Measured by ``stored_bits``.

Decisions where docs/methods.md is silent:

* **Budget** (``budget``, docs/methods.md §0, §8). ``"measured"`` (default): the target is the
  job's *measured* headline in its regime (``set_regime``): Q-all (PPL track A, zero-shot), the mean
  over the T query positions of what each read; after a P-token exact prefill (PPL track B,
  LongBench, RULER), the mean over the scored positions: the prefill's own prediction at the stored
  prompt, then the D decoded positions. The fp16 residual window is what makes it differ from the
  nominal figure (b=2, G=32, R=128 in Q-all at T=2048: 4.885 against 3.00 at the end of the
  window). Grid: b in 1..8 (every width the packed cache stores exactly; the paper's kernels have
  2/4/8 and docs/methods.md §2.4 admits 1 and 3 as fake quantization, 5-7 are the same arithmetic);
  G in {32, 64, 128} (values: G <= d, G divides d); R a multiple of the key group from 32 to 128
  (the paper's LongBench R; its GSM8K example uses 32). R = 0 is not a KIVI setting: the official
  code takes P mod R, and per-channel key groups wait in full precision until they complete, which
  R = G already is. One R for keys and values, as in KIVI's code. ``joint_kv=True`` (the KV-track
  rows): the pair whose *mean* is within the band of bpd_KV instead, the most balanced first
  (:mod:`methods.joint_budget`). The predicted figure is the
  exact bit count (:func:`headline_bpd`, the §2.3 storage rule with codes + fp16 scale and minimum
  per group + 16 bits per full-precision element, what ``stored_bits`` measures). Among the grid
  points within **2 % of the target on either side** (the tables' "at target" band; each side at
  its own target in the KV-track) the fit takes the most key bits, then the most value bits, then
  the largest R, then the smallest groups (finer groups, the paper's G = 32), then the closest. No
  point in the band -> :class:`Unsupported` naming the reachable range in that regime and the
  nearest grid points (the grid is sparse: in Q-all at T = 2048 keys reach 2.67-10.0, but e.g. 3.0
  falls between 2.71 and 3.17). ``"nominal"``: the asymptotic mapping, the largest
  b + 32/G <= target over b in {1,2,3,4,8}, G in {32,64,128} (2.0 -> (1,32), 2.25 -> (2,128),
  3.0 -> (2,32), 4.0 -> (3,32)), R = 128; below its floor (1.25 at b=1, G=128) ->
  :class:`Unsupported`. ``knobs()`` says which (``budget``, ``fitted``, ``not_fitted``) and the
  headline the knobs predict in the job's regime (``predicted``).
* Explicit options override the fit: with any of ``bits``, ``group``, ``residual``, ``v_bits``,
  ``v_group`` given, the job runs those knobs, the others mapped as ``"nominal"`` maps them
  (``group`` defaults to 32 with no target, R to 128), and reports its measured bpd without a
  target check (``knobs.not_fitted`` says so). The paper's setting is ``bits=2 group=32
  residual=128``. With no key target: KIVI-2 (b=2, G=32, R=128), not fitted.
* Values: ``bpd_v=None`` and ``v_bits=None`` -> values are kept exactly (16 bits, no quantization).
  ``v_bits`` given -> values quantized even without a target. ``v_group`` separate from ``group``
  (one target per side; KIVI's code shares one group size, so pass ``v_group=group`` to mimic it).
* Full-precision tokens are kept in the model's dtype (fp16/bf16 on a GPU; a float32 CPU model keeps
  float32, like :class:`methods.codec_state.ExactCodec`) and counted 16 bits per element.
* The state holds what is counted (docs/design.md §2): the packed codes and fp16 scales/minima,
  grown along their token axis (:class:`methods.buffers.SideStore`), and the full-precision tail.
  Attention dequantizes the groups into a transient copy in the model's dtype, as a fused kernel
  would on the fly: a single decode step reads exactly the prefixes quantized before it (§2.3), so
  it is one fused SDPA call over the decoded groups followed by the tail, with no float32 copy of
  the cache and no mask; the groups it completes are quantized after it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .attention import causal_attention
from .base import KVMethod, LayerState, Regime, Unsupported, query_positions
from .blocked_attention import SDPA_MIN_QUERIES, blocked_attention, mixed_attention
from .bookkeeping import host_ops, one_read
from .buffers import Growing, SideStore, row_elements
from .groupquant import quantize_dequantize_groups
from .joint_budget import best_pair

BITS_GRID = (1, 2, 3, 4, 8)
GROUP_GRID = (32, 64, 128)
DEFAULT_BITS = 2
DEFAULT_GROUP = 32
DEFAULT_RESIDUAL = 128  # R of the paper's LongBench runs (docs/methods.md §2.2)
_EPS = 1e-9


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
    fit = [c for c in cands if c[0] <= target + _EPS]
    if not fit:
        lo = min(c[0] for c in cands)
        raise Unsupported(
            f"{method}: {side}={target} is below the reachable range: b + 32/G >= {lo:g} "
            f"(b in {BITS_GRID if bits is None else (bits,)}, G in "
            f"{sorted({c[2] for c in cands})}), plus the fp16 residual share"
        )
    _, b, g = max(fit)
    return b, g


def _advance(store: SideStore, x_new, n_quant_new, quantize):
    """Append ``x_new`` and quantize up to position ``n_quant_new``. Returns the positions
    [n_quant_old, N) in both versions, (x_hat, x_exact), for the attention mix."""
    exact = store.exact_tail(x_new)
    store.append(x_new)
    hat = store.flush(n_quant_new, quantize)
    if hat is None:
        return exact, exact
    m = hat.shape[2]
    return (hat if m == exact.shape[2] else torch.cat([hat, exact[:, :, m:]], dim=2)), exact


@dataclass
class KiviLayerState(LayerState):
    bits: int
    group: int
    residual: int
    v_bits: int | None
    v_group: int | None
    k: SideStore = field(default_factory=SideStore)
    v: SideStore = field(default_factory=SideStore)
    v_exact: Growing = field(default_factory=Growing)  # values when they are not quantized
    _seen: int = 0

    def _quantizers(self, v):
        qk = lambda x: quantize_dequantize_groups(x, self.bits, self.group, axis=2)  # noqa: E731
        vg = self.v_group or min(self.group, v.shape[-1])
        qv = lambda x: quantize_dequantize_groups(x, self.v_bits, vg, axis=3)  # noqa: E731
        return qk, qv

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            self.store_prompt(k, v)
            return causal_attention(q, k, v, scaling)
        n0, t = self._seen, k.shape[2]
        n = n0 + t
        r = self.residual
        qk, qv = self._quantizers(v)
        if t == 1:
            return self._step(q, k, v, scaling, qk, qv)
        kp = self.k.decoded()  # read quantized by every new query
        vp = None if self.v_bits is None else self.v.decoded()
        k_hat_t, k_ex_t = _advance(self.k, k, r * (n // r), qk)
        if self.v_bits is None:
            self.v_exact.append(v)
        else:
            v_hat_t, v_ex_t = _advance(self.v, v, max(0, n - r), qv)
        self._seen = n
        with host_ops():
            self._reads = self._read_bits(n0, t, k)
        if t >= SDPA_MIN_QUERIES:
            if self.v_bits is None:
                return blocked_attention(q, kp, k_ex_t, k_hat_t, r, None, self.v_exact.data, None, None, scaling)
            return blocked_attention(q, kp, k_ex_t, k_hat_t, r, vp, v_ex_t, v_hat_t, r, scaling)
        tpos = torch.arange(n0, n, device=q.device)[:, None]
        pk = 0 if kp is None else kp.shape[2]
        key_mask = torch.arange(pk, n, device=q.device)[None, :] < r * torch.div(
            tpos, r, rounding_mode="floor"
        )
        if self.v_bits is None:
            return mixed_attention(
                q, kp, k_ex_t, k_hat_t, key_mask, None, self.v_exact.data, None, None, scaling
            )
        pv = 0 if vp is None else vp.shape[2]
        val_mask = torch.arange(pv, n, device=q.device)[None, :] < tpos - r
        return mixed_attention(
            q, kp, k_ex_t, k_hat_t, key_mask, vp, v_ex_t, v_hat_t, val_mask, scaling
        )

    def store_prompt(self, k, v) -> None:
        """Store a prompt of P tokens as KIVI does at the end of an exact prefill (§2.3: keys
        0..R*floor(P/R)-1 and values 0..P-R-1 quantized, the rest at fp16), without attending:
        ``attend(prefill=True)`` is this plus exact causal attention, and compose(snapkv, kivi)
        hands it the kept prompt."""
        if self._seen:
            raise ValueError("prefill must be the first call on a layer state")
        n, r = k.shape[2], self.residual
        qk, qv = self._quantizers(v)
        self.k.append(k)
        self.k.flush(r * (n // r), qk)
        if self.v_bits is None:
            self.v_exact.append(v)
        else:
            self.v.append(v)
            self.v.flush(max(0, n - r), qv)
        self._seen = n
        self._reads = None

    def _step(self, q, k, v, scaling, qk, qv):
        """One decode token. The query at position n0 reads key s quantized iff s < R floor(n0/R)
        and value s iff s < n0 - R (§2.3): exactly the prefixes quantized before this step. So it
        reads the cache as it is stored once its token is appended (the packed groups decoded, then
        the full-precision tail), with one fused SDPA call in the model's dtype (no mask); the
        groups this token completes are quantized afterwards."""
        n0 = self._seen
        n = n0 + 1
        r = self.residual
        self.k.append(k)
        if self.v_bits is None:
            self.v_exact.append(v)
            values = self.v_exact.data
        else:
            self.v.append(v)
            values = self.v.read()
        out = causal_attention(q, self.k.read(), values, scaling)
        self.k.flush(r * (n // r), qk)
        if self.v_bits is not None:
            self.v.flush(max(0, n - r), qv)
        self._seen = n
        self._reads = self._read_bits(n0, 1, k)
        return out

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, H, n, d] as a single query at the next position reads them (the packed
        groups decoded, then the full-precision tails), in the model's dtype."""
        return self.k.read(), (self.v_exact.data if self.v_bits is None else self.v.read())

    def _read_bits(self, n0, t, k):
        """§2.3 per query position p: keys 0..R*floor(p/R)-1 quantized, values 0..p-R-1."""
        r, row = self.residual, k.shape[0] * k.shape[1] * k.shape[3]
        if t == 1:
            bits_k = one_read(self.k.reads(n0 + 1, r * (n0 // r), row))
            if self.v_bits is None:
                return bits_k, one_read((n0 + 1) * 16.0 * row)
            return bits_k, one_read(self.v.reads(n0 + 1, max(0, n0 - r), row))
        p = query_positions(n0, t)
        bits_k = self.k.reads(p + 1, r * torch.floor(p / r), row)
        if self.v_bits is None:
            return bits_k, (p + 1) * 16.0 * row
        return bits_k, self.v.reads(p + 1, (p - r).clamp(min=0), row)

    def stored_bits(self):
        if self.v_bits is None:
            return self.k.bits(), self.v_exact.n * row_elements(self.v_exact) * 16
        return self.k.bits(), self.v.bits()

    @property
    def n_seen(self):
        return self._seen


def kivi_bpd(n_tokens, bits: int, group: int, n_full):
    """§2.4: [(T - n_full)(b + 32/G) + 16 n_full] / T (numbers, or float64 tensors elementwise)."""
    t = n_tokens
    return ((t - n_full) * (bits + 32.0 / group) + 16.0 * n_full) / t


# ---- budget='measured': the knob grid and the headline it predicts ----------------------------

#: bits tried by the fit: every width the packed cache stores exactly (KIVI's kernels: 2/4/8)
FIT_BITS = tuple(range(1, 9))
#: largest residual window tried by the fit: the paper's LongBench setting (docs/methods.md §2.2)
MAX_RESIDUAL = 128
#: relative band in which a measured bpd counts as at its target (the tables' mark)
AT_TARGET = 0.02
BUDGETS = ("measured", "nominal")
#: options that, when given, switch the fit off (the job runs them as set)
KNOB_OPTIONS = ("bits", "group", "residual", "v_bits", "v_group")


def scored_reads(regime: Regime, residual: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens held, of them quantized) at each position whose prediction the regime scores
    (docs/methods.md §0, §2.3), float64. Q-all: the query at p reads p + 1 tokens, keys below
    R floor(p/R) and values below p - R quantized. After a P-token exact prefill: its own
    prediction reads the stored prompt (keys below R floor(P/R), values below P - R), then each
    decoded query at p = P..P+D-1 reads as in Q-all."""
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


def headline_bpd(bits: int, group: int, residual: int, regime: Regime, side: str) -> float:
    """The measured bpd of one side in ``regime`` (docs/methods.md §0): the mean over the scored
    positions of :func:`kivi_bpd` of what each one read, exact (b + 32/G bits per quantized
    element: codes plus fp16 scale and minimum per group; 16 per full-precision element)."""
    held, quant = scored_reads(regime, residual, side)
    return float(kivi_bpd(held, bits, group, held - quant).mean())


def residual_grid() -> tuple[int, ...]:
    """R tried by the fit: multiples of the smallest group up to :data:`MAX_RESIDUAL`."""
    g = min(GROUP_GRID)
    return tuple(range(g, MAX_RESIDUAL + 1, g))


def value_groups(head_dim: int) -> tuple[int, ...]:
    """Value channel groups of the grid that fit a head: G <= d and G divides d."""
    return tuple(g for g in GROUP_GRID if g <= head_dim and head_dim % g == 0)


def side_points(side: str, regime: Regime, head_dim: int, residual: int) -> list[tuple[float, int, int]]:
    """(measured bpd, b, G) of every grid point of one side at residual R (keys: G divides R)."""
    groups = [g for g in GROUP_GRID if residual % g == 0] if side == "k" else value_groups(head_dim)
    return [(headline_bpd(b, g, residual, regime, side), b, g) for b in FIT_BITS for g in groups]


def in_band(x: float, target: float) -> bool:
    return abs(x - target) <= AT_TARGET * target + _EPS


def _prefer(k, v, r) -> tuple:
    """The fit's preference among admissible points: the most key bits, then the most value bits,
    then the largest R, then the smallest groups."""
    return (k[1], 0 if v is None else v[1], r, -k[2], 0 if v is None else -v[2])


def fit_joint(target_k: float, target_v: float, head_dim: int, regime: Regime) -> dict:
    """``joint_kv``: the (key point, value point) pair at one shared R whose mean measured bpd is
    within :data:`AT_TARGET` of (target_k + target_v) / 2, the most balanced first
    (:func:`methods.joint_budget.best_pair`), then :func:`_prefer`."""
    pairs = [((k, r), (v, r)) for r in residual_grid()
             for k in side_points("k", regime, head_dim, r) for v in side_points("v", regime, head_dim, r)]
    best = best_pair(pairs, lambda p: p[0][0], (target_k + target_v) / 2, AT_TARGET,
                     lambda kp, vp: _prefer(kp[0], vp[0], kp[1]))
    if best is None:
        pts = [x[0] for r in residual_grid() for side in ("k", "v") for x in side_points(side, regime, head_dim, r)]
        raise Unsupported(f"kivi: joint_kv: no pair of key and value points at one R has a mean within "
                          f"{AT_TARGET:.0%} of bpd_KV={(target_k + target_v) / 2:g} in {describe(regime)} "
                          f"(each side reaches [{min(pts):.2f}, {max(pts):.2f}])")
    (k, r), (v, _) = best
    return {"bits": k[1], "group": k[2], "residual": r, "v_bits": v[1], "v_group": v[2],
            "predicted_bpd_k": k[0], "predicted_bpd_v": v[0]}


def fit_knobs(target_k: float, target_v: float | None, head_dim: int, regime: Regime) -> dict:
    """budget='measured': the grid point whose measured bpd (:func:`headline_bpd`) lies within
    :data:`AT_TARGET` of the key target and, with a value target, of the value target too, one
    R shared by both sides as in KIVI. Preference among those: :func:`_prefer`, then the closest to
    the targets. :class:`Unsupported` with the reachable ranges when no point is in the band."""
    best = None
    for r in residual_grid():
        keys = [x for x in side_points("k", regime, head_dim, r) if in_band(x[0], target_k)]
        vals = [None] if target_v is None else [
            x for x in side_points("v", regime, head_dim, r) if in_band(x[0], target_v)]
        for k in keys:
            for v in vals:
                miss = abs(k[0] - target_k) / target_k + (0.0 if v is None else abs(v[0] - target_v) / target_v)
                pref = (*_prefer(k, v, r), -miss)
                if best is None or pref > best[0]:
                    best = (pref, k, v, r)
    if best is None:
        raise Unsupported(unreachable(target_k, target_v, head_dim, regime))
    _, k, v, r = best
    return {"bits": k[1], "group": k[2], "residual": r, "v_bits": None if v is None else v[1],
            "v_group": None if v is None else v[2], "predicted_bpd_k": k[0],
            "predicted_bpd_v": None if v is None else v[0]}


def describe(regime: Regime) -> str:
    if regime.kind == "qall":
        return f"Q-all over {regime.tokens} positions"
    return f"a {regime.tokens}-token prefill + {regime.decode} decoded positions"


def unreachable(target_k: float, target_v: float | None, head_dim: int, regime: Regime) -> str:
    """Why no grid point fits: each side's reachable range in the regime and the grid points
    nearest the target on either side (or that no shared R serves both)."""
    grid = (f"b in {FIT_BITS[0]}..{FIT_BITS[-1]}, G in {list(GROUP_GRID)}, R in {list(residual_grid())} "
            f"(a multiple of the key group)")
    parts = []
    for side, target, name in (("k", target_k, "bpd"), ("v", target_v, "v_bpd")):
        if target is None:
            continue
        pts = [(x[0], x[1], x[2], r) for r in residual_grid() for x in side_points(side, regime, head_dim, r)]
        if not pts:
            parts.append(f"{name}: no value group in {list(GROUP_GRID)} fits head_dim={head_dim}")
            continue
        lo, hi = min(pts)[0], max(pts)[0]
        below = max((p for p in pts if p[0] < target), default=None)
        above = min((p for p in pts if p[0] > target), default=None)
        near = ", ".join(f"{p[0]:.3f} at (b={p[1]}, G={p[2]}, R={p[3]})" for p in (below, above) if p)
        shared = sorted({p[3] for p in pts if in_band(p[0], target)})
        why = (f"within {AT_TARGET:.0%} only at R in {shared}, where the other side has no point in the band"
               if shared else f"no grid point within {AT_TARGET:.0%}; nearest {near}")
        parts.append(f"{name}={target:g}: reachable range [{lo:.2f}, {hi:.2f}], {why}")
    return (f"kivi: not reachable in {describe(regime)} (measured bpd, fp16 residual window and "
            f"metadata included; grid {grid}): " + "; ".join(parts)
            + " (budget=nominal maps b + 32/G instead; explicit knobs run as set)")


@dataclass
class Kivi(KVMethod):
    """KIVI (Liu et al., ICML 2024, arXiv 2402.02750), docs/methods.md §2; see the module docstring.

    bits/group: key bits and token-group size; v_bits/v_group: value bits and channel-group size;
    residual: R, the full-precision window (a multiple of the key group). None = chosen by
    ``configure``; values exact when neither ``bpd_v`` nor ``v_bits`` is given. budget: "measured"
    (the job's measured bpd is the target) or "nominal" (b + 32/G <= target, R = 128 unless given).
    joint_kv: with both targets, fit their mean instead of each side (:func:`fit_joint`).
    ``configure`` leaves these options untouched and records its choice in ``knobs()``."""

    name = "kivi"

    bits: int | None = None
    v_bits: int | None = None
    group: int | None = None
    v_group: int | None = None
    residual: int | None = None
    budget: str = "measured"
    joint_kv: bool = False

    def __post_init__(self):
        if self.budget not in BUDGETS:
            raise ValueError(f"kivi: budget must be one of {BUDGETS}, got {self.budget!r}")
        if self.residual is not None and (isinstance(self.residual, bool) or int(self.residual) != self.residual
                                          or self.residual < 1):
            raise ValueError(f"kivi: residual must be a positive integer (or null), got {self.residual!r}")

    def _explicit(self) -> list[str]:
        return [f"{k}={getattr(self, k)}" for k in KNOB_OPTIONS if getattr(self, k) is not None]

    def configure(self, shape, bpd_k, bpd_v):
        d = shape.head_dim
        self._fit = None
        explicit = self._explicit()
        if self.budget == "measured" and bpd_k is not None and not explicit:
            if self.joint_kv and bpd_v is not None:
                fit = fit_joint(float(bpd_k), float(bpd_v), d, self.regime)
            else:
                fit = fit_knobs(float(bpd_k), None if bpd_v is None else float(bpd_v), d, self.regime)
            self._resolved = tuple(fit[k] for k in ("bits", "group", "residual", "v_bits", "v_group"))
            self._fit = {"regime": dataclasses.asdict(self.regime), "band": AT_TARGET,
                         "predicted_bpd_k": fit["predicted_bpd_k"], "predicted_bpd_v": fit["predicted_bpd_v"]}
            if self.joint_kv and bpd_v is not None:
                self._fit["joint_kv"] = (float(bpd_k) + float(bpd_v)) / 2
            self._not_fitted = None
        else:
            self._resolved = self._nominal_knobs(d, bpd_k, bpd_v)
            self._not_fitted = (
                "no key target: KIVI-2 defaults" if bpd_k is None
                else "budget=nominal: the largest b + 32/G <= target" if self.budget == "nominal"
                else f"explicit knobs ({', '.join(explicit)}): not fitted to the target, reported at the "
                     "measured bpd"
            )
        self._predicted = self._predict(self.regime)
        self._check()

    def _nominal_knobs(self, d, bpd_k, bpd_v) -> tuple:
        """The asymptotic mapping (largest b + 32/G <= target over {1,2,3,4,8} x {32,64,128}),
        explicit options fixed, R = 128 unless given."""
        r = self.residual or DEFAULT_RESIDUAL
        kb, kg = grid_choice(bpd_k, bits=self.bits, group=self.group, divides=r, side="bpd")
        vb = vg = None
        if bpd_v is not None or self.v_bits is not None:
            vb, vg = grid_choice(
                bpd_v, bits=self.v_bits, group=self.v_group, max_group=d, divides=d, side="v_bpd"
            )
        return kb, kg, r, vb, vg

    def _predict(self, regime: Regime) -> dict:
        """The measured bpd the resolved knobs give in ``regime`` (:func:`headline_bpd`)."""
        kb, kg, r, vb, vg = self._knobs()
        pk = headline_bpd(kb, kg, r, regime, "k")
        pv = 16.0 if vb is None else headline_bpd(vb, vg or kg, r, regime, "v")
        return {"regime": dataclasses.asdict(regime), "bpd_k": pk, "bpd_v": pv}

    def _knobs(self) -> tuple:
        resolved = getattr(self, "_resolved", None)
        if resolved is None:  # not configured: the explicit options, KIVI-2 defaults otherwise
            resolved = (
                self.bits or DEFAULT_BITS,
                self.group or DEFAULT_GROUP,
                self.residual or DEFAULT_RESIDUAL,
                self.v_bits,
                self.v_group if self.v_bits is not None else None,
            )
        return resolved

    def _check(self):
        kb, kg, r, vb, _ = self._knobs()
        for name, b in (("bits", kb), ("v_bits", vb)):
            if b is not None and not (isinstance(b, int) and 1 <= b <= 8):
                raise ValueError(f"kivi: {name} must be an integer in 1..8, got {b!r}")
        if r < 1 or r % kg:
            raise ValueError(f"kivi: residual {r} must be a multiple of group {kg}")

    def new_layer_state(self, layer):
        self._check()
        kb, kg, r, vb, vg = self._knobs()
        return KiviLayerState(kb, kg, r, vb, vg)

    def knobs(self):
        kb, kg, r, vb, vg = self._knobs()
        out = {"bits": kb, "group": kg, "residual": r, "v_bits": vb, "v_group": vg,
               "budget": self.budget, "fitted": getattr(self, "_fit", None) is not None,
               "fit": getattr(self, "_fit", None)}
        if getattr(self, "_not_fitted", None):
            out["not_fitted"] = self._not_fitted
        if getattr(self, "_predicted", None):
            out["predicted"] = self._predicted
        return out

    def nominal_bpd(self, n_tokens):
        """§2.4 at the end of a window of ``n_tokens`` (keys: T mod R at fp16; values: min(T, R))."""
        t = n_tokens
        kb, kg, r, vb, vg = self._knobs()
        bpd_k = kivi_bpd(t, kb, kg, t % r)
        if vb is None:
            return bpd_k, 16.0
        return bpd_k, kivi_bpd(t, vb, vg or kg, min(t, r))
