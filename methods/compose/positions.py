"""Positions of held tokens under a pre-RoPE codec (docs/methods.md §12.3): their width, their
size and the packed form a composition stores.
"""

from __future__ import annotations

import torch

from ..packing import pack_bits, packed_nbytes, unpack_bits


def position_width(n_seen: int) -> int:
    """Bits of one stored position when ``n_seen`` tokens have been seen: positions
    0 .. n_seen - 1 take ⌈log₂ n_seen⌉ bits (at least 1)."""
    return max(1, (int(n_seen) - 1).bit_length())


def position_bits(n_kept: torch.Tensor, n_seen: torch.Tensor) -> torch.Tensor:
    """Bits per KV head :class:`KeptPositions` stores for ``n_kept`` held of ``n_seen`` seen tokens
    (float64, elementwise over tensors of counts): 0 when nothing is evicted, else 8 x the bytes of
    the cheaper encoding, fixed-width positions (``w // 8`` bytes each plus a packed stream of the
    ``w % 8`` high bits) or the packed kept mask (⌈n_seen / 8⌉ bytes)."""
    kept = torch.as_tensor(n_kept, dtype=torch.float64)
    seen = torch.as_tensor(n_seen, dtype=torch.float64)
    # ⌈log₂ seen⌉ = bit length of seen - 1, exactly from the binary exponent (frexp: x = m 2^e)
    width = torch.frexp(torch.clamp(seen - 1, min=0)).exponent.to(torch.float64).clamp(min=1)
    whole, rest = torch.div(width, 8, rounding_mode="floor"), torch.remainder(width, 8)
    as_positions = whole * kept + torch.ceil(kept * rest / 8)
    as_mask = torch.ceil(seen / 8)
    return torch.where(kept < seen, 8 * torch.minimum(as_positions, as_mask), torch.zeros_like(kept))


class KeptPositions:
    """The positions [B, H, C] of the held tokens (ascending per head, as both evictions hold
    them) as a pre-RoPE composition stores them: packed per KV head in the cheaper exact encoding
    (package docstring; :func:`position_bits` is its size), ``"none"`` when nothing is evicted.
    ``positions()`` decodes what is stored; ``bits()`` counts the packed bytes."""

    def __init__(self, pos: torch.Tensor, n_seen: int):
        b, h, c = pos.shape
        self.shape, self.n_seen, self.device = (b, h, c), int(n_seen), pos.device
        self.width = position_width(n_seen)
        whole, rest = divmod(self.width, 8)
        as_positions = whole * c + (packed_nbytes(c, rest) if rest else 0)
        as_mask = packed_nbytes(self.n_seen, 1)
        if c == self.n_seen:
            self.kind, self.streams = "none", []
        elif as_positions <= as_mask:
            self.kind = "positions"
            self.streams = [((pos >> (8 * j)) & 255).to(torch.uint8) for j in range(whole)]
            if rest:
                self.streams.append(pack_bits(pos >> (8 * whole), rest))
        else:
            self.kind = "mask"
            mask = torch.zeros(b, h, self.n_seen, dtype=torch.uint8, device=pos.device)
            self.streams = [pack_bits(mask.scatter_(-1, pos, 1), 1)]

    def positions(self) -> torch.Tensor:
        """The held positions [B, H, C] (int64), decoded from the stored streams."""
        b, h, c = self.shape
        if self.kind == "none":
            return torch.arange(c, device=self.device).expand(b, h, c)
        if self.kind == "mask":
            held = unpack_bits(self.streams[0], 1, self.n_seen, dtype=torch.uint8)
            # the c set bits of each head, ascending (a stable sort: no host synchronization)
            return held.sort(dim=-1, descending=True, stable=True).indices[..., :c].sort(dim=-1).values
        whole, rest = divmod(self.width, 8)
        out = torch.zeros(b, h, c, dtype=torch.int64, device=self.device)
        for j in range(whole):
            out |= self.streams[j].to(torch.int64) << (8 * j)
        if rest:
            out |= unpack_bits(self.streams[-1], rest, c) << (8 * whole)
        return out

    def bits(self) -> int:
        return 8 * sum(x.numel() for x in self.streams)
