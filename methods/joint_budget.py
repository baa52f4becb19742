"""One K+V budget for codecs whose knobs form a grid per side (KIVI, KVQuant, GEAR: ``joint_kv``).

docs/methods.md §0 defines the KV-track budget as bpd_KV = (bpd_K + bpd_V) / 2, and the tables
hold a cell at its target when that *mean* is within 2 % (analysis ``budget_target``). A codec
fitted side by side needs a grid point within 2 % on each side, which a sparse grid may not have
(KIVI's one residual window for both sides, KVQuant's per-token value metadata: docs/baselines.md);
KV-COBRA+ allocates one K+V budget jointly (§13). ``joint_kv=True`` gives the integer codecs the
same footing: any pair of per-side points (under the knobs the sides share) whose mean is under
the ceiling, at most 1.02 x bpd_KV (docs/methods.md §0.1), is admissible.

Decision where docs/methods.md is silent, the order of the admissible pairs
(:func:`admissible_pairs`; a job's held-out knob search scores them in this order, and a method
without one takes the first): the pairs whose mean is within 2 % of the target first, the most
**balanced** of them first (the smallest |bpd_K - bpd_V|: where the side-by-side fit has a point
the pair is as close to it as the grid allows; these methods' papers spend the same bits on keys
and values), then the cheaper pairs, the largest mean first; ties: the method's own preference.
A held-out choice of the split instead is ``v_bpd=auto`` (kvbench.fit.kv_split).
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from .budget import in_band, under_ceiling

P = TypeVar("P")


def admissible_pairs(pairs: Iterable[tuple[P, P]], bpd: Callable[[P], float], target_kv: float, band: float,
                     prefer: Callable[[P, P], tuple]) -> list[tuple[P, P]]:
    """The (key point, value point) pairs whose mean (bpd(k) + bpd(v)) / 2 is at most (1 + ``band``)
    ``target_kv``, in the module's order: within ``band`` of the target first, the most balanced
    first, then the cheaper ones, the largest mean first; ties: the highest ``prefer(k, v)``."""
    ranked = []
    for k, v in pairs:
        bk, bv = bpd(k), bpd(v)
        mean = (bk + bv) / 2
        if not under_ceiling(mean, target_kv, band):
            continue
        near = in_band(mean, target_kv, band)
        ranked.append(((near, -round(abs(bk - bv), 9) if near else round(mean, 9), prefer(k, v)), (k, v)))
    ranked.sort(key=lambda x: x[0], reverse=True)
    return [pair for _, pair in ranked]
