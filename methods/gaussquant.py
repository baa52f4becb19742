"""Fixed-step symmetric uniform quantizer for Gaussian-like latents (METHODS.md §1.1).

With calibration RMS sigma and b bits: step = s*(b) * sigma,
``code = clamp(floor(c / step) + 2**(b-1), 0, 2**b - 1)``, ``c_hat = (code - 2**(b-1) + 1/2) * step``.
No metadata is stored: the steps are static per-model constants. ``s*(b)`` minimises the MSE of
this exact (mid-rise, clamped) quantizer on N(0, 1); it is computed here from closed-form Gaussian
partial moments and a golden-section search, and cached (b <= 5 reproduces Max 1960).

Bits may differ per coordinate (a vector ``b_j``); coordinates with ``b_j = 0`` are dropped
(decoded as 0). Codes of mixed widths are packed into one little-endian bit stream with
:func:`methods.packing.pack_bits` (1-bit symbols): row-major over the rows, each code LSB first,
so a row of widths ``b_j`` occupies exactly ``sum_j b_j`` bits and the only padding is the final
partial byte of the whole stream (< 8 bits per call).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .packing import pack_bits, unpack_bits

MAX_BITS = 8
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.special.erf(x / _SQRT2))


def _pdf(x: torch.Tensor) -> torch.Tensor:
    return _INV_SQRT_2PI * torch.exp(-0.5 * x * x)  # 0 at +-inf


def _xpdf(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x * _pdf(x), nan=0.0)  # 0 at +-inf


def _mse_at_steps(steps: torch.Tensor, bits: int) -> torch.Tensor:
    """E[(c - Q(c))^2] for c ~ N(0, 1) at each step of ``steps`` [S], exact from the partial moments
    of every cell [lo, hi): int x^2 phi = mass + lo phi(lo) - hi phi(hi), int x phi = phi(lo) - phi(hi)."""
    levels = 1 << bits
    k = torch.arange(levels, dtype=torch.float64) - (levels >> 1)
    lo, hi, y = k * steps[:, None], (k + 1) * steps[:, None], (k + 0.5) * steps[:, None]
    lo[:, 0], hi[:, -1] = -math.inf, math.inf
    mass = _cdf(hi) - _cdf(lo)
    x2 = mass + _xpdf(lo) - _xpdf(hi)
    x1 = _pdf(lo) - _pdf(hi)
    return (x2 - 2.0 * y * x1 + y * y * mass).sum(-1)


@lru_cache(maxsize=None)
def _solve(bits: int) -> tuple[float, float]:
    if not (isinstance(bits, int) and 1 <= bits <= 16):
        raise ValueError(f"bits must be an integer in 1..16, got {bits!r}")

    def mse(logs: list[float]) -> torch.Tensor:
        return _mse_at_steps(torch.exp(torch.tensor(logs, dtype=torch.float64)), bits)

    # bracket on a log grid, then golden section in log(step) (the MSE is unimodal there)
    grid = torch.linspace(math.log(1e-4), math.log(4.0), 401, dtype=torch.float64)
    i = int(torch.argmin(_mse_at_steps(torch.exp(grid), bits)))
    a, b = float(grid[max(i - 1, 0)]), float(grid[min(i + 1, grid.numel() - 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = mse([c, d]).tolist()
    while b - a > 1e-12:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = float(mse([c])[0])
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = float(mse([d])[0])
    step = math.exp(0.5 * (a + b))
    return step, float(mse([math.log(step)])[0])


def optimal_step(bits: int) -> float:
    """s*(b): the MSE-optimal step of the fixed-step quantizer for N(0, 1)."""
    return _solve(int(bits))[0]


def gaussian_mse(bits: int) -> float:
    """MSE / sigma^2 of the quantizer at its optimal step; b = 0 (dropped coordinate) gives 1."""
    return 1.0 if int(bits) == 0 else _solve(int(bits))[1]


def step_table(bits: torch.Tensor) -> torch.Tensor:
    """s*(b_j) elementwise for an integer tensor (1.0 where b_j = 0, never used)."""
    table = torch.tensor([1.0] + [optimal_step(b) for b in range(1, MAX_BITS + 1)], dtype=torch.float64)
    return table.to(bits.device)[bits.long()]


def quantize(c: torch.Tensor, step: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Integer codes (int64) of ``c`` [..., n]; ``step`` and ``bits`` broadcast over ``c``."""
    bits = torch.as_tensor(bits, device=c.device).long()
    half = torch.where(bits > 0, 1 << (bits - 1).clamp(min=0), torch.zeros_like(bits))
    top = ((1 << bits) - 1).to(c.dtype)
    code = torch.floor(c / step) + half.to(c.dtype)  # clamp in float: no int overflow on outliers
    return torch.minimum(code.clamp(min=0), top.expand_as(code)).long()


def dequantize(code: torch.Tensor, step: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Reconstruction ``(code - 2**(b-1) + 1/2) * step``; 0 where ``b = 0``."""
    bits = torch.as_tensor(bits, device=code.device).long()
    half = (1 << (bits - 1).clamp(min=0)).to(step.dtype)
    value = (code.to(step.dtype) - half + 0.5) * step
    return torch.where(bits > 0, value, torch.zeros_like(value))


# ---- mixed-width packing -------------------------------------------------------------------------

_BLOCK_BITS = 1 << 22  # bits per block: bounds the int64 temporaries of pack_bits/unpack_bits


@lru_cache(maxsize=256)
def _layout_for(widths: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.tensor(widths, dtype=torch.long)
    index = torch.repeat_interleave(torch.arange(w.numel()), w)
    pos = torch.arange(index.numel()) - (torch.cumsum(w, 0) - w)[index]
    return index.to(device), pos.to(device)


def _layout(widths: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a row of widths b_j: the code index and the bit position of every stream bit (cached;
    pass ``widths`` on the CPU to avoid a device sync)."""
    return _layout_for(tuple(widths.tolist()), str(device))


def _row_block(row_bits: int) -> int:
    rows = max(8, (_BLOCK_BITS // max(row_bits, 1)) // 8 * 8)
    return rows  # a multiple of 8, so every block ends on a byte boundary


def pack_codes(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` [M, n] (code j < 2**widths[j]) into one uint8 stream of ceil(M*sum(b)/8) bytes."""
    m = codes.shape[0]
    index, pos = _layout(widths, codes.device)
    row_bits = index.numel()
    if m == 0 or row_bits == 0:
        return torch.zeros(0, dtype=torch.uint8, device=codes.device)
    step = _row_block(row_bits)
    out = []
    for start in range(0, m, step):
        block = codes[start : start + step].long()
        stream = (block[:, index] >> pos) & 1
        out.append(pack_bits(stream.reshape(-1), 1))
    return torch.cat(out)


def unpack_codes(packed: torch.Tensor, widths: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes [m, n]."""
    n = widths.numel()
    index, pos = _layout(widths, packed.device)
    row_bits = index.numel()
    codes = torch.zeros(m, n, dtype=torch.int64, device=packed.device)
    if m == 0 or row_bits == 0:
        return codes
    step = _row_block(row_bits)
    for start in range(0, m, step):
        rows = min(step, m - start)
        byte0 = start * row_bits // 8  # exact: start is a multiple of 8
        nbytes = (rows * row_bits + 7) // 8
        stream = unpack_bits(packed[byte0 : byte0 + nbytes], 1, rows * row_bits).reshape(rows, row_bits)
        codes[start : start + rows].index_add_(1, index, stream << pos)
    return codes
