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
    ids = window[None]
    if track == "A":
        logits = lm.logits(ids)[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).to(logits.device),
            reduction="sum",
        )
        return float(nll), ids.shape[1] - 1
    if track == "B":
        if context is None or not 0 < context < ids.shape[1]:
            raise ValueError(f"track B context={context} must lie inside the window ({ids.shape[1]})")
        logprobs = lm.score(ids[:, :context], ids[:, context:])
        return float(-logprobs.sum()), ids.shape[1] - context
    raise ValueError(f"unknown perplexity track {track!r}; valid choices: {', '.join(TRACKS)}")


def perplexity(lm: CompressedLM, windows, track: str = "A", context: int | None = None,
               each: Callable[[float, int], None] | None = None) -> float:
    """Perplexity of ``windows`` (an iterable of [T] token windows) through ``lm``; ``each(nll,
    count)``, when given, sees every window's summed NLL and predicted tokens as it is scored (the
    ``ppl`` task's live progress)."""
    total, n = 0.0, 0
    for window in windows:
        nll, count = window_nll(lm, window, track, context)
        total, n = total + nll, n + count
        if each is not None:
            each(nll, count)
    return math.exp(total / n)
