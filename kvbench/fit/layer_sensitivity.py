"""Per-layer sensitivity alpha_l for ``cobra_plus`` (docs/methods.md §13; KV-COBRA seed limitation 2).

The method's probe (:meth:`methods.cobra_plus.CobraPlus.sensitivity_probe`: the method itself at the
uniform allocation of the job's budget) is applied to one layer's keys (and, in the joint KV-track,
one layer's values) at a time, every other layer exact; the increase of the model's output KL to the
uncompressed model (``sensitivity_metric="kl"``, mean over positions) or of its NLL ("nll") on
calibration windows is that layer's measured harm. The method turns it into alpha_l by dividing by
the probe's modelled distortion. 1 + L (or 1 + 2L) passes per window. In the joint KV-track the
K/V exchange rate takes 2 more: the keys' reference on every layer at once, then the values'.

A measurement, not a search: it is asked for by ``"layer_sensitivity" in method.searches()`` once
the method is configured. Cached in ``$KVBENCH_CACHE/layer_sensitivity`` (keyed by model, method
options, targets, seed, calibration spec and :data:`VERSION`) through
:func:`kvbench.store.cache.cached_json`, like the held-out choices; the cost (seconds, passes) is
recorded in the result, 0 s on a cache hit.

Decisions where docs/methods.md is silent: the windows are the first ``sensitivity_windows`` calibration
windows (the job's own calibration draw, never an evaluation set), cut to ``sensitivity_seqlen``
tokens; KL(p_fp16 || p_probe) in float32 log-softmax.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from tqdm.auto import tqdm

from ..context import JobContext
from ..model.integrate import attached
from ..store.cache import cached_json
from .statistics import calibration_windows, spec_fields

log = logging.getLogger(__name__)

#: part of the cache key: bump when the probe or the measure changes
VERSION = 2
#: method options that do not change the measurement (only how the method uses it, or already
#: reflected in the other fields), left out of the cache key
NOT_IN_KEY = ("sensitivity_power", "ablate")


def method_fields(method) -> dict:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}


def _token_loss(logits: torch.Tensor, ids: torch.Tensor, ref_logp: torch.Tensor | None, metric: str) -> float:
    """Mean over positions of KL(ref || model) or of the NLL of the next token."""
    logp = torch.log_softmax(logits[0, :-1].float(), -1)
    if metric == "nll":
        return float(-logp.gather(-1, ids[0, 1:, None].to(logp.device)).mean())
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


@torch.no_grad()
def measure(model, probe, windows: torch.Tensor, sides, metric: str = "kl", per_layer: bool = True,
            whole: bool = False) -> dict:
    """{"increase": {side: [L]} (per_layer), "whole": {side: x} (whole: the side's reference on every
    layer at once), "passes", "seconds"} for a :class:`methods.cobra_plus.LayerProbe`."""
    t0 = time.perf_counter()
    n_layers = len(probe.k_codecs)
    inc = {side: [0.0] * n_layers for side in sides} if per_layer else {}
    all_layers = {side: 0.0 for side in sides} if whole else {}
    passes = 0

    def probe_loss(ids, ref, layer, side) -> float:
        with attached(model, probe.select(layer, side)):
            logits = model(input_ids=ids, use_cache=False).logits
        return _token_loss(logits, ids, ref, metric)

    for w in tqdm(windows, desc="layer sensitivity", unit="window", leave=False):
        ids = w[None].to(next(model.parameters()).device)
        base_logits = model(input_ids=ids, use_cache=False).logits
        passes += 1
        ref = torch.log_softmax(base_logits[0, :-1].float(), -1)
        base = _token_loss(base_logits, ids, ref, metric)  # 0 for KL
        for side in sides:
            for layer in range(n_layers) if per_layer else ():
                inc[side][layer] += (probe_loss(ids, ref, layer, side) - base) / len(windows)
                passes += 1
            if whole:
                all_layers[side] += (probe_loss(ids, ref, None, side) - base) / len(windows)
                passes += 1
    return {"increase": inc, "whole": all_layers, "passes": passes, "seconds": time.perf_counter() - t0}


def layer_sensitivity(ctx: JobContext, method) -> dict:
    """The measurement for ``method`` (configured), from the cache when present; adds "cache_hit"."""
    opts = {k: v for k, v in method_fields(method).items() if k not in NOT_IN_KEY}
    key = {"model": ctx.model_id, "method": method.name, "version": VERSION, "options": opts,
           "targets": list(method.sensitivity_targets()), "sides": list(method.sensitivity_sides()),
           "seed": ctx.seed, "calibration": spec_fields(ctx.spec)}

    def compute() -> dict:
        windows = calibration_windows(ctx.tokenizer, ctx.spec)
        windows = windows[: int(method.sensitivity_windows), : int(method.sensitivity_seqlen)]
        probe = method.sensitivity_probe(ctx.stats, ctx.seed)
        out = measure(ctx.model, probe, windows, method.sensitivity_sides(), method.sensitivity_metric,
                      method.sensitivity_per_layer(), method.sensitivity_whole())
        out.update(windows=list(windows.shape), metric=method.sensitivity_metric)
        log.info("layer sensitivity: %d passes in %.1f s", out["passes"], out["seconds"])
        return out

    return cached_json("layer_sensitivity", key, compute)


def measure_for(ctx: JobContext, method, record: dict | None = None, timings: dict | None = None) -> None:
    """Measure (or read) alpha's raw data and hand it to ``method``; record it and its cost in
    ``record`` (the result's ``layer_sensitivity``) and ``timings`` when given."""
    out = layer_sensitivity(ctx, method)
    info = {"seconds": round(out["seconds"], 3), "passes": out["passes"], "cache_hit": out["cache_hit"],
            "windows": out["windows"], "metric": out["metric"]}
    method.set_layer_sensitivity(out["increase"], info, out["whole"])
    if timings is not None:
        timings["sensitivity_s"] = 0.0 if out["cache_hit"] else out["seconds"]
    if record is not None:
        record["layer_sensitivity"] = {**info, "increase": out["increase"], "whole": out["whole"]}
