"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874, ICLR 2026) with QJL's 1-bit
inner-product stage (Zandieh, Daliri, Han, arXiv 2406.03482; amirzandieh/QJL).

Per vector x in R^d (one token of one KV head, one side) an instance stores nu = ||x|| (fp16) and
the Lloyd-Max codes of the rotated unit vector Pi x / nu (TurboQuant_mse, Alg. 1); TurboQuant_prod
(Alg. 2) adds gamma = ||rho|| (fp16) and the d sign bits of S rho of the residual rho. With the
outlier split two instances cover the d/8 highest-energy RoPE pairs and the rest (the paper's
2.5- and 3.5-bit settings). bpd per vector: sum_j b_j / d + 16 #norms / d (+ 1 per prod
instance). Specification, budget map and the decisions where the sources are silent:
docs/methods.md §16. The parts: :mod:`methods.turboquant_codebook` (f_d and its Lloyd-Max
codebooks), :mod:`methods.turboquant_budget` (plans, headline, the equal-budget mapping),
:mod:`methods.turboquant_codec` (Pi, S, channel sets, encode/decode); this module is the method.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from .base import KVMethod, ModelShape
from .budget import AT_TARGET, spread as knob_order
from .codec_state import CodecLayerState, ExactCodec
from .latent_codec import sub_seed
from .turboquant_budget import (PLANS, InstancePlan, SidePlan, admissible_knobs, budget_plan, headline_bpd,
                                paper_plan, plain_plan, plan_for_code_bits, reachable_plans,
                                side_plan, spread)
from .turboquant_codebook import Codebook, lloyd_max, unit_distortion
from .turboquant_codec import (SKETCHES, InstancePacked, TurboCodec, TurboInstance, TurboPacked, outlier_channels,
                               rotation, sketch_matrix)

__all__ = ["Codebook", "InstancePacked", "InstancePlan", "SidePlan", "TurboCodec", "TurboInstance", "TurboPacked",
           "TurboQuant", "budget_plan", "headline_bpd", "lloyd_max", "outlier_channels", "plain_plan",
           "paper_plan", "plan_for_code_bits", "reachable_plans", "rotation", "sketch_matrix", "spread", "unit_distortion"]

VARIANTS = ("mse", "prod")
SIDES = ("k", "v")


def _salt(side: int, instance: int, kind: int) -> int:
    """Seed salt of (side, instance, Pi = 0 | S = 1): distinct from the other codecs' salts."""
    return 16 + 4 * side + 2 * instance + kind


@dataclass
class TurboQuant(KVMethod):
    """TurboQuant (docs/methods.md §16): data-oblivious rotation + Lloyd-Max codebooks of f_d, fp16
    norms, optionally QJL's 1-bit residual stage on keys. Budget map and decisions:
    docs/methods.md §16.7, §16.10.

    Options: ``bits`` / ``v_bits`` (plain-paper rows b + 16/d, run as set; null = the equal-budget
    mapping from bpd / v_bpd), ``k_variant`` "mse" | "prod" (values are always mse, §16.3),
    ``split`` (§16.4), both null = chosen by the held-out knob search with the plan (the paper's
    b + 1/2-bit setting or the nearest, :meth:`knob_candidates`), mse and no split without one;
    ``pre_rope`` (§16.5: keys coded before RoPE), ``sketch`` "gaussian" | "orthogonal", ``debias``
    (§16.3 ablation, mse keys)."""

    name: ClassVar[str] = "turboquant"
    rows_in_one_state: ClassVar[bool] = True  # per-token codes and norms; bits by plan
    holds_last_read: ClassVar[bool] = True
    needs_calibration: ClassVar[bool] = True  # the harness's seed (and the split's energies)
    seeded: ClassVar[bool] = True

    bits: int | None = None
    v_bits: int | None = None
    k_variant: str | None = None
    split: bool | None = None
    pre_rope: bool = False
    sketch: str = "gaussian"
    debias: bool = False

    def __post_init__(self):
        if self.k_variant is not None and self.k_variant not in VARIANTS:
            raise ValueError(f"turboquant: k_variant={self.k_variant!r} not in {VARIANTS}")
        if self.sketch not in SKETCHES:
            raise ValueError(f"turboquant: sketch={self.sketch!r} not in {SKETCHES}")
        self._shape: ModelShape | None = None
        self._plans: dict = {}
        self._codecs: dict | None = None
        self._knobs: dict = {}
        self._seed = 0
        self._split = bool(self.split)

    def _choice(self) -> dict:
        """The knobs in force: the search's choice, else the options, else mse keys, no split, the
        nearest plan."""
        chosen = self.chosen_knobs or {}
        if chosen.get("plan", "nearest") not in PLANS or chosen.get("k_variant", "mse") not in VARIANTS:
            raise ValueError(f"turboquant: knobs {chosen} (plan in {PLANS}, k_variant in {VARIANTS})")
        return {"k_variant": chosen.get("k_variant", self.k_variant or "mse"),
                "split": bool(chosen.get("split", bool(self.split))), "plan": chosen.get("plan", "nearest")}

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        c = self._choice()
        self._split = c["split"]
        self._plans = {
            "k": self._side_plan(shape, self.bits, bpd_k, c["k_variant"], c["plan"]),
            "v": self._side_plan(shape, self.v_bits, bpd_v, "mse", c["plan"]),
        }
        self._knobs = {"target_bpd_k": bpd_k, "target_bpd_v": bpd_v, "k_variant": c["k_variant"],
                       "split": self._split, "plan": c["plan"], "pre_rope": self.pre_rope, "sketch": self.sketch,
                       "debias": self.debias, "regime": asdict(self.regime)}
        d = shape.head_dim
        head = {s: 16.0 if p is None else headline_bpd(p, shape.n_kv_heads, d, self.regime)
                for s, p in self._plans.items()}
        self._knobs["predicted"] = {"regime": asdict(self.regime), "bpd_k": head["k"], "bpd_v": head["v"]}
        if bpd_k is not None and self.bits is None:
            self._knobs["fit"] = {"band": AT_TARGET, "chosen_by": "held-out knob search" if self.chosen_knobs
                                  else "options" if self.k_variant is not None and self.split is not None
                                  else "preference"}
        for side, plan in self._plans.items():
            if plan is None:
                self._knobs[f"{side}_plan"] = "exact16"
                continue
            self._knobs.update({
                f"{side}_plan": plan.label(),
                f"{side}_bits_per_vector": plan.bits,
                f"{side}_widths": [list(i.widths) for i in plan.instances],
                f"{side}_headline_bpd": headline_bpd(plan, shape.n_kv_heads, d, self.regime),
                f"{side}_unit_distortion": [unit_distortion(i.widths, i.dim) for i in plan.instances],
                f"{side}_mode": "plain" if (self.bits if side == "k" else self.v_bits) is not None else "budget",
            })

    def _side_plan(self, shape, bits, target, variant, plan) -> SidePlan | None:
        if bits is not None:
            return plain_plan(bits, shape.head_dim, variant, self._split)
        return side_plan(target, shape, variant, self._split, self.regime, plan)

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: the key variant, the split and the plan chosen on held-out text, unless the
        keys run a plain-paper row (``bits``) or both knobs are set."""
        fixed = self.bits is not None or (self.k_variant is not None and self.split is not None)
        return () if fixed else ("knobs",)

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The admissible {"k_variant", "split", "plan"} at the targets in the job's regime
        (:func:`methods.turboquant_budget.admissible_knobs`; the options given stay fixed): the
        paper's b + 1/2-bit settings first (the split literally, mse then prod keys), then the
        equal-budget plans, split first, mse before prod (:func:`methods.budget.spread`, one point
        per family)."""
        if bpd_k is None or "knobs" not in self.searches():
            return []
        variants = VARIANTS if self.k_variant is None else (self.k_variant,)
        splits = (False, True) if self.split is None else (bool(self.split),)
        tv = None if bpd_v is None or self.v_bits is not None else float(bpd_v)  # v_bits: a plain row
        points = admissible_knobs(shape, float(bpd_k), tv, self.regime, variants, splits)
        return knob_order(points, lambda o: (o["plan"] == "paper", o["split"], o["k_variant"] == "mse"), limit)

    def calibrate(self, stats, seed=0):
        """Draws Pi and S from ``seed``; reads the statistics only for the split's pair energies."""
        if self._shape is None:
            raise RuntimeError("turboquant: configure() before calibrate()")
        if stats is not None and len(stats) != self._shape.n_layers:
            raise ValueError(f"turboquant: {len(stats)} layer statistics for {self._shape.n_layers} layers")
        if self._split and stats is None:
            raise ValueError("turboquant split: the outlier channels need calibration statistics")
        self._seed = int(seed)
        self._codecs = {}
        for side_i, side in enumerate(SIDES):
            plan = self._plans.get(side)
            layers = []
            for layer in range(self._shape.n_layers):
                if plan is None:
                    layers.append(ExactCodec())
                    continue
                energy = None if not self._split else _energy(stats[layer], side)
                layers.append(self._codec(plan, layer, side_i, energy))
            self._codecs[side] = layers
        self._knobs.update(seed=self._seed, rotation_bytes_if_stored=self._rotation_bytes())

    def _codec(self, plan: SidePlan, layer: int, side_i: int, energy) -> TurboCodec:
        h = self._shape.n_kv_heads
        channels = [None]
        if self._split:
            channels = list(outlier_channels(energy, plan.instances[0].dim))
        instances = []
        for j, (inst, ch) in enumerate(zip(plan.instances, channels)):
            rot = torch.stack([rotation(inst.dim, sub_seed(self._seed, layer, hh, _salt(side_i, j, 0)))
                               for hh in range(h)])
            sketch = None
            if inst.qjl:
                sketch = torch.stack([sketch_matrix(inst.dim, sub_seed(self._seed, layer, hh, _salt(side_i, j, 1)),
                                                    self.sketch) for hh in range(h)])
            scale = 1.0
            if self.debias and side_i == 0 and not inst.qjl and inst.code_bits:
                scale = 1.0 / (1.0 - unit_distortion(inst.widths, inst.dim))
            instances.append(TurboInstance(inst, rot, sketch, ch, scale))
        return TurboCodec(instances, pre_rope=self.pre_rope and side_i == 0)

    def _rotation_bytes(self) -> int:
        """fp32 bytes Pi and S would take if stored instead of regenerated from the seed."""
        per_layer = sum(4 * i.dim * i.dim * (1 + i.qjl) for p in self._plans.values() if p for i in p.instances)
        return per_layer * self._shape.n_heads_total

    def static_bytes(self) -> int:
        """fp32 centroids of the codebooks in use, the 8-byte seed, and with the split one bit per
        RoPE pair per (layer, KV head, side) marking the outlier set."""
        if self._shape is None:
            return 0
        books = {(b, i.dim) for p in self._plans.values() if p for i in p.instances for b in i.widths}
        total = sum(4 * (1 << b) for b, _ in books) + 8
        if self._split:
            sides = sum(p is not None for p in self._plans.values())
            total += (sides * self._shape.n_heads_total * (self._shape.head_dim // 2) + 7) // 8
        return total

    def new_layer_state(self, layer):
        if self._codecs is None:
            raise RuntimeError("turboquant: calibrate() before new_layer_state()")
        return CodecLayerState(self._codecs["k"][layer], self._codecs["v"][layer])

    def knobs(self):
        return dict(self._knobs)

    def nominal_bpd(self, n_tokens):
        d = self._shape.head_dim
        return tuple(16.0 if self._plans.get(s) is None else self._plans[s].bits / d for s in SIDES)


def _energy(stats, side: str) -> torch.Tensor:
    """Uncentered per-channel energy E[x_i^2] [H, d] (float64) of keys or values (pre-RoPE keys:
    the pair energy is RoPE-invariant, §16.4)."""
    mu = getattr(stats, f"mu_{side}").cpu().to(torch.float64)
    cov = getattr(stats, f"cov_{side}").cpu().to(torch.float64)
    return torch.diagonal(cov, dim1=-2, dim2=-1) + mu * mu
