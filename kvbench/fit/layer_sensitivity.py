"""Per-layer sensitivity alpha_l for ``cobra_plus`` (METHODS.md §13; KV-COBRA seed limitation 2).

The method's probe (:meth:`methods.cobra_plus.CobraPlus.sensitivity_probe`: the method itself at the
uniform allocation of the job's budget) is applied to one layer's keys (and, in the joint KV-track,
one layer's values) at a time, every other layer exact; the increase of the model's output KL to the
uncompressed model (``sensitivity_metric="kl"``, mean over positions) or of its NLL ("nll") on
calibration windows is that layer's measured harm. The method turns it into alpha_l by dividing by
the probe's modelled distortion. 1 + L (or 1 + 2L) passes per window. In the joint KV-track the
K/V exchange rate takes 2 more: the keys' reference on every layer at once, then the values'.

Cached in ``$KVBENCH_CACHE/layer_sensitivity`` (keyed by model, method options, targets, seed,
calibration spec and :data:`VERSION`), computed once across parallel jobs
(:func:`kvbench.cache_files.computed_once`), like the calibration statistics; the cost (seconds,
passes) is recorded in the result, 0 s on a cache hit.

Decisions where METHODS.md is silent: the windows are the first ``sensitivity_windows`` calibration
windows (the job's own calibration draw, never an evaluation set), cut to ``sensitivity_seqlen``
tokens; KL(p_fp16 || p_probe) in float32 log-softmax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time

import torch
from tqdm.auto import tqdm

from .cache_files import computed_once, unique_tmp
from .calibrate import calibration_windows, spec_fields
from .integrate import attach
from .models import cache_dir

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
        comp = attach(model, probe.select(layer, side))
        try:
            logits = model(input_ids=ids, use_cache=False).logits
        finally:
            comp.detach()
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


def layer_sensitivity(model, tokenizer, method, stats, spec, seed: int, model_id: str) -> dict:
    """The measurement for ``method`` (configured), from the cache when present; adds "cache_hit"."""
    opts = {k: v for k, v in method_fields(method).items() if k not in NOT_IN_KEY}
    blob = json.dumps({"model": model_id, "method": method.name, "version": VERSION, "options": opts,
                       "targets": list(method._ref), "sides": list(method.sensitivity_sides()),
                       "seed": seed, "calibration": spec_fields(spec)}, sort_keys=True, default=str)
    path = cache_dir() / "layer_sensitivity" / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    with computed_once(path):
        if path.exists():
            out = json.loads(path.read_text())
            log.info("layer sensitivity from cache %s", path)
            return {**out, "cache_hit": True}
        windows = calibration_windows(tokenizer, spec)[: int(method.sensitivity_windows), : int(method.sensitivity_seqlen)]
        probe = method.sensitivity_probe(stats, seed)
        out = measure(model, probe, windows, method.sensitivity_sides(), method.sensitivity_metric,
                      method.sensitivity_per_layer(), method.sensitivity_whole())
        out.update(windows=list(windows.shape), metric=method.sensitivity_metric)
        tmp = unique_tmp(path)
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)
    log.info("layer sensitivity: %d passes in %.1f s", out["passes"], out["seconds"])
    return {**out, "cache_hit": False}


def sensitivity_for_job(loaded, method, stats, spec, seed: int, model_id: str, result: dict, timings: dict) -> None:
    """Measure (or read) alpha's raw data and hand it to ``method``; record it and its cost."""
    out = layer_sensitivity(loaded.model, loaded.tokenizer, method, stats, spec, seed, model_id)
    info = {"seconds": round(out["seconds"], 3), "passes": out["passes"], "cache_hit": out["cache_hit"],
            "windows": out["windows"], "metric": out["metric"]}
    method.set_layer_sensitivity(out["increase"], info, out["whole"])
    timings["sensitivity_s"] = 0.0 if out["cache_hit"] else out["seconds"]
    result["layer_sensitivity"] = {**info, "increase": out["increase"], "whole": out["whole"]}
