"""§5 of ``python -m kvbench.bench``: the calibration pass against a plain forward pass.

The calibration pass is :func:`kvbench.calibrate.collect_stats` (forward hooks on q/k/v_proj
accumulating float64 per-KV-head moments) over the same windows a plain ``model(...)`` call runs
through; both are reported per 1k tokens and their ratio is the row (target at most 1.3x). The
statistics of the warm-up pass are returned for the calibrated methods of §1.
"""

from __future__ import annotations

import logging

import torch

from .common import BenchModel, Row, Sizes, calib_windows, paired_ratio
from ..fit.statistics import collect_stats

log = logging.getLogger(__name__)


def run(bm: BenchModel, sizes: Sizes) -> tuple[list[Row], list]:
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
        "calibration", "collect_stats", "calibration / forward", res["ratio"], "x", "<=", 1.3,
        note=f"{per_k['method_s']:.3g} s vs {per_k['base_s']:.3g} s per 1k tokens",
        detail={
            "windows": list(windows.shape), "tokens": tokens,
            "calib_s_per_1k_tokens": per_k["method_s"], "forward_s_per_1k_tokens": per_k["base_s"],
            **{k: res[k] for k in ("ratios", "base_times_s", "method_times_s")},
        },
    )
    return [row], stats_box[0]
