"""Perplexity, GPTQ/KVQuant convention (docs/methods.md §9.1): the ``ppl`` task.

Non-overlapping windows of ``seqlen`` tokens of each dataset's evaluation split, no per-window BOS,
PPL = exp(ΣNLL / #predicted), in track A (Q-all) or B (compressed context: the only track where
SnapKV applies); the loop is :mod:`kvbench.model.perplexity`, the one the held-out searches use.

Returns per-dataset PPL plus the arithmetic and geometric means over the datasets evaluated; the
measured bpd of each window is in ``lm.readings`` (track A pools every query position of every
window, track B the scored positions). While it runs, each window is a progress point of the
section ``ppl/<dataset>``: the running NLL (nats per token) and PPL over the windows so far, the
window's own PPL and the running measured bpd.
"""

from __future__ import annotations

import logging
import math

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from ..context import Progress, no_progress
from ..data.windows import ppl_windows
from ..model.compressed_lm import CompressedLM
from ..model.perplexity import perplexity
from .batch_size import scoring_probe, task_batch_size
from .registry import register_task, task_limit
from .reporting import RunningBpd, exp

log = logging.getLogger(__name__)


def evaluate_ppl(
    lm: CompressedLM,
    datasets: list[str],
    seqlen: int = 2048,
    limit: int | None = None,
    track: str = "A",
    context: int = 1536,
    data_dirs: dict | None = None,
    progress: Progress = no_progress,
    batch_size: int = 1,
) -> dict:
    """Per-dataset PPL of ``lm``; ``batch_size`` windows per pass (a batch gives what its windows
    give one by one)."""
    data_dirs = data_dirs or {}
    ppl, counts = {}, {}
    for name in datasets:
        windows = ppl_windows(lm.tokenizer, name, seqlen, limit, data_dirs.get(name))
        bar = tqdm(windows, desc=f"ppl {name} (track {track})", unit="window")
        ppl[name] = perplexity(lm, bar, track, context, each=window_progress(lm, f"ppl/{name}", progress),
                               batch_size=batch_size)
        counts[name] = len(windows)
        log.info("ppl %s = %.4f over %d windows of %d tokens", name, ppl[name], len(windows), seqlen)
    values = list(ppl.values())
    return {
        "ppl": {
            **ppl,
            "arith_mean": sum(values) / len(values),
            "geo_mean": math.exp(sum(math.log(v) for v in values) / len(values)),
        },
        "windows": counts,
    }


def window_progress(lm: CompressedLM, section: str, progress: Progress):
    """The perplexity loop's ``each``: one progress point of ``section`` per window."""
    if progress is no_progress:
        return None
    bpd, seen = RunningBpd(lm), {"windows": 0, "nll": 0.0, "tokens": 0}

    def each(nll: float, count: int) -> None:
        seen["windows"] += 1
        seen["nll"] += nll
        seen["tokens"] += count
        mean = seen["nll"] / seen["tokens"]
        progress(section, seen["windows"], nll=mean, ppl=exp(mean), window_ppl=exp(nll / count),
                 **bpd.values())

    return each


@register_task("ppl")
def run_ppl(job, lm: CompressedLM, result: dict, progress: Progress = no_progress) -> None:
    p = job.task.ppl
    probe = scoring_probe(lm, p.seqlen, p.seqlen - p.context if p.track == "B" else None)
    out = evaluate_ppl(
        lm, list(p.datasets), p.seqlen, task_limit(job, p), p.track, p.context,
        OmegaConf.to_container(p.data_dir, resolve=True) if p.get("data_dir") else {},
        progress, task_batch_size(job, lm, "ppl", result, probe),
    )
    result["metrics"]["ppl"] = out["ppl"]
    result["counts"]["ppl_windows"] = out["windows"]
    result["counts"]["ppl_track"] = p.track
