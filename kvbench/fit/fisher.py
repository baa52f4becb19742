"""Fisher information of the calibration keys and values, for a method that weights its fit by it
(``KVMethod.calibration_fisher()``; KVQuant, Hooper et al., arXiv 2401.18079, §3.2 Eq. 7; official
``gradients/run-fisher.py``). docs/methods.md §14.2.

F = (∂L/∂x)² for every element x of the ``k_proj`` and ``v_proj`` outputs (pre-RoPE keys, values;
bias included), L the mean next-token cross-entropy of one calibration window (labels = the
window's own tokens: the mean over its T − 1 predictions, as the official ``model(input_ids=x,
labels=x).loss``), one backward pass per window. F is kept at the positions of the key/value sample
(:func:`kvbench.fit.statistics.sample_positions`: the same windows, seed and positions as
``LayerStats.k_sample``/``v_sample``), as ``LayerStats.k_fisher``/``v_fisher`` [H, n, d].

Decisions where docs/methods.md is silent:

* The gradient is squared in float32 (float64 on a float64 model), not in the model's dtype (the
  official squares bf16 gradients, which on an fp16 model would underflow).
* Only the activations are differentiated (``torch.autograd.grad`` w.r.t. the hooked outputs; the
  parameters' ``requires_grad`` is switched off for the pass and restored), so no parameter
  gradient is computed or left behind. A window without a sampled position is not run.
* Cached on disk like the statistics (``$KVBENCH_CACHE/fisher``, keyed as the statistics with
  their sample: model, corpus, windows, length, seed, sample size).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from methods import LayerStats

from ..model.integrate import attention_modules, model_shape
from ..store.cache import cache_dir, computed_once, unique_tmp
from .statistics import CalibrationSpec, calibration_windows, sample_positions

log = logging.getLogger(__name__)


@contextlib.contextmanager
def activations_only(model):
    """Parameters frozen for the block (their ``requires_grad`` restored after)."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def window_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of one window ``ids`` [1, T], from embeddings that require
    grad, so that every activation of the pass is differentiable."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, use_cache=False).logits[0, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, ids[0, 1:])


def collect_fisher(model, windows: torch.Tensor, sample_tokens: int, seed: int = 0) -> list[tuple]:
    """(k_fisher, v_fisher) per layer, each [H, n, d] float32 (float64 on a float64 model): the
    squared gradients of each window's loss w.r.t. the ``k_proj``/``v_proj`` outputs at the
    sampled positions of :func:`kvbench.fit.statistics.collect_stats` with the same ``windows``,
    ``sample_tokens`` and ``seed``, in the same order."""
    shape = model_shape(model)
    device = next(model.parameters()).device
    n_tok = windows.shape[1]
    positions = sample_positions(windows.numel(), sample_tokens, seed)
    if positions.numel() == 0:
        raise ValueError("Fisher information is kept at the key/value sample's positions: sample_tokens must be > 0")
    outputs: dict = {}
    handles = []
    for layer, attn in enumerate(attention_modules(model)):
        for side, proj in enumerate((attn.k_proj, attn.v_proj)):
            handles.append(proj.register_forward_hook(
                lambda m, a, o, key=(layer, side): outputs.__setitem__(key, o)))
    parts = [([], []) for _ in range(shape.n_layers)]
    try:
        with activations_only(model), torch.enable_grad():
            for w, window in enumerate(tqdm(windows, desc="fisher", unit="window", leave=False)):
                lo, hi = torch.searchsorted(positions, torch.tensor([w * n_tok, (w + 1) * n_tok])).tolist()
                if hi == lo:
                    continue
                local = (positions[lo:hi] - w * n_tok).to(device)
                outputs.clear()
                loss = window_loss(model, window[None].to(device))
                keys = list(outputs)
                grads = torch.autograd.grad(loss, [outputs[k] for k in keys])
                for (layer, side), g in zip(keys, grads):
                    g = g[0].index_select(0, local)
                    sq = g.to(torch.promote_types(g.dtype, torch.float32)).square()
                    parts[layer][side].append(sq.reshape(-1, shape.n_kv_heads, shape.head_dim).cpu())
                outputs.clear()
    finally:
        for h in handles:
            h.remove()
    return [tuple(torch.cat(side).transpose(0, 1).contiguous() for side in layer) for layer in parts]


def with_fisher(stats: list[LayerStats], fisher: list[tuple]) -> list[LayerStats]:
    """``stats`` with ``k_fisher``/``v_fisher`` from :func:`collect_fisher`."""
    if len(stats) != len(fisher):
        raise ValueError(f"{len(fisher)} layers of Fisher information for {len(stats)} layers of statistics")
    return [replace(s, k_fisher=kf, v_fisher=vf) for s, (kf, vf) in zip(stats, fisher)]


def fisher_stats(model, tokenizer, model_id: str, spec: CalibrationSpec,
                 stats: list[LayerStats]) -> tuple[list[LayerStats], float, bool]:
    """``stats`` with the Fisher information of ``spec``'s windows and sample (from the disk cache
    when present). Returns (stats, seconds, hit)."""
    path = cache_dir() / "fisher" / f"{model_id}-{spec.key(model_id)}.pt"
    if not path.exists():
        with computed_once(path):
            if not path.exists():
                return _compute(model, tokenizer, spec, path, stats)
    log.info("Fisher information from cache %s", path)
    return with_fisher(stats, torch.load(path, weights_only=True)), 0.0, True


def _compute(model, tokenizer, spec: CalibrationSpec, path: Path, stats: list) -> tuple[list, float, bool]:
    t0 = time.perf_counter()
    log.info("Fisher information: one backward pass per window, %d x %d tokens of %s/%s (seed %d), "
             "kept at a sample of %d tokens", spec.n_windows, spec.seqlen, spec.dataset, spec.split, spec.seed,
             spec.sample_tokens)
    fisher = collect_fisher(model, calibration_windows(tokenizer, spec), spec.sample_tokens, spec.seed)
    seconds = time.perf_counter() - t0
    tmp = unique_tmp(path)
    torch.save(fisher, tmp)
    tmp.replace(path)
    return with_fisher(stats, fisher), seconds, False
