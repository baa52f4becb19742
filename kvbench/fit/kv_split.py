"""The KV-track split of METHODS.md §5.8, chosen on held-out calibration windows (``v_bpd=auto``).

For a total budget bpd_KV = β (``bpd=β v_bpd=auto``; β is the mean of the two sides, METHODS.md §0)
the candidates are b_V ∈ {2..8} with bpd_K = 2β − b_V ≥ 0.25. Each candidate is configured and
calibrated from the job's own statistics, then scored by Q-all perplexity (track A) on 8 windows of
the calibration corpus's training split that overlap none of the calibration windows; the lowest
perplexity wins (ties: the larger b_V, as the seed's ablation favours value-heavy splits). Never an
evaluation set. The choice and every candidate's perplexity are cached in ``$KVBENCH_CACHE/kv_split``
(keyed by model, method options, β, seed and calibration spec) and recorded in the result.

Held-out (selection) windows, METHODS.md §1.2 "Separation": windows of the calibration spec's own
split (a calibration corpus's train split, checked when the spec is made), at offsets drawn with
``seed + 7919`` and rejected when they overlap a calibration window or one another
(:func:`heldout_starts`); :func:`heldout` is what every selection reads (this split, compose's
split, cobra_plus's switches), ``n`` windows of the calibration length.

Decisions where METHODS.md is silent: the offsets above; a candidate the method cannot reach
(``Unsupported``, e.g. KQ-SVD's r·b grid) is listed as such and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time

import torch
from tqdm.auto import tqdm

from methods import Unsupported, build_method

from .calibrate import calibration_ids, calibration_starts, spec_fields
from .compressed_lm import CompressedLM
from .data import windows as W
from .integrate import attach, model_shape
from .cache_files import computed_once, unique_tmp
from .models import cache_dir

log = logging.getLogger(__name__)

V_BITS = range(2, 9)
MIN_BPD_K = 0.25
N_HELDOUT = 8
HELDOUT_SEED_OFFSET = 7919


def candidates(beta: float) -> list[tuple[float, int]]:
    """(bpd_K, b_V) pairs with (bpd_K + b_V) / 2 = β, b_V in 2..8, bpd_K >= 0.25."""
    out = [(2 * beta - b, b) for b in V_BITS if 2 * beta - b >= MIN_BPD_K - 1e-12]
    if not out:
        raise Unsupported(
            f"v_bpd=auto: bpd_KV={beta} leaves no split with b_V in 2..8 and bpd_K >= {MIN_BPD_K} "
            f"(needs bpd_KV >= {(2 + MIN_BPD_K) / 2:g})"
        )
    return out


def heldout_starts(n_tokens: int, spec, n: int = N_HELDOUT) -> list[int]:
    """Offsets, in the calibration split's tokens, of the ``n`` held-out windows of ``spec``: none
    overlaps a calibration window (:func:`kvbench.calibrate.calibration_starts`) or another."""
    avoid = calibration_starts(n_tokens, spec)
    return W.heldout_starts(n_tokens, n, spec.seqlen, spec.seed + HELDOUT_SEED_OFFSET, avoid)


def heldout(tokenizer, spec, n: int = N_HELDOUT) -> torch.Tensor:
    """[n, seqlen] held-out selection windows of the calibration corpus's train split; the first k
    are the same for every n >= k."""
    ids = calibration_ids(tokenizer, spec)
    return W.windows_at(ids, heldout_starts(ids.numel(), spec, n), spec.seqlen)


def _ppl(lm: CompressedLM, windows: torch.Tensor) -> float:
    nll, n = 0.0, 0
    for w in windows:
        logits = lm.logits(w[None])[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:].to(logits.device), reduction="sum"))
        n += w.numel() - 1
    return math.exp(nll / n)


def choose_split(model, tokenizer, name: str, options: dict, beta: float, stats, spec, seed: int,
                 model_id: str) -> dict:
    """The §5.8 split for ``name`` at bpd_KV = ``beta``: {"bpd_k", "v_bpd", "ppl", "candidates",
    "seconds", "cache_hit"}; Unsupported when no candidate is reachable."""
    blob = json.dumps({"model": model_id, "method": name, "options": options, "beta": beta,
                       "seed": seed, "calibration": spec_fields(spec)}, sort_keys=True, default=str)
    path = cache_dir() / "kv_split" / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    with computed_once(path):
        if path.exists():
            out = json.loads(path.read_text())
            log.info("v_bpd=auto: split (K %g, V %d) from cache %s", out["bpd_k"], out["v_bpd"], path)
            return {**out, "cache_hit": True}
        out = _search(model, tokenizer, name, options, beta, stats, spec, seed)
        tmp = unique_tmp(path)
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)
    log.info("v_bpd=auto: chose K %g / V %d (held-out PPL %.3f)", out["bpd_k"], out["v_bpd"], out["ppl"])
    return {**out, "cache_hit": False}


def _search(model, tokenizer, name, options, beta, stats, spec, seed) -> dict:
    """Every candidate of :func:`candidates` scored on the held-out windows; the best one."""
    t0 = time.perf_counter()
    windows = heldout(tokenizer, spec)
    shape = model_shape(model)
    scored = []
    for bpd_k, b_v in tqdm(candidates(beta), desc=f"v_bpd=auto split (bpd_KV {beta:g})", leave=False):
        method = build_method(name, **options)
        try:
            method.configure(shape, bpd_k, float(b_v))
            if method.needs_calibration:
                method.calibrate(stats, seed=seed)
        except Unsupported as err:
            scored.append({"bpd_k": bpd_k, "v_bpd": b_v, "ppl": None, "unsupported": str(err)})
            continue
        comp = attach(model, method)
        try:
            ppl = _ppl(CompressedLM(model, tokenizer, comp), windows)
        finally:
            comp.detach()
        scored.append({"bpd_k": bpd_k, "v_bpd": b_v, "ppl": ppl})
        log.info("v_bpd=auto: K %g / V %d -> held-out PPL %.3f", bpd_k, b_v, ppl)
    ok = [c for c in scored if c["ppl"] is not None and math.isfinite(c["ppl"])]
    if not ok:
        raise Unsupported(f"v_bpd=auto: no split of bpd_KV={beta} is reachable for {name}: {scored}")
    best = min(ok, key=lambda c: (c["ppl"], -c["v_bpd"]))
    return {"bpd_k": best["bpd_k"], "v_bpd": best["v_bpd"], "ppl": best["ppl"], "candidates": scored,
            "heldout_windows": [N_HELDOUT, spec.seqlen], "seconds": time.perf_counter() - t0}
