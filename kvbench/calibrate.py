"""Calibration pass: per-KV-head moments of pre-RoPE keys, values and queries (METHODS.md §1.2).

Forward hooks on ``q_proj``, ``k_proj`` and ``v_proj`` accumulate, in float64 per KV head, the
sums that give μ_K, Σ_K (centered), μ_V, Σ_V and the group query second moment
M_Q = (1/g) Σ_{h in group} E[q_h q_hᵀ] (uncentered). Windows are drawn GPTQ-style
(``random.seed(seed)``) from the calibration corpus. Results are cached on disk, keyed by model,
corpus, window count, window length and seed, so a sweep over budgets calibrates once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from methods import LayerStats

from .data.text import corpus_text
from .data.windows import encode, random_windows
from .integrate import attention_modules, model_shape
from .models import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str = "wikitext2"
    split: str = "train"
    n_windows: int = 32
    seqlen: int = 1024
    seed: int = 0
    data_dir: str | None = None

    def key(self, model_id: str) -> str:
        blob = json.dumps({"model": model_id, **self.__dict__}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class _Accumulator:
    """Running float64 sums for one layer."""

    def __init__(self, n_kv: int, group: int, d: int, device):
        z = dict(dtype=torch.float64, device=device)
        self.n_kv, self.group, self.d = n_kv, group, d
        self.sum_k = torch.zeros(n_kv, d, **z)
        self.sq_k = torch.zeros(n_kv, d, d, **z)
        self.sum_v = torch.zeros(n_kv, d, **z)
        self.sq_v = torch.zeros(n_kv, d, d, **z)
        self.sq_q = torch.zeros(n_kv, d, d, **z)
        self.n = 0

    def _heads(self, out: torch.Tensor, n_heads: int) -> torch.Tensor:
        return out.reshape(-1, n_heads, self.d).to(torch.float64).transpose(0, 1)  # [H, N, d]

    def add_k(self, out):
        x = self._heads(out, self.n_kv)
        self.sum_k += x.sum(1)
        self.sq_k += x.transpose(1, 2) @ x
        self.n += x.shape[1]

    def add_v(self, out):
        x = self._heads(out, self.n_kv)
        self.sum_v += x.sum(1)
        self.sq_v += x.transpose(1, 2) @ x

    def add_q(self, out):
        x = self._heads(out, self.n_kv * self.group)  # [Hq, N, d]
        sq = x.transpose(1, 2) @ x
        self.sq_q += sq.view(self.n_kv, self.group, self.d, self.d).mean(1)

    def finish(self) -> LayerStats:
        n = self.n
        mu_k, mu_v = self.sum_k / n, self.sum_v / n
        cov_k = self.sq_k / n - mu_k[:, :, None] * mu_k[:, None, :]
        cov_v = self.sq_v / n - mu_v[:, :, None] * mu_v[:, None, :]
        sym = lambda m: (m + m.transpose(1, 2)) / 2  # noqa: E731
        return LayerStats(
            mu_k=mu_k.cpu(),
            cov_k=sym(cov_k).cpu(),
            mu_v=mu_v.cpu(),
            cov_v=sym(cov_v).cpu(),
            m_q=sym(self.sq_q / n).cpu(),
            n_tokens=n,
        )


@torch.no_grad()
def collect_stats(model, windows: torch.Tensor) -> list[LayerStats]:
    """Run ``windows`` [n, T] through the unpatched model and return one LayerStats per layer."""
    shape = model_shape(model)
    device = next(model.parameters()).device
    accs = [
        _Accumulator(shape.n_kv_heads, shape.group_size, shape.head_dim, device)
        for _ in range(shape.n_layers)
    ]
    handles = []
    for acc, attn in zip(accs, attention_modules(model)):
        handles.append(attn.q_proj.register_forward_hook(lambda m, a, o, acc=acc: acc.add_q(o)))
        handles.append(attn.k_proj.register_forward_hook(lambda m, a, o, acc=acc: acc.add_k(o)))
        handles.append(attn.v_proj.register_forward_hook(lambda m, a, o, acc=acc: acc.add_v(o)))
    try:
        for window in tqdm(windows, desc="calibration", unit="window", leave=False):
            model(input_ids=window[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [acc.finish() for acc in accs]


def calibration_windows(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    ids = encode(tokenizer, corpus_text(spec.dataset, spec.split, spec.data_dir))
    return random_windows(ids, spec.n_windows, spec.seqlen, spec.seed)


def calibrate(model, tokenizer, model_id: str, spec: CalibrationSpec) -> tuple[list, float, bool]:
    """Statistics for ``model`` (from the disk cache when present). Returns (stats, seconds, hit)."""
    path = cache_dir() / "calibration" / f"{model_id}-{spec.key(model_id)}.pt"
    if path.exists():
        stats = [LayerStats(**d) for d in torch.load(path, weights_only=True)]
        log.info("calibration statistics from cache %s", path)
        return stats, 0.0, True
    t0 = time.perf_counter()
    log.info(
        "calibrating on %d x %d tokens of %s/%s (seed %d)",
        spec.n_windows, spec.seqlen, spec.dataset, spec.split, spec.seed,
    )
    stats = collect_stats(model, calibration_windows(tokenizer, spec))
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save([s.__dict__ for s in stats], tmp)
    Path(tmp).replace(path)
    return stats, seconds, False
