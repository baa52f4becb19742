"""The held-out search protocol, shared by every free parameter the harness chooses.

A search has **candidates** (a list of labelled method configurations); each is **fitted** like the
job would fit it (configured at its budget, calibrated from the job's statistics) and, when it can
be, **scored** by perplexity through the compressed model on held-out windows
(:mod:`kvbench.fit.heldout`). A candidate the method cannot reach (``Unsupported``) is **recorded**
as such and never chosen; none reachable is ``Unsupported`` for the job. The lowest perplexity
wins, ties broken by each search's stated rule. The outcome, every candidate included, is
**cached** as JSON (:func:`kvbench.store.cache.cached_json`) keyed by what determines it, and
recorded in the result.

Users: :mod:`.kv_split` (``v_bpd=auto``), :mod:`.budget_share` (compose's ``split``),
:mod:`.knob_search` (a method's knobs among its admissible configurations),
:mod:`.cobra_plus_select` (per candidate, since its coordinate descent revisits points);
:mod:`.measured_keep` measures through the same pass (:func:`heldout_pass`).
"""

from __future__ import annotations

import math
from typing import Callable

from methods import Unsupported

from ..context import JobContext
from ..model.batching import largest_fitting
from ..model.compressed_lm import CompressedLM, summarize_readings
from ..model.integrate import attached
from ..model.perplexity import perplexity


def fit_candidate(ctx: JobContext, method, bpd_k: float | None, bpd_v: float | None,
                  before_calibration: Callable[[object], None] | None = None) -> str | None:
    """Configure ``method`` at (bpd_k, bpd_v) and calibrate it from ``ctx.stats`` when it needs
    them; ``before_calibration(method)`` runs in between (a measurement the fit uses). Returns
    None, or the message of the ``Unsupported`` that stopped it."""
    try:
        method.configure(ctx.shape, bpd_k, bpd_v)
        if before_calibration is not None:
            before_calibration(method)
        if method.needs_calibration:
            method.calibrate(ctx.stats, seed=ctx.seed)
    except Unsupported as err:
        return str(err)
    return None


def heldout_ppl(ctx: JobContext, method, windows, track: str = "A", context: int | None = None) -> float:
    """Perplexity of ``windows`` through the model with ``method`` attached, the windows run
    ``ctx.batch`` at a time (``auto`` on CUDA: the largest batch that fits)."""
    return _ppl(heldout_nll(ctx, method, windows, track, context))


def heldout_scored(ctx: JobContext, method, windows) -> tuple[float, dict | None]:
    """Q-all perplexity of ``windows`` and the bpd measured over them by the job's own rule
    (:func:`kvbench.model.compressed_lm.summarize_readings`: ``measured_k``, ``measured_v``,
    ``end_k``, ...; None for a model that records no readings)."""
    nll, measured = heldout_pass(ctx, method, windows, "A", None)
    return _ppl(nll), measured


def heldout_window_ppl(ctx: JobContext, method, windows) -> list[float]:
    """Each window's own Q-all perplexity, the windows run ``ctx.batch`` at a time."""
    return [math.exp(s / n) for s, n in heldout_nll(ctx, method, windows, "A", None)]


def heldout_nll(ctx: JobContext, method, windows, track: str, context: int | None) -> list[tuple[float, int]]:
    """(summed NLL, predicted tokens) of every window in order. A batch gives what its rows give
    alone (tests/test_batch_equality.py), so the batch never changes a search's outcome."""
    return heldout_pass(ctx, method, windows, track, context)[0]


def heldout_pass(ctx: JobContext, method, windows, track: str,
                 context: int | None) -> tuple[list[tuple[float, int]], dict | None]:
    """:func:`heldout_nll` and the bpd measured over the same pass by the job's rule
    (:func:`kvbench.model.compressed_lm.summarize_readings`; None when nothing records readings)."""
    with attached(ctx.model, method) as comp:
        lm = CompressedLM(ctx.model, ctx.tokenizer, comp)
        out: list[tuple[float, int]] = []

        def run(n: int) -> None:
            out.clear()
            lm.readings.clear()  # an attempt stopped by an out-of-memory error leaves nothing
            perplexity(lm, windows, track, context, each=lambda s, c: out.append((s, c)), batch_size=n)

        if ctx.batch == "auto" and lm.device.type == "cuda":
            largest_fitting(run, cap=len(windows))
        else:
            run(1 if ctx.batch == "auto" else int(ctx.batch))
        return out, summarize_readings(lm.readings)


def _ppl(nll: list[tuple[float, int]]) -> float:
    return math.exp(sum(s for s, _ in nll) / sum(n for _, n in nll))


def lowest(scored: list[dict], tie: Callable[[dict], object], none_reachable: str) -> dict:
    """The reachable candidate with the lowest finite ``ppl`` (then the lowest ``tie(c)``);
    ``Unsupported(none_reachable)`` when there is none."""
    ok = [c for c in scored if c["ppl"] is not None and math.isfinite(c["ppl"])]
    if not ok:
        raise Unsupported(none_reachable)
    return min(ok, key=lambda c: (c["ppl"], tie(c)))
