"""The KVQuant method (Hooper et al., NeurIPS 2024, arXiv 2401.18079): options, budget fit, knob
candidates, calibration and layer states. docs/methods.md §14."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import KVMethod, ModelShape, Unsupported
from ..budget import AT_TARGET, describe, no_joint_pair, reach, side_unreachable
from ..codec_state import ExactCodec, codecs_static_bytes
from ..latent_codec import SAMPLE_TOKENS
from .budget import (KNOBS, OUTLIER_GRID, PRESETS, SINK_GRID, configurations, headline, knob_options,
                     preferred, preset_knobs, token_cost)
from .calibration import FISHER_SCALES, _fisher, _sample, key_calibration, value_calibration
from .codec import BITS, KeyCodec, ValueCodec, outlier_level
from .state import KVQuantLayerState

BUDGETS = ("measured", "nominal")


@dataclass
class KVQuant(KVMethod):
    """KVQuant (Hooper et al., NeurIPS 2024, arXiv 2401.18079) per docs/methods.md §14.

    Knobs: ``bits``/``v_bits`` (b in 1..5), ``outliers``/``v_outliers`` (f per side, the "-1 %" of
    nuq4-1 %; ``v_outliers`` None = ``outliers``), ``sink`` (exact first tokens), or ``preset``
    (one of :data:`~methods.kvquant.budget.PRESETS`: the paper's setting, run as set). None =
    free: fitted to ``bpd``/``v_bpd`` under the ceiling (§0.1), and chosen by the held-out knob
    search when no knob is given (``searches()``). Explicit bits run as set (their side unchecked;
    unset outliers 0, sink 1). ``fisher``: weight the k-means by the Fisher information
    (``calibration_fisher()``; false: F = 1); ``fisher_scale`` "paper" (F s², Eq. 7) | "code" (F);
    ``budget`` "measured" | "nominal"; ``calib_tokens`` (calibration keys/values sampled per head);
    ``joint_kv`` (with both targets: the two sides' mean under the ceiling of bpd_KV)."""

    name: ClassVar[str] = "kvquant"
    needs_calibration: ClassVar[bool] = True

    bits: int | None = None
    v_bits: int | None = None
    outliers: float | None = None
    v_outliers: float | None = None
    sink: int | None = None
    preset: str | None = None
    fisher: bool = True
    fisher_scale: str = "paper"
    budget: str = "measured"
    calib_tokens: int = SAMPLE_TOKENS
    joint_kv: bool = False

    def __post_init__(self):
        for knob in ("bits", "v_bits"):
            b = getattr(self, knob)
            if b is not None and b not in BITS:
                raise ValueError(f"kvquant: {knob}={b!r}; valid choices: {BITS} or null (fitted)")
        for knob in ("outliers", "v_outliers"):
            f = getattr(self, knob)
            if f is not None and not 0.0 <= float(f) < 0.5:
                raise ValueError(f"kvquant: {knob}={f!r} is the outlier fraction f, 0 <= f < 0.5, or null (fitted)")
        if self.sink is not None and (int(self.sink) != self.sink or self.sink < 0):
            raise ValueError(f"kvquant: sink={self.sink!r}; an integer >= 0 or null (fitted)")
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"kvquant: preset={self.preset!r}; valid choices: {list(PRESETS)} or null")
            given = [k for k in KNOBS if getattr(self, k) is not None]
            if given:
                raise ValueError(f"kvquant: preset={self.preset!r} sets {list(KNOBS)}; drop {given}")
        if self.fisher_scale not in FISHER_SCALES:
            raise ValueError(f"kvquant: fisher_scale={self.fisher_scale!r}; valid choices: {FISHER_SCALES}")
        if not isinstance(self.fisher, bool):
            raise ValueError(f"kvquant: fisher={self.fisher!r}; valid choices: true, false")
        if self.budget not in BUDGETS:
            raise ValueError(f"kvquant: budget={self.budget!r}; valid choices: {BUDGETS}")
        if int(self.calib_tokens) < 1:
            raise ValueError(f"kvquant: calib_tokens={self.calib_tokens!r} must be >= 1")
        self._shape: ModelShape | None = None
        self._plan: dict | None = None
        self._k_codecs: list | None = None
        self._v_codecs: list | None = None
        self._calib: dict = {}

    # -- budget --------------------------------------------------------------------------------

    def _explicit(self) -> list[str]:
        return [f"{k}={getattr(self, k)}" for k in (*KNOBS, "preset") if getattr(self, k) is not None]

    def _fixed(self, values: bool) -> dict:
        """The knobs the options fix ({knob: value}; absent = free): a preset all of them; explicit
        bits their side, with unset outliers 0 and an unset sink 1 (§14.3's defaults)."""
        if self.preset is not None:
            return preset_knobs(self.preset, values)
        fixed = {k: getattr(self, k) for k in KNOBS if getattr(self, k) is not None}
        if self.outliers is not None and self.v_outliers is None:
            fixed["v_outliers"] = self.outliers
        if self.bits is not None or self.v_bits is not None:
            fixed.setdefault("outliers", 0.0)
            fixed.setdefault("v_outliers", fixed["outliers"])
            fixed.setdefault("sink", 1)
        return fixed

    def _sides(self, bpd_k, bpd_v) -> dict:
        """{side: target or None (run as set)} for the quantized sides."""
        sides = {}
        explicit = {"k": self.bits is not None or self.preset is not None, "v": self.v_bits is not None}
        for side, target in (("k", bpd_k), ("v", bpd_v)):
            has_target = target is not None and float(target) != 16.0
            if explicit[side] or has_target:
                sides[side] = None if explicit[side] or not has_target else float(target)
        if self.preset is not None and "v" in sides:
            sides["v"] = None
        return sides

    def _configs(self, n: int, bpd_k, bpd_v) -> tuple[list[dict], dict, float | None]:
        """(every admissible configuration, in the fit's order; the sides; the joint target)."""
        sides = self._sides(bpd_k, bpd_v)
        fixed = self._fixed("v" in sides)
        grids = {side: ((fixed.get(f"{p}bits"),) if f"{p}bits" in fixed else BITS,
                        (float(fixed[f"{p}outliers"]),) if f"{p}outliers" in fixed else OUTLIER_GRID)
                 for side, p in (("k", ""), ("v", "v_")) if side in sides}
        sinks = (int(fixed["sink"]),) if "sink" in fixed else SINK_GRID
        joint = self.joint_kv and set(sides) == {"k", "v"} and None not in sides.values()
        target_kv = (sides["k"] + sides["v"]) / 2 if joint else None
        configs = configurations(sides, grids, sinks, n, self.regime, self.budget, target_kv)
        return preferred(configs), sides, target_kv

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: with no knob given, the admissible configurations are chosen among on
        held-out text (kvbench/fit/knob_search.py)."""
        return ("knobs",) if self.budget == "measured" and not self._explicit() else ()

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The admissible configurations at the targets in the job's regime (each side under its
        ceiling, or with ``joint_kv`` the two sides' mean under bpd_KV's), at most ``limit``: the
        richest paper preset first when admissible, then one per (key bits, value bits) in turn,
        the most bits first (:func:`methods.kvquant.budget.preferred`)."""
        if bpd_k is None or "knobs" not in self.searches():
            return []
        configs, _, _ = self._configs(shape.n_kv_heads * shape.head_dim, bpd_k, bpd_v)
        return [knob_options(c) for c in configs][:limit]

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        n = shape.n_kv_heads * shape.head_dim
        if n > 32767:
            raise ValueError(f"kvquant: int16 outlier indices need H_kv d <= 32767, got {n}")
        configs, sides, target_kv = self._configs(n, bpd_k, bpd_v)
        plan = {"n": n, "target_bpd_k": bpd_k, "target_bpd_v": bpd_v}
        if not sides:
            self._plan = {**plan, "sink": 0, "k_bits": None, "v_bits": None, "k_outliers": None,
                          "v_outliers": None, "predicted_bpd_k": 16.0, "predicted_bpd_v": 16.0}
            return
        if not configs:
            raise Unsupported(self._unreachable(sides, n, bpd_k, bpd_v, target_kv))
        chosen = self.chosen_knobs
        if chosen is None:
            fit, how = configs[0], ("run as set" if None in sides.values() and not target_kv
                                    else "preference (paper preset first, then the most bits)")
        else:
            match = [c for c in configs if knob_options(c) == {k: chosen.get(k) for k in KNOBS}]
            if not match:
                raise Unsupported(f"kvquant: knobs {chosen} are not admissible at bpd={bpd_k}, v_bpd={bpd_v} "
                                  f"in {describe(self.regime)}")
            fit, how = match[0], "held-out knob search"
        self._plan = {**plan, "sink": fit["sink"], "k_bits": fit["bits"], "v_bits": fit["v_bits"],
                      "k_outliers": fit["outliers"], "v_outliers": fit["v_outliers"],
                      "predicted_bpd_k": fit["predicted_bpd_k"], "predicted_bpd_v": fit["predicted_bpd_v"],
                      "chosen_by": how, "admissible": len(configs), "band": AT_TARGET}
        if self.preset is not None:
            self._plan["preset"] = self.preset
        if target_kv is not None:
            self._plan["joint_kv"] = target_kv

    def _unreachable(self, sides: dict, n: int, bpd_k, bpd_v, target_kv) -> str:
        what = ("per-token figure of §14.6" if self.budget == "nominal"
                else f"measured headline in {describe(self.regime)}")
        grid = f"b in {BITS}, f in {OUTLIER_GRID}, sink in {SINK_GRID}"
        cheapest = {side: [headline(token_cost(side, 1, 0.0, n), 0, self.regime, self.budget)] for side in sides}
        richest = {side: [headline(token_cost(side, BITS[-1], OUTLIER_GRID[-1], n), 1, self.regime, self.budget)]
                   for side in sides}
        if target_kv is not None:
            pts = [x for side in sides for x in cheapest[side] + richest[side]]
            return (no_joint_pair("kvquant", target_kv, self.regime)
                    + f" (each side reaches {reach(pts)} at {grid}; under the ceiling "
                      f"{1 + AT_TARGET:g} x bpd_KV none)")
        parts = [side_unreachable("bpd" if side == "k" else "v_bpd", target, cheapest[side] + richest[side],
                                  f": the cheapest configuration ({cheapest[side][0]:.3f}, nuq1-0%, no sink) is "
                                  f"over {1 + AT_TARGET:g} x the target")
                 for side, target in sides.items() if target is not None]
        return f"kvquant ({what}, n = H_kv d = {n}, {grid}): " + "; ".join(parts or ["no configuration"])

    # -- calibration ---------------------------------------------------------------------------

    def _quantizes(self) -> bool:
        return self._plan is None or self._plan["k_bits"] is not None or self._plan["v_bits"] is not None

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head whose keys and values :meth:`calibrate` fits on (asked before
        ``configure``; 0 once configured with both sides exact)."""
        return int(self.calib_tokens) if self._quantizes() else 0

    def calibration_fisher(self) -> bool:
        """Whether the k-means is weighted by the Fisher information (``fisher``; §14.2(a))."""
        return bool(self.fisher) and self._quantizes()

    def calibrate(self, stats, seed=0):
        if self._plan is None:
            raise RuntimeError("kvquant: configure() before calibrate()")
        plan = self._plan
        self._k_codecs, self._v_codecs, fracs = [], [], []
        for layer, st in enumerate(stats):
            for side, codecs in (("k", self._k_codecs), ("v", self._v_codecs)):
                bits = plan[f"{side}_bits"]
                if bits is None:
                    codecs.append(ExactCodec())
                    continue
                t = outlier_level(plan[f"{side}_outliers"])
                x = _sample(st, side, layer)
                fisher = _fisher(st, side, layer) if self.fisher else None
                if side == "k":
                    u, lo, lut, frac = key_calibration(x, t, bits, self.fisher_scale, fisher)
                    codecs.append(KeyCodec(u, lo, lut, bits, t < 1.0))
                    fracs.append(frac)
                else:
                    codecs.append(ValueCodec(value_calibration(x, t, bits, self.fisher_scale, fisher), bits, t))
        sample = stats[0].k_sample if stats else None
        self._calib = {"calibration_tokens": 0 if sample is None else int(sample.shape[1])}
        if fracs and plan["k_outliers"]:
            f_hat = sum(fracs) / len(fracs)
            cost = plan["k_bits"] + 32 * f_hat + 32 / plan["n"]
            self._calib.update(key_outlier_fraction_calibration=f_hat,
                               predicted_bpd_k_calibration=headline(cost, plan["sink"], self.regime, self.budget))

    def static_bytes(self) -> int:
        return codecs_static_bytes(self._k_codecs, self._v_codecs)

    def new_layer_state(self, layer):
        if self._k_codecs is None or self._v_codecs is None:
            raise RuntimeError("kvquant: calibrate() before new_layer_state()")
        return KVQuantLayerState(self._k_codecs[layer], self._v_codecs[layer], exact_first=self._plan["sink"])

    def knobs(self):
        if self._plan is None:
            return {}
        out = {k: v for k, v in self._plan.items() if k != "n"}
        out["predicted"] = {"bpd_k": self._plan["predicted_bpd_k"], "bpd_v": self._plan["predicted_bpd_v"]}
        out.update(fisher=self.fisher, fisher_scale=self.fisher_scale, budget=self.budget,
                   regime=describe(self.regime), vector_length=self._plan["n"], **self._calib)
        if self._k_codecs and isinstance(self._k_codecs[0], KeyCodec):
            out["lut_k_layer0"] = [float(c) for c in self._k_codecs[0].lut]
        return out

    def nominal_bpd(self, n_tokens):
        plan = self._plan
        out = []
        for side in ("k", "v"):
            b = plan[f"{side}_bits"]
            if b is None:
                out.append(16.0)
                continue
            cost = token_cost(side, b, plan[f"{side}_outliers"], plan["n"])
            share = min(plan["sink"], n_tokens) / max(1, n_tokens)
            out.append(cost + (16.0 - cost) * share)
        return tuple(out)
