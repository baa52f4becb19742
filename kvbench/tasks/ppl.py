"""Perplexity, GPTQ/KVQuant convention (METHODS.md §9.1).

Non-overlapping windows of ``seqlen`` tokens, no per-window BOS, PPL = exp(ΣNLL / #predicted).

* Track A (Q-all): one teacher-forced pass per window through the compressed model; every token
  of the window is predicted but the first.
* Track B (compressed context): the first ``context`` tokens of each window are prefilled exactly
  and compressed, the remaining ``seqlen - context`` are scored through the compressed cache with
  decode semantics; NLL on those targets only. The only track where SnapKV applies.

Returns per-dataset PPL plus the arithmetic and geometric means over the datasets evaluated; the
measured bpd of each window is in ``lm.readings`` (METHODS.md §0 v2: track A pools every query
position of every window, track B the scored positions).
"""

from __future__ import annotations

import logging
import math

import torch
from tqdm.auto import tqdm

from .compressed_lm import CompressedLM
from .data.windows import ppl_windows

log = logging.getLogger(__name__)


def window_nll(lm: CompressedLM, window: torch.Tensor, track: str, context: int) -> tuple[float, int]:
    ids = window[None]
    if track == "A":
        logits = lm.logits(ids)[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).to(logits.device),
            reduction="sum",
        )
        return float(nll), ids.shape[1] - 1
    if track == "B":
        if not 0 < context < ids.shape[1]:
            raise ValueError(f"track B context={context} must lie inside the window ({ids.shape[1]})")
        logprobs = lm.score(ids[:, :context], ids[:, context:])
        return float(-logprobs.sum()), ids.shape[1] - context
    raise ValueError(f"unknown perplexity track {track!r}; valid choices: A, B")


def evaluate_ppl(
    lm: CompressedLM,
    datasets: list[str],
    seqlen: int = 2048,
    limit: int | None = None,
    track: str = "A",
    context: int = 1536,
    data_dirs: dict | None = None,
) -> dict:
    data_dirs = data_dirs or {}
    ppl, counts = {}, {}
    for name in datasets:
        windows = ppl_windows(lm.tokenizer, name, seqlen, limit, data_dirs.get(name))
        total, n = 0.0, 0
        for window in tqdm(windows, desc=f"ppl {name} (track {track})", unit="window"):
            nll, count = window_nll(lm, window, track, context)
            total, n = total + nll, n + count
        ppl[name] = math.exp(total / n)
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
