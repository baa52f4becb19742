"""What a composed state reads from its eviction state, through the eviction's public methods
only: the held positions, bits per held token, the tokens each query read; and the gathers and
rotation that place codec tokens at those positions.
"""

from __future__ import annotations

import torch

from ..base import LayerState, rotate_half
from ..eviction import EvictionLayerState


def kept_positions(ev: LayerState) -> torch.Tensor:
    """Positions [B, H, C] of the tokens an eviction state holds, in its stored order."""
    if isinstance(ev, EvictionLayerState):
        return ev.kept_positions()
    raise TypeError(f"compose: no kept positions for {type(ev).__name__}")


def eviction_token_bits(ev: LayerState) -> tuple[float, float]:
    """(K, V) bits per held token (all heads and batch) in the eviction's own accounting: 16 per
    element plus its state."""
    bk, bv = ev.stored_bits()
    return bk / ev.n_kept, bv / ev.n_kept


def state_token_bits(ev: LayerState) -> tuple[float, float]:
    """(K, V) state bits per held token: the eviction's bits beyond 16 per element."""
    k, _ = ev.kept_kv()
    per_k, per_v = eviction_token_bits(ev)
    elems = k.shape[0] * k.shape[1] * k.shape[3]
    return per_k - 16.0 * elems, per_v - 16.0 * elems


def read_counts(ev: LayerState) -> torch.Tensor:
    """Tokens each query of the last decode call read [T] (float64): the eviction's reads over its
    own bits per held token."""
    reads = ev.read_bits()
    return reads[0] / eviction_token_bits(ev)[0]


def gather_tokens(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d] at positions pos [B, H, C] -> [B, H, C, d]."""
    return x.gather(2, pos[..., None].expand(*pos.shape, x.shape[-1]))


def gather_rope(c: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """cos or sin [B, T, d] at per-head positions pos [B, H, C] -> [B, H, C, d]."""
    b, h = pos.shape[:2]
    return gather_tokens(c[:, None].expand(b, h, *c.shape[1:]), pos)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with cos/sin broadcastable to x [B, H, T, d] (``base.apply_rope``'s arithmetic)."""
    return (x * cos) + (rotate_half(x) * sin)


class ComposedState(LayerState):
    """What both composed states share: their eviction state ``evict`` owns the held tokens."""

    @property
    def n_seen(self):
        return self.evict.n_seen

    @property
    def n_kept(self) -> int:
        return self.evict.n_kept
