"""How many items a task runs at a time: ``task.batch_size=N|auto`` (docs/design.md §2.1).

``null`` (the default) is ``auto`` on CUDA and 1 on a CPU. ``auto`` finds the largest batch that
fits the device, as lm-eval's ``auto`` does: it runs the task's largest item at a batch of
:data:`kvbench.model.batching.MAX_AUTO` rows, halving on an out-of-memory error until one fits; on a CPU, where memory
runs out by swapping rather than by an error, ``auto`` is 1. A batch gives what its rows give alone
(tests/test_batch_equality.py), so the batch size is not part of a job's identity; the result
records the batch each task used under ``batch_size``.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..model.batching import largest_fitting

log = logging.getLogger(__name__)

def batch_setting(job, lm) -> int | str:
    """``task.batch_size`` as an int >= 1 or ``"auto"`` (null: ``auto`` where ``lm`` runs on CUDA,
    1 elsewhere)."""
    value = job.task.get("batch_size") if job.task is not None else None
    if value is None:
        return "auto" if _device(lm).type == "cuda" else 1
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(n) != str(value).strip():
        raise ValueError(f"task.batch_size={value!r}; valid choices: a whole number >= 1, auto, null")
    return n


def resolve_batch_size(setting: int | str, lm, probe: Callable[[int], None], task: str) -> int:
    """``setting`` (:func:`batch_setting`) as a number: ``auto`` runs ``probe(n)``, the task's
    largest item at a batch of ``n`` (its readings are dropped), on CUDA, and is 1 elsewhere."""
    if setting != "auto":
        return int(setting)
    if _device(lm).type != "cuda":
        return 1
    start = len(lm.readings)

    def quiet_probe(b: int) -> None:
        try:
            probe(b)
        finally:
            del lm.readings[start:]

    n = largest_fitting(quiet_probe)
    log.info("%s: batch size auto -> %d", task, n)
    return n


def task_batch_size(job, lm, task: str, result: dict, probe: Callable[[int], None]) -> int:
    """The batch ``task`` runs at, recorded in ``result["batch_size"][task]``."""
    n = resolve_batch_size(batch_setting(job, lm), lm, probe, task)
    result.setdefault("batch_size", {})[task] = n
    return n


def probe_ids(tokens: int, vocab: int) -> torch.Tensor:
    """A stand-in row of ``tokens`` ids (memory depends on the length, not on the ids)."""
    return torch.arange(tokens) % max(2, vocab)


def scoring_probe(lm, tokens: int, targets: int | None = None) -> Callable[[int], None]:
    """``probe(n)``: n rows of ``tokens`` scored in one pass (Q-all), or, with ``targets`` (track
    B; methods without a single-pass form), contexts of ``tokens - targets`` then the targets."""
    def probe(n: int) -> None:
        row = probe_ids(tokens, lm.model.config.vocab_size)
        if targets is None and lm.supports_in_pass:
            lm.logits(row[None].expand(n, tokens).contiguous())
        else:
            cut = tokens - (targets or 1)
            lm.score_rows([row[:cut]] * n, [row[cut:]] * n)

    return probe


def generation_probe(lm, tokens: int, new_tokens: int = 2) -> Callable[[int], None]:
    """``probe(n)``: n prompts of ``tokens`` prefilled, then ``new_tokens`` decoded."""
    return lambda n: lm.generate_rows([probe_ids(tokens, lm.model.config.vocab_size)] * n, new_tokens, ())


def generation_batch_size(job, lm, task: str, result: dict, prompt_tokens: int) -> int:
    """:func:`task_batch_size` of a generation task whose prompts have at most ``prompt_tokens``."""
    return task_batch_size(job, lm, task, result, generation_probe(lm, prompt_tokens))


def _device(lm) -> torch.device:
    """Where ``lm`` runs (a test's stand-in without a model: the CPU)."""
    return getattr(lm, "device", None) or torch.device("cpu")
