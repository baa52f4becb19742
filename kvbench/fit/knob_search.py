"""A method's knobs chosen among its admissible configurations on held-out calibration windows
(docs/methods.md §0.1), for a method that declares ``"knobs"`` in ``KVMethod.searches()``.

The **candidates** are the method's (``KVMethod.knob_candidates``): configurations whose predicted
bpd in the job's regime is at most 1.02 x each target, in the method's stated order, the paper
setting first when admissible, at most :data:`N_CANDIDATES` of them: the number of evaluations of
cobra_plus's selection (conf/experiment/cobra_plus_select.yaml), so that every method with free
knobs gets the same tuning effort. Each is configured at the job's targets in the job's regime
(``KVMethod.use_knobs``), calibrated when the method is, and scored by Q-all perplexity (track A)
on the :data:`~kvbench.fit.heldout.N_HELDOUT` held-out windows of :mod:`kvbench.fit.heldout`
(never evaluation text), through the protocol of :mod:`kvbench.fit.search`. The lowest perplexity
wins; ties: the earlier candidate in the method's order. The outcome is cached in
``$KVBENCH_CACHE/knob_search`` (keyed by model, method, options, targets, regime, seed,
calibration spec, the candidates and :data:`VERSION`) and recorded in the result
(``knob_search``: every candidate with its held-out perplexity, and the choice).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from tqdm.auto import tqdm

from methods import build_method

from ..context import JobContext
from ..store.cache import cached_json
from .heldout import N_HELDOUT, heldout
from .search import fit_candidate, heldout_ppl, lowest
from .statistics import spec_fields

log = logging.getLogger(__name__)

#: candidate evaluations per search: those of cobra_plus's selection (docs/methods.md §0.1)
N_CANDIDATES = 27
#: part of the cache key: bump when a candidate's score changes meaning
VERSION = 1


def candidates(ctx: JobContext, method, bpd_k: float, bpd_v: float | None) -> list[dict]:
    """The method's admissible configurations to score (at most :data:`N_CANDIDATES`); the method
    must have its regime set."""
    return method.knob_candidates(ctx.shape, bpd_k, bpd_v, N_CANDIDATES)


def choose_knobs(ctx: JobContext, name: str, options: dict, bpd_k: float, bpd_v: float | None,
                 cands: list[dict]) -> dict:
    """The candidate of ``cands`` with the lowest held-out perplexity: {"knobs", "ppl",
    "candidates", "rule", "heldout_windows", "seconds", "cache_hit"}; Unsupported when none is
    reachable."""
    key = {"model": ctx.model_id, "method": name, "options": options, "bpd_k": bpd_k, "bpd_v": bpd_v,
           "regime": dataclasses.asdict(ctx.regime), "seed": ctx.seed, "calibration": spec_fields(ctx.spec),
           "candidates": cands, "version": VERSION}
    out = cached_json("knob_search", key, lambda: search(ctx, name, options, bpd_k, bpd_v, cands))
    log.info("knobs of %s at bpd %g/%s: %s (held-out PPL %.3f of %d candidates)", name, bpd_k, bpd_v,
             out["knobs"], out["ppl"], len(out["candidates"]))
    return out


def search(ctx: JobContext, name: str, options: dict, bpd_k: float, bpd_v: float | None, cands: list[dict],
           score: Callable[[object], float] | None = None) -> dict:
    """Score every candidate (``score(method)``: the held-out perplexity of a configured method;
    default :func:`kvbench.fit.search.heldout_ppl` on the held-out windows) and take the lowest."""
    t0 = time.perf_counter()
    if score is None:
        windows = heldout(ctx.tokenizer, ctx.spec)
        score = lambda m: heldout_ppl(ctx, m, windows)  # noqa: E731
    scored = []
    for i, knobs in enumerate(tqdm(cands, desc=f"{name} knobs (bpd {bpd_k:g})", leave=False)):
        method = build_method(name, **options)
        method.set_regime(ctx.regime)
        method.use_knobs(knobs)
        unsupported = fit_candidate(ctx, method, bpd_k, bpd_v)
        row = {"index": i, "knobs": knobs}
        if unsupported is not None:
            scored.append({**row, "ppl": None, "unsupported": unsupported})
            continue
        predicted = method.knobs().get("predicted") or {}
        row.update(predicted_bpd_k=predicted.get("bpd_k"), predicted_bpd_v=predicted.get("bpd_v"))
        scored.append({**row, "ppl": score(method)})
        log.info("%s knobs %s -> held-out PPL %.3f", name, knobs, scored[-1]["ppl"])
    best = lowest(scored, lambda c: c["index"], f"{name}: no knob candidate is reachable: {scored}")
    return {"knobs": best["knobs"], "ppl": best["ppl"], "candidates": scored,
            "rule": (f"lowest Q-all PPL on the held-out windows among at most {N_CANDIDATES} admissible "
                     "candidates in the method's order (paper setting first when admissible); ties: the "
                     "earlier candidate"),
            "heldout_windows": [N_HELDOUT, ctx.spec.seqlen], "seconds": time.perf_counter() - t0}


def choose_for_job(ctx: JobContext, name: str, options: dict, method, bpd_k: float, bpd_v: float | None,
                   result: dict) -> None:
    """The job's step: when the method offers candidates at the targets, search them, hand the
    choice to ``method`` (``use_knobs``) and record the search in ``result["knob_search"]``."""
    cands = candidates(ctx, method, bpd_k, bpd_v)
    if not cands:  # nothing admissible: configure says why
        return
    out = choose_knobs(ctx, name, options, bpd_k, bpd_v, cands)
    result["timings"]["knob_search_s"] = 0.0 if out["cache_hit"] else out["seconds"]
    result["knob_search"] = {**out, "admissible": len(method.knob_candidates(ctx.shape, bpd_k, bpd_v))}
    method.use_knobs(out["knobs"])
