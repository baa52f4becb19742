"""Held-out (selection) windows, docs/methods.md §1.2 "Separation".

Every free parameter the harness chooses (the K/V split, compose's budget share, cobra_plus's
switches, a method's knobs) is chosen on windows of the calibration spec's own split (a calibration corpus's train
split, checked when the spec is made) that overlap no calibration window: offsets drawn with
``seed + 7919`` and rejected when they overlap a calibration window or one another. Never an
evaluation set. ``n`` windows of the calibration length; the first k are the same for every n >= k,
so searches that read fewer windows read a prefix of the same ones.
"""

from __future__ import annotations

import torch

from ..data import windows as W
from .statistics import calibration_ids, calibration_starts

N_HELDOUT = 8
HELDOUT_SEED_OFFSET = 7919


def heldout_starts(n_tokens: int, spec, n: int = N_HELDOUT) -> list[int]:
    """Offsets, in the calibration split's tokens, of the ``n`` held-out windows of ``spec``: none
    overlaps a calibration window (:func:`kvbench.fit.statistics.calibration_starts`) or another."""
    avoid = calibration_starts(n_tokens, spec)
    return W.heldout_starts(n_tokens, n, spec.seqlen, spec.seed + HELDOUT_SEED_OFFSET, avoid)


def heldout(tokenizer, spec, n: int = N_HELDOUT) -> torch.Tensor:
    """[n, seqlen] held-out selection windows of the calibration corpus's train split."""
    ids = calibration_ids(tokenizer, spec)
    return W.windows_at(ids, heldout_starts(ids.numel(), spec, n), spec.seqlen)
