"""The perplexity loop, written once: evaluation (:mod:`kvbench.tasks.ppl`) and every held-out
search of :mod:`kvbench.fit` score windows through it, so a held-out perplexity and a reported one
are the same computation (GPTQ/KVQuant convention, docs/methods.md §9.1).

* Track A (Q-all): one teacher-forced pass per window through the compressed model; every token
  of the window is predicted but the first.
* Track B (compressed context): the first ``context`` tokens of each window are prefilled exactly
  and compressed, the remaining ones are scored through the compressed cache with decode
  semantics; NLL on those targets only.

PPL = exp(ΣNLL / #predicted) over all the windows given, summed in window order.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .compressed_lm import CompressedLM

TRACKS = ("A", "B")


def window_nll(lm: CompressedLM, window: torch.Tensor, track: str, context: int | None) -> tuple[float, int]:
    """(summed NLL, predicted tokens) of one window [T]."""
    return batch_nll(lm, [window], track, context)[0]


def batch_nll(lm: CompressedLM, windows: list, track: str, context: int | None) -> list[tuple[float, int]]:
    """(summed NLL, predicted tokens) of each of equal-length windows [T], scored in one batch."""
    ids = torch.stack(list(windows))
    if track == "A":
        logits = lm.logits(ids)[:, :-1].float()
        targets = ids[:, 1:].to(logits.device)
        out = []
        for i in range(ids.shape[0]):
            nll = torch.nn.functional.cross_entropy(logits[i], targets[i], reduction="sum")
            out.append((float(nll), ids.shape[1] - 1))
        return out
    if track == "B":
        if context is None or not 0 < context < ids.shape[1]:
            raise ValueError(f"track B context={context} must lie inside the window ({ids.shape[1]})")
        logprobs = lm.score_rows(list(ids[:, :context]), list(ids[:, context:]))
        return [(float(-lp.sum()), ids.shape[1] - context) for lp in logprobs]
    raise ValueError(f"unknown perplexity track {track!r}; valid choices: {', '.join(TRACKS)}")


def perplexity(lm: CompressedLM, windows, track: str = "A", context: int | None = None,
               each: Callable[[float, int], None] | None = None, batch_size: int = 1) -> float:
    """Perplexity of ``windows`` (an iterable of [T] token windows) through ``lm``, ``batch_size``
    windows per pass; ``each(nll, count)``, when given, sees every window's summed NLL and
    predicted tokens in window order as it is scored (the ``ppl`` task's live progress). The sum
    runs in window order whatever the batch, so a batch gives what its windows give one by one."""
    total, n, batch = 0.0, 0, []

    def flush():
        nonlocal total, n
        for nll, count in batch_nll(lm, batch, track, context):
            total, n = total + nll, n + count
            if each is not None:
                each(nll, count)
        batch.clear()

    for window in windows:
        batch.append(window)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return math.exp(total / n)
