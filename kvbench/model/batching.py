"""Ragged batches: how rows of different lengths share one forward pass (docs/design.md §2.1).

A batch is B token rows padded to one length T. Each row's tokens fill a contiguous span of
columns, ``valid(i)``: the last ``n_i`` columns under left padding (prompts, whose last position
must predict the next token in column T - 1), the first ``n_i`` under right padding (the
teacher-forced passes of lm-eval, which pads on the right). The token ids of the padding are
``pad_id`` and mean nothing.

With a method attached, the harness never lets a padded column reach a method:
:class:`kvbench.model.integrate.Compressor` hands each row's valid span to that row's own layer
states, so a row's quantization groups, scales, statistics, scores, evictions and bits are those of
the sequence alone. The plain model sees the padded batch with a 2-D attention mask (or, for a
right-padded pass from position 0, causality alone, as lm-eval runs it). Positions are given per
row, counted from the row's first real token, so RoPE never sees the padding either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SIDES = ("left", "right")
#: the largest batch ``task.batch_size=auto`` tries
MAX_AUTO = 64


@dataclass
class Padded:
    """``ids`` [B, T] and, per row, its real tokens ``lengths[i]`` on the ``side`` opposite the
    padding."""

    ids: torch.Tensor
    lengths: list[int]
    side: str = "left"

    def __post_init__(self):
        if self.side not in SIDES:
            raise ValueError(f"padding side {self.side!r}; valid choices: {', '.join(SIDES)}")
        if len(self.lengths) != self.ids.shape[0] or any(not 0 <= n <= self.width for n in self.lengths):
            raise ValueError(f"lengths {self.lengths} do not fit ids of shape {tuple(self.ids.shape)}")

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def ragged(self) -> bool:
        return any(n != self.width for n in self.lengths)

    def valid(self, i: int) -> slice:
        """The columns of row ``i``'s real tokens."""
        n = self.lengths[i]
        return slice(self.width - n, self.width) if self.side == "left" else slice(0, n)

    def mask(self) -> torch.Tensor:
        """[B, T] bool, True on real tokens."""
        cols = torch.arange(self.width, device=self.ids.device)[None]
        n = torch.tensor(self.lengths, device=self.ids.device)[:, None]
        return cols >= self.width - n if self.side == "left" else cols < n

    def positions(self, starts: list[int] | None = None) -> torch.Tensor:
        """[B, T] positions: ``starts[i]`` (default 0) at row ``i``'s first real token, counting up;
        padding columns repeat the nearest real position (any valid position: nothing reads them)."""
        starts = starts or [0] * len(self.lengths)
        cols = torch.arange(self.width, device=self.ids.device)[None]
        first = torch.tensor([self.valid(i).start for i in range(len(self.lengths))], device=self.ids.device)
        base = torch.tensor(starts, device=self.ids.device)[:, None]
        return base + (cols - first[:, None]).clamp(min=0)


def pad(rows, side: str = "left", pad_id: int = 0, device=None) -> Padded:
    """Pad token rows (lists or 1-D tensors) to their longest length."""
    rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]
    if not rows:
        raise ValueError("pad() needs at least one row")
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    for i, r in enumerate(rows):
        if side == "left":
            ids[i, width - r.numel():] = r
        else:
            ids[i, : r.numel()] = r
    return Padded(ids.to(device) if device is not None else ids, [r.numel() for r in rows], side)


def chunks(order: list[int], size: int) -> list[list[int]]:
    """``order`` cut into consecutive batches of at most ``size`` indices."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [order[i:i + size] for i in range(0, len(order), size)]


def longest_first(lengths: list[int]) -> list[int]:
    """Indices sorted by decreasing length, ties in their original order (lm-eval's order: the
    first batch is the largest, so an out-of-memory error comes at once, and rows of similar
    length share a batch)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def largest_fitting(probe: Callable[[int], None], cap: int = MAX_AUTO) -> int:
    """The largest batch ``n <= cap`` (halving from ``cap``) for which ``probe(n)`` runs without a
    CUDA out-of-memory error."""
    n = max(1, cap)
    while True:
        try:
            probe(n)
            return n
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if n == 1:
                raise
            n //= 2
