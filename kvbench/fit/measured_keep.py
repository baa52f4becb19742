"""compose's kept fraction refitted to the *measured* headline on calibration-corpus windows
(docs/methods.md §0, §12).

compose fits its kept fraction rho to a prediction: the codec's nominal bits on the held count of
each scored read (:meth:`methods.compose.Compose.predicted_bpd`). For KIVI under an eviction that
evicts while decoding (H2O; SnapKV with decode=evict) that prediction cannot be exact: which held
tokens still sit in KIVI's fp16 residual, and how many partly evicted key groups keep their scale
and minimum, depend on the attention. On SmolLM2, PPL track B, compose(h2o, kivi) measured
bpd_KV 0.344 at a target of 0.5 and 0.927 at 1 (``Compose.prediction_exact`` is False for it).

The refit, for such a composition with a fitted rho (``"measured_keep" in method.searches()``):
``N_WINDOWS`` windows of the calibration corpus laid out as the job's regime (Q-all: ``tokens``
query positions; prefill-exact: ``tokens`` of exact context, then ``decode + 1`` targets
teacher-forced, the PPL track B layout) are run through the composed model and the headline
bpd_KV is measured by the same rule as the job's (:mod:`kvbench.model.compressed_lm`). Iteration k measures m_k at rho_k and takes as the next rho
the one whose *prediction* is target x predicted(rho_k) / m_k (the prediction's error, taken as a
factor, carried to the next point) when it lies inside the bracket of the points measured so far;
else the linear interpolation between the bracket's ends, or, before there is a bracket, a step in
proportion to target / m_k (KIVI's residual flushes make the prediction a saw in rho, so its
inverse can point the wrong way). It stops within ``TOL`` of the target, after
``MAX_MEASUREMENTS``, or when the next rho holds the same token counts as a point already
measured (the same prediction: adjacent kept counts bracket the target); the measured point
closest to the target is kept (ties: the lower one). The codec's budgets stay those of the split.
The windows overlap no calibration window and no held-out selection window
(:mod:`kvbench.fit.heldout`), and never an evaluation set.

Every measured point, the windows and the time go into the result (``measured_fit``; the method's
knobs summarize it); the outcome is cached in ``$KVBENCH_CACHE/measured_keep``, keyed by model,
method options (the chosen split included), targets, regime, seed, calibration spec and
:data:`FIT_VERSION`. The figure reported is always the evaluation's own measurement; the refit only
moves the configuration towards the target.

Decisions where docs/methods.md is silent:

* The split is chosen first (:mod:`kvbench.fit.budget_share`, candidates at the predicted rho) and
  only the chosen split is refitted: refitting every candidate would triple the cost of the
  longest fit in the harness (H2O + KIVI decodes token by token).
* ``N_WINDOWS`` = 2 and ``TOL`` = 0.5%: each measurement decodes the windows token by token
  (about 25 s per 2048-token window on one CPU thread); on SmolLM2 track B at a target of 0.5 the
  refitted compose(h2o, kivi) read 0.5005 on these windows and 0.501 on a PTB test window, inside
  the 2% the tables mark (†).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from methods.compose import RHO_MIN

from ..context import JobContext
from ..data import windows as W
from ..store.cache import cached_json
from .heldout import N_HELDOUT, heldout_starts
from .search import heldout_pass
from .statistics import calibration_ids, calibration_starts, spec_fields

log = logging.getLogger(__name__)

N_WINDOWS = 2
TOL = 0.005
MAX_MEASUREMENTS = 5
MEASURE_SEED_OFFSET = 104_729
#: part of the cache key: bump when what a refit measures or chooses changes
FIT_VERSION = 1


def window_length(regime) -> int:
    """Tokens of one measurement window laid out as ``regime``."""
    return regime.tokens if regime.kind == "qall" else regime.tokens + regime.decode + 1


def measurement_starts(n_tokens: int, spec, length: int, n: int = N_WINDOWS) -> list[int]:
    """Offsets of the ``n`` measurement windows of ``length`` tokens in the calibration split:
    none overlaps a calibration window, a held-out selection window or another."""
    avoid = calibration_starts(n_tokens, spec) + heldout_starts(n_tokens, spec, N_HELDOUT)
    return W.heldout_starts(n_tokens, n, max(length, spec.seqlen), spec.seed + MEASURE_SEED_OFFSET, avoid)


def measurement_windows(tokenizer, spec, regime, n: int = N_WINDOWS) -> torch.Tensor:
    """[n, window_length(regime)] measurement windows of the calibration corpus."""
    ids = calibration_ids(tokenizer, spec)
    length = window_length(regime)
    return W.windows_at(ids, measurement_starts(ids.numel(), spec, length, n), length)


def measured_kv(ctx: JobContext, method, windows: torch.Tensor) -> tuple[float, float]:
    """The headline (bpd_K, bpd_V) of ``windows`` through the model with ``method`` attached, in
    the method's regime, by the job's own rule."""
    reg = method.regime
    track, context = ("A", None) if reg.kind == "qall" else ("B", reg.tokens)
    _, s = heldout_pass(ctx, method, windows, track, context)
    return s["measured_k"], s["measured_v"]


def refit_kept(ctx: JobContext, method, options: dict, bpd_k: float, bpd_v: float | None) -> dict:
    """Refit ``method``'s kept fraction to the measured headline (see the module docstring); the
    method is left at the chosen rho, its knobs summarize the refit. Returns the record (every
    measured point), which the job stores as the result's ``measured_fit``."""
    key = {"model": ctx.model_id, "method": "compose", "fit": FIT_VERSION, "options": options,
           "bpd_k": bpd_k, "bpd_v": bpd_v, "regime": asdict(ctx.regime), "seed": ctx.seed,
           "calibration": spec_fields(ctx.spec), "split": method.knobs().get("split"),
           "rho0": method.knobs()["rho"]}
    out = cached_json("measured_keep", key, lambda: _search(ctx, method, bpd_k, bpd_v))
    method.set_kept_fraction(out["rho"], {"rho_predicted": out["points"][0]["rho"],
                                          "measured_kv_calibration": out["measured_kv"],
                                          "measurements": len(out["points"])})
    log.info("compose: kept fraction refitted to the measured figure: rho %.4g -> %.4g (bpd_KV %.4g at "
             "a target of %g)", out["points"][0]["rho"], out["rho"], out["measured_kv"], out["target"])
    return out


def _next_rho(points: list[dict], target: float, proposed: float) -> float | None:
    """The next kept fraction: ``proposed`` (the prediction's) when it lies strictly inside the
    bracket of the measured points; else, with a bracket, the linear interpolation of the measured
    figure between its two ends; without one, a step in proportion (the bits scale about with the
    kept share), within [RHO_MIN, 1]. None when no point is left to try (rho at a bound)."""
    below = [p for p in points if p["measured_kv"] < target]
    above = [p for p in points if p["measured_kv"] > target]
    lo = max(below, key=lambda p: p["rho"], default=None)
    hi = min(above, key=lambda p: p["rho"], default=None)
    if (lo is None or proposed > lo["rho"]) and (hi is None or proposed < hi["rho"]):
        return proposed
    if lo is not None and hi is not None:
        w = (target - lo["measured_kv"]) / (hi["measured_kv"] - lo["measured_kv"])
        return lo["rho"] + w * (hi["rho"] - lo["rho"])
    last = points[-1]
    step = min(1.0, max(RHO_MIN, last["rho"] * target / last["measured_kv"]))
    return None if step == last["rho"] else step


def _search(ctx: JobContext, method, bpd_k: float, bpd_v: float | None) -> dict:
    t0 = time.perf_counter()
    target = (bpd_k + (bpd_v if bpd_v is not None else bpd_k)) / 2
    windows = measurement_windows(ctx.tokenizer, ctx.spec, method.regime)
    points: list[dict] = []
    rho = method.knobs()["rho"]
    bar = tqdm(total=MAX_MEASUREMENTS, desc="compose: measured kept fraction", leave=False)
    for _ in range(MAX_MEASUREMENTS):
        method.set_kept_fraction(rho)
        predicted = method.knobs()["predicted_bpd_kv"]
        if any(p["predicted_kv"] == predicted for p in points):
            break  # the same held counts as a point measured already: nothing between them to try
        mk, mv = measured_kv(ctx, method, windows)
        m = (mk + mv) / 2
        points.append({"rho": rho, "predicted_kv": predicted, "measured_k": mk, "measured_v": mv,
                       "measured_kv": m})
        bar.update()
        log.info("compose: rho %.4g -> measured bpd_KV %.4g (predicted %.4g, target %g)", rho, m, predicted, target)
        if abs(m - target) <= TOL * target:
            break
        nxt = _next_rho(points, target, method.rho_for(target * predicted / m))
        if nxt is None or nxt == rho:
            break
        rho = nxt
    bar.close()
    best = min(points, key=lambda p: (abs(p["measured_kv"] - target), p["measured_kv"]))
    return {"rho": best["rho"], "measured_kv": best["measured_kv"], "target": target, "points": points,
            "windows": [int(windows.shape[0]), int(windows.shape[1])], "seconds": time.perf_counter() - t0}
