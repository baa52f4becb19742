"""Token windows for perplexity (docs/methods.md §9.1), calibration and selection (§1.2).

Evaluation windows come from a corpus's evaluation split (:func:`ppl_windows`: the ``test`` split,
c4's validation shard); calibration and held-out selection windows from the calibration corpus's
train split (:mod:`kvbench.fit.statistics`, :mod:`kvbench.fit.heldout`), the held-out ones overlapping
no calibration window (:func:`heldout_starts`)."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import torch

from .text import EVALUATION_SPLITS, c4_documents, corpus_text


def _token_cache() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")) / "tokens"


def encode(tokenizer, text: str, cache: bool = True) -> torch.Tensor:
    """Tokenize a whole corpus, without special tokens (GPTQ: no per-window BOS).

    Large corpora are cached on disk keyed by the tokenizer's vocabulary and the text's hash, so a
    sweep tokenizes each corpus once."""
    if not cache or len(text) < 100_000:
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    h = hashlib.sha256(text.encode("utf-8"))
    h.update(repr((type(tokenizer).__name__, len(tokenizer), tokenizer.name_or_path)).encode())
    path = _token_cache() / f"{h.hexdigest()[:24]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ids, tmp)
    tmp.replace(path)
    return ids


def nonoverlapping_windows(ids: torch.Tensor, seqlen: int, limit: int | None = None) -> torch.Tensor:
    """⌊numel/seqlen⌋ consecutive windows [n, seqlen]; ``limit`` keeps the first ones."""
    n = ids.numel() // seqlen
    if limit is not None:
        n = min(n, int(limit))
    if n == 0:
        raise ValueError(f"corpus of {ids.numel()} tokens is shorter than one window of {seqlen}")
    return ids[: n * seqlen].view(n, seqlen)


def random_starts(n_tokens: int, n: int, seqlen: int, seed: int) -> list[int]:
    """The offsets of :func:`random_windows` (GPTQ: ``random.seed(seed)``, ``randint`` each)."""
    if n_tokens <= seqlen:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for windows of {seqlen}")
    rng = random.Random(seed)
    return [rng.randint(0, n_tokens - seqlen - 1) for _ in range(n)]


def windows_at(ids: torch.Tensor, starts: list[int], seqlen: int) -> torch.Tensor:
    """[len(starts), seqlen]: the windows of ``ids`` starting at ``starts``."""
    return torch.stack([ids[s : s + seqlen] for s in starts])


def random_windows(ids: torch.Tensor, n: int, seqlen: int, seed: int) -> torch.Tensor:
    """GPTQ ``get_wikitext2`` calibration: ``n`` windows at random offsets, ``random.seed(seed)``."""
    return windows_at(ids, random_starts(ids.numel(), n, seqlen, seed), seqlen)


def heldout_starts(n_tokens: int, n: int, seqlen: int, seed: int, avoid: list[int]) -> list[int]:
    """Offsets of ``n`` windows of length ``seqlen`` drawn at random (``random.seed(seed)``) and
    rejected when they overlap one of the windows starting at ``avoid`` or one already drawn
    (docs/methods.md §1.2: selection windows overlap no calibration window). The first k offsets do not
    depend on ``n``."""
    if n_tokens <= seqlen:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for windows of {seqlen}")
    rng = random.Random(seed)
    starts: list[int] = []
    for _ in range(1000 * n):
        if len(starts) == n:
            break
        s = rng.randint(0, n_tokens - seqlen - 1)
        if all(abs(s - a) >= seqlen for a in avoid + starts):
            starts.append(s)
    if len(starts) < n:
        raise ValueError(f"corpus too short for {n} held-out windows of {seqlen} beside {len(avoid)} others")
    return starts


def heldout_windows(ids: torch.Tensor, n: int, seqlen: int, seed: int, avoid: list[int]) -> torch.Tensor:
    """The windows of :func:`heldout_starts` (held-out windows of the calibration corpus)."""
    return windows_at(ids, heldout_starts(ids.numel(), n, seqlen, seed, avoid), seqlen)


def c4_windows(tokenizer, seqlen: int, n: int = 256, seed: int = 0, data_dir=None) -> torch.Tensor:
    """GPTQ ``get_c4`` evaluation: ``n`` random documents longer than ``seqlen`` tokens, one random
    window each, ``random.seed(0)``."""
    docs = c4_documents(data_dir)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        doc = encode(tokenizer, docs[rng.randint(0, len(docs) - 1)])
        if doc.numel() <= seqlen:
            continue
        start = rng.randint(0, doc.numel() - seqlen - 1)
        out.append(doc[start : start + seqlen])
    return torch.stack(out)


def ppl_windows(tokenizer, name: str, seqlen: int, limit=None, data_dir=None) -> torch.Tensor:
    """Evaluation windows of ``name``: consecutive windows of its evaluation split, from the first
    token (c4: :func:`c4_windows`); ``limit`` keeps the first ones."""
    if name == "c4":
        return c4_windows(tokenizer, seqlen, n=min(256, limit or 256), data_dir=data_dir)
    text = corpus_text(name, EVALUATION_SPLITS.get(name, "test"), data_dir)
    return nonoverlapping_windows(encode(tokenizer, text), seqlen, limit)
