"""§1 of ``python -m kvbench.bench``: what a method costs perplexity track A.

For each method, the wall time of :func:`kvbench.model.perplexity.window_nll` (track A: one teacher-forced
Q-all pass through the model with the method attached) on the same windows, divided by FP16's
(the plain, unpatched model, as ``kvbench.run`` evaluates ``method=fp16``). Pairs FP16/method are
interleaved and the median ratio of ``eval_reps`` pairs after a warm-up is the row. Targets: at
most 1.15x for the codecs (KIVI, SVDq, KQ-SVD, KV-COBRA), at most 1.2x for the published competitors
(KVQuant, GEAR at 4 bpd, TurboQuant), at most 2x for H2O. A method whose
perplexity is exactly FP16's compressed nothing (not attached, or a window shorter than what it
keeps exact), so its time says nothing about its cost: that row is a MISS whatever the ratio.
Calibrated methods use statistics from §5's calibration pass, outside the timed region.
"""

from __future__ import annotations

import logging
import math

from .common import EVAL_CASES, BenchModel, Row, Sizes, attached_around, budget_label, eval_windows, make_method, paired_ratio
from ..model.compressed_lm import CompressedLM
from ..model.integrate import model_shape
from ..model.perplexity import window_nll

log = logging.getLogger(__name__)

TARGETS = {"codec": 1.15, "evict": 2.0, "baseline": 1.2}  # baseline: KVQuant, GEAR, TurboQuant


def run(bm: BenchModel, sizes: Sizes, stats, cases=EVAL_CASES) -> list[Row]:
    windows = eval_windows(bm, sizes.eval_seqlen, sizes.eval_windows)
    shape = model_shape(bm.model)
    fp16 = CompressedLM(bm.model, bm.tokenizer, None)
    ppl_box: dict = {}

    def track_a(lm, key):
        def go():
            total, n = 0.0, 0
            for w in windows:
                nll, count = window_nll(lm, w, "A", 0)
                total, n = total + nll, n + count
            ppl_box[key] = math.exp(total / n)
        return go

    base = track_a(fp16, "fp16")
    rows = []
    for label, name, options, bpd, v_bpd, kind in cases:
        method = make_method(name, options, shape, bpd, v_bpd, stats)
        # the method is attached only around its own passes: FP16's run on the unpatched model
        lm = CompressedLM(bm.model, bm.tokenizer, None)
        setup, teardown = attached_around(lm, method)

        log.info("overhead: %s (%s), %d x %d tokens", label, budget_label(bpd, v_bpd), *windows.shape)
        res = paired_ratio(base, track_a(lm, label), bm.device, sizes.eval_reps, base_warmup=not rows,
                           setup=setup, teardown=teardown)
        measured = lm.measured_bpd
        untouched = ppl_box[label] == ppl_box["fp16"] and name != "fp16"
        if untouched:
            log.warning("overhead: %s gives exactly FP16's perplexity (nothing compressed at this length?)", label)
        rows.append(Row(
            "overhead", f"{label} ({budget_label(bpd, v_bpd)})", "time / fp16", res["ratio"], "x",
            "<=", TARGETS[kind],
            note=f"{res['method_s']:.3g} s vs {res['base_s']:.3g} s; ppl {ppl_box[label]:.3g} vs {ppl_box['fp16']:.3g}",
            invalid="perplexity exactly FP16's: nothing compressed" if untouched else "",
            detail={
                "method": name, "options": options, "bpd": bpd, "v_bpd": v_bpd, "kind": kind,
                "windows": list(windows.shape), "ppl": ppl_box[label], "ppl_fp16": ppl_box["fp16"],
                "measured_bpd": list(measured), "knobs": _jsonable(method.knobs()),
                **{k: res[k] for k in ("base_s", "method_s", "ratios", "base_times_s", "method_times_s")},
            },
        ))
    return rows


def _jsonable(knobs: dict) -> dict:
    """Knobs without the long per-head lists (budgets, ranks) that would swamp the JSON."""
    return {k: v for k, v in knobs.items() if not (isinstance(v, list) and len(v) > 16)}
