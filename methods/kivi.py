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
  rows): a pair is admissible when its *mean* is under the ceiling of bpd_KV instead, those within
  2 % first, the most balanced first (:mod:`methods.joint_budget`). The predicted figure is the
  exact bit count (:func:`headline_bpd`, the §2.3 storage rule with codes + fp16 scale and minimum
  per group + 16 bits per full-precision element, what ``stored_bits`` measures). A grid point is
  **admissible** when it is at most 1.02 x the target (docs/methods.md §0.1; each side at its own
  target in the KV-track; under is allowed). In a job the held-out knob search chooses among them
  (``searches()`` names ``"knobs"``; :meth:`Kivi.knob_candidates`, kvbench/fit/knob_search.py) and
  hands its choice back through ``use_knobs``; without one the fit takes the most key bits, then
  the most value bits, then the largest R, then the smallest groups (finer groups, the paper's
  G = 32), then the closest. Nothing admissible -> :class:`Unsupported` naming the reachable range
  in that regime and the cheapest grid point (in Q-all at T = 2048 keys reach 2.67-10.0). ``"nominal"``: the asymptotic mapping, the largest
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
from dataclasses import dataclass, field

import torch

from .attention import causal_attention
from .base import KVMethod, LayerState, Regime, Unsupported, query_positions
from .blocked_attention import SDPA_MIN_QUERIES, blocked_attention, mixed_attention
from .bookkeeping import host_ops, one_read
from .budget import (AT_TARGET, DEFAULT_BITS, DEFAULT_GROUP, GROUP_GRID, describe, grid_choice, no_joint_pair,
                     over_ceiling, reach, scored_reads, side_unreachable, spread, under_ceiling, unreachable)
from .buffers import Growing, SideStore, row_elements
from .groupquant import quantize_dequantize_groups
from .joint_budget import admissible_pairs

DEFAULT_RESIDUAL = 128  # R of the paper's LongBench runs (docs/methods.md §2.2)


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
BUDGETS = ("measured", "nominal")
#: options that, when given, switch the fit off (the job runs them as set)
KNOB_OPTIONS = ("bits", "group", "residual", "v_bits", "v_group")


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


def _prefer(k, v, r) -> tuple:
    """The fit's preference among admissible points: the most key bits, then the most value bits,
    then the largest R, then the smallest groups."""
    return (k[1], 0 if v is None else v[1], r, -k[2], 0 if v is None else -v[2])


def joint_fits(target_k: float, target_v: float, head_dim: int, regime: Regime) -> list[dict]:
    """``joint_kv``: every (key point, value point) pair at one shared R whose mean measured bpd is
    under the ceiling of (target_k + target_v) / 2, in :func:`methods.joint_budget.admissible_pairs`
    order (those within :data:`AT_TARGET` first, the most balanced first), then :func:`_prefer`."""
    pairs = [((k, r), (v, r)) for r in residual_grid()
             for k in side_points("k", regime, head_dim, r) for v in side_points("v", regime, head_dim, r)]
    ranked = admissible_pairs(pairs, lambda p: p[0][0], (target_k + target_v) / 2, AT_TARGET,
                              lambda kp, vp: _prefer(kp[0], vp[0], kp[1]))
    return [{"bits": k[1], "group": k[2], "residual": r, "v_bits": v[1], "v_group": v[2],
             "predicted_bpd_k": k[0], "predicted_bpd_v": v[0]} for (k, r), (v, _) in ranked]


def fit_joint(target_k: float, target_v: float, head_dim: int, regime: Regime, choice: dict | None = None) -> dict:
    """The first of :func:`joint_fits`, or the one with the knobs ``choice`` (the held-out knob
    search's); :class:`Unsupported` when no pair is admissible or ``choice`` is not one of them."""
    fits = joint_fits(target_k, target_v, head_dim, regime)
    if not fits:
        pts = [x[0] for r in residual_grid() for side in ("k", "v") for x in side_points(side, regime, head_dim, r)]
        raise Unsupported(no_joint_pair("kivi", (target_k + target_v) / 2, regime, " at one R")
                          + f" (each side reaches {reach(pts)})")
    return _chosen(fits, choice, target_k, target_v, regime)


def admissible_fits(target_k: float, target_v: float | None, head_dim: int, regime: Regime) -> list[dict]:
    """Every grid point, one R shared by both sides as in KIVI, whose measured bpd
    (:func:`headline_bpd`) is under the ceiling of the key target and, with a value target, of the
    value target too (:func:`methods.budget.under_ceiling`, docs/methods.md §0.1), in the order of
    :func:`_prefer`, then the closest to the targets."""
    ranked = []
    for r in residual_grid():
        keys = [x for x in side_points("k", regime, head_dim, r) if under_ceiling(x[0], target_k)]
        vals = [None] if target_v is None else [
            x for x in side_points("v", regime, head_dim, r) if under_ceiling(x[0], target_v)]
        for k in keys:
            for v in vals:
                miss = abs(k[0] - target_k) / target_k + (0.0 if v is None else abs(v[0] - target_v) / target_v)
                ranked.append(((*_prefer(k, v, r), -miss), {
                    "bits": k[1], "group": k[2], "residual": r, "v_bits": None if v is None else v[1],
                    "v_group": None if v is None else v[2], "predicted_bpd_k": k[0],
                    "predicted_bpd_v": None if v is None else v[0]}))
    ranked.sort(key=lambda x: x[0], reverse=True)
    return [fit for _, fit in ranked]


def knob_options(fit: dict) -> dict:
    """The options of a fit (what ``Kivi.use_knobs`` takes), without its predictions."""
    return {k: fit[k] for k in KNOB_OPTIONS}


def paper_knobs(with_values: bool) -> dict:
    """The paper's setting (docs/methods.md §2.2): b = 2, G = 32, R = 128, values alike."""
    return {"bits": DEFAULT_BITS, "group": DEFAULT_GROUP, "residual": DEFAULT_RESIDUAL,
            "v_bits": DEFAULT_BITS if with_values else None, "v_group": DEFAULT_GROUP if with_values else None}


def fit_knobs(target_k: float, target_v: float | None, head_dim: int, regime: Regime,
              choice: dict | None = None) -> dict:
    """budget='measured': among :func:`admissible_fits`, the one with the knobs ``choice`` (the
    held-out knob search's), or without a choice the first (the most preferred).
    :class:`Unsupported` with the reachable ranges when no point is admissible, or when ``choice``
    is not one of them."""
    fits = admissible_fits(target_k, target_v, head_dim, regime)
    if not fits:
        raise Unsupported(why_unreachable(target_k, target_v, head_dim, regime))
    return _chosen(fits, choice, target_k, target_v, regime)


def _chosen(fits: list[dict], choice: dict | None, target_k: float, target_v: float | None, regime: Regime) -> dict:
    """The fit of ``fits`` with the knobs ``choice``, the first without one; Unsupported when
    ``choice`` is not among them."""
    if choice is None:
        return fits[0]
    for fit in fits:
        if knob_options(fit) == {k: choice.get(k) for k in KNOB_OPTIONS}:
            return fit
    raise Unsupported(f"kivi: knobs {choice} are not admissible at bpd={target_k:g}"
                      f"{'' if target_v is None else f', v_bpd={target_v:g}'} in {describe(regime)}")


def why_unreachable(target_k: float, target_v: float | None, head_dim: int, regime: Regime) -> str:
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
        shared = sorted({p[3] for p in pts if under_ceiling(p[0], target)})
        why = (f"under the ceiling only at R in {shared}, where the other side has no admissible point"
               if shared else over_ceiling(pts, target, lambda p: f"{p[0]:.3f} at (b={p[1]}, G={p[2]}, R={p[3]})"))
        parts.append(side_unreachable(name, target, [p[0] for p in pts], f", {why}"))
    return unreachable("kivi", f"in {describe(regime)} (measured bpd, fp16 residual window and metadata "
                       f"included; grid {grid})", parts,
                       " (budget=nominal maps b + 32/G instead; explicit knobs run as set)")


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
    rows_in_one_state = True  # groups, residual window and bits per row and position

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
                fit = fit_joint(float(bpd_k), float(bpd_v), d, self.regime, self.chosen_knobs)
            else:
                fit = fit_knobs(float(bpd_k), None if bpd_v is None else float(bpd_v), d, self.regime,
                                self.chosen_knobs)
            self._resolved = tuple(fit[k] for k in KNOB_OPTIONS)
            self._fit = {"regime": dataclasses.asdict(self.regime), "band": AT_TARGET,
                         "predicted_bpd_k": fit["predicted_bpd_k"], "predicted_bpd_v": fit["predicted_bpd_v"]}
            self._fit["chosen_by"] = "held-out knob search" if self.chosen_knobs else "preference"
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

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: the measured fit's admissible points are chosen among on held-out text."""
        return ("knobs",) if self.budget == "measured" and not self._explicit() else ()

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The admissible grid points of the measured fit in the job's regime (side by side, or the
        pairs of :func:`joint_fits` for ``joint_kv`` with both targets): the paper's setting first
        when admissible, then one point per key bit width (key and value widths in the KV-track) in
        turn, the most bits first, each width's points in the fit's order
        (:func:`methods.budget.spread`)."""
        if bpd_k is None or "knobs" not in self.searches():
            return []
        if self.joint_kv and bpd_v is not None:
            fits = joint_fits(float(bpd_k), float(bpd_v), shape.head_dim, self.regime)
        else:
            fits = admissible_fits(float(bpd_k), None if bpd_v is None else float(bpd_v), shape.head_dim,
                                   self.regime)
        options, paper = [knob_options(f) for f in fits], paper_knobs(bpd_v is not None)
        return spread(options, lambda o: (o["bits"], o["v_bits"] or 0), limit,
                      first=paper if paper in options else None)

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
