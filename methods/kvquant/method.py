"""The KVQuant method (Hooper et al., NeurIPS 2024, arXiv 2401.18079): options, budget fit,
calibration and layer states. docs/methods.md §14."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import KVMethod, ModelShape, Unsupported
from ..budget import AT_TARGET, describe, in_band, no_joint_pair, reach, side_unreachable
from ..codec_state import ExactCodec, codecs_static_bytes
from ..joint_budget import best_pair
from ..latent_codec import SAMPLE_TOKENS
from .budget import headline, token_cost
from .calibration import FISHER_SCALES, _sample, key_calibration, value_calibration
from .codec import BITS, KeyCodec, ValueCodec, outlier_level
from .state import KVQuantLayerState

BUDGETS = ("measured", "nominal")


@dataclass
class KVQuant(KVMethod):
    """KVQuant (Hooper et al., NeurIPS 2024, arXiv 2401.18079) per docs/methods.md §14; see the module
    docstring for the quantizers, the bit count, the grid reached and the decisions.

    Options: ``bits``/``v_bits`` (b in 1..5; None = fitted to ``bpd``/``v_bpd``), ``outliers``
    (f, the "-1 %" of nuq4-1 %; 0 = none), ``sink`` (exact first tokens; None = 1, or 0 where 1
    leaves the 2 % band), ``fisher_scale`` ("code" | "paper"), ``budget`` ("measured" | "nominal"),
    ``calib_tokens`` (calibration keys/values sampled per head), ``joint_kv`` (with both targets:
    the mean of the two sides within the band, :mod:`methods.joint_budget`, instead of each side)."""

    name: ClassVar[str] = "kvquant"
    needs_calibration: ClassVar[bool] = True

    bits: int | None = None
    v_bits: int | None = None
    outliers: float = 0.0
    sink: int | None = None
    fisher_scale: str = "code"
    budget: str = "measured"
    calib_tokens: int = SAMPLE_TOKENS
    joint_kv: bool = False

    def __post_init__(self):
        for knob in ("bits", "v_bits"):
            b = getattr(self, knob)
            if b is not None and b not in BITS:
                raise ValueError(f"kvquant: {knob}={b!r}; valid choices: {BITS} or null (fitted)")
        if not 0.0 <= float(self.outliers) < 0.5:
            raise ValueError(f"kvquant: outliers={self.outliers!r} is the outlier fraction f, 0 <= f < 0.5")
        if self.sink is not None and (int(self.sink) != self.sink or self.sink < 0):
            raise ValueError(f"kvquant: sink={self.sink!r}; an integer >= 0 or null (fitted)")
        if self.fisher_scale not in FISHER_SCALES:
            raise ValueError(f"kvquant: fisher_scale={self.fisher_scale!r}; valid choices: {FISHER_SCALES}")
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

    def _sides(self, bpd_k, bpd_v) -> dict:
        """Per quantized side: (target or None, explicit bits or None)."""
        sides = {}
        for side, target, bits in (("k", bpd_k, self.bits), ("v", bpd_v, self.v_bits)):
            quantized = bits is not None or (target is not None and float(target) != 16.0)
            if quantized:
                sides[side] = (None if target is None or float(target) == 16.0 else float(target), bits)
        return sides

    def _points(self, side: str, n: int, sink: int) -> list[tuple[float, int]]:
        """(predicted headline, b) for every b of the grid."""
        f = float(self.outliers)
        return [(headline(token_cost(side, b, f, n), sink, self.regime, self.budget), b) for b in BITS]

    def _fit_side(self, side: str, target: float | None, bits: int | None, n: int, sink: int):
        """(b, predicted) for one side at ``sink``, or None when no b is within the band."""
        f = float(self.outliers)
        if bits is not None:  # run as set
            return bits, headline(token_cost(side, bits, f, n), sink, self.regime, self.budget)
        inside = [(abs(x - target), b, x) for x, b in self._points(side, n, sink)
                  if in_band(x, target, eps=1e-12)]
        if not inside:
            return None
        _, b, x = min(inside)
        return b, x

    def _fit_joint(self, target_kv: float, n: int, sink: int):
        """``joint_kv``: {side: (b, predicted)} for the most balanced pair of key and value points
        whose mean is within the band of ``target_kv`` (:func:`methods.joint_budget.best_pair`;
        then the most key bits), or None."""
        pairs = [(k, v) for k in self._points("k", n, sink) for v in self._points("v", n, sink)]
        best = best_pair(pairs, lambda p: p[0], target_kv, AT_TARGET, lambda k, v: (k[1], v[1]))
        return None if best is None else {"k": best[0][::-1], "v": best[1][::-1]}

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        n = shape.n_kv_heads * shape.head_dim
        if n > 32767:
            raise ValueError(f"kvquant: int16 outlier indices need H_kv d <= 32767, got {n}")
        sides = self._sides(bpd_k, bpd_v)
        sinks = [int(self.sink)] if self.sink is not None else [1, 0]
        joint = (self.joint_kv and set(sides) == {"k", "v"} and self.bits is None and self.v_bits is None
                 and None not in (sides["k"][0], sides["v"][0]))
        target_kv = (sides["k"][0] + sides["v"][0]) / 2 if joint else None
        for sink in sinks:
            if joint:
                fit = self._fit_joint(target_kv, n, sink)
            else:
                fit = {s: self._fit_side(s, target, bits, n, sink) for s, (target, bits) in sides.items()}
            if fit is not None and all(v is not None for v in fit.values()):
                break
        else:
            if joint:
                pts = [x for s in sinks for side in ("k", "v") for x, _ in self._points(side, n, s)]
                raise Unsupported(no_joint_pair("kvquant", target_kv, self.regime)
                                  + f" (each side reaches {reach(pts)} at b in {BITS})")
            raise Unsupported(self._unreachable(sides, n, sinks))
        self._plan = {
            "n": n, "sink": sink if sides else 0, "t": outlier_level(float(self.outliers)),
            "k_bits": fit["k"][0] if "k" in fit else None, "v_bits": fit["v"][0] if "v" in fit else None,
            "predicted_bpd_k": fit["k"][1] if "k" in fit else 16.0,
            "predicted_bpd_v": fit["v"][1] if "v" in fit else 16.0,
            "target_bpd_k": bpd_k, "target_bpd_v": bpd_v,
        }
        if joint:
            self._plan["joint_kv"] = target_kv
        if self.sink is None and sides and sink == 0:
            self._plan["sink_dropped"] = (
                f"one sink token puts the measured headline in {describe(self.regime)} outside "
                f"{AT_TARGET:.0%} of the target")

    def _unreachable(self, sides: dict, n: int, sinks: list[int]) -> str:
        what = ("per-token figure of §14.6" if self.budget == "nominal"
                else f"measured headline in {describe(self.regime)}")
        parts = []
        for side, (target, bits) in sides.items():
            if bits is not None:
                continue
            pts = [(x, b, s) for s in sinks for x, b in self._points(side, n, s)]
            nearest = sorted(pts, key=lambda p: abs(p[0] - target))[:2]
            near = ", ".join(f"{x:.3f} (b={b}, sink {s})" for x, b, s in nearest)
            parts.append(side_unreachable("bpd" if side == "k" else "v_bpd", target, [p[0] for p in pts],
                                          f" at b in {BITS}, f={self.outliers:g}; no point within "
                                          f"{AT_TARGET:.0%} (nearest {near})"))
        return f"kvquant ({what}, n = H_kv d = {n}): " + "; ".join(parts)

    # -- calibration ---------------------------------------------------------------------------

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head whose keys and values :meth:`calibrate` fits on (asked before
        ``configure``; 0 once configured with both sides exact)."""
        if self._plan is not None and self._plan["k_bits"] is None and self._plan["v_bits"] is None:
            return 0
        return int(self.calib_tokens)

    def calibrate(self, stats, seed=0):
        if self._plan is None:
            raise RuntimeError("kvquant: configure() before calibrate()")
        plan, t = self._plan, self._plan["t"]
        self._k_codecs, self._v_codecs, fracs = [], [], []
        for layer, st in enumerate(stats):
            if plan["k_bits"] is None:
                self._k_codecs.append(ExactCodec())
            else:
                u, l, lut, frac = key_calibration(_sample(st, "k", layer), t, plan["k_bits"], self.fisher_scale)
                self._k_codecs.append(KeyCodec(u, l, lut, plan["k_bits"], t < 1.0))
                fracs.append(frac)
            if plan["v_bits"] is None:
                self._v_codecs.append(ExactCodec())
            else:
                lut = value_calibration(_sample(st, "v", layer), t, plan["v_bits"], self.fisher_scale)
                self._v_codecs.append(ValueCodec(lut, plan["v_bits"], t))
        sample = stats[0].k_sample if stats else None
        self._calib = {"calibration_tokens": 0 if sample is None else int(sample.shape[1])}
        if fracs and t < 1.0:
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
        out.update(outliers=float(self.outliers), fisher_scale=self.fisher_scale, budget=self.budget,
                   regime=describe(self.regime), vector_length=self._plan["n"], **self._calib)
        if self._k_codecs and isinstance(self._k_codecs[0], KeyCodec):
            out["lut_k_layer0"] = [float(c) for c in self._k_codecs[0].lut]
        return out

    def nominal_bpd(self, n_tokens):
        plan = self._plan
        f = float(self.outliers)
        out = []
        for side in ("k", "v"):
            b = plan[f"{side}_bits"]
            if b is None:
                out.append(16.0)
                continue
            cost = token_cost(side, b, f, plan["n"])
            share = min(plan["sink"], n_tokens) / max(1, n_tokens)
            out.append(cost + (16.0 - cost) * share)
        return tuple(out)

