"""Real bit packing, so that a cache's stored bytes are bytes (METHODS.md §0: bpd is measured).

``pack_bits(codes, bits)`` packs the last axis of unsigned integer codes (each < 2**bits, 1 <= bits
<= 8) into a little-endian bit stream of ``ceil(n * bits / 8)`` bytes per row; ``unpack_bits``
inverts it given the row length ``n``. Vectorized over all leading axes.
"""

from __future__ import annotations

import torch


def _check_bits(bits: int) -> None:
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes per row of ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    _check_bits(bits)
    if codes.dtype.is_floating_point:
        raise TypeError("pack_bits takes integer codes")
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n = codes.shape[-1]
    codes = codes.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits} bits")
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes[..., None] >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    pad = (-stream.shape[-1]) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*stream.shape[:-1], -1, 8)
    weights = 1 << torch.arange(8, device=codes.device)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    _check_bits(bits)
    if bits == 8:
        return packed[..., :n].to(torch.int64)
    shifts8 = torch.arange(8, device=packed.device)
    stream = ((packed.to(torch.int64)[..., None] >> shifts8) & 1).reshape(*packed.shape[:-1], -1)
    stream = stream[..., : n * bits].reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device)
    return (stream * weights).sum(-1)
