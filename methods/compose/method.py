"""The compose method: options, the codec's share of the budget and the kept fraction fitted to
the target (the package docstring gives the rules).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..base import KVMethod, Unsupported
from ..codec_state import CodecLayerState
from ..kivi import KiviLayerState
from ..snapkv import SnapKVLayerState
from .kivi_state import KiviComposedState, SnapKiviState
from .positions import position_bits
from .tokenwise import TokenwiseComposedState

EVICTIONS = ("h2o", "snapkv")
#: codecs whose layer state is neither token-wise nor KIVI's (see the package docstring)
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
    from .. import REGISTRY

    return [n for n, c in REGISTRY.items()
            if not c.evicts_tokens and n != "compose" and n not in UNSUPPORTED_CODECS]




@dataclass
class Compose(KVMethod):
    """compose(evict, codec), docs/methods.md §12; see the package docstring.

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
        from .. import REGISTRY, build_method

        if self.evict not in EVICTIONS:
            raise ValueError(f"compose: unknown evict={self.evict!r}; valid choices: {', '.join(EVICTIONS)}")
        valid = codec_choices()
        if self.codec not in valid:
            why = " (not supported yet: see methods/compose/__init__.py)" if self.codec in UNSUPPORTED_CODECS else ""
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
        # the kept tokens' stored positions of a pre-RoPE codec (§12.3) cost what the kept set makes them
        self.rows_in_one_state = (self._evictor.rows_in_one_state and self._codec.rows_in_one_state
                                  and self.codec not in PRE_ROPE_CODECS)
        self._shape = None
        self._rho = None
        self._knobs: dict = {}

    def searches(self) -> tuple[str, ...]:
        """``"budget_share"``: the harness chooses ``split`` by calibration-corpus PPL (§12) when
        neither ``keep`` nor ``split`` is given (``kvbench/fit/budget_share.py``).
        ``"measured_keep"``: once configured with a fitted kept fraction whose prediction is not
        exact (:attr:`prediction_exact`), the harness refits it to the measured headline
        (``kvbench/fit/measured_keep.py``, :meth:`set_kept_fraction`)."""
        names = ("budget_share",) if self.keep is None and self.split is None else ()
        if self._knobs.get("fitted") and not self.prediction_exact:
            names += ("measured_keep",)
        return names

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
    def prediction_exact(self) -> bool:
        """Whether :meth:`predicted_bpd` is what the regime measures. False for KIVI under an
        eviction that evicts while decoding (H2O; SnapKV with decode=evict): which held tokens sit
        in KIVI's fp16 residual and how many partly evicted key groups keep their metadata depend
        on the attention, so the harness refits the kept fraction to the measured figure on
        calibration-corpus windows (``kvbench/fit/measured_keep.py``, :meth:`set_kept_fraction`)."""
        if self.codec != "kivi":
            return True
        return self.evict == "snapkv" and self._evictor.decode == "keep"

    def set_kept_fraction(self, rho: float, record: dict | None = None) -> None:
        """Set the kept fraction to ``rho`` at the codec's current budgets (a refit of the fitted
        rho, e.g. to the measured figure); ``record`` (how it was chosen) goes into the knobs."""
        if self._shape is None or not self._knobs.get("fitted"):
            raise RuntimeError("compose: set_kept_fraction() refits a fitted rho; configure() first")
        if not RHO_MIN <= rho <= 1.0:
            raise ValueError(f"compose: kept fraction must be in [{RHO_MIN:g}, 1], got {rho!r}")
        self._set_rho(rho)
        pred = self.predicted_bpd()
        self._knobs.update(rho=rho, predicted_bpd_k=pred[0], predicted_bpd_v=pred[1],
                           predicted_bpd_kv=sum(pred) / 2, predicted_positions_bpd_k=self.positions_bpd())
        if record is not None:
            self._knobs["measured_fit"] = record

    def rho_for(self, bpd_kv: float) -> float:
        """The kept fraction whose *predicted* bpd_KV is ``bpd_kv`` at the codec's current budgets
        (clamped to [RHO_MIN, 1]); the configured rho is left as it was."""
        before = self._rho
        try:
            rho, _ = self._fit_rho(bpd_kv)
        except Unsupported:
            rho = RHO_MIN
        finally:
            self._set_rho(before)
        return rho

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
        return int(self._codec.calibration_sample_tokens())

    def calibration_fisher(self) -> bool:
        return bool(self._codec.calibration_fisher())

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

    def allocation(self):
        """The codec's allocation (its bits per kept element) and ``kept``, the fitted kept
        fraction ρ of every KV head [L, H_kv]."""
        out = dict(self._codec.allocation())
        if self._shape is not None and self._rho is not None:
            out["kept"] = torch.full((self._shape.n_layers, self._shape.n_kv_heads), float(self._rho),
                                     dtype=torch.float64)
        return out
