"""compose(evict, codec): token eviction x KV codec in one cache (docs/methods.md §12).

The eviction method (H2O §6, SnapKV §7) decides which tokens stay; the codec (KIVI §2, KQ-SVD §4,
KV-COBRA §5, FP16, later ones) stores the kept tokens' keys and values. Both are registered methods,
built with their own options and used through their own layer states; compose adds only the
wiring and the bit count (a wrapper in the spirit of kvpress's ``ComposedPress``, never a copy).

**Order: evict, then encode** [§12 decision]. Why: eviction decisions are made from what a
deployed compressed cache would hold and compute (H2O's scores from attention over decoded keys),
and a token about to be dropped is never encoded (after an exact prefill it costs no codec work and
does not widen a KIVI group's range). The eviction state holds the *decoded* form of the kept
tokens, so it attends, scores and evicts from what the compressed cache really holds:

* ``prefill=True`` (prefill-exact: PPL track B, LongBench): the eviction attends exactly and selects
  as it does alone (H2O: column sums of the exact prefill attention; SnapKV: the observation
  window); then only the kept tokens are encoded (a token about to be dropped is never encoded),
  with their own RoPE positions, and their decoded form replaces the exact one in the eviction
  state (``replace_kept_kv``). Decoding continues per the two methods' rules.
* ``prefill=False`` (decode semantics: Q-all, PPL track A; decode steps): each new token is encoded
  on arrival and handed decoded to the eviction state, which attends over the decoded cache, adds
  *that* attention to H2O's scores and evicts; an evicted token's stored form is dropped. A chunk of
  T tokens gives what T single steps give (token-wise codecs: the chunk goes to H2O at once, and
  H2O's own chunk = steps property carries over; KIVI: steps, below).

**Token-wise codecs** (``CodecLayerState``: FP16, KQ-SVD, KV-COBRA-MSE/KL, any later one): every
token is encoded on its own, so they compose per token. Bits: each encode call's packed size
(measured from the codec's packed objects) spread evenly over the tokens it encoded; a kept token
costs that, an evicted one nothing.

**KIVI** (``KiviLayerState``): its rules act on the **arrival index** a of a token in the stream the
codec receives (the kept prompt in position order after an exact prefill, then every decoded
token; in Q-all the position itself). After n arrivals, key a is stored quantized iff
a < R*floor(n/R) and value a iff a < n - R (§2.3); key groups are G consecutive arrivals; with
nothing evicted this is KIVI on the kept sequence (SnapKV: exactly; keep=1: exactly KIVI). Under
H2O's decode eviction:

* a token evicted while in the fp16 residual is simply dropped (16 bits per element saved); it never
  joins a quantization group, and a key group formed at a flush has only its kept members (their
  min/max set the group's scale and zero point);
* a token evicted from a quantized key group loses its b-bit codes (the group's codes are compacted,
  which needs no requantization: the scale and minimum stay valid), but the group's fp16 scale and
  minimum (32 bits per channel) stay stored and counted until every member of the group is evicted;
  the remaining members keep their decoded values. A quantized value (per-token groups) goes with
  its token.

The reads (what each query held, docs/methods.md §0) are exact per head from these rules. Under
H2O, KIVI's per-query mix of exact and quantized versions changes with the query position and
eviction, so a decode chunk runs token by token through the eviction state (one pass = decoding
by construction). SnapKV with ``decode="keep"`` never evicts after its prefill, so compose(snapkv,
kivi) hands the kept prompt to KIVI's own layer state (:class:`SnapKiviState`) and a chunk takes
KIVI's one-pass path: PPL track B's 512 targets in one call instead of 512. With ``decode="evict"``
(``evict_options={decode: evict}``, §7.3) SnapKV re-selects while decoding, and the arrival-index
state above runs it as it runs H2O: an evicted token's codes are dropped, its key group's scale and
minimum stay until the group is empty.

**Positions of kept tokens** (§12.3). A post-RoPE codec (KIVI, FP16) stores keys already rotated:
the eviction needs no positions. A pre-RoPE codec (:data:`PRE_ROPE_CODECS`) stores keys before
rotation, and each held key is rotated at its original position when read; once a token is evicted
the slot no longer implies it, so the token-wise state stores the held positions
(:class:`KeptPositions`), per KV head, packed, as the cheaper of two exact encodings: fixed-width
positions of w = ⌈log₂ n_seen⌉ bits each (every held position is below the n_seen tokens seen so
far; the width grows by one bit when n_seen passes a power of two, and is at most the spec's 16 for
n_seen ≤ 65,536), or a kept mask of one bit per seen position (cheaper when more than about 1/w of
the tokens are held). Nothing evicted: nothing stored (the slots are the positions). The rotation
of the kept prompt after an exact prefill reads its positions from that stored form, and the bits
count on the key side (values are not rotated), in ``stored_bits``, in the reads and in the fit.

**Budget** (§12): bpd = kept share x codec bits per kept element + eviction state (H2O: an fp32
score per kept token and KV head, 16/d per element and side; SnapKV: none) + the positions of a
pre-RoPE codec (key side). Without ``v_bpd`` the target applies to K and V alike (as for H2O). The
kept share is measured over the job's regime (``set_regime``) by the headline rule of docs/methods.md §0, the mean over the scored positions of what each one read: in Q-all every query position; in
prefill-exact regimes the decoded positions after the P-token prefill (H2O evicts back to its
prefill budget; SnapKV with decode=keep keeps every decoded token, with decode=evict re-selects),
or the cache at the end of the prefill when the regime decodes nothing.
``keep=rho`` fixes the eviction's kept fraction (H2O: heavy_ratio + recent_ratio = rho, SnapKV:
C = round(rho * P)); the codec then gets
target / (predicted kept share) - state bits per kept element, each side, lowered to the nearest
value its own ``configure`` accepts. Otherwise a *split* rho_0 (``split``; by default chosen from
{1/2, 1/4, 1/8} by the harness on the calibration corpus, ``kvbench/fit/budget_share.py``;
:data:`DEFAULT_SPLIT` when nothing chooses) sets the codec's budget the same way, and the kept
fraction rho is then fitted (bisection) so that the predicted measured bpd_KV equals the target:
the codec's grid and its fp16 residual (KIVI) are paid for by keeping fewer tokens. Where no rho
reaches the target at the split's codec budget, the codec's budget steps down its own grid until
one does (logged in the knobs' ``note``); a target no rho reaches even at the codec's lowest budget
is :class:`Unsupported` with the reachable range. Example (SmolLM2, PPL track B, split 1/4,
SnapKV with decode=evict): KIVI (R = 128) stores the last 128 arrived values at fp16, so bpd_KV = 1
keeps rho ~ 0.10 (about 160 tokens at the end of the prefill) at 3-bit codes (G = 64); with
decode=keep the 511 appended targets alone put the reachable range at bpd_KV >= 0.96 (split 1/8).

Decisions where docs/methods.md is silent:

* Codec choices: every registered method that does not evict, except compose itself and
  :data:`UNSUPPORTED_CODECS`, whose layer states are neither token-wise nor KIVI's layout: SVDq
  (token groups in a per-sequence latent basis with their own fp16 buffer), GEAR (blocks with a
  per-block low-rank factor and an fp16 buffer) and KVQuant (an exact first token and per-token
  outlier lists).
* SnapKV's ``gqa="repeat"`` (g copies per KV head, §7.2) and an explicit ``capacity`` are refused:
  compose sets the capacity from rho, one kept set per KV head.
* The prediction that fits rho uses the codec's ``nominal_bpd(n)`` on the kept count n (exact for
  token-wise codecs; for KIVI under eviction while decoding it ignores the partially evicted
  groups' metadata and which kept tokens sit in the residual: compose(snapkv with decode=evict,
  kivi) measured bpd_KV 0.97 at a target of 1 on SmolLM2, keys above and values below their
  prediction); the reported figure is always the measured one.
* Stored positions (pre-RoPE codecs): the width grows with the tokens seen instead of being fixed
  at ⌈log₂ T_max⌉ for a model's whole window, the cheapest fixed-width exact code for what the
  cache holds at that moment; the mask alternative makes the cost at most one bit per seen token
  and KV head (1/d bpd_K). H2O's own ``count_indices`` would count a second copy, so it is refused
  with a pre-RoPE codec. The working copy holds each key rotated once, at encode time, from these
  positions (the prefill's kept keys) or its arrival position (a decoded key); a fused kernel would
  rotate on every read from the same stored positions.
* The fit targets bpd_KV, the mean of the two sides (the KV-track axis, §0): a codec whose sides
  land on different grid points (integer b_V of KV-COBRA, KIVI's full value residual) ends with one
  side above and one below its own target; both are reported.
* Per-token codec bits are measured per encode call; the only non-uniformity, < 8 padding bits per
  call of a bit-packed codec, is spread over the call's tokens. Packed streams are not retained
  after encoding (the eviction would have to compact them); the decoded working copy in the
  eviction state is what attention reads, as in every layer state.
* The eviction state's own accounting gives its state bits: its stored bits minus 16 per kept
  element (H2O: the score, plus positions with ``count_indices``).
* The eviction is configured through its own bpd mapping at rho (H2O with ``budget="nominal"``,
  since compose fits rho to the measured figure itself); the codec is not told the job's regime
  (it stores a kept sequence; its per-kept-element budget is nominal).
* KIVI's decode steps quantize one value per step in place in the eviction's storage; a flush
  replaces the kept keys (every R arrivals).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import KVMethod, LayerState, Unsupported, rotate_half
from .codec_state import Codec, CodecLayerState
from .eviction import EvictionLayerState
from .groupquant import fake_quantize_groups, quantize_dequantize_groups
from .kivi import KiviLayerState
from .packing import pack_bits, packed_nbytes, unpack_bits
from .snapkv import SnapKVLayerState

EVICTIONS = ("h2o", "snapkv")
#: codecs whose layer state is neither token-wise nor KIVI's (see the module docstring)
UNSUPPORTED_CODECS = ("svdq", "gear", "kvquant")
#: codecs that store keys before RoPE (their key codec's ``pre_rope``; checked when a layer state
#: is built): composed with an eviction they store the held positions (docs/methods.md §12.3)
PRE_ROPE_CODECS = ("svdq", "kqsvd", "cobra_mse", "cobra_kl", "cobra_plus")
#: the split candidates the harness chooses from by calibration-corpus PPL (§12)
SPLITS = (0.5, 0.25, 0.125)
#: the split when no choice is made (provisional default; the harness normally chooses)
DEFAULT_SPLIT = 0.25
#: smallest kept fraction the fit of rho considers (the eviction's own floors apply below it)
RHO_MIN = 1e-4


def _init_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def codec_choices() -> list[str]:
    """Registered methods compose accepts as ``codec``."""
    from . import REGISTRY

    return [n for n, c in REGISTRY.items()
            if not c.evicts_tokens and n != "compose" and n not in UNSUPPORTED_CODECS]


# ------------------------------------------------------------------------------------------------
# The method


@dataclass
class Compose(KVMethod):
    """compose(evict, codec), docs/methods.md §12; see the module docstring.

    evict: ``h2o`` | ``snapkv``; codec: a registered codec (:func:`codec_choices`);
    evict_options / codec_options: their own options (as ``method.<option>`` alone);
    keep: a fixed kept fraction rho in (0, 1]; split: the nominal kept fraction that sets the codec's
    budget, rho then fitted to the target (default :data:`DEFAULT_SPLIT`, or the harness's choice).
    """

    name: ClassVar[str] = "compose"
    evicts_tokens: ClassVar[bool] = True
    seeded: ClassVar[bool] = True  # the split is chosen on the seed's calibration windows

    evict: str = "h2o"
    codec: str = "kivi"
    keep: float | None = None
    split: float | None = None
    evict_options: dict | None = None
    codec_options: dict | None = None

    def __post_init__(self):
        from . import REGISTRY, build_method

        if self.evict not in EVICTIONS:
            raise ValueError(f"compose: unknown evict={self.evict!r}; valid choices: {', '.join(EVICTIONS)}")
        valid = codec_choices()
        if self.codec not in valid:
            why = " (not supported yet: see methods/compose.py)" if self.codec in UNSUPPORTED_CODECS else ""
            raise ValueError(f"compose: unknown codec={self.codec!r}{why}; valid choices: {', '.join(valid)}")
        for label, x in (("keep", self.keep), ("split", self.split)):
            number = isinstance(x, (int, float)) and not isinstance(x, bool)
            if x is not None and not (number and 0.0 < x <= 1.0):
                raise ValueError(f"compose: {label} must be a fraction in (0, 1], got {x!r}")
        if self.keep is not None and self.split is not None:
            raise ValueError("compose: give keep (a fixed kept fraction) or split (fitted), not both")
        ev_opts = dict(self.evict_options or {})
        if self.evict == "h2o" and "budget" in _init_fields(REGISTRY["h2o"]):
            # compose fits the kept fraction to the measured figure itself (below): H2O must map
            # its target by the nominal formula rho = bpd / (16 + 16/d)
            if ev_opts.setdefault("budget", "nominal") != "nominal":
                raise ValueError("compose: h2o's budget is compose's to fit; drop evict_options.budget")
        if ev_opts.get("count_indices") and self.codec in PRE_ROPE_CODECS:
            raise ValueError(
                f"compose: {self.codec} stores keys before RoPE, so compose stores and counts the held "
                "positions itself (docs/methods.md §12.3); drop evict_options.count_indices"
            )
        self._evictor = build_method(self.evict, **ev_opts)
        codec_opts = dict(self.codec_options or {})
        if self.codec == "kivi" and codec_opts.setdefault("budget", "nominal") != "nominal":
            # compose gives the codec its budget per kept element and fits rho itself: KIVI must
            # map it by b + 32/G, not fit its own knobs to a regime it does not see
            raise ValueError("compose: kivi's budget is compose's to fit; drop codec_options.budget")
        self._codec = build_method(self.codec, **codec_opts)
        if self.evict == "snapkv":
            if self._evictor.gqa != "mean":
                raise ValueError("compose: snapkv needs gqa='mean' (one kept set per KV head)")
            if self._evictor.capacity is not None:
                raise ValueError("compose: snapkv's capacity comes from the kept fraction; drop capacity")
        # capability flags of the parts (the class defaults describe no instance)
        self.needs_calibration = self._codec.needs_calibration
        self.supports_in_pass = self._evictor.supports_in_pass
        self._shape = None
        self._rho = None
        self._knobs: dict = {}

    def searches(self) -> tuple[str, ...]:
        """The harness chooses ``split`` by calibration-corpus PPL (§12) when neither ``keep`` nor
        ``split`` is given (``kvbench/fit/budget_share.py``)."""
        return ("budget_share",) if self.keep is None and self.split is None else ()

    # ---- regime, budget ------------------------------------------------------------------------

    def set_regime(self, regime):
        """The job's regime is compose's (its fit) and the eviction's; the codec is not told: it
        stores a kept sequence, and its budget per kept element is given nominally."""
        super().set_regime(regime)
        self._evictor.set_regime(regime)

    def state_bits_per_element(self, head_dim: int) -> float:
        """Eviction state per kept element and side (§6.4: H2O's fp32 score, 16/d; SnapKV: 0)."""
        if self.evict == "h2o":
            return self._evictor.bits_per_element(head_dim) - 16.0
        return 0.0

    def _set_rho(self, rho: float) -> None:
        """Configure the eviction for kept fraction rho (through its own bpd mapping)."""
        d = self._shape.head_dim
        per = 16.0 + self.state_bits_per_element(d)
        self._evictor.configure(self._shape, rho * per, rho * per)
        self._rho = rho

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        tk = bpd_k if bpd_k is not None else bpd_v
        tv = bpd_v if bpd_v is not None else bpd_k
        fixed = self.keep is not None
        split = float(self.keep if fixed else (self.split or DEFAULT_SPLIT))
        self._set_rho(split)
        if tk is None:  # no target: the codec's own defaults at the split
            self._codec.configure(shape, None, None)
            self._knobs = {"rho": split, "fitted": False}
            return
        share = float(np.mean(self._share()))
        e = self.state_bits_per_element(shape.head_dim)
        wanted = ((tk - self.positions_bpd()) / share - e, tv / share - e)
        ck, cv = self._configure_codec(wanted, (tk, tv), share)
        note = None
        if not fixed:
            (ck, cv), rho, note = self._fit((tk + tv) / 2, ck, cv)
            self._set_rho(rho)
        else:
            self._set_rho(split)
        pred = self.predicted_bpd()
        self._knobs = {
            "rho": self._rho, "fitted": not fixed, "split": None if fixed else split,
            "keep": self.keep, "kept_share_at_split": share, "state_bits_per_element": e,
            "codec_target_k": ck, "codec_target_v": cv,
            "predicted_bpd_k": pred[0], "predicted_bpd_v": pred[1], "predicted_bpd_kv": sum(pred) / 2,
            "positions": "stored" if self.stores_positions else "none",
            "predicted_positions_bpd_k": self.positions_bpd(),
        }
        if note:
            self._knobs["note"] = note

    def _configure_codec(self, wanted, targets, share) -> tuple[float, float]:
        """Configure the codec at the largest per-kept-element budgets (each side, K first) not
        above ``wanted`` that its own ``configure`` accepts: the value itself, else multiples of 1/d
        downwards (every grid of the registered codecs lies on them)."""
        d = self._shape.head_dim
        for side, x in enumerate(wanted):
            if x <= 0:
                raise Unsupported(
                    f"compose({self.evict}, {self.codec}): target {targets[side]} leaves no bits for the "
                    f"codec ({self.state_bits_per_element(d):g} state bits per kept element, kept share "
                    f"{share:.3g})"
                )
        ck = self._largest_accepted(wanted[0], lambda x: (x, None))
        cv = self._largest_accepted(wanted[1], lambda x: (ck, x))
        return ck, cv

    def _largest_accepted(self, x: float, args) -> float:
        d = self._shape.head_dim
        first = None
        for cand in [x] + [j / d for j in range(math.floor(x * d + 1e-9), 0, -1)]:
            try:
                self._codec.configure(self._shape, *args(cand))
                return cand
            except Unsupported as err:
                first = first or err
        raise Unsupported(
            f"compose({self.evict}, {self.codec}): the codec cannot store {x:.4g} bits per kept "
            f"element or fewer: {first}"
        ) from first

    # ---- prediction ------------------------------------------------------------------------------

    @property
    def stores_positions(self) -> bool:
        """Whether the held positions are stored (a pre-RoPE codec, docs/methods.md §12.3)."""
        return self.codec in PRE_ROPE_CODECS

    def _reads(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens held, tokens seen) at each read the regime's headline figure is taken over
        (docs/methods.md §0), from the eviction's own budget functions at the current rho: Q-all,
        every query position; prefill-exact, the prediction the prefill makes (the cache at the end
        of the prefill) and each decoded position (H2O: min(P + j, C + 1); SnapKV: its storage rule,
        ``SnapKV.held_counts``)."""
        reg = self.regime
        p = reg.tokens
        if self.evict == "h2o":
            st = self._evictor.new_layer_state(0)
            if reg.kind == "qall":
                held = [1] + [min(t, st.qall_budget(t - 1)[0]) + 1 for t in range(1, p)]
                return np.array(held, dtype=np.float64), np.arange(1, p + 1, dtype=np.float64)
            cap = sum(st.prefill_budget(p))
        else:  # SnapKV acts on a prompt: a Q-all regime reads as a prompt of that length
            cap = self._evictor.capacity_for(p)
        first = np.array([min(p, cap)], dtype=np.float64)
        if reg.kind == "qall" or not reg.decode:
            return first, np.array([p], dtype=np.float64)
        j = np.arange(1, reg.decode + 1, dtype=np.float64)
        if self.evict == "h2o":
            decoded = np.minimum(p + j, cap + 1)
        else:
            decoded = self._evictor.held_counts(p, reg.decode).numpy()
        return np.concatenate([first, decoded]), np.concatenate([[float(p)], p + j])

    def _share(self) -> np.ndarray:
        held, seen = self._reads()
        return held / seen

    def positions_bpd(self) -> float:
        """Key-side bpd of the stored positions the regime's figure should give at the current rho
        (0 for a post-RoPE codec): per read, :func:`position_bits` / (seen x d), averaged."""
        if not self.stores_positions:
            return 0.0
        held, seen = self._reads()
        bits = position_bits(torch.from_numpy(held), torch.from_numpy(seen)).numpy()
        return float(np.mean(bits / (seen * self._shape.head_dim)))

    def predicted_bpd(self) -> tuple[float, float]:
        """bpd_K, bpd_V the regime's measured figure should give at the current knobs: per read,
        (codec bits of the held tokens + their state bits) / (seen tokens x d), averaged, plus the
        stored positions on the key side."""
        held, seen = self._reads()
        e = self.state_bits_per_element(self._shape.head_dim)
        cache: dict[int, tuple[float, float]] = {}
        for n in np.unique(held).astype(int).tolist():
            bk, bv = self._codec.nominal_bpd(n)
            cache[n] = (bk * n, bv * n)
        out = []
        for side in (0, 1):
            bits = np.array([cache[int(n)][side] for n in held]) + held * e
            out.append(float(np.mean(bits / seen)))
        return out[0] + self.positions_bpd(), out[1]

    def _fit(self, target: float, ck: float, cv: float):
        """((codec targets), rho, note): rho fitted at the codec's budgets; where no rho reaches the
        target, the codec's budgets step down its grid (both sides, then the one that still can)
        until one does, or :class:`Unsupported` with the reachable range of the lowest budgets."""
        lowered = False
        while True:
            try:
                rho, note = self._fit_rho(target)
            except Unsupported as err:
                low = self._lower_codec(ck, cv)
                if low is None:
                    raise err
                ck, cv = low
                lowered = True
                continue
            if lowered:
                note = (note + "; " if note else "") + (
                    f"codec budgets lowered below the split's to reach the target: {self._codec.knobs()}"
                )
            return (ck, cv), rho, note

    def _lower_codec(self, ck: float, cv: float) -> tuple[float, float] | None:
        """The codec configured one grid step below its current asymptotic rates (both sides, else
        the side that can go lower); None when neither can (a codec that accepts every target but
        stores the same, FP16, cannot either)."""
        d = self._shape.head_dim
        rk, rv = self._codec.nominal_bpd(1 << 20)  # asymptotic rates (residual share vanishes)
        tries = ((rk - 1.0 / d, rv - 1.0 / d), (ck, rv - 1.0 / d), (rk - 1.0 / d, cv))
        for k_try, v_try in tries:
            if min(k_try, v_try) <= 0:
                continue
            try:
                k_new = k_try if k_try == ck else self._largest_accepted(k_try, lambda x: (x, None))
                v_new = self._largest_accepted(v_try, lambda x: (k_new, x))
            except Unsupported:
                continue
            nk, nv = self._codec.nominal_bpd(1 << 20)
            if nk < rk or nv < rv:
                return k_new, v_new
        self._codec.configure(self._shape, ck, cv)  # restore the last feasible budgets
        return None

    def _fit_rho(self, target: float) -> tuple[float, str | None]:
        """The kept fraction whose predicted bpd_KV is the target (bisection; monotone in rho)."""
        def kv(rho):
            self._set_rho(rho)
            return sum(self.predicted_bpd()) / 2

        lo, hi = RHO_MIN, 1.0
        f_lo, f_hi = kv(lo), kv(hi)
        if f_hi <= target:
            return 1.0, f"every token kept: bpd_KV {f_hi:.4g} <= target {target:g}"
        if f_lo > target * (1 + 1e-9):
            raise Unsupported(
                f"compose({self.evict}, {self.codec}): bpd_KV={target:g} unreachable in this regime "
                f"({self.regime.kind}, {self.regime.tokens} tokens, {self.regime.decode} decoded) with the "
                f"codec's knobs {self._codec.knobs()}: reachable [{f_lo:.4g}, {f_hi:.4g}] (kept fraction "
                f"{RHO_MIN:g} .. 1)"
            )
        for _ in range(48):
            mid = 0.5 * (lo + hi)
            if kv(mid) <= target:
                lo = mid
            else:
                hi = mid
        return lo, None

    def nominal_bpd(self, n_tokens):
        """End-of-sequence bpd for a cache of ``n_tokens`` (no decode): the eviction's kept count C
        at that length times the codec's nominal bits, plus state (and positions), over n_tokens."""
        if self._shape is None:
            raise RuntimeError("compose: configure() before nominal_bpd()")
        if self.evict == "h2o":
            kept = min(n_tokens, self._evictor.new_layer_state(0).qall_budget(n_tokens - 1)[0])
        else:
            kept = min(n_tokens, self._evictor.capacity_for(n_tokens))
        e = self.state_bits_per_element(self._shape.head_dim)
        bk, bv = self._codec.nominal_bpd(kept)
        pos = 0.0
        if self.stores_positions:
            pos = float(position_bits(torch.tensor(float(kept)), torch.tensor(float(n_tokens))))
        d = self._shape.head_dim
        return (bk + e) * kept / n_tokens + pos / (n_tokens * d), (bv + e) * kept / n_tokens

    # ---- calibration, cache ----------------------------------------------------------------------

    def calibration_sample_tokens(self) -> int:
        ask = getattr(self._codec, "calibration_sample_tokens", None)
        return int(ask()) if callable(ask) else 0

    def calibrate(self, stats, seed=0):
        if self._codec.needs_calibration:
            self._codec.calibrate(stats, seed=seed)

    def new_layer_state(self, layer):
        ev = self._evictor.new_layer_state(layer)
        cs = self._codec.new_layer_state(layer)
        if isinstance(cs, CodecLayerState):
            if cs.exact_first:
                raise ValueError("compose: a codec with exact_first tokens is not supported")
            if bool(cs.key_codec.pre_rope) != self.stores_positions:
                raise RuntimeError(
                    f"compose: {self.codec}'s key codec has pre_rope={cs.key_codec.pre_rope}, but "
                    f"PRE_ROPE_CODECS {'lists' if self.stores_positions else 'does not list'} it"
                )
            return TokenwiseComposedState(ev, cs.key_codec, cs.value_codec)
        if isinstance(cs, KiviLayerState) and isinstance(ev, SnapKVLayerState) and ev.interval is None:
            return SnapKiviState(ev, cs)
        if isinstance(cs, KiviLayerState):
            return KiviComposedState(ev, cs.bits, cs.group, cs.residual, cs.v_bits, cs.v_group)
        raise ValueError(
            f"compose: codec {self.codec!r} has a {type(cs).__name__}, neither token-wise "
            "(CodecLayerState) nor KIVI's; valid choices: " + ", ".join(codec_choices())
        )

    def static_bytes(self) -> int:
        return self._codec.static_bytes()

    def knobs(self):
        return {
            "evict": self.evict, "codec": self.codec, **self._knobs,
            "evict_knobs": self._evictor.knobs(), "codec_knobs": self._codec.knobs(),
        }


# ------------------------------------------------------------------------------------------------
# What compose reads from an eviction state (public methods only)


def kept_positions(ev: LayerState) -> torch.Tensor:
    """Positions [B, H, C] of the tokens an eviction state holds, in its stored order."""
    if isinstance(ev, EvictionLayerState):
        return ev.kept_positions()
    raise TypeError(f"compose: no kept positions for {type(ev).__name__}")


def eviction_token_bits(ev: LayerState) -> tuple[float, float]:
    """(K, V) bits per held token (all heads and batch) in the eviction's own accounting: 16 per
    element plus its state."""
    bk, bv = ev.stored_bits()
    return bk / ev.n_kept, bv / ev.n_kept


def state_token_bits(ev: LayerState) -> tuple[float, float]:
    """(K, V) state bits per held token: the eviction's bits beyond 16 per element."""
    k, _ = ev.kept_kv()
    per_k, per_v = eviction_token_bits(ev)
    elems = k.shape[0] * k.shape[1] * k.shape[3]
    return per_k - 16.0 * elems, per_v - 16.0 * elems


def read_counts(ev: LayerState) -> torch.Tensor:
    """Tokens each query of the last decode call read [T] (float64): the eviction's reads over its
    own bits per held token."""
    reads = ev.read_bits()
    return reads[0] / eviction_token_bits(ev)[0]


def gather_tokens(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d] at positions pos [B, H, C] -> [B, H, C, d]."""
    return x.gather(2, pos[..., None].expand(*pos.shape, x.shape[-1]))


def gather_rope(c: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """cos or sin [B, T, d] at per-head positions pos [B, H, C] -> [B, H, C, d]."""
    b, h = pos.shape[:2]
    return gather_tokens(c[:, None].expand(b, h, *c.shape[1:]), pos)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with cos/sin broadcastable to x [B, H, T, d] (``base.apply_rope``'s arithmetic)."""
    return (x * cos) + (rotate_half(x) * sin)


# ------------------------------------------------------------------------------------------------
# Positions of held tokens under a pre-RoPE codec (docs/methods.md §12.3)


def position_width(n_seen: int) -> int:
    """Bits of one stored position when ``n_seen`` tokens have been seen: positions
    0 .. n_seen - 1 take ⌈log₂ n_seen⌉ bits (at least 1)."""
    return max(1, (int(n_seen) - 1).bit_length())


def position_bits(n_kept: torch.Tensor, n_seen: torch.Tensor) -> torch.Tensor:
    """Bits per KV head :class:`KeptPositions` stores for ``n_kept`` held of ``n_seen`` seen tokens
    (float64, elementwise over tensors of counts): 0 when nothing is evicted, else 8 x the bytes of
    the cheaper encoding, fixed-width positions (``w // 8`` bytes each plus a packed stream of the
    ``w % 8`` high bits) or the packed kept mask (⌈n_seen / 8⌉ bytes)."""
    kept = torch.as_tensor(n_kept, dtype=torch.float64)
    seen = torch.as_tensor(n_seen, dtype=torch.float64)
    # ⌈log₂ seen⌉ = bit length of seen - 1, exactly from the binary exponent (frexp: x = m 2^e)
    width = torch.frexp(torch.clamp(seen - 1, min=0)).exponent.to(torch.float64).clamp(min=1)
    whole, rest = torch.div(width, 8, rounding_mode="floor"), torch.remainder(width, 8)
    as_positions = whole * kept + torch.ceil(kept * rest / 8)
    as_mask = torch.ceil(seen / 8)
    return torch.where(kept < seen, 8 * torch.minimum(as_positions, as_mask), torch.zeros_like(kept))


class KeptPositions:
    """The positions [B, H, C] of the held tokens (ascending per head, as both evictions hold
    them) as a pre-RoPE composition stores them: packed per KV head in the cheaper exact encoding
    (module docstring; :func:`position_bits` is its size), ``"none"`` when nothing is evicted.
    ``positions()`` decodes what is stored; ``bits()`` counts the packed bytes."""

    def __init__(self, pos: torch.Tensor, n_seen: int):
        b, h, c = pos.shape
        self.shape, self.n_seen, self.device = (b, h, c), int(n_seen), pos.device
        self.width = position_width(n_seen)
        whole, rest = divmod(self.width, 8)
        as_positions = whole * c + (packed_nbytes(c, rest) if rest else 0)
        as_mask = packed_nbytes(self.n_seen, 1)
        if c == self.n_seen:
            self.kind, self.streams = "none", []
        elif as_positions <= as_mask:
            self.kind = "positions"
            self.streams = [((pos >> (8 * j)) & 255).to(torch.uint8) for j in range(whole)]
            if rest:
                self.streams.append(pack_bits(pos >> (8 * whole), rest))
        else:
            self.kind = "mask"
            mask = torch.zeros(b, h, self.n_seen, dtype=torch.uint8, device=pos.device)
            self.streams = [pack_bits(mask.scatter_(-1, pos, 1), 1)]

    def positions(self) -> torch.Tensor:
        """The held positions [B, H, C] (int64), decoded from the stored streams."""
        b, h, c = self.shape
        if self.kind == "none":
            return torch.arange(c, device=self.device).expand(b, h, c)
        if self.kind == "mask":
            held = unpack_bits(self.streams[0], 1, self.n_seen, dtype=torch.uint8)
            # the c set bits of each head, ascending (a stable sort: no host synchronization)
            return held.sort(dim=-1, descending=True, stable=True).indices[..., :c].sort(dim=-1).values
        whole, rest = divmod(self.width, 8)
        out = torch.zeros(b, h, c, dtype=torch.int64, device=self.device)
        for j in range(whole):
            out |= self.streams[j].to(torch.int64) << (8 * j)
        if rest:
            out |= unpack_bits(self.streams[-1], rest, c) << (8 * whole)
        return out

    def bits(self) -> int:
        return 8 * sum(x.numel() for x in self.streams)


# ------------------------------------------------------------------------------------------------
# Token-wise codecs


class _ComposedState(LayerState):
    """What both composed states share: their eviction state ``evict`` owns the held tokens."""

    @property
    def n_seen(self):
        return self.evict.n_seen

    @property
    def n_kept(self) -> int:
        return self.evict.n_kept


@dataclass
class TokenwiseComposedState(_ComposedState):
    """An eviction state holding token-wise-decoded tokens; bits = held tokens x codec bits per
    token + the eviction's state + (a pre-RoPE key codec) the held positions, :class:`KeptPositions`,
    rebuilt after every call from the eviction's kept set."""

    evict: LayerState
    key_codec: Codec
    value_codec: Codec

    def __post_init__(self):
        self._codec_bits = [0, 0]  # bits of every encode call, K and V
        self._encoded = 0  # token slots (all heads) encoded
        self._positions: KeptPositions | None = None

    @property
    def stores_positions(self) -> bool:
        return bool(self.key_codec.pre_rope)

    def _encode(self, k, v, k_pre, cos, sin):
        kc, vc = self.key_codec, self.value_codec
        if kc.pre_rope:
            if k_pre is None or cos is None:
                raise ValueError("a pre-RoPE key codec needs k_pre and rope")
            pk = kc.encode(k_pre)
            k_hat = rotate(kc.decode(pk).to(k.dtype), cos, sin)
        else:
            pk = kc.encode(k)
            k_hat = kc.decode(pk).to(k.dtype)
        pv = vc.encode(v)
        self._codec_bits[0] += kc.bits(pk)
        self._codec_bits[1] += vc.bits(pv)
        self._encoded += k.shape[2]
        return k_hat, vc.decode(pv).to(v.dtype)

    def codec_token_bits(self) -> tuple[float, float]:
        """Codec bits per token slot (all heads and batch), K and V."""
        n = max(self._encoded, 1)
        return self._codec_bits[0] / n, self._codec_bits[1] / n

    def _store_positions(self) -> None:
        if self.stores_positions:
            self._positions = KeptPositions(kept_positions(self.evict), self.evict.n_seen)

    def position_bits(self) -> int:
        """Bits of the stored positions now (0 for a post-RoPE key codec)."""
        return 0 if self._positions is None else self._positions.bits()

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            self._store_positions()
            # a pre-RoPE key is rotated at the position its cache stores
            pos = kept_positions(self.evict) if self._positions is None else self._positions.positions()
            kp = None if k_pre is None else gather_tokens(k_pre, pos)
            cos = sin = None
            if rope is not None:
                cos, sin = gather_rope(rope.cos, pos), gather_rope(rope.sin, pos)
            k_hat, v_hat = self._encode(gather_tokens(k, pos), gather_tokens(v, pos), kp, cos, sin)
            self.evict.replace_kept_kv(k_hat, v_hat)
            self._reads = None
            return out
        cos = sin = None
        if rope is not None:
            cos, sin = rope.cos[:, None], rope.sin[:, None]
        n0 = self.evict.n_seen
        k_hat, v_hat = self._encode(k, v, k_pre, cos, sin)
        out = self.evict.attend(q, k_hat, v_hat, scaling=scaling, prefill=False)
        self._store_positions()
        counts = read_counts(self.evict)
        (ck, cv), (sk, sv) = self.codec_token_bits(), state_token_bits(self.evict)
        reads_k = counts * (ck + sk)
        if self.stores_positions:
            b, h = self._positions.shape[:2]
            seen = torch.arange(n0 + 1, n0 + k.shape[2] + 1, dtype=torch.float64)
            reads_k = reads_k + b * h * position_bits(counts, seen)
        self._reads = (reads_k, counts * (cv + sv))
        return out

    def stored_bits(self):
        n = self.evict.n_kept
        if n == 0:
            return 0, 0
        (ck, cv), (sk, sv) = self.codec_token_bits(), state_token_bits(self.evict)
        return round(n * (ck + sk)) + self.position_bits(), round(n * (cv + sv))


# ------------------------------------------------------------------------------------------------
# KIVI


@dataclass
class KiviComposedState(_ComposedState):
    """An eviction state holding KIVI-stored tokens, KIVI's rules on arrival indices (module
    docstring). Keys are post-RoPE (KIVI §2.2): ``k_pre``/``rope`` are not used.

    Codec-side edits of held tokens (a key group's flush, a value leaving the residual) are written
    into the eviction's storage (``kept_kv``/``replace_kept_kv``). Held tokens are in ascending
    arrival order in both evictions (H2O keeps ascending positions; SnapKV appends and its
    re-selections keep the held order). The job builds it for H2O and for SnapKV with
    decode=evict; SnapKV with decode=keep, which never evicts after its prefill, gets
    :class:`SnapKiviState` (KIVI's own state on the kept sequence, its one-pass chunk path
    included), and this class on SnapKV is the independent reference the tests hold it to."""

    evict: LayerState
    bits: int
    group: int
    residual: int
    v_bits: int | None
    v_group: int | None

    def __post_init__(self):
        self._arrived = 0  # tokens handed to the codec
        self._flushed = 0  # keys with arrival index below this are quantized (a multiple of R)
        self._prompt = None  # (P, C_0, rank [B, H, P]) after an exact prefill
        self._meta_bits = 32  # fp16 scale + fp16 minimum per group (read from the packed groups)

    # -- arrival indices ------------------------------------------------------------------------
    def arrivals(self) -> torch.Tensor:
        """Arrival index [B, H, C] of every held token, in the eviction's stored order."""
        pos = kept_positions(self.evict)
        if self._prompt is None:
            return pos
        p, c0, rank = self._prompt
        prompt = rank.gather(-1, pos.clamp(max=p - 1))
        return torch.where(pos >= p, pos - p + c0, prompt)

    def _value_group(self, d: int) -> int:
        return self.v_group or min(self.group, d)

    # -- KIVI's storage rule --------------------------------------------------------------------
    def _flush_keys(self, upto: int) -> None:
        """Quantize the held keys with arrival in [flushed, upto) in groups of G arrivals; a
        group's min/max come from its held members only."""
        a0, s = self._flushed, upto - self._flushed
        if s <= 0:
            return
        k, v = self.evict.kept_kv()
        arr = self.arrivals()
        sel = (arr >= a0) & (arr < upto)
        slot = torch.where(sel, arr - a0, s)  # slot s collects the tokens outside the range
        b, h, _, d = k.shape
        x = torch.full((b, h, s + 1, d), float("inf"), dtype=k.dtype, device=k.device)
        x.scatter_(2, slot[..., None].expand(*slot.shape, d), k)
        xg = x[:, :, :s].reshape(b, h, s // self.group, self.group, d)
        mn = xg.amin(dim=3, keepdim=True)
        mn = torch.where(torch.isinf(mn), torch.zeros_like(mn), mn)  # groups with no member
        filled = torch.where(torch.isinf(xg), mn, xg).reshape(b, h, s, d)  # holes take the min
        gp, hat = quantize_dequantize_groups(filled, self.bits, self.group, axis=2)
        self._meta_bits = 8 * (gp.scale.element_size() + gp.minimum.element_size())
        hat = torch.cat([hat, hat.new_zeros(b, h, 1, d)], dim=2)
        k_new = torch.where(sel[..., None], hat.gather(2, slot[..., None].expand(*slot.shape, d)), k)
        self.evict.replace_kept_kv(k_new, v)
        self._flushed = upto

    def _quantize_values(self, lo: int, hi: int) -> None:
        """Quantize the held values with arrival in [lo, hi) (per-token channel groups)."""
        if self.v_bits is None or hi <= lo:
            return
        k, v = self.evict.kept_kv()
        arr = self.arrivals()
        sel = (arr >= lo) & (arr < hi)
        hat = fake_quantize_groups(v, self.v_bits, self._value_group(v.shape[-1]), axis=3)
        self.evict.replace_kept_kv(k, torch.where(sel[..., None], hat, v))

    def _quantize_value(self, a: int) -> None:
        """Quantize the held value of arrival ``a`` (one decode step), in place in the cache."""
        if self.v_bits is None or a < 0:
            return
        _, v = self.evict.kept_kv()
        g = self._value_group(v.shape[-1])
        hit = self.arrivals() == a  # [B, H, C]: at most one held token per head
        j = hit.to(torch.int8).argmax(dim=-1)[..., None, None].expand(*hit.shape[:2], 1, v.shape[-1])
        x = v.gather(2, j)
        hat = fake_quantize_groups(x, self.v_bits, g, axis=3)
        v.scatter_(2, j, torch.where(hit.any(dim=-1)[..., None, None], hat, x))

    def held_bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) codec bits held now (0-dim float64 tensors), from the held tokens' arrivals."""
        n = self.evict.n_kept
        if n == 0:
            z = torch.zeros((), dtype=torch.float64)
            return z, z
        k, _ = self.evict.kept_kv()
        b, h, _, d = k.shape
        g_v = self._value_group(d)
        per_qv = self.v_bits * d + (d // g_v) * self._meta_bits if self.v_bits is not None else 16 * d
        r = self.residual
        arr = self.arrivals()
        qk = arr < self._flushed
        gid = torch.div(arr, self.group, rounding_mode="floor")
        first = torch.ones_like(qk)
        first[..., 1:] = gid[..., 1:] != gid[..., :-1]  # ascending arrivals: a group starts here
        n_all = float(arr.numel())
        n_qk = qk.sum().to(torch.float64)
        alive = (first & qk).sum().to(torch.float64)
        bits_k = n_qk * self.bits * d + (n_all - n_qk) * 16 * d + alive * self._meta_bits * d
        n_qv = (arr < self._arrived - r).sum().to(torch.float64)
        bits_v = n_qv * per_qv + (n_all - n_qv) * 16 * d
        return bits_k.cpu(), bits_v.cpu()

    # -- attention ------------------------------------------------------------------------------
    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            pos = kept_positions(self.evict)
            p, c0 = k.shape[2], pos.shape[-1]
            rank = pos.argsort(dim=-1).argsort(dim=-1)  # arrival = rank in position order
            rank_of = torch.zeros(*pos.shape[:2], p, dtype=torch.long, device=pos.device)
            rank_of.scatter_(-1, pos, rank)
            self._prompt = (p, c0, rank_of)
            self._arrived = c0
            self._flush_keys(self.residual * (c0 // self.residual))
            self._quantize_values(0, max(0, c0 - self.residual))
            self._reads = None
            return out
        outs, reads_k, reads_v = [], [], []
        new_tok = 16.0 * k.shape[0] * k.shape[1] * k.shape[3]  # a new token is read at fp16
        state = None
        r = self.residual
        for j in range(k.shape[2]):
            held_k, held_v = self.held_bits()
            count = self.evict.n_kept + 1  # every held token and the new one
            sl = slice(j, j + 1)
            qj, kj, vj = q[:, :, sl], k[:, :, sl], v[:, :, sl]
            outs.append(self.evict.attend(qj, kj, vj, scaling=scaling, prefill=False))
            if state is None:  # state bits per held token: constant for a layer
                state = state_token_bits(self.evict)
            reads_k.append(held_k + new_tok + count * state[0])
            reads_v.append(held_v + new_tok + count * state[1])
            self._arrived += 1
            self._flush_keys(r * (self._arrived // r))
            self._quantize_value(self._arrived - r - 1)
        self._reads = (torch.stack(reads_k), torch.stack(reads_v))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def stored_bits(self):
        if self.evict.n_kept == 0:
            return 0, 0
        hk, hv = self.held_bits()
        sk, sv = state_token_bits(self.evict)
        n = self.evict.n_kept
        return round(float(hk) + n * sk), round(float(hv) + n * sv)


class SnapKiviState(LayerState):
    """compose(snapkv, kivi) with decode=keep: SnapKV selects at the end of the exact prefill and
    never evicts after it, so the composition is KIVI on the kept sequence (arrival = index, module
    docstring). The kept prompt, in position order, is handed to KIVI's own layer state as its prompt
    (``KiviLayerState.store_prompt``); from there KIVI stores, attends and counts by its own rules,
    its one-pass form of a decode chunk included (PPL track B's 512 scored targets are one call,
    not 512). SnapKV keeps no state beyond the tokens, so the bits are KIVI's."""

    def __init__(self, evict: SnapKVLayerState, kivi: KiviLayerState):
        self.evict, self.kivi = evict, kivi
        self._dropped = 0  # prompt tokens SnapKV evicted

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            k_kept, v_kept = self.evict.kept_kv()
            self.kivi.store_prompt(k_kept, v_kept)
            self._dropped = k.shape[2] - k_kept.shape[2]
            self.evict = None  # its tokens now live in the KIVI state
            self._reads = None
            return out
        if self.evict is not None:  # nothing prefilled: SnapKV's own refusal (no one-pass form)
            return self.evict.attend(q, k, v, scaling=scaling, prefill=False)
        out = self.kivi.attend(q, k, v, scaling=scaling, prefill=False)
        self._reads = self.kivi.read_bits()
        return out

    def stored_bits(self):
        return self.kivi.stored_bits()

    @property
    def n_seen(self):
        return self._dropped + self.kivi.n_seen

    @property
    def n_kept(self) -> int:
        return self.kivi.n_seen

