"""One K+V budget for codecs whose knobs form a grid per side (KIVI, KVQuant, GEAR: ``joint_kv``).

docs/methods.md §0 defines the KV-track budget as bpd_KV = (bpd_K + bpd_V) / 2, and the tables
hold a cell at its target when that *mean* is within 2 % (analysis ``budget_target``). A codec
fitted side by side needs a grid point within 2 % on each side, which a sparse grid may not have
(KIVI's one residual window for both sides, KVQuant's per-token value metadata: docs/baselines.md);
KV-COBRA+ allocates one K+V budget jointly (§13). ``joint_kv=True`` gives the integer codecs the
same footing: any pair of per-side points (under the knobs the sides share) whose mean lies in the
band is admissible.

Decision where docs/methods.md is silent: among admissible pairs, the most **balanced** one wins
(the smallest |bpd_K - bpd_V|: where the side-by-side fit has a point the pair is as close to it as
the grid allows; these methods' papers spend the same bits on keys and values), then the method's
own preference. A held-out choice of the split instead is ``v_bpd=auto`` (kvbench.fit.kv_split).
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from .budget import in_band

P = TypeVar("P")


def best_pair(pairs: Iterable[tuple[P, P]], bpd: Callable[[P], float], target_kv: float, band: float,
              prefer: Callable[[P, P], tuple]) -> tuple[P, P] | None:
    """The admissible (key point, value point) pair — (bpd(k) + bpd(v)) / 2 within ``band`` of
    ``target_kv`` — that is most balanced, then highest under ``prefer``; None when none is."""
    best, best_key = None, None
    for k, v in pairs:
        bk, bv = bpd(k), bpd(v)
        if not in_band((bk + bv) / 2, target_kv, band):
            continue
        key = (-round(abs(bk - bv), 9), prefer(k, v))
        if best_key is None or key > best_key:
            best, best_key = (k, v), key
    return best
