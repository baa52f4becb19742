"""Real bit packing, so that a cache's stored bytes are bytes (docs/methods.md §0: bpd is measured).

``pack_bits(codes, bits)`` packs the last axis of unsigned integer codes (each < 2**bits, 1 <= bits
<= 8) into a little-endian bit stream of ``ceil(n * bits / 8)`` bytes per row; ``unpack_bits``
inverts it given the row length ``n``. Vectorized over all leading axes.

Decisions where docs/methods.md is silent: the range check of the codes (each < 2**bits) costs two
device->host synchronizations per call on a GPU, on the hot path of every flush, while the package's quantizers clamp their codes into range by construction. It runs when a
caller asks (``check=True``) or when the environment sets ``KVBENCH_CHECK_CODES=1`` (debugging),
not by default.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

#: the default of ``pack_bits(check=None)``: ``KVBENCH_CHECK_CODES=1`` checks every call
CHECK_CODES = os.environ.get("KVBENCH_CHECK_CODES", "0") not in ("", "0")


def _check_bits(bits: int) -> None:
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


@lru_cache(maxsize=64)
def _shifts(step: int, end: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """arange(0, end, step) on ``device``, made once (a hot path would launch it per call)."""
    return torch.arange(0, end, step, dtype=dtype).to(device)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes per row of ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int, *, check: bool | None = None) -> torch.Tensor:
    """Codes [..., n] -> uint8 [..., ceil(n * bits / 8)]. ``check``: raise ``ValueError`` on a code
    outside [0, 2**bits) (None: :data:`CHECK_CODES`; out-of-range codes are otherwise undefined).

    For 1, 2 and 4 bits, 8/b codes fill one byte (code j at bit ``j * bits``). Otherwise every 8
    consecutive codes fill exactly ``bits`` bytes: they are OR-ed into one integer word whose bytes,
    least significant first, are the stream. Either way this is the little-endian bit stream of the
    module docstring, built with a few operations per code instead of one int64 per bit."""
    _check_bits(bits)
    if codes.dtype.is_floating_point:
        raise TypeError("pack_bits takes integer codes")
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if (CHECK_CODES if check is None else check) and codes.numel():
        lo, hi = torch.aminmax(codes)
        if int(lo) < 0 or int(hi) >= (1 << bits):
            raise ValueError(f"codes out of range for {bits} bits")
    if bits in (1, 2, 4):  # whole codes per byte: shift them in uint8 and add (no overlapping bits)
        k = 8 // bits
        c = codes.to(torch.uint8)
        if n % k:
            c = torch.nn.functional.pad(c, (0, (-n) % k))
        shifts = _shifts(bits, 8, torch.uint8, str(codes.device))
        return (c.reshape(*lead, -1, k) << shifts).sum(-1, dtype=torch.uint8)
    word_dtype = torch.int32 if bits <= 3 else torch.int64  # 8 codes of b bits: 8b <= 24 or <= 56
    c = codes.to(word_dtype)
    if n % 8:
        c = torch.nn.functional.pad(c, (0, (-n) % 8))
    c = c.reshape(*lead, -1, 8)
    # the 8 codes at bits 0, b, 2b, ... of one word (disjoint bits: the sum is the OR), then
    # its ``bits`` bytes, least significant first: a fixed handful of ops for any b
    word = (c << _shifts(bits, 8 * bits, word_dtype, str(codes.device))).sum(-1, dtype=word_dtype)
    out = ((word[..., None] >> _shifts(8, 8 * bits, word_dtype, str(codes.device))) & 255).to(torch.uint8)
    out = out.reshape(*lead, -1)
    nbytes = packed_nbytes(n, bits)
    return out if out.shape[-1] == nbytes else out[..., :nbytes].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: codes [..., n] (``dtype``: int64 by default; ``torch.uint8``
    saves memory traffic when the codes are only converted to floats afterwards)."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :n].to(dtype)
    lead = packed.shape[:-1]
    if bits in (1, 2, 4):  # whole codes per byte: shift the bytes themselves
        k = 8 // bits
        nbytes = packed_nbytes(n, bits)
        shifts = _shifts(bits, 8, torch.uint8, str(packed.device))
        codes = (packed[..., :nbytes, None] >> shifts) & ((1 << bits) - 1)
        codes = codes.reshape(*lead, nbytes * k)
        codes = codes if nbytes * k == n else codes[..., :n]
        return codes.to(dtype)
    groups = (n + 7) // 8  # 8 codes per ``bits`` bytes
    need = groups * bits
    if packed.shape[-1] >= need:
        p = packed[..., :need]
    else:  # the stream's last partial group was trimmed: restore its zero bytes
        p = torch.nn.functional.pad(packed, (0, need - packed.shape[-1]))
    word_dtype = torch.int32 if bits <= 3 else torch.int64
    p = p.reshape(*lead, groups, bits).to(word_dtype)
    word = (p << _shifts(8, 8 * bits, word_dtype, str(packed.device))).sum(-1, dtype=word_dtype)
    shifts = _shifts(bits, 8 * bits, word_dtype, str(packed.device))
    codes = ((word[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*lead, groups * 8)
    codes = codes if groups * 8 == n else codes[..., :n]
    return codes.to(dtype)
