"""compose's budget split chosen on held-out calibration windows (METHODS.md §12).

``method=compose`` without ``keep`` or ``split``: each split rho_0 in {1/2, 1/4, 1/8}
(:data:`methods.compose.SPLITS`) gives the codec its share of the budget and fits the kept fraction
to the target (see :mod:`methods.compose`); every candidate is configured for the job's regime,
calibrated from the job's own statistics where the codec needs them, and scored by perplexity
through the composed model on held-out windows of the calibration corpus (the windows of
:func:`kvbench.kv_split.heldout`, which overlap no calibration window; never an evaluation set).
The lowest perplexity wins (ties: the larger split, more tokens kept). The choice and every
candidate's perplexity are cached in ``$KVBENCH_CACHE/keep_fraction`` (keyed by model, method
options, targets, regime, seed, calibration spec and :data:`FIT_VERSION`), logged, and recorded in
the result.

Decisions where METHODS.md is silent:

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

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from methods import Regime, Unsupported, build_method
from methods.compose import SPLITS

from .cache_files import computed_once, unique_tmp
from .calibrate import spec_fields
from .compressed_lm import CompressedLM
from .integrate import attach, model_shape
from .kv_split import heldout
from .models import cache_dir

log = logging.getLogger(__name__)

N_HELDOUT = 4
CONTEXT_SHARE = 0.75
#: part of the cache key: bump when the budget fit of methods/compose.py changes what a split means
FIT_VERSION = 2


def _ppl(lm: CompressedLM, windows: torch.Tensor, in_pass: bool) -> float:
    """Perplexity of ``windows`` through ``lm``: Q-all, or exact context then scored targets."""
    nll, n = 0.0, 0
    for w in windows:
        if in_pass:
            logits = lm.logits(w[None])[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:].to(logits.device), reduction="sum"))
            n += w.numel() - 1
        else:
            c = round(CONTEXT_SHARE * w.numel())
            nll -= float(lm.score(w[None, :c], w[None, c:]).sum())
            n += w.numel() - c
    return math.exp(nll / n)


def choose_split(model, tokenizer, options: dict, bpd_k: float, bpd_v: float | None, regime: Regime,
                 stats, spec, seed: int, model_id: str) -> dict:
    """compose's split for the job: {"split", "ppl", "candidates", "seconds", "cache_hit"}."""
    blob = json.dumps({"model": model_id, "method": "compose", "fit": FIT_VERSION, "options": options,
                       "bpd_k": bpd_k, "bpd_v": bpd_v, "regime": asdict(regime), "seed": seed,
                       "calibration": spec_fields(spec)}, sort_keys=True, default=str)
    path = cache_dir() / "keep_fraction" / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    with computed_once(path):
        if path.exists():
            out = json.loads(path.read_text())
            log.info("compose: split %g from cache %s", out["split"], path)
            return {**out, "cache_hit": True}
        out = _search(model, tokenizer, options, bpd_k, bpd_v, regime, stats, spec, seed)
        tmp = unique_tmp(path)
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)
    log.info("compose: chose split %g (held-out PPL %.3f)", out["split"], out["ppl"])
    return {**out, "cache_hit": False}


def _search(model, tokenizer, options, bpd_k, bpd_v, regime, stats, spec, seed) -> dict:
    t0 = time.perf_counter()
    windows = heldout(tokenizer, spec, n=N_HELDOUT)
    shape = model_shape(model)
    scored = []
    for split in tqdm(SPLITS, desc="compose split", leave=False):
        method = build_method("compose", **{**options, "split": split})
        method.set_regime(regime)
        try:
            method.configure(shape, bpd_k, bpd_v)
            if method.needs_calibration:
                method.calibrate(stats, seed=seed)
        except Unsupported as err:
            scored.append({"split": split, "ppl": None, "unsupported": str(err)})
            continue
        knobs = method.knobs()
        key = (knobs.get("rho"), knobs.get("codec_knobs"))
        same = [c for c in scored if (c.get("rho"), c.get("codec_knobs")) == key]
        if same:  # the fit landed on a configuration already scored (e.g. the codec's lowest budget)
            scored.append({**same[0], "split": split, "same_as_split": same[0]["split"]})
            continue
        in_pass = regime.kind == "qall" and method.supports_in_pass
        comp = attach(model, method)
        try:
            ppl = _ppl(CompressedLM(model, tokenizer, comp), windows, in_pass)
        finally:
            comp.detach()
        scored.append({"split": split, "ppl": ppl, "rho": key[0], "codec_knobs": key[1]})
        log.info("compose: split %g (rho %.4g) -> held-out PPL %.3f", split, knobs.get("rho"), ppl)
    ok = [c for c in scored if c["ppl"] is not None and math.isfinite(c["ppl"])]
    if not ok:
        raise Unsupported(f"compose: no split in {SPLITS} reaches the target: {scored}")
    best = min(ok, key=lambda c: (c["ppl"], -c["split"]))
    return {"split": best["split"], "ppl": best["ppl"], "candidates": scored,
            "heldout_windows": [len(windows), spec.seqlen], "seconds": time.perf_counter() - t0}


def split_for_job(cfg, loaded, name: str, options: dict, bpd_k, bpd_v, stats, result: dict, timings: dict):
    """The job's compose method with the chosen split (regime set; not yet configured)."""
    from omegaconf import OmegaConf

    from .calibrate import CalibrationSpec
    from .job import calibration_model_id, job_regime

    spec = CalibrationSpec(**{**OmegaConf.to_container(cfg.calibration), "seed": int(cfg.seed)})
    regime = job_regime(cfg)
    choice = choose_split(loaded.model, loaded.tokenizer, options, bpd_k, bpd_v, regime, stats, spec,
                          int(cfg.seed), calibration_model_id(cfg, loaded))
    timings["split_s"] = 0.0 if choice["cache_hit"] else choice["seconds"]
    result["keep_fraction"] = choice
    method = build_method(name, **{**options, "split": choice["split"]})
    method.set_regime(regime)
    return method
