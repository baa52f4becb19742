"""The K/V split of docs/methods.md §5.8, chosen on held-out calibration windows (``v_bpd=auto``).

For a total budget bpd_KV = β (``bpd=β v_bpd=auto``; β is the mean of the two sides, docs/methods.md §0)
the candidates are b_V ∈ {2..8} with bpd_K = 2β − b_V ≥ 0.25. Each candidate is configured and
calibrated from the job's own statistics, then scored by Q-all perplexity (track A) on the 8
held-out windows of :mod:`kvbench.fit.heldout`; the lowest perplexity wins (ties: the larger b_V,
as the seed's ablation favours value-heavy splits). The choice and every candidate's perplexity
are cached in ``$KVBENCH_CACHE/kv_split`` (keyed by model, method options, β, seed and calibration
spec) and recorded in the result (``kv_split``), through the protocol of :mod:`kvbench.fit.search`.

Decisions where docs/methods.md is silent: the held-out offsets (:mod:`kvbench.fit.heldout`); a
candidate the method cannot reach (``Unsupported``, e.g. KQ-SVD's r·b grid) is listed as such and
skipped.
"""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from methods import Unsupported, build_method

from ..context import JobContext
from ..store.cache import cached_json
from .heldout import N_HELDOUT, heldout
from .search import fit_candidate, heldout_ppl, lowest
from .statistics import spec_fields

log = logging.getLogger(__name__)

V_BITS = range(2, 9)
MIN_BPD_K = 0.25


def candidates(beta: float) -> list[tuple[float, int]]:
    """(bpd_K, b_V) pairs with (bpd_K + b_V) / 2 = β, b_V in 2..8, bpd_K >= 0.25."""
    out = [(2 * beta - b, b) for b in V_BITS if 2 * beta - b >= MIN_BPD_K - 1e-12]
    if not out:
        raise Unsupported(
            f"v_bpd=auto: bpd_KV={beta} leaves no split with b_V in 2..8 and bpd_K >= {MIN_BPD_K} "
            f"(needs bpd_KV >= {(2 + MIN_BPD_K) / 2:g})"
        )
    return out


def choose_kv_split(ctx: JobContext, name: str, options: dict, beta: float) -> dict:
    """The §5.8 split for ``name`` at bpd_KV = ``beta``: {"bpd_k", "v_bpd", "ppl", "candidates",
    "heldout_windows", "seconds", "cache_hit"}; Unsupported when no candidate is reachable."""
    key = {"model": ctx.model_id, "method": name, "options": options, "beta": beta,
           "seed": ctx.seed, "calibration": spec_fields(ctx.spec)}
    out = cached_json("kv_split", key, lambda: _search(ctx, name, options, beta))
    log.info("v_bpd=auto: K %g / V %d (held-out PPL %.3f)", out["bpd_k"], out["v_bpd"], out["ppl"])
    return out


def _search(ctx: JobContext, name: str, options: dict, beta: float) -> dict:
    t0 = time.perf_counter()
    windows = heldout(ctx.tokenizer, ctx.spec)
    scored = []
    for bpd_k, b_v in tqdm(candidates(beta), desc=f"v_bpd=auto split (bpd_KV {beta:g})", leave=False):
        method = build_method(name, **options)
        unsupported = fit_candidate(ctx, method, bpd_k, float(b_v))
        if unsupported is not None:
            scored.append({"bpd_k": bpd_k, "v_bpd": b_v, "ppl": None, "unsupported": unsupported})
            continue
        ppl = heldout_ppl(ctx, method, windows)
        scored.append({"bpd_k": bpd_k, "v_bpd": b_v, "ppl": ppl})
        log.info("v_bpd=auto: K %g / V %d -> held-out PPL %.3f", bpd_k, b_v, ppl)
    best = lowest(scored, lambda c: -c["v_bpd"],
                  f"v_bpd=auto: no split of bpd_KV={beta} is reachable for {name}: {scored}")
    return {"bpd_k": best["bpd_k"], "v_bpd": best["v_bpd"], "ppl": best["ppl"], "candidates": scored,
            "heldout_windows": [N_HELDOUT, ctx.spec.seqlen], "seconds": time.perf_counter() - t0}
