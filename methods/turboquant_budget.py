"""TurboQuant's plans and budget (arXiv 2504.19874; docs/methods.md §16.4, §16.7): how many bits
each rotated coordinate of each instance gets, the outlier split, what a plan stores per encode
call, its measured headline in a regime, and the equal-budget mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import ModelShape, Regime, Unsupported
from .budget import AT_TARGET, under_ceiling
from .turboquant_codebook import MAX_BITS

NORM_BITS = 16  # nu and gamma are fp16


def spread(total: int, n: int) -> tuple[int, ...]:
    """§16.7: ``total`` code bits over n exchangeable coordinates, ceil(b_bar) on the first
    m = total mod n, floor(b_bar) on the rest."""
    lo, m = divmod(int(total), n)
    return (lo + 1,) * m + (lo,) * (n - m)


@dataclass(frozen=True)
class InstancePlan:
    """One TurboQuant instance: ``part`` "all" | "outlier" | "rest" channels, their number, the
    widths of its rotated coordinates (descending) and whether a QJL stage follows."""

    part: str
    dim: int
    widths: tuple[int, ...]
    qjl: bool

    @property
    def code_bits(self) -> int:
        return sum(self.widths)

    @property
    def norms(self) -> int:
        """nu, plus gamma for prod with an mse stage (gamma = 1 when the stage is empty)."""
        return 1 + int(self.qjl and self.code_bits > 0)

    @property
    def bits(self) -> int:
        """Bits per vector: codes + sign bits + fp16 norms."""
        return self.code_bits + (self.dim if self.qjl else 0) + NORM_BITS * self.norms

    def label(self) -> str:
        counts: dict[int, int] = {}
        for b in self.widths:
            counts[b] = counts.get(b, 0) + 1
        codes = " + ".join(f"{n} @{b}" for b, n in counts.items())
        return codes + (f" + QJL({self.dim})" if self.qjl else "")


@dataclass(frozen=True)
class SidePlan:
    """The instances of one side (K or V) and their cost."""

    instances: tuple[InstancePlan, ...]

    @property
    def bits(self) -> int:
        return sum(i.bits for i in self.instances)

    @property
    def norms(self) -> int:
        return sum(i.norms for i in self.instances)

    def label(self) -> str:
        parts = [f"{i.part}: {i.label()}" if len(self.instances) > 1 else i.label() for i in self.instances]
        return "; ".join(parts) + f" + {self.norms} fp16 norm{'s' if self.norms > 1 else ''}"


def split_dims(d: int) -> tuple[int, int]:
    """(outlier channels, the rest): d/8 RoPE pairs (§16.4's 32 of 128)."""
    if d % 8:
        raise Unsupported(f"turboquant split: head_dim {d} has no d/8 RoPE pairs (needs d % 8 == 0)")
    return d // 4, d - d // 4


def _share(c: int, d_out: int, d_rest: int) -> tuple[int, int]:
    """Code bits (outlier, rest) of a split: the outliers one bit more per coordinate (§16.4)."""
    d = d_out + d_rest
    c_out = round(d_out * (c + d_rest) / d)
    c_out = min(max(c_out, c - MAX_BITS * d_rest, 0), c, MAX_BITS * d_out)
    return c_out, c - c_out


def plan_for_code_bits(code_bits: int, d: int, variant: str, split: bool) -> SidePlan:
    """The plan that spends ``code_bits`` on the mse stage(s)."""
    qjl = variant == "prod"
    if not split:
        return SidePlan((InstancePlan("all", d, spread(code_bits, d), qjl),))
    d_out, d_rest = split_dims(d)
    c_out, c_rest = _share(code_bits, d_out, d_rest)
    return SidePlan((InstancePlan("outlier", d_out, spread(c_out, d_out), qjl),
                     InstancePlan("rest", d_rest, spread(c_rest, d_rest), qjl)))


def reachable_plans(d: int, variant: str, split: bool) -> list[SidePlan]:
    """Every plan the equal-budget mapping may choose, by ascending bits per vector: at least one
    code bit for mse (nothing coded otherwise), from QJL alone for prod."""
    first = 1 if variant == "mse" else 0
    return [plan_for_code_bits(c, d, variant, split) for c in range(first, MAX_BITS * d + 1)]


def plain_plan(bits: int, d: int, variant: str, split: bool) -> SidePlan:
    """§16.7's plain-paper rows: b bits per coordinate (prod: b - 1 + QJL), one norm per
    instance (prod: two); with the split, the outliers get b + 1 (§16.4's 32 @3 + 96 @2)."""
    top = MAX_BITS + (variant == "prod")  # prod: b - 1 <= MAX_BITS mse bits + QJL
    if not (isinstance(bits, int) and 1 <= bits <= top):
        raise ValueError(f"turboquant bits={bits!r}: an integer in 1..{top} for k_variant={variant!r}")
    b = bits - (variant == "prod")
    qjl = variant == "prod"
    if not split:
        return SidePlan((InstancePlan("all", d, (b,) * d, qjl),))
    d_out, d_rest = split_dims(d)
    if b + 1 > MAX_BITS:
        raise ValueError(f"turboquant split: outliers at b + 1 = {b + 1} > {MAX_BITS} bits")
    return SidePlan((InstancePlan("outlier", d_out, (b + 1,) * d_out, qjl),
                     InstancePlan("rest", d_rest, (b,) * d_rest, qjl)))


def _call_bits(plan: SidePlan, rows: int) -> int:
    """Bits one encode call of ``rows`` vectors stores: per instance one code stream padded to a
    whole byte, ceil(d_i / 8) sign bytes per vector, fp16 norms."""
    total = 0
    for inst in plan.instances:
        total += 8 * ((rows * inst.code_bits + 7) // 8)
        total += rows * (8 * ((inst.dim + 7) // 8) * inst.qjl + NORM_BITS * inst.norms)
    return total


def headline_bpd(plan: SidePlan, heads: int, d: int, regime: Regime) -> float:
    """docs/methods.md §0 headline of one side: the mean over the regime's scored positions of the
    bits held / (t H d) (every layer holds the same). Q-all: one call of T tokens; prefill: one
    call of P tokens read by the first scored position, then one call per decoded token."""
    if regime.kind == "qall":
        return _call_bits(plan, heads * regime.tokens) / (regime.tokens * heads * d)
    p, n = regime.tokens, regime.decode
    held = _call_bits(plan, heads * p) + _call_bits(plan, heads) * np.arange(n + 1, dtype=np.float64)
    return float((held / (p + np.arange(n + 1))).mean()) / (heads * d)


def budget_plan(target: float, shape: ModelShape, variant: str, split: bool, regime: Regime) -> SidePlan:
    """The equal-budget mapping: of the reachable plans whose headline in ``regime`` is under the
    ceiling (at most 1.02 x the target, :func:`methods.budget.under_ceiling`, docs/methods.md §0.1),
    the one nearest to ``target`` d bits per vector (ties: fewer bits); else :class:`Unsupported`
    with the range."""
    d = shape.head_dim
    plans = reachable_plans(d, variant, split)
    ok = [p for p in plans if under_ceiling(headline_bpd(p, shape.n_kv_heads, d, regime), target)]
    if not ok:
        lo, hi = plans[0].bits / d, plans[-1].bits / d
        got = headline_bpd(plans[0], shape.n_kv_heads, d, regime)
        raise Unsupported(
            f"turboquant ({variant}{', split' if split else ''}): bpd {target:g} unreachable on head_dim {d}; "
            f"reachable {lo:.4g}..{hi:.4g} in steps of 1/{d} (the cheapest measures {got:.4g}, over "
            f"{1 + AT_TARGET:g} x the target)"
        )
    return min(ok, key=lambda p: (abs(p.bits - target * d), p.bits))


def is_paper_label(target: float | None) -> bool:
    """Whether ``target`` is one of the paper's split settings, b + 1/2 bits (2.5, 3.5; §16.4)."""
    return target is not None and float(target) >= 1.5 and (2 * float(target)) % 2 == 1


def paper_plan(label: float, d: int, variant: str) -> SidePlan:
    """The paper's b + 1/2-bit setting (§16.4) literally: the outlier split, the outliers at
    ceil(label) bits, the rest at floor(label), TurboQuant_prod's QJL bit included in each
    (:func:`plain_plan` at floor(label) with the split): 32 @3 + 96 @2 + 2 norms at 2.5, d = 128."""
    if not is_paper_label(label):
        raise ValueError(f"turboquant: {label!r} is not one of the paper's b + 1/2-bit settings")
    return plain_plan(int(label), d, variant, True)


#: how a side's widths follow from its target: the paper's b + 1/2-bit setting literally, or the
#: equal-budget mapping (:func:`budget_plan`)
PLANS = ("paper", "nearest")


def side_plan(target: float | None, shape: ModelShape, variant: str, split: bool, regime: Regime,
              plan: str = "nearest") -> SidePlan | None:
    """One side's plan at ``target`` (None: no target or 16, the side stays exact): ``"paper"`` at a
    paper label (:func:`paper_plan`, the split) when its headline is under the ceiling, else
    :class:`Unsupported`; otherwise :func:`budget_plan`."""
    if target is None or float(target) == 16:
        return None
    target = float(target)
    if plan == "paper" and is_paper_label(target):
        d = shape.head_dim
        try:
            p = paper_plan(target, d, variant)
        except ValueError as err:
            raise Unsupported(f"turboquant ({variant}): {err}") from err
        got = headline_bpd(p, shape.n_kv_heads, d, regime)
        if not under_ceiling(got, target):
            raise Unsupported(f"turboquant ({variant}): the paper's {target:g}-bit setting ({p.label()}) measures "
                              f"{got:.4g} on head_dim {d}, over {1 + AT_TARGET:g} x the target")
        return p
    return budget_plan(target, shape, variant, split, regime)


def admissible_knobs(shape: ModelShape, bpd_k: float, bpd_v: float | None, regime: Regime,
                     variants: tuple[str, ...], splits: tuple[bool, ...]) -> list[dict]:
    """The knobs the held-out search may choose at the targets (docs/methods.md §0.1, §16.10):
    {"k_variant", "split", "plan"} for every key variant of ``variants`` and split of ``splits``
    whose plans are under the ceiling of each target; ``plan="paper"`` (the split) where the key
    target is a paper label, ``"nearest"`` always, a nearest plan dropped when it equals the paper's.
    Values are always mse and share the split."""
    out, seen = [], set()
    for plan in PLANS:
        for split in splits:
            if plan == "paper" and not (split and is_paper_label(bpd_k)):
                continue
            for variant in variants:
                try:
                    plans = (side_plan(bpd_k, shape, variant, split, regime, plan),
                             side_plan(bpd_v, shape, "mse", split, regime, plan))
                except Unsupported:
                    continue
                key = tuple(None if p is None else p.instances for p in plans)
                if key not in seen:
                    seen.add(key)
                    out.append({"k_variant": variant, "split": split, "plan": plan})
    return out
