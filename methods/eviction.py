"""Token eviction: what H2O (docs/methods.md §6) and SnapKV (§7) share.

An eviction cache holds whole tokens, K and V alike, at 16 bits per element. Each method supplies
its score and its rules (which budget, when to select, which tokens are protected); the steps
after the score are written once here: keep the best-scored older tokens plus a recent window
(:func:`top_and_recent`), gather the kept K and V (:meth:`EvictionLayerState._gather`), and count
the stored bits from what is held (:meth:`EvictionLayerState.stored_bits`, plus the method's
per-token metadata, :meth:`EvictionLayerState.metadata_bits`).
"""

from __future__ import annotations

import torch

from .base import LayerState
from .sparsifier import top_k_latest


def top_and_recent(older: torch.Tensor, n_heavy: int, n_recent: int) -> torch.Tensor:
    """Kept indices [..., k + n_recent] of a sequence whose first ``older.shape[-1]`` tokens have
    the scores ``older`` [..., T_old] and whose last ``n_recent`` are kept whole: the ``n_heavy``
    best-scored older tokens (ascending; ties keep the later, :func:`top_k_latest`), then the
    recent ones."""
    heavy = top_k_latest(older, n_heavy)
    t = older.shape[-1]
    recent = torch.arange(t, t + n_recent, device=older.device).expand(*older.shape[:-1], n_recent)
    return torch.cat([heavy, recent], dim=-1)


class EvictionLayerState(LayerState):
    """A layer's held tokens: K, V [B, Hs, n, d] in ``self._k``/``self._v`` (None before the first
    call), ``self._seen`` tokens seen. Subclasses implement ``_prefill`` and ``_decode`` (both
    ``(q, k, v, scaling) -> output``), ``kept_positions``, and :meth:`metadata_bits` when they
    store more than the tokens."""

    #: the method's name, for messages
    label = "eviction"

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{self.label}: {q.shape[1]} query heads for {k.shape[1]} KV heads")
        if prefill:
            return self._prefill(q, k, v, scaling)
        return self._decode(q, k, v, scaling)

    def _gather(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold the tokens ``idx`` [B, Hs, C] of k, v [B, Hs, n, d]."""
        self._k = k.gather(2, idx[..., None].expand(*idx.shape, k.shape[-1]))
        self._v = v.gather(2, idx[..., None].expand(*idx.shape, v.shape[-1]))

    def metadata_bits(self) -> int:
        """Bits per side stored beside the tokens (scores, positions); none by default."""
        return 0

    def stored_bits(self):
        """16 bits per held element, keys and values separately, plus :meth:`metadata_bits` on
        each side."""
        if self._k is None:
            return 0, 0
        meta = self.metadata_bits()
        return self._k.numel() * 16 + meta, self._v.numel() * 16 + meta

    @property
    def n_seen(self):
        return self._seen

    @property
    def n_kept(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    # compose: a codec hands the eviction the decoded form of its tokens
    def kept_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stored K, V [B, Hs, n, d] of the held tokens, in ``kept_positions`` order: the
        tensors themselves (a codec may overwrite entries in place with their decoded form)."""
        return self._k, self._v

    def replace_kept_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the stored K, V by same-shaped tensors (the decoded form a codec stores them
        in, docs/methods.md §12); the kept set and its bookkeeping are unchanged."""
        if self._k is None or k.shape != self._k.shape or v.shape != self._v.shape:
            raise ValueError(f"{self.label}: replace_kept_kv needs tensors shaped like the kept cache")
        self._k, self._v = k, v
