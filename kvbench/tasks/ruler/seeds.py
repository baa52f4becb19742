"""The random state each RULER generation starts from: lm-eval's own (``simple_evaluate``'s default
seeds, cwe's ``Random(42)``) or one derived from ``task.ruler.item_seed``; :mod:`.items` says which
items each gives."""

from __future__ import annotations

import hashlib
import importlib
import random


def _seed(item_seed: int, task: str, length: int) -> int:
    digest = hashlib.sha256(f"{item_seed}:{task}:{length}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def generation_seeds(item_seed: int | None, task: str, length: int) -> tuple[int, int]:
    """(Python, numpy) global seeds the generator of (task, length) starts from: lm-eval's
    ``simple_evaluate`` defaults for ``item_seed=None``, else the hash of (item_seed, task, length)."""
    if item_seed is None:
        from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

        return DEFAULT_RANDOM_SEED, DEFAULT_OTHER_SEED
    seed = _seed(item_seed, task, length)
    return seed, seed % 2**32


def cwe_rng(item_seed: int | None, seed: int) -> random.Random:
    """cwe's module-level RNG for one generation: lm-eval's ``Random(42)`` in its state after the
    module's import-time shuffle of ``WORDS`` (item_seed None), else ``Random(seed)``."""
    if item_seed is not None:
        return random.Random(seed)
    cwe = importlib.import_module("lm_eval.tasks.ruler.cwe_utils")
    rng = random.Random(42)
    rng.shuffle([None] * len(cwe.WORDS))  # a shuffle's draws depend on the length only
    return rng


def evaluator_seeds(item_seed: int | None) -> dict:
    """``simple_evaluate``'s seeds: its own defaults for lm-eval's items, else ``item_seed``."""
    if item_seed is None:
        return {}
    return {f"{k}_seed": int(item_seed) for k in ("random", "numpy_random", "torch_random", "fewshot_random")}
