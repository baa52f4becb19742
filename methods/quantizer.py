"""The seed's per-channel quantizer primitives, defects fixed (docs/methods.md §1.1; seeds/000).

Names and semantics follow the seed's ``quantizer.py``: channels are the **last axis**, statistics
are taken over all other axes, and every function returns :class:`QuantizedTensor` with
``x_hat = (data - zero_point) * scale``. Inputs may be numpy arrays or torch tensors; outputs are
of the same kind (torch results stay on the input's device).

Defects of the seed and how they are fixed here:

1. **Symmetric levels.** The seed uses ``qmax = 2^(b-1) - 1`` and codes in ``[-qmax, qmax]``:
   2-bit gets only {-1, 0, 1} (3 of 4 levels), and since the scale is ``absmax / qmax`` a wider
   ``qmin = -2^(b-1)`` would never be reached either. [decision] ``levels="full"`` (default) is the
   mid-rise quantizer that uses all 2^b levels over [-absmax, absmax]:
   ``step = 2 absmax / 2^b``, ``code = clamp(floor(x / step) + 2^(b-1), 0, 2^b - 1)``,
   ``x_hat = (code - 2^(b-1) + 1/2) * step`` (the same reconstruction points as the fixed-step
   quantizer of §1.1). Max error ``absmax / 2^b`` instead of ``absmax / (2^b - 2)``; zero is not a
   level. ``levels="seed"`` keeps the seed's restricted mid-tread range for comparison.
   The zero point is then a constant implied by ``bits`` (``2^(b-1) - 1/2``, or ``2^(b-1)`` for the
   seed range) and is stored once as a 0-d float32.
2. **Asymmetric overflow.** The seed casts codes and the integer zero point
   ``round(qmin - min / scale)`` to int8: codes of an unsigned b-bit range reach 255 and the zero
   point of an all-positive (all-negative) channel is a large negative (positive) integer. Codes
   are stored as uint8 (0..2^b-1 for every b <= 8) and zero points as int32. [decision] The range
   guard is ``max(max - min, 1e-8, 1e-6 * absmax)`` (the seed has only the 1e-8 floor): it keeps
   ``|zero_point| <= (2^b - 1) * (10^6 + 1)`` < 2^31 for any finite input, so a constant channel
   (range 0) neither divides by zero nor overflows, and reconstructs to within ``scale / 2``.
3. **Precision.** Statistics, codes and the reconstruction are computed in float64; the scale is
   stored as float32 and the codes are computed from the stored (float32-rounded) scale, so what is
   stored is what is used. The seed dequantizes ``(q - zp) * scale`` in float32, which loses the low
   bits of large zero points; here that product is float64, then cast to float32 (the seed's
   output dtype).

``compression_ratio`` keeps the seed's byte count (codes one per byte, unpacked);
``compression_ratio_packed`` counts the codes at ``bits`` bits each (``ceil(n * bits / 8)`` bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

RANGE_GUARD = 1e-8
RELATIVE_GUARD = 1e-6


@dataclass
class QuantizedTensor:
    """Codes ``data`` (uint8, the input's shape), per-channel ``scale`` (float32 [C]),
    ``zero_point`` (int32 [C] asymmetric, 0-d float32 symmetric) and the bit width."""

    data: Any
    scale: Any
    zero_point: Any
    bits: int


def _to_torch(x) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        return x, False
    return torch.from_numpy(np.asarray(x)), True


def _out(t: torch.Tensor, as_numpy: bool):
    return t.cpu().numpy() if as_numpy else t


def _check_bits(bits: int, low: int = 1) -> None:
    if not (isinstance(bits, int) and low <= bits <= 8):
        raise ValueError(f"bits must be an integer in {low}..8, got {bits!r}")


def _channel_axes(x: torch.Tensor) -> tuple[int, ...]:
    if x.ndim == 0:
        raise ValueError("need at least one axis (the channel axis is the last)")
    return tuple(range(x.ndim - 1))


def quantize_per_channel_symmetric(x, bits: int, levels: str = "full") -> QuantizedTensor:
    """Zero-centred per-channel quantization with scale from the channel's absolute maximum."""
    if levels not in ("full", "seed"):
        raise ValueError(f"levels must be 'full' or 'seed', got {levels!r}")
    _check_bits(bits, 1 if levels == "full" else 2)
    xt, as_numpy = _to_torch(x)
    xd = xt.double()
    axes = _channel_axes(xd)
    absmax = xd.abs().amax(dim=axes) if axes else xd.abs()
    absmax = absmax.clamp_min(RANGE_GUARD)
    half = 1 << (bits - 1)
    if levels == "full":
        scale = (2.0 * absmax / (1 << bits)).float()
        code = torch.floor(xd / scale.double()) + half
        zp = half - 0.5
    else:
        qmax = half - 1
        scale = (absmax / qmax).float()
        code = torch.round(xd / scale.double()).clamp(-qmax, qmax) + half
        zp = float(half)
    data = code.clamp(0, (1 << bits) - 1).to(torch.uint8)
    zero = torch.tensor(zp, dtype=torch.float32, device=xt.device)
    return QuantizedTensor(_out(data, as_numpy), _out(scale, as_numpy), _out(zero, as_numpy), bits)


def quantize_per_channel_asymmetric(x, bits: int) -> QuantizedTensor:
    """Affine per-channel quantization to unsigned codes 0..2^b-1 with an integer zero point."""
    _check_bits(bits, 1)
    xt, as_numpy = _to_torch(x)
    xd = xt.double()
    axes = _channel_axes(xd)
    qmin, qmax = 0, (1 << bits) - 1
    mn = xd.amin(dim=axes) if axes else xd
    mx = xd.amax(dim=axes) if axes else xd
    absmax = torch.maximum(mn.abs(), mx.abs())
    rng = torch.maximum((mx - mn).clamp_min(RANGE_GUARD), RELATIVE_GUARD * absmax)
    scale = (rng / (qmax - qmin)).float()
    s = scale.double()
    zp = torch.round(qmin - mn / s)
    data = (torch.round(xd / s) + zp).clamp(qmin, qmax).to(torch.uint8)
    zp = zp.to(torch.int32)
    return QuantizedTensor(_out(data, as_numpy), _out(scale, as_numpy), _out(zp, as_numpy), bits)


def dequantize(qt: QuantizedTensor):
    """``(data - zero_point) * scale`` in float64, returned as float32 of the codes' kind."""
    data, as_numpy = _to_torch(qt.data)
    scale, _ = _to_torch(qt.scale)
    zp, _ = _to_torch(qt.zero_point)
    out = (data.double() - zp.double().to(data.device)) * scale.double().to(data.device)
    return _out(out.float(), as_numpy)


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return int(np.asarray(t).nbytes)


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else int(np.asarray(t).size)


def quantization_error(original, qt: QuantizedTensor) -> dict:
    """RMSE, max and mean absolute error of the reconstruction, and the compression ratio
    ``original bytes / (data + scale + zero_point bytes)`` (plus the bit-packed ratio)."""
    orig, _ = _to_torch(original)
    rec, _ = _to_torch(dequantize(qt))
    diff = orig.double() - rec.double().to(orig.device)
    meta = _nbytes(qt.scale) + _nbytes(qt.zero_point)
    packed = math.ceil(_numel(qt.data) * qt.bits / 8)
    n = diff.numel()
    return {
        "rmse": float(diff.pow(2).mean().sqrt()) if n else 0.0,
        "max_abs_error": float(diff.abs().max()) if n else 0.0,
        "mean_abs_error": float(diff.abs().mean()) if n else 0.0,
        "compression_ratio": _nbytes(original) / (_nbytes(qt.data) + meta),
        "compression_ratio_packed": _nbytes(original) / (packed + meta),
    }
