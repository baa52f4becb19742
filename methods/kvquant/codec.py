"""KVQuant's quantizers (Hooper et al., NeurIPS 2024, arXiv 2401.18079, §3.1-3.4; official
``quant_fn_nuq_recon``, ``get_outliers``, ``get_outliers_dynamic`` of SqueezeAILab/KVQuant
``quant/kvquant/simquant_module_quantizer.py``): the outlier thresholds, the nearest signpost of a
non-uniform table (LUT), and the key (static per channel, pre-RoPE) and value (dynamic per token)
codecs with their dense-and-sparse storage. Specification: docs/methods.md §14.3, §14.5."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import work_dtype
from ..bookkeeping import host_ops
from ..codec_state import Codec
from ..packing import pack_bits, unpack_bits

BITS = (1, 2, 3, 4, 5)  # §14.3: the code's 2..5 and the harness extension b = 1
QUANTILE_LIMIT = 1 << 24  # torch.quantile refuses larger inputs


def outlier_level(f: float) -> float:
    """t of §14.2 for an outlier fraction f: tau = 1 - f, t = 1 - (1 - tau)/2 (the code's formula
    from ``--sparsity-threshold`` tau; f = 0 gives t = 1, min-max)."""
    tau = 1.0 - f
    return 1 - ((1 - tau) / 2)


def quantiles(x: torch.Tensor, t: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper, lower) = the t and 1 - t quantiles of a 2-D ``x`` along ``dim`` (``torch.quantile``,
    linear interpolation, as ``np.percentile``; t = 1 is the max and min, which is what the
    quantile gives there), in slices along the other axis: torch refuses above 2^24 elements."""
    if t >= 1.0:
        return x.amax(dim), x.amin(dim)
    q = x.new_tensor([t, 1 - t])
    step = max(1, QUANTILE_LIMIT // max(1, x.shape[dim]))
    both = torch.cat([torch.quantile(c, q, dim=dim) for c in x.split(step, dim=1 - dim)], 1)
    return both[0], both[1]


def value_outlier_count(n: int, t: float) -> int:
    """Outliers of one value token of n distinct entries (§14.3): x >= quantile(t) marks
    n - ceil((n - 1) t), x <= quantile(1 - t) marks floor((n - 1)(1 - t)) + 1 (none for t = 1)."""
    if t >= 1.0:
        return 0
    return (n - math.ceil((n - 1) * t)) + (math.floor((n - 1) * (1 - t)) + 1)


def nearest_codes(z: torch.Tensor, lut: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``lut`` [k] for every element of ``z`` (int64):
    the nearer of the two entries that bracket z by |z - c| (the official
    ``round_to_nearest_pole_sim`` compares |z - c| over all entries: for sorted entries the
    minimum is at a bracket); a tie goes to the lower entry, the first in stored order. ``pairs``:
    :func:`bracket_pairs` of ``lut``, when the caller keeps it."""
    k = lut.numel()
    if pairs is None:
        pairs = bracket_pairs(lut)
    lo = (torch.searchsorted(lut, z.contiguous()) - 1).clamp_(0, k - 2)
    dist = (z.unsqueeze(-1) - pairs[lo]).abs()  # [..., 2]: |z - lut[lo]|, |z - lut[lo + 1]|
    return lo + (dist[..., 1] < dist[..., 0])


def bracket_pairs(lut: torch.Tensor) -> torch.Tensor:
    """[k - 1, 2] table of the sorted ``lut``'s neighbouring entries (lut[i], lut[i + 1]): one
    gather gives both entries that bracket z (a codec keeps it with its LUT)."""
    return torch.stack([lut[:-1], lut[1:]], -1)



def _vectors(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d] -> [B*T, H*d]: one row per token (batch-major), the layer's channels in
    ``k_proj``/``v_proj`` output order (head-major)."""
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b * t, h * d)


def _unvectors(rows: torch.Tensor, shape: tuple) -> torch.Tensor:
    b, h, t, d = shape
    return rows.reshape(b, t, h, d).permute(0, 2, 1, 3)


def _outlier_dtype(dtype: torch.dtype) -> torch.dtype:
    """16 bits per stored outlier: bf16 on a bf16 model, fp16 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


@dataclass
class KVQuantPacked:
    """One encode call of ``rows`` = B*T tokens (batch-major rows) of n channels.

    codes: uint8 [rows, ceil(n b / 8)] packed b-bit LUT indices (outlier slots included).
    meta: fp16 [rows, 2] per-token maximum and minimum (values), or None (keys).
    values, index: the outliers, row-major: 16-bit values [M] and int16 channel indices [M].
    pointer: int32 [rows] end of each row's outliers in ``values`` (CSR/CSC pointer), or None
    (no sparse part). token_bits: float64 CPU [T], the bits of each position summed over the batch.
    """

    codes: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    meta: torch.Tensor | None
    values: torch.Tensor | None
    index: torch.Tensor | None
    pointer: torch.Tensor | None
    token_bits: torch.Tensor

    def bits(self) -> int:
        """Stored bits, from the tensors."""
        parts = (self.codes, self.meta, self.values, self.index, self.pointer)
        return 8 * sum(p.numel() * p.element_size() for p in parts if p is not None)


class _NuqCodec(Codec):
    """Shared encode/decode of §14.3: nearest LUT entry of the normalized inliers, outliers kept."""

    def __init__(self, lut: torch.Tensor, bits: int, sparse: bool):
        if not (isinstance(bits, int) and bits in BITS):
            raise ValueError(f"kvquant: bits must be one of {BITS}, got {bits!r}")
        if lut.numel() != 2**bits:
            raise ValueError(f"kvquant: a {bits}-bit LUT has {2**bits} entries, got {lut.numel()}")
        self.lut = lut.half().sort().values
        self._pairs = bracket_pairs(self.lut)
        self.nbits = bits
        self.sparse = bool(sparse)
        self._cache: dict = {}

    def _on(self, name: str, tensor: torch.Tensor, device, dtype) -> torch.Tensor:
        key = (name, str(device), dtype)
        if key not in self._cache:
            self._cache[key] = tensor.to(device=device, dtype=dtype)
        return self._cache[key]

    def _mask(self, vec: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _scale(self, vec: torch.Tensor, mask: torch.Tensor | None):
        """(offset, half-range, stored meta or None) broadcastable to ``vec`` [R, n]."""
        raise NotImplementedError

    def _meta_scale(self, meta: torch.Tensor, dtype: torch.dtype, device):
        raise NotImplementedError

    def _meta_bits(self) -> int:
        return 0

    def _divisor(self, half: torch.Tensor) -> torch.Tensor:
        """The half-range with 1 where it is 0 (a constant vector decodes to its offset)."""
        return torch.where(half != 0, half, torch.ones_like(half))

    def encode(self, x):
        return self.encode_decode(x)[0]

    def encode_decode(self, x):
        dt = work_dtype(x)
        vec = _vectors(x).to(dt)
        rows, n = vec.shape
        mask = self._mask(vec) if self.sparse else None
        offset, half, meta = self._scale(vec, mask)
        centred = vec - offset
        if mask is not None:
            centred = centred.masked_fill(mask, 0.0)
        z = centred / self._divisor(half)
        lut = self._on("lut", self.lut, vec.device, dt)
        codes = nearest_codes(z, lut, self._on("pairs", self._pairs, vec.device, dt))
        dec = lut[codes] * half + offset
        values = index = pointer = None
        counts = None
        if mask is not None:
            flat = mask.reshape(-1).nonzero().squeeze(1)
            values = vec.reshape(-1)[flat].to(_outlier_dtype(x.dtype))
            index = (flat % n).to(torch.int16)
            per_row = mask.sum(-1, dtype=torch.int32)
            pointer = per_row.cumsum(0, dtype=torch.int32)
            dec.reshape(-1)[flat] = values.to(dt)
            counts = per_row.cpu()
        packed = KVQuantPacked(
            pack_bits(codes.to(torch.uint8), self.nbits), tuple(x.shape), dt, meta, values, index, pointer,
            self._token_bits(x.shape, counts),
        )
        return packed, _unvectors(dec, x.shape)

    def _token_bits(self, shape: tuple, counts: torch.Tensor | None) -> torch.Tensor:
        """Bits of each position (summed over the batch): codes, meta, and with a sparse part
        32 bits per outlier (value + index) plus the 32-bit pointer."""
        b, h, t, d = shape
        n = h * d
        fixed = 8 * ((n * self.nbits + 7) // 8) + self._meta_bits() + (32 if self.sparse else 0)
        with host_ops():
            if counts is None:
                return torch.full((t,), float(b * fixed), dtype=torch.float64)
            per = counts.to(torch.float64).reshape(b, t).mul_(32).add_(fixed)
            return per.sum(0)

    def decode(self, packed):
        b, h, t, d = packed.shape
        n = h * d
        dt = packed.dtype
        codes = unpack_bits(packed.codes, self.nbits, n)
        lut = self._on("lut", self.lut, packed.codes.device, dt)
        offset, half = self._meta_scale(packed.meta, dt, packed.codes.device)
        dec = lut[codes] * half + offset
        if packed.pointer is not None:
            rows = b * t
            ends = packed.pointer.long()
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            row = torch.repeat_interleave(torch.arange(rows, device=ends.device), counts)
            dec.reshape(-1)[row * n + packed.index.long()] = packed.values.to(dt)
        return _unvectors(dec, packed.shape)

    def bits(self, packed):
        return packed.bits()

    def parts(self, packed):
        parts = {"codes": packed.codes, "meta": packed.meta, "pointer": packed.pointer}
        return (packed.shape, packed.dtype), parts, {"values": packed.values, "index": packed.index}

    def decode_stored(self, store):
        """Elementwise: without a sparse part and at batch 1 (rows in position order), every
        stored row in one pass; else run by run (:meth:`decode_calls`)."""
        runs = store.runs()
        if any(shape[0] != 1 or "pointer" in parts for (shape, _), _, parts, _ in runs):
            return super().decode_stored(store)
        (_, h, _, d), dt = runs[0][0]
        rows = sum(calls * shape[2] for (shape, _), calls, _, _ in runs)
        codes = store.flat("codes")
        lut = self._on("lut", self.lut, codes.device, dt)
        meta = store.flat("meta").view(rows, 2) if "meta" in runs[0][2] else None
        offset, half = self._meta_scale(meta, dt, codes.device)
        dec = lut[unpack_bits(codes.view(rows, -1), self.nbits, h * d)] * half + offset
        return dec.view(1, rows, h, d).transpose(1, 2)

    def decode_calls(self, layout, calls, parts, ragged):
        """:meth:`decode` of ``calls`` stored calls at once: elementwise, the outliers of every
        call scattered in one pass (each call's pointer restarts at its first row)."""
        shape, dt = layout
        b, h, t, d = shape
        n, rows = h * d, b * t
        codes = parts["codes"]
        lut = self._on("lut", self.lut, codes.device, dt)
        meta = parts.get("meta")
        offset, half = self._meta_scale(None if meta is None else meta.reshape(calls * rows, 2), dt, codes.device)
        dec = lut[unpack_bits(codes.reshape(calls * rows, -1), self.nbits, n)] * half + offset
        if "pointer" in parts:
            ends = parts["pointer"].long()
            counts = torch.diff(ends, dim=1, prepend=ends.new_zeros(calls, 1)).reshape(-1)
            values = ragged["values"]
            row = torch.repeat_interleave(torch.arange(calls * rows, device=ends.device), counts,
                                          output_size=values.numel())
            dec.reshape(-1)[row * n + ragged["index"].long()] = values.to(dt)
        return dec.reshape(calls, b, t, h, d).permute(0, 1, 3, 2, 4)


class KeyCodec(_NuqCodec):
    """§14.3 keys of one layer, static per channel: ``upper``, ``lower`` [n] fp16 thresholds, ``lut``
    [2^b]; ``sparse`` (f > 0) keeps x > u or x < l exactly. Pre-RoPE."""

    pre_rope = True

    def __init__(self, upper: torch.Tensor, lower: torch.Tensor, lut: torch.Tensor, bits: int, sparse: bool):
        super().__init__(lut, bits, sparse)
        self.upper, self.lower = upper.half().reshape(-1), lower.half().reshape(-1)
        # the code's offset and range: fp16 arithmetic on the fp16 thresholds (exact sum, rounded)
        self.offset = (self.upper.double() + self.lower.double()).half() / 2
        self.half_range = (self.upper.double() - self.lower.double()).half() / 2

    def static_bits(self) -> int:
        """Two fp16 thresholds per channel and the fp16 LUT (§14.2)."""
        return 16 * (self.upper.numel() + self.lower.numel() + self.lut.numel())

    def _mask(self, vec):
        up = self._on("upper", self.upper, vec.device, vec.dtype)
        lo = self._on("lower", self.lower, vec.device, vec.dtype)
        return (vec > up) | (vec < lo)

    def _scale(self, vec, mask):
        offset, half = self._meta_scale(None, vec.dtype, vec.device)
        return offset, half, None

    def _meta_scale(self, meta, dtype, device):
        return (self._on("offset", self.offset, device, dtype),
                self._on("half_range", self.half_range, device, dtype))

    def _divisor(self, half):
        key = ("divisor", str(half.device), half.dtype)  # static per channel: computed once
        if key not in self._cache:
            self._cache[key] = super()._divisor(half)
        return self._cache[key]


class ValueCodec(_NuqCodec):
    """§14.3 values of one layer, dynamic per token over its n entries: ``lut`` [2^b]; ``t`` the
    outlier quantile level (``sparse`` when t < 1). Stores each token's fp16 max and min."""

    def __init__(self, lut: torch.Tensor, bits: int, t: float = 1.0):
        super().__init__(lut, bits, t < 1.0)
        self.t = float(t)

    def static_bits(self) -> int:
        return 16 * self.lut.numel()

    def _meta_bits(self) -> int:
        return 32

    def _mask(self, vec):
        upper, lower = quantiles(vec, self.t, 1)
        return (vec >= upper[:, None]) | (vec <= lower[:, None])

    def _scale(self, vec, mask):
        trimmed = vec
        if mask is not None:
            median = torch.median(vec, dim=-1).values
            trimmed = torch.where(mask, median[:, None], vec)
        meta = torch.stack([trimmed.amax(-1), trimmed.amin(-1)], -1).half()
        offset, half = self._meta_scale(meta, vec.dtype, vec.device)
        return offset, half, meta

    def _meta_scale(self, meta, dtype, device):
        mx, mn = meta.to(dtype).unbind(-1)
        return ((mx + mn) / 2)[:, None], ((mx - mn) / 2)[:, None]

