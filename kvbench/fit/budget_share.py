"""compose's budget share chosen on held-out calibration windows (docs/methods.md §12).

compose gives its codec a share rho_0 of the budget (its ``split`` option) and fits the kept
fraction to the rest. ``method=compose`` without ``keep`` or ``split`` asks for it to be chosen
(``"budget_share" in method.searches()``): each share rho_0 in {1/2, 1/4, 1/8}
(:data:`methods.compose.SPLITS`) gives the codec its share of the budget and fits the kept fraction
to the target (see :mod:`methods.compose`); every candidate is configured for the job's regime,
calibrated from the job's own statistics where the codec needs them, and scored by perplexity
through the composed model on held-out windows of the calibration corpus (the windows of
:mod:`kvbench.fit.heldout`, which overlap no calibration window; never an evaluation set).
The lowest perplexity wins (ties: the larger split, more tokens kept). The choice and every
candidate's perplexity are cached in ``$KVBENCH_CACHE/keep_fraction`` (keyed by model, method
options, targets, regime, seed, calibration spec and :data:`FIT_VERSION`), logged, and recorded in
the result (``keep_fraction``), through the protocol of :mod:`kvbench.fit.search`.

Decisions where docs/methods.md is silent:

* :data:`N_HELDOUT` = 4 held-out windows of the calibration length (half of ``v_bpd=auto``'s 8):
  H2O + KIVI decodes token by token, three candidates on 8 windows would cost more than the job.
* The windows are scored in the job's regime kind: Q-all (teacher-forced, track A) when the job's
  regime is Q-all and the eviction has a single-pass form; otherwise prefill-exact with the first
  :data:`CONTEXT_SHARE` of each window as the exact context (track B's 1536 of 2048).
* A candidate the composition cannot reach (``Unsupported``) is listed as such and skipped; none
  reachable -> ``Unsupported``. A candidate whose fit lands on a configuration already scored (the
  same rho and codec knobs, e.g. the codec's lowest budget) is not scored again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from tqdm.auto import tqdm

from methods import build_method
from methods.compose import SPLITS

from ..context import JobContext
from ..store.cache import cached_json
from .heldout import heldout
from .search import fit_candidate, heldout_ppl, lowest
from .statistics import spec_fields

log = logging.getLogger(__name__)

N_HELDOUT = 4
CONTEXT_SHARE = 0.75
#: part of the cache key: bump when the budget fit of methods/compose changes what a share means
FIT_VERSION = 2


def choose_budget_share(ctx: JobContext, options: dict, bpd_k: float, bpd_v: float | None) -> dict:
    """compose's share for the job: {"split", "ppl", "candidates", "heldout_windows", "seconds",
    "cache_hit"}."""
    key = {"model": ctx.model_id, "method": "compose", "fit": FIT_VERSION, "options": options,
           "bpd_k": bpd_k, "bpd_v": bpd_v, "regime": asdict(ctx.regime), "seed": ctx.seed,
           "calibration": spec_fields(ctx.spec)}
    out = cached_json("keep_fraction", key, lambda: _search(ctx, options, bpd_k, bpd_v))
    log.info("compose: split %g (held-out PPL %.3f)", out["split"], out["ppl"])
    return out


def _search(ctx: JobContext, options: dict, bpd_k: float, bpd_v: float | None) -> dict:
    t0 = time.perf_counter()
    windows = heldout(ctx.tokenizer, ctx.spec, n=N_HELDOUT)
    scored = []
    for split in tqdm(SPLITS, desc="compose split", leave=False):
        method = build_method("compose", **{**options, "split": split})
        method.set_regime(ctx.regime)
        unsupported = fit_candidate(ctx, method, bpd_k, bpd_v)
        if unsupported is not None:
            scored.append({"split": split, "ppl": None, "unsupported": unsupported})
            continue
        knobs = method.knobs()
        key = (knobs.get("rho"), knobs.get("codec_knobs"))
        same = [c for c in scored if (c.get("rho"), c.get("codec_knobs")) == key]
        if same:  # the fit landed on a configuration already scored (e.g. the codec's lowest budget)
            scored.append({**same[0], "split": split, "same_as_split": same[0]["split"]})
            continue
        if ctx.regime.kind == "qall" and method.supports_in_pass:
            ppl = heldout_ppl(ctx, method, windows)
        else:
            ppl = heldout_ppl(ctx, method, windows, "B", round(CONTEXT_SHARE * windows.shape[1]))
        scored.append({"split": split, "ppl": ppl, "rho": key[0], "codec_knobs": key[1]})
        log.info("compose: split %g (rho %.4g) -> held-out PPL %.3f", split, knobs.get("rho"), ppl)
    best = lowest(scored, lambda c: -c["split"], f"compose: no split in {SPLITS} reaches the target: {scored}")
    return {"split": best["split"], "ppl": best["ppl"], "candidates": scored,
            "heldout_windows": [len(windows), ctx.spec.seqlen], "seconds": time.perf_counter() - t0}
