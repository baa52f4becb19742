"""A method's knobs chosen among its admissible configurations on held-out calibration windows
(docs/methods.md §0.1), for a method that declares ``"knobs"`` in ``KVMethod.searches()``.

The **candidates** are the method's (``KVMethod.knob_candidates``): configurations whose predicted
bpd in the job's regime is at most 1.02 x each target, in the method's stated order, the paper
setting first when admissible, at most :data:`N_CANDIDATES` of them: the number of evaluations of
cobra_plus's selection (conf/experiment/cobra_plus_select.yaml), so that every method with free
knobs gets the same tuning effort. Each is configured at the job's targets in the job's regime
(``KVMethod.use_knobs``), calibrated when the method is, and scored by Q-all perplexity (track A)
on the :data:`~kvbench.fit.heldout.N_HELDOUT` held-out windows of :mod:`kvbench.fit.heldout`
(never evaluation text), through the protocol of :mod:`kvbench.fit.search`. The same pass
measures the candidate's bpd by the job's rule (:func:`job_figures` carries it to the job's
regime), and a candidate measured over the ceiling is not admissible after all (§0.1: "predicted,
and then measured": a data-dependent cost such as KVQuant's outlier fraction can read more on
other text than on the calibration sample it was predicted from). The lowest perplexity among the
rest wins; ties: the earlier candidate in the method's order. The outcome is cached in
``$KVBENCH_CACHE/knob_search`` (keyed by model, method, options, targets, regime, seed,
calibration spec, the candidates and :data:`VERSION`) and recorded in the result
(``knob_search``: every candidate with its held-out perplexity and measured bpd, and the choice).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from tqdm.auto import tqdm

from methods import build_method
from methods.budget import AT_TARGET, under_ceiling

from ..context import JobContext
from ..store.cache import cached_json
from .heldout import N_HELDOUT, heldout
from .search import fit_candidate, heldout_scored, lowest
from .statistics import spec_fields

log = logging.getLogger(__name__)

#: candidate evaluations per search: those of cobra_plus's selection (docs/methods.md §0.1)
N_CANDIDATES = 27
#: part of the cache key: bump when a candidate's score changes meaning
VERSION = 2
#: the uncompressed width: a value budget of 16 bits is the K-track's
FP16_BITS = 16.0


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
           score: Callable[[object], float | tuple[float, dict | None]] | None = None) -> dict:
    """Score every candidate and take the lowest. ``score(method)``: the held-out perplexity of a
    configured method, or (perplexity, the bpd measured over the same windows as
    :func:`kvbench.model.compressed_lm.summarize_readings` gives it); default
    :func:`kvbench.fit.search.heldout_scored` on the held-out windows. A candidate whose measured
    figure (:func:`job_figures`) is over the ceiling is recorded and never chosen."""
    t0 = time.perf_counter()
    if score is None:
        windows = heldout(ctx.tokenizer, ctx.spec)
        score = lambda m: heldout_scored(ctx, m, windows)  # noqa: E731
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
        got = score(method)
        ppl, measured = got if isinstance(got, tuple) else (got, None)
        row["ppl"] = ppl
        figures = None if measured is None else job_figures(ctx, method, predicted, measured)
        if figures is not None:
            row.update(measured_bpd_k=figures[0], measured_bpd_v=figures[1])
            over = over_ceiling(bpd_k, bpd_v, figures)
            if over is not None:
                row["over_ceiling"] = over
        scored.append(row)
        log.info("%s knobs %s -> held-out PPL %.3f%s", name, knobs, ppl,
                 f" ({row['over_ceiling']})" if "over_ceiling" in row else "")
    eligible = [c for c in scored if "over_ceiling" not in c]
    best = lowest(eligible, lambda c: c["index"],
                  f"{name}: no knob candidate is reachable under the ceiling: {scored}")
    return {"knobs": best["knobs"], "ppl": best["ppl"], "candidates": scored,
            "rule": (f"lowest Q-all PPL on the held-out windows among at most {N_CANDIDATES} admissible "
                     "candidates in the method's order (paper setting first when admissible), none whose "
                     "bpd measured there is over the ceiling; ties: the earlier candidate"),
            "heldout_windows": [N_HELDOUT, ctx.spec.seqlen], "seconds": time.perf_counter() - t0}


def job_figures(ctx: JobContext, method, predicted: dict, measured: dict) -> tuple[float, float] | None:
    """(bpd_K, bpd_V) of the job's regime as the held-out windows measure a configured candidate
    (``predicted``: its knobs' ``"predicted"`` figures in the job's regime).

    Where the held-out pass is the job's regime (Q-all over the held-out windows' length) its
    headline is the job's figure. Elsewhere: the method's predicted headline in the job's regime
    plus what the held-out text read beyond the method's own formula, per side (the measured
    end-of-sequence bpd minus ``nominal_bpd`` at the held-out length; zero for a method whose
    bits do not depend on the data). None when the method predicts nothing."""
    if ctx.regime.kind == "qall" and ctx.regime.tokens == ctx.spec.seqlen:
        return measured["measured_k"], measured["measured_v"]
    if predicted.get("bpd_k") is None:
        return None
    nk, nv = method.nominal_bpd(ctx.spec.seqlen)
    return (predicted["bpd_k"] + measured["end_k"] - nk,
            (predicted.get("bpd_v") or FP16_BITS) + measured["end_v"] - nv)


def over_ceiling(bpd_k: float, bpd_v: float | None, figures: tuple[float, float]) -> str | None:
    """Why ``figures`` (bpd_K, bpd_V) put a candidate over the ceiling, or None. The figure is
    the tables' (analysis ``budget_target``): bpd_K, or bpd_KV = (bpd_K + bpd_V) / 2 when the
    values have a budget of their own."""
    kv = bpd_v is not None and bpd_v != FP16_BITS
    figure = sum(figures) / 2 if kv else figures[0]
    target = (bpd_k + bpd_v) / 2 if kv else bpd_k
    if under_ceiling(figure, target):
        return None
    side = "bpd_KV" if kv else "bpd_K"
    return f"{side} {figure:.4g} as the held-out windows measure it, over {1 + AT_TARGET:g} x {target:g}"


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
