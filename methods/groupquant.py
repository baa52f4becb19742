"""Asymmetric min-max group quantizer, KIVI form (docs/methods.md §1.1; KIVI ``quant/new_pack.py``).

For every group of ``G`` consecutive elements along one axis:

    mn = min x,   s = max((max x - mn) / (2^b - 1), 1e-8),
    q  = clamp(round_half_even((x - mn) / s), 0, 2^b - 1),   x_hat = q * s + mn.

``s`` and ``mn`` are stored as fp16 (32 bits per group); the zero point is the float minimum, not
rounded to an integer. The codes are packed ``b`` bits each with :func:`methods.packing.pack_bits`
(``G * b / 8`` bytes per group), so :meth:`GroupPacked.bits` is the size of what is stored.

Grouping along tokens gives KIVI's per-channel key quantizer (groups of G tokens of one channel);
grouping along channels gives its per-token value quantizer (groups of G channels of one token).

Decisions where docs/methods.md is silent:

* **What is stored is what is used.** ``s`` and ``mn`` are rounded to fp16 first and both the codes
  and the reconstruction use the rounded values, so the codes are the nearest points of the grid
  that dequantization actually produces (KIVI computes them in fp16 arithmetic, to the same
  effect).
* The guard ``s >= 1e-8``: 1e-8 is below the smallest fp16 subnormal (2^-24 ~ 6e-8) and would
  round to 0, so the stored scale is floored at 2^-24 (which is all the guard does). A constant
  group then reconstructs as ``mn`` (fp16-rounded) and nothing divides by zero.
* Arithmetic in float32 (inputs in bf16/fp16 are upcast); the reconstruction is cast back to the
  input dtype. Values beyond the fp16 range (|x| > 65504) are not supported (fp16 metadata).
* The quantized axis length must be a multiple of ``G`` (callers quantize complete groups only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import work_dtype
from .packing import pack_bits, unpack_bits

FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal)


@dataclass
class GroupPacked:
    """Packed codes [..., n/G, G*b/8] (uint8) with fp16 scale and minimum [..., n/G].

    ``...`` are the input's axes other than ``axis`` in their original order; ``shape`` and
    ``dtype`` are those of the quantized tensor (to rebuild it)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    nbits: int
    group: int
    axis: int
    shape: tuple
    dtype: torch.dtype

    def bits(self) -> int:
        """Stored bits, measured from the tensors: codes + scales + minima."""
        return 8 * sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))


def _grouped(x: torch.Tensor, group: int, axis: int) -> torch.Tensor:
    xm = x.movedim(axis, -1)
    n = xm.shape[-1]
    if group < 1 or n % group:
        raise ValueError(f"axis length {n} is not a multiple of the group size {group}")
    return xm.reshape(*xm.shape[:-1], n // group, group)


def fp16_params(xg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, minimum) of groups along the last axis of float32 ``xg``.

    The guard ``s >= 1e-8`` is the fp16 floor alone: 1e-8 rounds to fp16 0, so clamping at 1e-8
    before the cast and at 2^-24 after it gives what the cast and the 2^-24 floor give (one op
    fewer per call)."""
    return fp16_scale_min(xg, float((1 << bits) - 1))


def fp16_scale_min(xg: torch.Tensor, levels) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, minimum) of groups along the last axis of ``xg`` for ``levels`` = 2^b - 1 (a
    number, or a tensor broadcasting against the groups: SVDq's per-channel widths)."""
    mn, mx = torch.aminmax(xg, dim=-1)
    return ((mx - mn) / levels).half().clamp_min(FP16_TINY), mn.half()


def _codes(xg: torch.Tensor, bits: int):
    """(fp16 scale, fp16 minimum, their working-dtype copies, float codes) of groups ``xg``."""
    s16, mn16 = fp16_params(xg, bits)
    scale, low = s16.to(xg.dtype)[..., None], mn16.to(xg.dtype)[..., None]
    q = ((xg - low) / scale).round().clamp(0, (1 << bits) - 1)
    return s16, mn16, scale, low, q


def quantize_groups(x: torch.Tensor, bits: int, group: int, axis: int = -1) -> GroupPacked:
    """Quantize ``x`` in groups of ``group`` consecutive elements along ``axis``."""
    return quantize_dequantize_groups(x, bits, group, axis, decode=False)[0]


def quantize_dequantize_groups(
    x: torch.Tensor, bits: int, group: int, axis: int = -1, *, decode: bool = True
) -> tuple[GroupPacked, torch.Tensor | None]:
    """(:func:`quantize_groups` of ``x``, its reconstruction): the reconstruction is computed from
    the codes before they are packed, so it equals ``dequantize_groups`` of the pack bit for bit
    without unpacking it (what the layer states store and then read)."""
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    axis = axis % x.ndim
    xg = _grouped(x, group, axis).to(work_dtype(x))
    s16, mn16, scale, low, q = _codes(xg, bits)
    gp = GroupPacked(pack_bits(q.to(torch.uint8), bits), s16, mn16, bits, group, axis, tuple(x.shape), x.dtype)
    if not decode:
        return gp, None
    return gp, _ungrouped(q * scale + low, axis).to(x.dtype)


def group_codes(gp: GroupPacked) -> torch.Tensor:
    """The unpacked integer codes [..., n/G, G] (int64)."""
    return unpack_bits(gp.codes, gp.nbits, gp.group)


def _ungrouped(xg: torch.Tensor, axis: int) -> torch.Tensor:
    """Inverse of :func:`_grouped`: [..., n/G, G] back to the input's layout (a view)."""
    return xg.reshape(*xg.shape[:-2], -1).movedim(-1, axis)


def dequantize_groups(gp: GroupPacked) -> torch.Tensor:
    """x_hat = q * s + mn with the stored fp16 s and mn, in the original shape and dtype."""
    dt = torch.float64 if gp.dtype == torch.float64 else torch.float32
    q = unpack_bits(gp.codes, gp.nbits, gp.group, dtype=torch.uint8).to(dt)
    xg = q * gp.scale.to(dt)[..., None] + gp.minimum.to(dt)[..., None]
    return _ungrouped(xg, gp.axis).to(gp.dtype)


def fake_quantize_groups(x: torch.Tensor, bits: int, group: int, axis: int = -1) -> torch.Tensor:
    """Quantize then dequantize (the value attention reads)."""
    return quantize_dequantize_groups(x, bits, group, axis)[1]

