"""Fixed-step symmetric uniform quantizer for Gaussian-like latents (docs/methods.md §1.1).

With calibration RMS sigma and b bits: step = s*(b) * sigma,
``code = clamp(floor(c / step) + 2**(b-1), 0, 2**b - 1)``, ``c_hat = (code - 2**(b-1) + 1/2) * step``.
No metadata is stored: the steps are static per-model constants. ``s*(b)`` minimises the MSE of
this exact (mid-rise, clamped) quantizer on N(0, 1); it is computed here from closed-form Gaussian
partial moments and a golden-section search, and cached (b <= 5 reproduces Max 1960).

Bits may differ per coordinate (a vector ``b_j``); coordinates with ``b_j = 0`` are dropped
(decoded as 0). Codes of mixed widths are packed into one little-endian bit stream
(:func:`pack_codes`, the layout of :func:`methods.packing.pack_bits` with per-code widths):
row-major over the rows, each code LSB first,
so a row of widths ``b_j`` occupies exactly ``sum_j b_j`` bits and the only padding is the final
partial byte of the whole stream (< 8 bits per call).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


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


# ---- calibrated step (§1.1b) --------------------------------------------------------------------

STEP_BRACKET = (0.25, 64.0)  # §1.1b: Delta / (s*(b) sigma) is searched in [0.25, 64]
GRID_PER_OCTAVE = 6  # log grid 1/6 octave apart over the bracket (49 points; 1.0 is one of them)
GOLDEN_TOL = 1e-3  # golden section stops when the bracket spans < 0.1 % in Delta


class _Groups:
    """Normalized samples of G groups (float32, flattened), their widths and Gaussian steps."""

    def __init__(self, samples, bits):
        self.x = [s.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous() for s in samples]
        if any(x.numel() == 0 for x in self.x):
            raise ValueError("calibrated_multipliers: every group needs at least one sample")
        self.bits = [int(b) for b in torch.as_tensor(bits).reshape(-1).tolist()]
        if len(self.bits) != len(self.x) or not all(1 <= b <= 16 for b in self.bits):
            raise ValueError(f"calibrated_multipliers: one width in 1..16 per group, got {bits!r}")
        self.unit = torch.tensor([optimal_step(b) for b in self.bits], dtype=torch.float64)
        longest = max(x.numel() for x in self.x)
        self._u, self._f = torch.empty(longest), torch.empty(longest)  # reused temporaries

    def mse(self, mult: torch.Tensor) -> torch.Tensor:
        """Per-group empirical MSE [G] (float64) at steps mult_g * s*(b_g), in the units of the
        normalized samples. In units of the step, u = x / step + 2^(b-1), the error is
        step * (u - clamp(floor(u), 0, 2^b - 1) - 1/2), exactly :func:`quantize` then
        :func:`dequantize`; computed in place, group by group, in float32."""
        step = mult.to(torch.float64) * self.unit
        out = torch.empty_like(step)
        for g, (x, b) in enumerate(zip(self.x, self.bits)):
            u, f = self._u[: x.numel()], self._f[: x.numel()]
            torch.mul(x, 1.0 / float(step[g]), out=u).add_(float(1 << (b - 1)))
            torch.floor(u, out=f).clamp_(0.0, float((1 << b) - 1))
            u.sub_(f).sub_(0.5).square_()
            out[g] = float(u.sum()) / x.numel()  # float32 cascade sum (10x faster than a float64 one)
        return out * step**2


def calibrated_multipliers(samples, bits) -> tuple[torch.Tensor, torch.Tensor]:
    """§1.1b: per group g, the multiplier m_g in [0.25, 64] minimizing the empirical MSE of the
    fixed-step quantizer with step m_g * s*(b_g) on that group's samples, which must already be
    divided by their sigma (so m = 1 is the Gaussian step of §1.1). Returns (m [G], MSE [G]),
    float64; the MSE is in the units of the normalized samples.

    ``samples``: a sequence of G tensors (any shape, flattened); ``bits``: G integer widths.
    The empirical MSE is not unimodal in the step (an outlier switches from clipped to granular),
    so a log grid 1/6 octave apart (49 points, m = 1 among them) is scanned first; golden section
    on log m then refines inside the two grid cells around the grid minimum, and the better of the
    grid minimum and the refined point is returned (never worse than m = 1 on these samples).
    Deterministic; one pass over all samples per trial step (about 1 ns per sample and step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~60 passes of small in-place ops: a second thread only adds spin-waits
    try:
        return _search(_Groups(samples, bits))
    finally:
        torch.set_num_threads(threads)


def _search(grp: _Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid + golden-section search of :func:`calibrated_multipliers`."""
    n_groups = len(grp.x)
    lo, hi = (math.log(v) for v in STEP_BRACKET)
    n_grid = round((hi - lo) / math.log(2.0) * GRID_PER_OCTAVE) + 1
    grid = torch.linspace(lo, hi, n_grid, dtype=torch.float64)
    table = torch.stack([grp.mse(torch.full((n_groups,), math.exp(float(v)), dtype=torch.float64)) for v in grid], 1)
    best = table.argmin(1)
    a = grid[(best - 1).clamp(min=0)]
    b = grid[(best + 1).clamp(max=n_grid - 1)]
    gr = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = grp.mse(c.exp()), grp.mse(d.exp())
    while float((b - a).max()) > GOLDEN_TOL:
        # golden section per group: keep [a, d] where f(c) < f(d), else [c, b]; one new probe
        left = fc < fd
        keep, f_keep = torch.where(left, c, d), torch.where(left, fc, fd)
        a, b = torch.where(left, a, c), torch.where(left, d, b)
        probe = torch.where(left, b - gr * (b - a), a + gr * (b - a))
        f_probe = grp.mse(probe.exp())
        c, fc = torch.where(left, probe, keep), torch.where(left, f_probe, f_keep)
        d, fd = torch.where(left, keep, probe), torch.where(left, f_keep, f_probe)
    mid = 0.5 * (a + b)
    f_mid = grp.mse(mid.exp())
    f_grid = table.gather(1, best[:, None])[:, 0]
    use_mid = f_mid < f_grid
    mult = torch.where(use_mid, mid, grid[best]).exp()
    return mult, torch.where(use_mid, f_mid, f_grid)


def quantize(c: torch.Tensor, step: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Integer codes (int64) of ``c`` [..., n]; ``step`` and ``bits`` broadcast over ``c``."""
    # One integer width needs no host->device tensor
    if isinstance(bits, int):
        code = torch.floor(c / step) + float(1 << (bits - 1) if bits > 0 else 0)
        return code.clamp(0, float((1 << bits) - 1)).long()
    bits = torch.as_tensor(bits, device=c.device).long()
    half = torch.where(bits > 0, 1 << (bits - 1).clamp(min=0), torch.zeros_like(bits))
    top = ((1 << bits) - 1).to(c.dtype)
    code = torch.floor(c / step) + half.to(c.dtype)  # clamp in float: no int overflow on outliers
    return torch.minimum(code.clamp(min=0), top.expand_as(code)).long()


def dequantize(code: torch.Tensor, step: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Reconstruction ``(code - 2**(b-1) + 1/2) * step``; 0 where ``b = 0``."""
    # One integer width needs no host->device tensor
    if isinstance(bits, int):
        value = (code.to(step.dtype) - float(1 << max(bits - 1, 0)) + 0.5) * step
        return value if bits > 0 else torch.zeros_like(value)
    bits = torch.as_tensor(bits, device=code.device).long()
    half = (1 << (bits - 1).clamp(min=0)).to(step.dtype)
    value = (code.to(step.dtype) - half + 0.5) * step
    return torch.where(bits > 0, value, torch.zeros_like(value))


# ---- mixed-width packing -------------------------------------------------------------------------

_BLOCK_BITS = 1 << 23  # stream bits per block: bounds the temporaries of pack_codes/unpack_codes


@lru_cache(maxsize=256)
def _layout_for(widths: tuple[int, ...], device: str):
    """The static layout of a row of widths b_j. ``g`` rows (g = 8 / gcd(sum b, 8)) end on a byte
    boundary; in such a super-row, code i starts at bit ``off_i`` = byte ``off_i >> 3``, shift
    ``off_i & 7``, and (b_i <= 8) spills at most into the next byte. Last: the common width when
    every b_j is the same 1, 2, 4 or 8 (whole codes per byte: the fast path), else 0, and the
    shifts of one byte's codes for it (uint8)."""
    w = torch.tensor(widths, dtype=torch.long)
    row_bits = int(w.sum())
    g = 8 // math.gcd(row_bits, 8) if row_bits else 1
    wg = w.repeat(g)
    off = torch.cumsum(wg, 0) - wg
    dev = torch.device(device)
    row_bytes = g * row_bits // 8
    byte = (off >> 3).clamp(max=max(row_bytes - 1, 0))  # a 0-bit code at a row's end adds nothing
    same = widths[0] if widths and all(b == widths[0] for b in widths) and widths[0] in (1, 2, 4, 8) else 0
    shifts = torch.arange(0, 8, max(same, 1), dtype=torch.uint8).to(dev)
    return (g, row_bits, row_bytes, byte.to(dev),
            (off & 7).to(dev, torch.int32), ((1 << wg) - 1).to(dev, torch.int32), same, shifts)


def _layout(widths, device):
    """Cached :func:`_layout_for`; ``widths`` a tuple, or a CPU tensor (on a device it would sync)."""
    return _layout_for(_key(widths), str(device))


def _key(widths) -> tuple[int, ...]:
    return widths if isinstance(widths, tuple) else tuple(widths.tolist())


@lru_cache(maxsize=256)
def _bit_sources(widths: tuple[int, ...], rows: int, device: str):
    """Where each bit of the stream of ``rows`` rows comes from: for stream bit p (padded with
    zeros to whole bytes), the code ``src[p]`` of the rows' flattened codes and its bit
    ``bit[p]``; a padding bit reads a bit that is 0 in every in-range code (bit b_i of a code of
    b_i < 8 bits). Also the position ``p & 7`` of each bit in its byte (uint8 [p] each)."""
    w = torch.tensor(widths, dtype=torch.long).repeat(rows)
    total = int(w.sum())
    src = torch.repeat_interleave(torch.arange(w.numel()), w)
    bit = torch.arange(total) - (torch.cumsum(w, 0) - w)[src]
    pad = -total % 8
    if pad:  # some code has b_i < 8 (else total would be a multiple of 8)
        i = int(torch.nonzero(w < 8)[0, 0])
        src = torch.cat([src, torch.full((pad,), i)])
        bit = torch.cat([bit, torch.full((pad,), int(w[i]))])
    dev = torch.device(device)
    pos = torch.arange(total + pad, dtype=torch.uint8) & 7
    return src.to(dev), bit.to(dev, torch.uint8), pos.to(dev)


def prepare_layout(widths, device) -> None:
    """Build (and cache) every layout :func:`pack_codes` may use for ``widths`` on ``device``:
    the super-row's and those of 1..g-1 trailing rows (a decode step packs one row). Done by a
    codec when it prepares its parameters, so that the hot path never builds one (their
    construction syncs and costs a dozen ops)."""
    key = _key(widths)
    g, row_bits, *_ = _layout_for(key, str(device))
    for rows in range(1, g + 1):
        if row_bits:
            _bit_sources(key, rows, str(device))


def _block_rows(g: int, row_bits: int) -> int:
    return max(1, _BLOCK_BITS // max(g * row_bits, 1))  # super-rows per block


def _pack_rows(c: torch.Tensor, widths: tuple[int, ...], rows: int) -> torch.Tensor:
    """Rows of ``rows`` consecutive code rows each, c [M', rows * n] (uint8), to their streams
    [M', ceil(rows * sum(b) / 8)]: stream bit p is bit ``bit[p]`` of code ``src[p]``
    (:func:`_bit_sources`), gathered, isolated, moved to its place in the byte and summed."""
    src, bit, pos = _bit_sources(widths, rows, str(c.device))
    b = (torch.gather(c, 1, src.expand(c.shape[0], -1)) >> bit) & 1
    return (b << pos).reshape(c.shape[0], -1, 8).sum(-1, dtype=torch.uint8)


def pack_codes(codes: torch.Tensor, widths) -> torch.Tensor:
    """Pack ``codes`` [M, n] (code j < 2**widths[j]) into one uint8 stream of ceil(M*sum(b)/8) bytes.

    ``codes``: integers, or floats holding exact integers (a quantizer's codes before their cast);
    ``widths``: [n] on the CPU, or a tuple. Every g rows (g = 8 / gcd(sum b, 8)) end on a byte
    boundary; per such super-row (and once for the last M mod g rows), each stream bit is gathered
    from its code (:func:`_pack_rows`: 6 ops in all, independent of the widths). One width for
    every code, 1, 2, 4 or 8 bits: 8/b whole codes per byte, shifted and summed (3 ops; the same
    stream)."""
    m, n = codes.shape
    key = _key(widths)
    g, row_bits, row_bytes, _, _, _, same, shifts = _layout_for(key, str(codes.device))
    if m == 0 or row_bits == 0:
        return torch.zeros(0, dtype=torch.uint8, device=codes.device)
    if same:
        flat = codes.reshape(-1)
        k = 8 // same
        if flat.numel() % k:
            flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % k))
        flat = flat.to(torch.uint8)
        return flat if k == 1 else (flat.reshape(-1, k) << shifts).sum(-1, dtype=torch.uint8)
    c = codes.to(torch.uint8)
    full, tail = m - m % g, m % g
    parts = []
    step = _block_rows(g, row_bits) * g
    for start in range(0, full, step):
        stop = min(start + step, full)
        parts.append(_pack_rows(c[start:stop].reshape(-1, g * n), key, g).reshape(-1))
    if tail:
        parts.append(_pack_rows(c[full:].reshape(1, tail * n), key, tail).reshape(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def unpack_codes(packed: torch.Tensor, widths, m: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: codes [m, n] (each read from the <= 2 bytes it spans), int64
    or ``dtype`` (a float dtype when the codes only feed arithmetic)."""
    n = len(widths) if isinstance(widths, tuple) else widths.numel()
    g, row_bits, row_bytes, byte, shift, mask, same, shifts = _layout(widths, packed.device)
    if m == 0 or row_bits == 0:
        return torch.zeros(m, n, dtype=dtype, device=packed.device)
    if same:
        k = 8 // same
        codes = packed if k == 1 else ((packed[:, None] >> shifts) & ((1 << same) - 1)).reshape(-1)
        return codes[: m * n].reshape(m, n).to(dtype)
    sup = -(-m // g)
    data = packed[: sup * row_bytes]
    if data.numel() < sup * row_bytes:  # the last super-row is partial
        data = torch.nn.functional.pad(data, (0, sup * row_bytes - data.numel()))
    data = torch.nn.functional.pad(data.reshape(sup, row_bytes), (0, 1))
    out = torch.empty(sup, g * n, dtype=dtype, device=packed.device)
    step = _block_rows(g, row_bits)
    for start in range(0, sup, step):
        d = data[start : start + step].to(torch.int32)
        pairs = d[:, :-1] | (d[:, 1:] << 8)  # the 16-bit word at every byte of the row
        word = torch.gather(pairs, 1, byte.expand(d.shape[0], -1))  # gather: index_select is slow for ints
        out[start : start + step] = (word >> shift) & mask
    return out.reshape(-1, n)[:m]


def rows_per_byte_boundary(widths: tuple[int, ...]) -> int:
    """g: the fewest rows of ``widths`` that end on a byte boundary (8 / gcd(sum b, 8))."""
    return _layout_for(_key(widths), "cpu")[0]


def unpack_calls(data: torch.Tensor, widths: tuple[int, ...], rows: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Codes [S * rows, n] of S stored calls ``data`` [S, bytes], each the :func:`pack_codes` stream
    of ``rows`` rows: each call padded to whole super-rows (rows that end on a byte boundary),
    then one stream (no padding when the rows fill whole bytes)."""
    calls, n = data.shape[0], len(widths)
    g, _, row_bytes, *_ = _layout(widths, data.device)
    sup = -(-rows // g)
    if data.shape[1] < sup * row_bytes:
        data = torch.nn.functional.pad(data, (0, sup * row_bytes - data.shape[1]))
    codes = unpack_codes(data.reshape(-1), widths, calls * sup * g, dtype)
    return codes if sup * g == rows else codes.reshape(calls, sup * g, n)[:, :rows].reshape(calls * rows, n)
