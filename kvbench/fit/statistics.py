"""Calibration statistics: per-KV-head moments of pre-RoPE keys, values and queries (docs/methods.md §1.2).

Forward hooks on ``q_proj``, ``k_proj`` and ``v_proj`` accumulate, in float64 per KV head, the
sums that give μ_K, Σ_K (centered), μ_V, Σ_V and the group query second moment
M_Q = (1/g) Σ_{h in group} E[q_h q_hᵀ] (uncentered). Windows are drawn GPTQ-style
(``random.seed(seed)``) from the calibration corpus. Results are cached on disk, keyed by model,
corpus, window count, window length and seed, so a sweep over budgets collects them once.

A method that asks for it (``calibration_sample_tokens()`` > 0, see :func:`sample_request`) also
gets a sample of the calibration keys and values themselves, for the calibrated step of
docs/methods.md §1.1b: ``LayerStats.k_sample`` / ``v_sample`` [H, n, d].

Decisions where docs/methods.md is silent (the sample):

* n = min(requested, all calibration tokens) token positions drawn uniformly without replacement
  (``torch.randperm`` seeded by the calibration seed) before the pass, the same positions for every
  layer and head: the reservoir sample of §1.1b with the stream length known in advance.
* Keys and values are both sampled (values cost as much again, and the rotated value codec of
  §5.8 uses the same calibrated step); stored centered (k - mu_k) in float16, which keeps the
  precision relative to the spread (a stored raw key would lose it to a large mean).
* The cache key includes ``sample_tokens`` only when it is > 0, so statistics cached without a
  sample keep their key; a file with a sample is a separate entry.

Separation (docs/methods.md §1.2): a spec is checked when it is made
(:func:`kvbench.data.text.check_calibration_source`): the corpus is a calibration corpus and the
split its train split (``wiki_proxy``: its calibration part), else ``ValueError`` naming the valid
ones. Cache keys (:func:`spec_fields`) name the part of a corpus that kvbench cuts in two.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from methods import LayerStats

from ..data.text import check_calibration_source, corpus_part, corpus_text
from ..data.windows import encode, random_starts, windows_at
from ..model.integrate import attention_modules, model_shape
from ..store.cache import cache_dir, computed_once, unique_tmp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str = "wikitext2"
    split: str = "train"
    n_windows: int = 32
    seqlen: int = 1024
    seed: int = 0
    data_dir: str | None = None
    sample_tokens: int = 0  # §1.1b: key/value sample per head; 0 = none

    def __post_init__(self):
        check_calibration_source(self.dataset, self.split, self.data_dir)

    def key(self, model_id: str) -> str:
        fields = spec_fields(self)
        if not fields["sample_tokens"]:
            del fields["sample_tokens"]  # the key of statistics without a sample is unchanged
        blob = json.dumps({"model": model_id, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def spec_fields(spec: CalibrationSpec) -> dict:
    """The spec's fields for cache keys, with ``part`` where kvbench cuts the corpus into a
    calibration and an evaluation part (wiki_proxy); other corpora keep the plain fields."""
    fields = asdict(spec)
    part = corpus_part(spec.dataset, spec.split)
    if part is not None:
        fields["part"] = part
    return fields


def sample_request(method) -> int:
    """Tokens per head of the calibration sample ``method`` asks for (0 when it needs none)."""
    return int(method.calibration_sample_tokens())


def with_sample(spec: CalibrationSpec, method) -> CalibrationSpec:
    """``spec`` with the sample ``method`` asks for (what the harness passes to :func:`statistics`);
    a larger ``sample_tokens`` already in the spec (the config's ``calibration``) is kept."""
    return replace(spec, sample_tokens=max(int(spec.sample_tokens), sample_request(method)))


def sample_positions(n_total: int, n_sample: int, seed: int) -> torch.Tensor:
    """Sorted positions (int64) of min(n_sample, n_total) calibration tokens drawn uniformly without
    replacement, deterministic given ``seed``."""
    if n_sample <= 0:
        return torch.zeros(0, dtype=torch.long)
    perm = torch.randperm(n_total, generator=torch.Generator().manual_seed(int(seed)))
    return perm[: min(int(n_sample), n_total)].sort().values


class _Sampler:
    """The rows of one projection output at the sampled token positions, in pass order."""

    def __init__(self, positions: torch.Tensor):
        self.positions, self.seen, self.parts = positions, 0, []

    def add(self, x: torch.Tensor) -> None:
        """``x`` [H, N, d]: the next N tokens of the pass."""
        if self.positions.numel():
            lo, hi = torch.searchsorted(self.positions, torch.tensor([self.seen, self.seen + x.shape[1]])).tolist()
            if hi > lo:
                local = (self.positions[lo:hi] - self.seen).to(x.device)
                self.parts.append(x.index_select(1, local).to(torch.float32))
        self.seen += x.shape[1]

    def centered(self, mu: torch.Tensor) -> torch.Tensor | None:
        """[H, n, d] float16 on the CPU of x - mu, or None without a sample."""
        if not self.parts:
            return None
        return (torch.cat(self.parts, 1) - mu[:, None, :].to(torch.float32)).to(torch.float16).cpu()


class _Accumulator:
    """Running float64 sums for one layer (and the samplers of its keys and values)."""

    def __init__(self, n_kv: int, group: int, d: int, device, positions: torch.Tensor | None = None):
        z = dict(dtype=torch.float64, device=device)
        self.n_kv, self.group, self.d = n_kv, group, d
        self.sum_k = torch.zeros(n_kv, d, **z)
        self.sq_k = torch.zeros(n_kv, d, d, **z)
        self.sum_v = torch.zeros(n_kv, d, **z)
        self.sq_v = torch.zeros(n_kv, d, d, **z)
        self.sq_q = torch.zeros(n_kv, d, d, **z)
        self.n = 0
        pos = torch.zeros(0, dtype=torch.long) if positions is None else positions
        self.k_sampler, self.v_sampler = _Sampler(pos), _Sampler(pos)

    def _heads(self, out: torch.Tensor, n_heads: int) -> torch.Tensor:
        return out.reshape(-1, n_heads, self.d).to(torch.float64).transpose(0, 1)  # [H, N, d]

    def add_k(self, out):
        x = self._heads(out, self.n_kv)
        self.sum_k += x.sum(1)
        self.sq_k += x.transpose(1, 2) @ x
        self.n += x.shape[1]
        self.k_sampler.add(x)

    def add_v(self, out):
        x = self._heads(out, self.n_kv)
        self.sum_v += x.sum(1)
        self.sq_v += x.transpose(1, 2) @ x
        self.v_sampler.add(x)

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
            k_sample=self.k_sampler.centered(mu_k),
            v_sample=self.v_sampler.centered(mu_v),
        )


@torch.no_grad()
def collect_stats(model, windows: torch.Tensor, sample_tokens: int = 0, seed: int = 0) -> list[LayerStats]:
    """Run ``windows`` [n, T] through the unpatched model and return one LayerStats per layer;
    with ``sample_tokens`` > 0 each also holds the key/value sample (positions from ``seed``)."""
    shape = model_shape(model)
    device = next(model.parameters()).device
    positions = sample_positions(windows.numel(), sample_tokens, seed)
    accs = [
        _Accumulator(shape.n_kv_heads, shape.group_size, shape.head_dim, device, positions)
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


def calibration_ids(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    """The tokens of the calibration split (calibration and held-out windows are cut from them)."""
    return encode(tokenizer, corpus_text(spec.dataset, spec.split, spec.data_dir))


def calibration_starts(n_tokens: int, spec: CalibrationSpec) -> list[int]:
    """Offsets of the calibration windows in :func:`calibration_ids` (GPTQ, ``random.seed(seed)``)."""
    return random_starts(n_tokens, spec.n_windows, spec.seqlen, spec.seed)


def calibration_windows(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    ids = calibration_ids(tokenizer, spec)
    return windows_at(ids, calibration_starts(ids.numel(), spec), spec.seqlen)


def statistics(model, tokenizer, model_id: str, spec: CalibrationSpec) -> tuple[list, float, bool]:
    """Statistics for ``model`` (from the disk cache when present). Returns (stats, seconds, hit).
    A method is then fitted to them by its own ``calibrate`` (:class:`methods.KVMethod`).

    Parallel jobs on one cache compute each entry once (:func:`kvbench.store.cache.computed_once`):
    the first takes the entry's lock and computes, the others wait and read the file."""
    path = cache_dir() / "calibration" / f"{model_id}-{spec.key(model_id)}.pt"
    if not path.exists():
        with computed_once(path):
            if not path.exists():
                return _compute(model, tokenizer, spec, path)
    stats = [LayerStats(**d) for d in torch.load(path, weights_only=True)]
    log.info("calibration statistics from cache %s", path)
    return stats, 0.0, True


def _compute(model, tokenizer, spec: CalibrationSpec, path: Path) -> tuple[list, float, bool]:
    t0 = time.perf_counter()
    log.info(
        "calibrating on %d x %d tokens of %s/%s (seed %d)%s",
        spec.n_windows, spec.seqlen, spec.dataset, spec.split, spec.seed,
        f", with a key/value sample of {spec.sample_tokens} tokens" if spec.sample_tokens else "",
    )
    stats = collect_stats(model, calibration_windows(tokenizer, spec), spec.sample_tokens, spec.seed)
    seconds = time.perf_counter() - t0
    tmp = unique_tmp(path)  # per process: two writers never share a temporary file
    # the Fisher information is cached apart (kvbench/fit/fisher.py): a file holds the moments and sample only,
    # the fields every version of LayerStats reads
    torch.save([{k: v for k, v in s.__dict__.items() if k not in ('k_fisher', 'v_fisher')} for s in stats], tmp)
    tmp.replace(path)
    return stats, seconds, False
