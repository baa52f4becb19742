"""GEAR: quantization backbone + exact sparse outliers + low-rank residual, in a streaming buffer.

Kang, Zhang, Kundu, Jeong, Liu, Krishna, Zhao, "GEAR: An Efficient Error Reduction Framework for KV
Cache Compression in LLM Inference", arXiv 2403.05527 (v4, NeurIPS 2024 ENLSP, PMLR 262:305-321);
code opengear-project/GEAR. Specification, budget map and the decisions where the sources are
silent: docs/methods.md §15. Per layer, every block of n_b tokens X ~ D + S + L (§15.1), keys
post-RoPE; bpd per block b + 32/G + 2k(16 + iota)/n + 16 r (n + d)/(n d) plus the fp16 buffer
share (§15.7). The parts: :mod:`methods.gear_codec` (D, S, L and the stored blocks),
:mod:`methods.gear_budget` (the measured headline and the fit), :mod:`methods.gear_state` (the
streaming cache); this module is the method (knobs, the held-out knob search's candidates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .base import KVMethod, Unsupported
from .budget import AT_TARGET, spread
from .gear_budget import (_predict, admissible_fits, block_grid, chosen_fit, fit_joint, fit_knobs, headline,
                          joint_fits, knob_options, why_unreachable)
from .gear_codec import (KCOUNTS, LEVELS, PAPER, PAPER_PROMPT_RANK, SIDE_KNOBS, GearPacked, SideCodec,
                         decode_blocks, draw_omegas, encode_blocks, power_iteration, sparse_backbone)
from .gear_state import GearLayerState

__all__ = ["Gear", "GearLayerState", "GearPacked", "SideCodec", "admissible_fits", "block_grid", "decode_blocks",
           "draw_omegas", "encode_blocks", "fit_joint", "fit_knobs", "headline", "power_iteration",
           "sparse_backbone", "why_unreachable"]

PROMPTS = ("chunked", "one_block")
BUDGETS = ("measured", "nominal")


@dataclass
class Gear(KVMethod):
    """GEAR (Kang et al., arXiv 2403.05527), docs/methods.md §15; decisions §15.12.

    bits/group/sparsity/rank: the key side's b, G, s, r; ``v_`` forms: the value side's; block: n_b.
    None = fitted by ``configure`` (any given = run as set, the rest at the §15.6 setting).
    levels: "harness" (2^b - 1) | "official" (b^2 - 1 on the sparse path); kcount: "harness" |
    "official" (the outlier count of §15.3); index_bits: 16 | 32; loop: power-iteration rounds;
    prompt: "chunked" | "one_block" (the prefill's blocks, §15.5/§15.8) with prompt_rank (r_p);
    budget: "measured" | "nominal"; seed: Omega's seed (None = the torch seed at ``configure``);
    joint_kv: with both targets, fit their mean instead of each side (:func:`fit_joint`)."""

    name = "gear"
    rows_in_one_state = True  # blocks, outliers and rank per row; one Ω for all rows
    seeded = True

    bits: int | None = None
    group: int | None = None
    sparsity: float | None = None
    rank: int | None = None
    v_bits: int | None = None
    v_group: int | None = None
    v_sparsity: float | None = None
    v_rank: int | None = None
    block: int | None = None
    levels: str = "harness"
    kcount: str = "harness"
    index_bits: int = 16
    loop: int = 3
    prompt: str = "chunked"
    prompt_rank: int | None = None
    budget: str = "measured"
    seed: int | None = None
    joint_kv: bool = False

    def __post_init__(self):
        for name, value, choices in (("levels", self.levels, LEVELS), ("kcount", self.kcount, KCOUNTS),
                                     ("prompt", self.prompt, PROMPTS), ("budget", self.budget, BUDGETS)):
            if value not in choices:
                raise ValueError(f"gear: {name} must be one of {choices}, got {value!r}")
        if self.index_bits not in (16, 32):
            raise ValueError(f"gear: index_bits must be 16 or 32, got {self.index_bits!r}")
        if self.block is not None and (isinstance(self.block, bool) or int(self.block) != self.block
                                       or self.block < 1):
            raise ValueError(f"gear: block must be a positive integer (or null), got {self.block!r}")

    def _opts(self) -> dict:
        return {"levels_rule": self.levels, "kcount": self.kcount, "index_bits": self.index_bits,
                "loop": self.loop}

    def _explicit(self) -> list[str]:
        names = [*SIDE_KNOBS, *(f"v_{k}" for k in SIDE_KNOBS), "block"]
        return [f"{k}={getattr(self, k)}" for k in names if getattr(self, k) is not None]

    def _side(self, side: str, knobs: dict | None) -> SideCodec | None:
        if knobs is None:
            return None
        return SideCodec(side, int(knobs["bits"]), int(knobs["group"]), float(knobs["sparsity"]),
                         int(knobs["rank"]), **self._opts())

    def _given(self, prefix: str) -> dict:
        return {k: (getattr(self, prefix + k) if getattr(self, prefix + k) is not None else PAPER[k])
                for k in SIDE_KNOBS}

    def configure(self, shape, bpd_k, bpd_v):
        h, d = shape.n_kv_heads, shape.head_dim
        self._shape = (h, d)
        self._seed = self.seed if self.seed is not None else torch.initial_seed()
        explicit = self._explicit()
        self._fit = self._not_fitted = None
        prompt_rank = self._prompt_rank() if self.prompt == "one_block" else None
        joint = self.joint_kv and bpd_k is not None and bpd_v is not None
        if joint and not explicit:
            fit = fit_joint((float(bpd_k) + float(bpd_v)) / 2, h, d, self.regime, self._opts(), self.budget,
                            prompt_rank, self.chosen_knobs)
        elif bpd_k is not None and not explicit:
            fit = fit_knobs(float(bpd_k), None if bpd_v is None else float(bpd_v), h, d, self.regime,
                            self._opts(), self.budget, prompt_rank, self.chosen_knobs)
        if bpd_k is not None and not explicit:
            block, kk, vk = fit["block"], fit["k"], fit["v"]
            self._fit = {"regime": dataclasses.asdict(self.regime), "band": AT_TARGET, "budget": self.budget,
                         "predicted_bpd_k": fit["predicted_bpd_k"], "predicted_bpd_v": fit["predicted_bpd_v"]}
            if joint:
                self._fit["joint_kv"] = (float(bpd_k) + float(bpd_v)) / 2
            self._fit["chosen_by"] = "held-out knob search" if self.chosen_knobs else "preference"
        else:
            block = self.block or PAPER["block"]
            kk = self._given("")
            vk = self._given("v_") if (bpd_v is not None or self.v_bits is not None) else None
            self._not_fitted = ("no key target: the run templates' GEAR setting (docs/methods.md §15.6)"
                                if bpd_k is None else
                                f"explicit knobs ({', '.join(explicit)}): not fitted to the target, reported "
                                "at the measured bpd")
        self._resolved = (int(block), self._side("k", kk), self._side("v", vk))
        self._check()

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: the fit's admissible points are chosen among on held-out text."""
        return () if self._explicit() else ("knobs",)

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The admissible points of the fit in the job's regime (side by side, :func:`admissible_fits`,
        or the pairs of :func:`joint_fits` for ``joint_kv`` with both targets): the §15.6 setting
        first when admissible, then one point per (b, r) of the keys (and of the values in the
        KV-track; joint: one pair per key and value b) in turn, the most bits and the largest rank
        first, each family's points in preference order (:func:`methods.budget.spread`), so that
        the fit's own first pair (the most balanced) is among them."""
        if bpd_k is None or self._explicit():
            return []
        h, d = shape.n_kv_heads, shape.head_dim
        tv = None if bpd_v is None else float(bpd_v)
        prompt_rank = self._prompt_rank() if self.prompt == "one_block" else None
        side = {k: PAPER[k] for k in SIDE_KNOBS}
        paper = {"block": PAPER["block"], "k": side, "v": None if tv is None else dict(side)}
        if self.joint_kv and tv is not None:
            fits = joint_fits((float(bpd_k) + tv) / 2, h, d, self.regime, self._opts(), self.budget, prompt_rank)
            paper = paper if paper in [knob_options(f) for f in fits] else None
        else:
            fits = admissible_fits(float(bpd_k), tv, h, d, self.regime, self._opts(), self.budget, prompt_rank)
            try:
                chosen_fit(paper, float(bpd_k), tv, h, d, self.regime, self._opts(), self.budget, prompt_rank)
            except Unsupported:
                paper = None

        joint = self.joint_kv and tv is not None

        def family(o):  # joint: per (key bits, value bits), as KIVI's and KVQuant's pairs
            v = o["v"] or {"bits": 0, "rank": 0}
            return (o["k"]["bits"], v["bits"]) if joint else (o["k"]["bits"], o["k"]["rank"], v["bits"], v["rank"])

        return spread([knob_options(f) for f in fits], family, limit, first=paper)

    def _prompt_rank(self) -> int:
        return self.prompt_rank if self.prompt_rank is not None else PAPER_PROMPT_RANK

    def _knobs(self):
        resolved = getattr(self, "_resolved", None)
        if resolved is None:
            raise RuntimeError("gear: call configure(shape, bpd_k, bpd_v) before new_layer_state()")
        return resolved

    def _check(self):
        block, kc, vc = self._knobs()
        h, d = self._shape
        kc.check(block, h, d)
        if vc is not None:
            vc.check(block, h, d)

    def new_layer_state(self, layer):
        block, kc, vc = self._knobs()
        return GearLayerState(layer, block, kc, vc, self._seed, self.prompt,
                              self._prompt_rank() if self.prompt == "one_block" else None)

    def knobs(self):
        block, kc, vc = self._knobs()
        h, d = self._shape

        def side(c):
            if c is None:
                return None
            return {"bits": c.bits, "group": c.group, "sparsity": c.sparsity, "rank": c.rank,
                    "outliers_per_vector": 2 * c.outliers(block, h, d), "levels": c.levels,
                    "code_bits": c.code_bits, "block_bpd": c.cost(block, h, d)}

        out = {"block": block, "k": side(kc), "v": side(vc), "levels": self.levels, "kcount": self.kcount,
               "index_bits": self.index_bits, "loop": self.loop, "prompt": self.prompt,
               "prompt_rank": self._prompt_rank() if self.prompt == "one_block" else None,
               "budget": self.budget, "seed": self._seed, "fitted": self._fit is not None, "fit": self._fit,
               "predicted": self._predicted()}
        if self._not_fitted:
            out["not_fitted"] = self._not_fitted
        return out

    def _predicted(self) -> dict:
        """The measured headline the knobs give in the job's regime."""
        block, kc, vc = self._knobs()
        h, d = self._shape
        pr = self._prompt_rank() if self.prompt == "one_block" else None
        pk = _predict(kc, block, h, d, self.regime, "measured", pr)
        pv = 16.0 if vc is None else _predict(vc, block, h, d, self.regime, "measured", pr)
        return {"regime": dataclasses.asdict(self.regime), "bpd_k": pk, "bpd_v": pv}

    def nominal_bpd(self, n_tokens):
        """End of a sequence of ``n_tokens`` (chunked blocks): n_b floor(T/n_b) tokens compressed."""
        block, kc, vc = self._knobs()
        h, d = self._shape
        t = n_tokens
        m = block * (t // block)

        def one(c):
            return 16.0 if c is None else (m * c.cost(block, h, d) + 16.0 * (t - m)) / t

        return one(kc), one(vc)
