"""§5 of ``python -m kvbench.bench``: the calibration pass against a plain forward pass, and what
each calibrated method then fits.

The calibration pass is :func:`kvbench.fit.statistics.collect_stats` (forward hooks on q/k/v_proj
accumulating float64 per-KV-head moments) over the same windows a plain ``model(...)`` call runs
through; both are reported per 1k tokens and their ratio is the row (target at most 1.3x). The
statistics of the warm-up pass are returned (as a :class:`kvbench.bench.common.StatsSource`) for
the calibrated methods of §1.

The published competitors (KVQuant, GEAR, TurboQuant, at the budgets of the overhead section) get
one row each for what calibrating them costs beyond that pass:

* **sample pass** (a method that asks for a key/value sample, ``calibration_sample_tokens()``:
  KVQuant, 4096 tokens per head) — ``collect_stats`` with that sample over the same windows against
  the plain forward pass, interleaved (target at most 1.3x, as the moments' pass: a slow sampler
  misses it);
* **fit** — the method's ``calibrate`` on those statistics, seconds, INFO (a one-off cost per
  job, against nothing a method's speed could be judged by; the note says what it fits): KVQuant
  its per-channel key thresholds and one non-uniform signpost table per layer and side by 1-D
  k-means over the sample; TurboQuant draws its per-head rotations from the seed (it reads no
  statistics unless ``split``); GEAR calibrates nothing (its Omega is drawn per block while
  encoding), so its row says so.
"""

from __future__ import annotations

import logging
import time

import torch

from methods import build_method

from ..fit.statistics import collect_stats
from ..model.integrate import model_shape
from .common import (BASELINES, EVAL_CASES, INFO, BenchModel, Row, Sizes, StatsSource, budget_label, calib_windows,
                     bench_options, paired_ratio)

log = logging.getLogger(__name__)

TARGET = 1.3
#: what each published competitor's ``calibrate`` fits (the fit row's note)
FITS = {
    "kvquant": "per-channel key thresholds (t/1-t quantiles) and a 2^b-entry signpost table per layer and "
               "side by 1-D k-means over the calibration sample",
    "turboquant": "per-(layer, KV head) random rotations drawn from the seed (no statistics read without split)",
    "gear": "nothing (Omega is drawn per block while encoding)",
}


def run(bm: BenchModel, sizes: Sizes, cases=None) -> tuple[list[Row], StatsSource]:
    windows = calib_windows(bm, sizes.calib_seqlen, sizes.calib_windows)
    model, dev = bm.model, bm.device
    stats_box: list = []

    @torch.no_grad()
    def plain():
        for w in windows:
            model(input_ids=w[None].to(dev), use_cache=False)

    def calib():
        stats_box[:] = [collect_stats(model, windows)]

    log.info("calibration: %d x %d tokens, %d reps", *windows.shape, sizes.calib_reps)
    res = paired_ratio(plain, calib, dev, sizes.calib_reps)
    tokens = windows.numel()
    per_k = {k: res[k] / tokens * 1000 for k in ("base_s", "method_s")}
    row = Row(
        "calibration", "collect_stats", "calibration / forward", res["ratio"], "x", "<=", TARGET,
        note=f"{per_k['method_s']:.3g} s vs {per_k['base_s']:.3g} s per 1k tokens",
        detail={
            "windows": list(windows.shape), "tokens": tokens,
            "calib_s_per_1k_tokens": per_k["method_s"], "forward_s_per_1k_tokens": per_k["base_s"],
            **{k: res[k] for k in ("ratios", "base_times_s", "method_times_s")},
        },
    )
    source = StatsSource(lambda n: collect_stats(model, windows, n), stats_box[0])
    if cases is None:
        cases = [c for c in EVAL_CASES if c[1] in BASELINES]
    rows = [row]
    for case in cases:
        rows += method_rows(bm, sizes, case, plain, windows, source)
    return rows, source


def method_rows(bm: BenchModel, sizes: Sizes, case: tuple, plain, windows: torch.Tensor,
                source: StatsSource) -> list[Row]:
    """The sample-pass row (methods that ask for a sample) and the fit row of one method; the
    sampled statistics go into ``source`` for the sections after this one."""
    label, name, options, bpd, v_bpd, _ = case
    method = build_method(name, **bench_options(name, options))
    method.configure(model_shape(bm.model), bpd, v_bpd)
    tag = f"{label} ({budget_label(bpd, v_bpd)})"
    tokens = windows.numel()
    rows = []
    n = method.calibration_sample_tokens()
    if n > 0:
        box: dict = {}

        def sampled():
            box["stats"] = collect_stats(bm.model, windows, n)

        log.info("calibration: %s sample pass (%d tokens per head)", label, n)
        res = paired_ratio(plain, sampled, bm.device, sizes.calib_reps)
        source._cache[n] = box["stats"]
        rows.append(Row(
            "calibration", f"{tag}: sample pass", "calibration with sample / forward", res["ratio"], "x", "<=",
            TARGET, note=f"collect_stats with a {n}-token key/value sample per head; "
                         f"{res['method_s'] / tokens * 1000:.3g} s vs {res['base_s'] / tokens * 1000:.3g} s per 1k tokens",
            detail={"method": name, "bpd": bpd, "v_bpd": v_bpd, "sample_tokens": n, "windows": list(windows.shape),
                    **{k: res[k] for k in ("ratios", "base_times_s", "method_times_s")}},
        ))
    if not method.needs_calibration:
        rows.append(Row("calibration", f"{tag}: fit", "seconds", 0.0, " s", INFO, 0.0, shown="none",
                        note=f"calibrates {FITS.get(name, 'nothing')}",
                        detail={"method": name, "bpd": bpd, "v_bpd": v_bpd, "calibrated": False}))
        return rows
    stats = source(n)
    times = []
    for _ in range(max(1, sizes.calib_reps)):
        fresh = build_method(name, **bench_options(name, options))
        fresh.configure(model_shape(bm.model), bpd, v_bpd)
        t0 = time.perf_counter()
        fresh.calibrate(stats, seed=0)
        times.append(time.perf_counter() - t0)
    best = min(times)
    layers = int(bm.model.config.num_hidden_layers)
    rows.append(Row(
        "calibration", f"{tag}: fit", "seconds", best, " s", INFO, 0.0, shown=f"{best:.3g} s",
        note=f"calibrate() on the statistics, fastest of {len(times)} ({best / layers * 1e3:.3g} ms per layer): "
             f"{FITS.get(name, 'its calibration')}",
        detail={"method": name, "bpd": bpd, "v_bpd": v_bpd, "calibrated": True, "seconds": best, "times_s": times,
                "sample_tokens": n, "layers": layers},
    ))
    return rows
