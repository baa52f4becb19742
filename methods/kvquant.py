"""KVQuant: per-channel pre-RoPE keys, per-token values, non-uniform datatypes, dense-and-sparse.

Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, "KVQuant: Towards 10 Million Context
Length LLM Inference with KV Cache Quantization", NeurIPS 2024, arXiv 2401.18079; code
SqueezeAILab/KVQuant (``quant/kvquant/simquant_module_quantizer.py``, ``quant/llama_simquant.py``).
Specification: docs/methods.md §14 (budget map §8 and its "Additions" table, measured bpd §0, regimes §1.3).

* **Vectors** (§14.1): the quantized tensors are the projection outputs (bias included). A key
  vector is one output channel of the whole ``k_proj`` (n = H_kv d channels per layer, each with its
  own static thresholds), quantized **before RoPE**; RoPE is applied to the dequantized key. A
  value vector is one token's whole ``v_proj`` output (all H_kv heads together, n entries).
* **Calibration** (§14.2, :func:`key_calibration`, :func:`value_calibration`): with the outlier
  fraction f, sparsity threshold tau = 1 - f and t = 1 - (1 - tau)/2, keys get per-channel upper and
  lower thresholds u, l = the t and 1 - t quantiles over the calibration tokens (linear
  interpolation, as ``np.percentile``; f = 0 gives max and min), values the same per calibration
  token. z = (x - (u + l)/2) / ((u - l)/2); elements with |z| > 1 are left out, and one nuqb
  signpost table (LUT, 2^b entries) per layer and side is fitted by 1-D k-means over the rest of the
  layer's normalized elements (:func:`kmeans_1d`).
* **Quantizers** (§14.3, :class:`KeyCodec`, :class:`ValueCodec`): keys, static: outlier iff
  x > u_c or x < l_c (fp16 thresholds), inliers normalized by the offset (u + l)/2 and half-range
  (u - l)/2 (computed in fp16 from the fp16 thresholds, as the official module does), snapped to the
  nearest LUT entry (:func:`nearest_codes`; a tie goes to the lower entry, the first in stored
  order) and rescaled; outliers kept exactly. Values, dynamic per token: outlier iff
  x >= quantile(t) or x <= quantile(1 - t) of the token's n entries (``torch.quantile``); outliers
  replaced by the token median, the max and min of that give offset and half-range; nearest LUT
  entry; outliers restored.
* **Attention sink** (§14.3, ``--first_few_fp16``): the sequence's first ``sink`` tokens are kept
  exactly in K and V (:class:`methods.codec_state.CodecLayerState` ``exact_first``), 16 bits per
  element, counted.
* **Regimes** (§14.4): a token's stored form depends only on itself and static data, so a Q-all pass
  equals token-by-token decoding exactly; there is no residual window. Prefill-exact: the prompt
  attends exactly, then is compressed; each generated token is compressed on arrival and attends to
  its own compressed K/V.
* **bpd** (§14.5), per element of an ordinary token: every element carries a b-bit code (outlier
  slots are dead codes); with f > 0 each outlier stores a 16-bit value and a 16-bit index and each
  token a 32-bit sparse pointer (CSC for K, CSR for V); values store their fp16 offset and
  half-range per token: bpd_K = b + 32 f_K + 32/n, bpd_V = b + 32 f_V + 64/n (f = 0: b and b + 32/n),
  plus the sink share. ``stored_bits`` counts the stored tensors (packed codes, fp16 metadata,
  outlier values, int16 indices, int32 pointers), and each query's read is exact per token
  (:class:`KVQuantLayerState`: outlier counts vary per token).

Grid reached (``budget="measured"``, K-track, ``sink`` fitted, f = 0; keys at f = 0 carry no
per-token metadata, so d = 64 (SmolLM2-135M, n = 192) and d = 128 (Llama-3.1-8B, n = 1024) reach
the same points). Q-all over 2048 positions, where the sink share is (16 - b) H_2048 / 2048
= 0.0040 (16 - b):

| bpd_K | d = 64 and d = 128                                        |
|-------|-----------------------------------------------------------|
| 0.5   | no (reachable 1.00-5.04: b >= 1)                          |
| 1     | 1.00 at nuq1-0%, sink 0 (with the sink 1.06: out of 2 %)  |
| 2     | 2.00 at nuq2-0%, sink 0 (with the sink 2.06)              |
| 3     | 3.05 at nuq3-0%, sink 1                                    |
| 4     | 4.05 at nuq4-0%, sink 1                                    |

After a 1536-token prefill with 511 decoded positions (PPL track B) the sink share is 0.00056
(16 - b): every row keeps the sink (1.01, 2.01, 3.01, 4.01). Outliers cost 32 f + 32/n: nuq4-1 %
is 4.35 + sink at n = 1024 (4.40 in Q-all, within 2 % of 4.35), 4.49 + sink at n = 192. Values at
f = 0 cost b + 32/n: 4.03 at n = 1024 (within 2 % of 4), 4.17 at n = 192 (not: v_bpd = 4 is
unsupported on SmolLM2, and so is every integer v_bpd there).

Decisions where docs/methods.md is silent:

* **Fisher weighting** (§11 register 15). The harness's calibration pass has no backward, so F is
  not available: ``fisher_scale="code"`` (default) weights every element by F = 1 (the code's
  k-means with uniform Fisher information), ``"paper"`` by F s^2 with F = 1, s the element's scale
  (the key channel's or the value token's half-range, paper Eq. 7).
* **k-means**: sklearn is not a dependency of ``methods/``, so :func:`kmeans_1d` is our own weighted
  Lloyd iteration in float64 with the official settings (2^b clusters, at most 50 iterations,
  sklearn's tolerance 1e-4 times the data variance), initialized at the quantiles of the point
  density p^(1/3) (:func:`companding_init`) instead of k-means++ with ``random_state=0``: a local
  optimum of the same objective, not the same centroids (tests compare the objective with
  sklearn's). Centroids are stored sorted, in fp16
  (§14.2's static bytes), and used rounded.
* **Calibration data**: the harness's sample of calibration keys and values
  (``LayerStats.k_sample``/``v_sample``, ``calib_tokens`` per head, the same tokens for every layer;
  §1.2's windows, not KVQuant's 16 x 2048), never evaluation text. The sample's positions are not
  known, so window-initial tokens are not excluded from k-means (about one in ``seqlen`` of the
  sample; with f > 0 most of their elements are outliers and excluded anyway).
* **Budget** (``budget``): ``"measured"`` (default): each quantized side's predicted measured
  headline in the job's regime (``set_regime``; Q-all: the mean over the T positions of what each
  query read; prefill: the prompt's own prediction at the stored prompt and the D decoded positions)
  must be within 2 % of its target; ``"nominal"``: §14.6's per-token figure (no sink share). b in
  1..5 (the code's 2..5, and b = 1 as the harness extension of §14.6), f = ``outliers`` as given
  (predicted f_K = f; f_V from the exact per-token count of §14.3). ``sink=None`` (default): one
  sink token (§14.3's default) unless it puts a side out of the band, then none (the knobs say
  which, and why). Nothing in the band -> :class:`Unsupported` with the reachable points. An
  explicit ``bits``/``v_bits`` runs as set, without the target check. ``joint_kv=True`` (the
  KV-track rows): the two sides' mean within 2 % of bpd_KV, the most balanced pair first
  (:mod:`methods.joint_budget`). At f = 0 values cost 32/n more per element than keys: on
  Llama-3.1-8B (n = 1024) bpd_KV 1 becomes reachable (nuq1 + nuq1, 1.016) where v_bpd = 1 alone is
  not; on SmolLM2 (n = 192) every pair's mean is an integer + 0.083 (+ the sink share), so no
  integer bpd_KV is within 2 % either way.
* **Stored values**: outliers in fp16 (bf16 on a bf16 model: 16 bits either way; exact for the
  fp16 activations of the official simulator), indices int16 (n <= 32767), pointers int32; a value
  token stores its fp16 maximum and minimum (after the median replacement), 32 bits carrying the
  same information as the offset and half-range, which are computed from them in float32 as in the
  code (App. G: never rounded). Keys are dequantized (float32, float64 for float64 inputs) and
  rotated when attention reads them; the official's final fp16 cast of the projection output is a
  property of its fp16 models, not of the cache, and is not applied.
* A constant channel (u = l) or token (max = min) decodes to its offset (the code divides by zero
  there and ``nan_to_num`` gives the same).
* Q-Norm (``--norm``) and ``--cap_outliers`` are not implemented (off by default in §14.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import work_dtype
from .base import KVMethod, ModelShape, Regime, Unsupported
from .bookkeeping import host_ops
from .budget import AT_TARGET, describe, in_band, no_joint_pair, reach, side_unreachable
from .codec_state import Codec, CodecLayerState, ExactCodec, codecs_static_bytes
from .joint_budget import best_pair
from .latent_codec import SAMPLE_TOKENS
from .packing import pack_bits, unpack_bits

BITS = (1, 2, 3, 4, 5)  # §14.3: the code's 2..5 and the harness extension b = 1
KMEANS_ITERS = 50  # official KMeans(max_iter=50)
KMEANS_TOL = 1e-4  # sklearn's default tol, relative to the data variance
QUANTILE_LIMIT = 1 << 24  # torch.quantile refuses larger inputs
FISHER_SCALES = ("code", "paper")
BUDGETS = ("measured", "nominal")


# ---------------------------------------------------------------------------------------------
# primitives


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


INIT_BINS = 2048  # histogram bins of the k-means initialization


def companding_init(xs: torch.Tensor, ws: torch.Tensor, k: int, bins: int = INIT_BINS) -> torch.Tensor:
    """k starting centroids for sorted points ``xs`` with weights ``ws``: the (i + 1/2)/k quantiles
    of the point density p^(1/3) (Bennett 1948 / Panter-Dite 1951: the high-resolution optimal
    quantizer's point density), from a weighted histogram of ``bins`` equal bins over [min, max],
    linear within a bin."""
    lo, hi = float(xs[0]), float(xs[-1])
    if not hi > lo:
        return xs.new_full((k,), lo)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    hist = torch.zeros(bins, dtype=torch.float64).index_add_(0, torch.bucketize(xs, edges[1:-1], right=True), ws)
    cum = torch.cat([hist.new_zeros(1), (hist.clamp(min=0) ** (1 / 3)).cumsum(0)])
    targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k * cum[-1]
    j = (torch.searchsorted(cum, targets, right=True) - 1).clamp_(0, bins - 1)
    frac = (targets - cum[j]) / (cum[j + 1] - cum[j]).clamp(min=1e-300)
    return edges[j] + frac.clamp(0, 1) * (edges[j + 1] - edges[j])


def kmeans_1d(x: torch.Tensor, k: int, weight: torch.Tensor | None = None,
              iters: int = KMEANS_ITERS, tol: float = KMEANS_TOL) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) of ``x`` [M] into ``k`` sorted centroids, float64.

    Points are sorted once; each iteration assigns the contiguous runs between centroid midpoints
    (a point on a midpoint goes to the lower centroid, as :func:`nearest_codes`) and moves each
    centroid to its run's weighted mean from prefix sums (an empty run keeps its centroid). Init:
    :func:`companding_init`. Stops when the assignment no longer changes or the summed squared
    centroid shift is <= tol * var(x) (sklearn's rule), after at most ``iters`` rounds."""
    if x.numel() == 0:
        raise ValueError("k-means needs at least one calibration element")
    xs, order = x.to(torch.float64).reshape(-1).sort()
    ws = torch.ones_like(xs) if weight is None else weight.to(torch.float64).reshape(-1)[order]
    if not bool(ws.sum() > 0):
        raise ValueError("k-means weights must have a positive sum")
    zero = xs.new_zeros(1)
    cw = torch.cat([zero, ws.cumsum(0)])
    cwx = torch.cat([zero, (ws * xs).cumsum(0)])
    centers = companding_init(xs, ws, k)
    bound = tol * float(xs.var(unbiased=False)) if xs.numel() > 1 else 0.0
    edges = None
    for _ in range(iters):
        mids = (centers[:-1] + centers[1:]) / 2
        cut = torch.searchsorted(xs, mids, right=True)
        new_edges = torch.cat([cut.new_zeros(1), cut, cut.new_full((1,), xs.numel())])
        if edges is not None and torch.equal(new_edges, edges):
            break
        edges = new_edges
        w = cw[edges[1:]] - cw[edges[:-1]]
        wx = cwx[edges[1:]] - cwx[edges[:-1]]
        moved = torch.where(w > 0, wx / torch.where(w > 0, w, 1.0), centers).sort().values
        shift = float(((moved - centers) ** 2).sum())
        centers = moved
        if shift <= bound:
            break
    return centers


def _normalized(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor):
    """(z, half-range) of §14.2(c): z = (x - (u + l)/2) / ((u - l)/2) (broadcast)."""
    zero = (upper + lower) / 2
    half = (upper - lower) / 2
    return (x - zero) / half, half


def _fit_lut(z: torch.Tensor, half: torch.Tensor, bits: int, fisher_scale: str) -> torch.Tensor:
    """The fp16 LUT of one layer and side: k-means over the inliers |z| <= 1 (the code masks
    z > 1 and z < -1), weighted by 1 (``"code"``) or the element's squared scale (``"paper"``)."""
    keep = (z.abs() <= 1) & torch.isfinite(z)
    weight = None
    if fisher_scale == "paper":
        weight = (half**2).expand_as(z)[keep]
    return kmeans_1d(z[keep], 2**bits, weight).half()


def key_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code"):
    """§14.2 for the keys of one layer: ``x`` [N, n] calibration keys (float64). Returns (u, l
    fp16 [n] per-channel thresholds, fp16 LUT [2^b], key outlier fraction of the sample under the
    quantizer's rule with the fp16 thresholds). The k-means normalization uses the unrounded
    thresholds, as the code (it rounds them to fp16 when it builds the quantized layer)."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 0)
    z, half = _normalized(x, upper[None], lower[None])
    lut = _fit_lut(z, half, bits, fisher_scale)
    u16, l16 = upper.half(), lower.half()
    frac = float(((x > u16.double()) | (x < l16.double())).double().mean())
    return u16, l16, lut, frac


def value_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code") -> torch.Tensor:
    """§14.2 for the values of one layer: ``x`` [N, n] calibration values (float64), thresholds per
    calibration token (the code's per-token ``np.percentile``). Returns the fp16 LUT [2^b]."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 1)
    z, half = _normalized(x, upper[:, None], lower[:, None])
    return _fit_lut(z, half, bits, fisher_scale)


# ---------------------------------------------------------------------------------------------
# codecs


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


class KVQuantLayerState(CodecLayerState):
    """:class:`methods.codec_state.CodecLayerState` whose reads are exact per token: with outliers
    the bits differ from token to token, so query i of a chunk reads the bits of the tokens up to
    its own (:attr:`KVQuantPacked.token_bits`), not the chunk's average."""

    def _call_reads(self, prior_k, prior_v, entries_k, entries_v):
        return held_per_token(prior_k, entries_k), held_per_token(prior_v, entries_v)


def held_per_token(prior: float, entries: list) -> torch.Tensor:
    """Bits held after each new token, float64 CPU: ``prior`` plus the cumulative per-token bits of
    the (codec, packed, tokens) entries of one call (exact tokens cost the same each)."""
    with host_ops():
        parts = []
        for codec, packed, n in entries:
            per = getattr(packed, "token_bits", None)
            if per is None:
                per = torch.full((n,), codec.bits(packed) / n, dtype=torch.float64)
            parts.append(per)
        held = parts[0] if len(parts) == 1 else torch.cat(parts)  # a decode step: one part, no cat
        return held.cumsum(0).add_(prior)


# ---------------------------------------------------------------------------------------------
# budget


def token_cost(side: str, bits: int, f: float, n: int) -> float:
    """bpd of an ordinary token (§14.5): keys b + [f > 0](32 f + 32/n); values b + 32/n
    + [f > 0](32 f_V + 32/n) with f_V the exact per-token count of :func:`value_outlier_count`."""
    if side == "k":
        return bits + ((32 * f + 32 / n) if f > 0 else 0.0)
    cost = bits + 32 / n
    if f > 0:
        cost += 32 * value_outlier_count(n, outlier_level(f)) / n + 32 / n
    return cost


def sink_share(regime: Regime, sink: int) -> float:
    """Mean over the regime's scored positions of the fraction of the cache held by the first
    ``sink`` tokens: Q-all, positions t = 1..T reading t tokens; prefill, the prompt's prediction at
    P tokens and the D decoded ones at P+1..P+D."""
    if sink <= 0:
        return 0.0
    if regime.kind == "qall":
        lengths = torch.arange(1, regime.tokens + 1, dtype=torch.float64)
    else:
        lengths = torch.arange(regime.tokens, regime.tokens + regime.decode + 1, dtype=torch.float64)
    return float((lengths.clamp(max=sink) / lengths).mean())


def headline(cost: float, sink: int, regime: Regime, budget: str = "measured") -> float:
    """Predicted measured bpd of one side: ``cost`` per ordinary token, 16 for the sink tokens."""
    if budget == "nominal":
        return cost
    return cost + (16.0 - cost) * sink_share(regime, sink)


# ---------------------------------------------------------------------------------------------
# the method


@dataclass
class KVQuant(KVMethod):
    """KVQuant (Hooper et al., NeurIPS 2024, arXiv 2401.18079) per docs/methods.md §14; see the module
    docstring for the quantizers, the bit count, the grid reached and the decisions.

    Options: ``bits``/``v_bits`` (b in 1..5; None = fitted to ``bpd``/``v_bpd``), ``outliers``
    (f, the "-1 %" of nuq4-1 %; 0 = none), ``sink`` (exact first tokens; None = 1, or 0 where 1
    leaves the 2 % band), ``fisher_scale`` ("code" | "paper"), ``budget`` ("measured" | "nominal"),
    ``calib_tokens`` (calibration keys/values sampled per head), ``joint_kv`` (with both targets:
    the mean of the two sides within the band, :mod:`methods.joint_budget`, instead of each side)."""

    name: ClassVar[str] = "kvquant"
    needs_calibration: ClassVar[bool] = True

    bits: int | None = None
    v_bits: int | None = None
    outliers: float = 0.0
    sink: int | None = None
    fisher_scale: str = "code"
    budget: str = "measured"
    calib_tokens: int = SAMPLE_TOKENS
    joint_kv: bool = False

    def __post_init__(self):
        for knob in ("bits", "v_bits"):
            b = getattr(self, knob)
            if b is not None and b not in BITS:
                raise ValueError(f"kvquant: {knob}={b!r}; valid choices: {BITS} or null (fitted)")
        if not 0.0 <= float(self.outliers) < 0.5:
            raise ValueError(f"kvquant: outliers={self.outliers!r} is the outlier fraction f, 0 <= f < 0.5")
        if self.sink is not None and (int(self.sink) != self.sink or self.sink < 0):
            raise ValueError(f"kvquant: sink={self.sink!r}; an integer >= 0 or null (fitted)")
        if self.fisher_scale not in FISHER_SCALES:
            raise ValueError(f"kvquant: fisher_scale={self.fisher_scale!r}; valid choices: {FISHER_SCALES}")
        if self.budget not in BUDGETS:
            raise ValueError(f"kvquant: budget={self.budget!r}; valid choices: {BUDGETS}")
        if int(self.calib_tokens) < 1:
            raise ValueError(f"kvquant: calib_tokens={self.calib_tokens!r} must be >= 1")
        self._shape: ModelShape | None = None
        self._plan: dict | None = None
        self._k_codecs: list | None = None
        self._v_codecs: list | None = None
        self._calib: dict = {}

    # -- budget --------------------------------------------------------------------------------

    def _sides(self, bpd_k, bpd_v) -> dict:
        """Per quantized side: (target or None, explicit bits or None)."""
        sides = {}
        for side, target, bits in (("k", bpd_k, self.bits), ("v", bpd_v, self.v_bits)):
            quantized = bits is not None or (target is not None and float(target) != 16.0)
            if quantized:
                sides[side] = (None if target is None or float(target) == 16.0 else float(target), bits)
        return sides

    def _points(self, side: str, n: int, sink: int) -> list[tuple[float, int]]:
        """(predicted headline, b) for every b of the grid."""
        f = float(self.outliers)
        return [(headline(token_cost(side, b, f, n), sink, self.regime, self.budget), b) for b in BITS]

    def _fit_side(self, side: str, target: float | None, bits: int | None, n: int, sink: int):
        """(b, predicted) for one side at ``sink``, or None when no b is within the band."""
        f = float(self.outliers)
        if bits is not None:  # run as set
            return bits, headline(token_cost(side, bits, f, n), sink, self.regime, self.budget)
        inside = [(abs(x - target), b, x) for x, b in self._points(side, n, sink)
                  if in_band(x, target, eps=1e-12)]
        if not inside:
            return None
        _, b, x = min(inside)
        return b, x

    def _fit_joint(self, target_kv: float, n: int, sink: int):
        """``joint_kv``: {side: (b, predicted)} for the most balanced pair of key and value points
        whose mean is within the band of ``target_kv`` (:func:`methods.joint_budget.best_pair`;
        then the most key bits), or None."""
        pairs = [(k, v) for k in self._points("k", n, sink) for v in self._points("v", n, sink)]
        best = best_pair(pairs, lambda p: p[0], target_kv, AT_TARGET, lambda k, v: (k[1], v[1]))
        return None if best is None else {"k": best[0][::-1], "v": best[1][::-1]}

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        n = shape.n_kv_heads * shape.head_dim
        if n > 32767:
            raise ValueError(f"kvquant: int16 outlier indices need H_kv d <= 32767, got {n}")
        sides = self._sides(bpd_k, bpd_v)
        sinks = [int(self.sink)] if self.sink is not None else [1, 0]
        joint = (self.joint_kv and set(sides) == {"k", "v"} and self.bits is None and self.v_bits is None
                 and None not in (sides["k"][0], sides["v"][0]))
        target_kv = (sides["k"][0] + sides["v"][0]) / 2 if joint else None
        for sink in sinks:
            if joint:
                fit = self._fit_joint(target_kv, n, sink)
            else:
                fit = {s: self._fit_side(s, target, bits, n, sink) for s, (target, bits) in sides.items()}
            if fit is not None and all(v is not None for v in fit.values()):
                break
        else:
            if joint:
                pts = [x for s in sinks for side in ("k", "v") for x, _ in self._points(side, n, s)]
                raise Unsupported(no_joint_pair("kvquant", target_kv, self.regime)
                                  + f" (each side reaches {reach(pts)} at b in {BITS})")
            raise Unsupported(self._unreachable(sides, n, sinks))
        self._plan = {
            "n": n, "sink": sink if sides else 0, "t": outlier_level(float(self.outliers)),
            "k_bits": fit["k"][0] if "k" in fit else None, "v_bits": fit["v"][0] if "v" in fit else None,
            "predicted_bpd_k": fit["k"][1] if "k" in fit else 16.0,
            "predicted_bpd_v": fit["v"][1] if "v" in fit else 16.0,
            "target_bpd_k": bpd_k, "target_bpd_v": bpd_v,
        }
        if joint:
            self._plan["joint_kv"] = target_kv
        if self.sink is None and sides and sink == 0:
            self._plan["sink_dropped"] = (
                f"one sink token puts the measured headline in {describe(self.regime)} outside "
                f"{AT_TARGET:.0%} of the target")

    def _unreachable(self, sides: dict, n: int, sinks: list[int]) -> str:
        what = ("per-token figure of §14.6" if self.budget == "nominal"
                else f"measured headline in {describe(self.regime)}")
        parts = []
        for side, (target, bits) in sides.items():
            if bits is not None:
                continue
            pts = [(x, b, s) for s in sinks for x, b in self._points(side, n, s)]
            nearest = sorted(pts, key=lambda p: abs(p[0] - target))[:2]
            near = ", ".join(f"{x:.3f} (b={b}, sink {s})" for x, b, s in nearest)
            parts.append(side_unreachable("bpd" if side == "k" else "v_bpd", target, [p[0] for p in pts],
                                          f" at b in {BITS}, f={self.outliers:g}; no point within "
                                          f"{AT_TARGET:.0%} (nearest {near})"))
        return f"kvquant ({what}, n = H_kv d = {n}): " + "; ".join(parts)

    # -- calibration ---------------------------------------------------------------------------

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head whose keys and values :meth:`calibrate` fits on (asked before
        ``configure``; 0 once configured with both sides exact)."""
        if self._plan is not None and self._plan["k_bits"] is None and self._plan["v_bits"] is None:
            return 0
        return int(self.calib_tokens)

    def calibrate(self, stats, seed=0):
        if self._plan is None:
            raise RuntimeError("kvquant: configure() before calibrate()")
        plan, t = self._plan, self._plan["t"]
        self._k_codecs, self._v_codecs, fracs = [], [], []
        for layer, st in enumerate(stats):
            if plan["k_bits"] is None:
                self._k_codecs.append(ExactCodec())
            else:
                u, l, lut, frac = key_calibration(_sample(st, "k", layer), t, plan["k_bits"], self.fisher_scale)
                self._k_codecs.append(KeyCodec(u, l, lut, plan["k_bits"], t < 1.0))
                fracs.append(frac)
            if plan["v_bits"] is None:
                self._v_codecs.append(ExactCodec())
            else:
                lut = value_calibration(_sample(st, "v", layer), t, plan["v_bits"], self.fisher_scale)
                self._v_codecs.append(ValueCodec(lut, plan["v_bits"], t))
        sample = stats[0].k_sample if stats else None
        self._calib = {"calibration_tokens": 0 if sample is None else int(sample.shape[1])}
        if fracs and t < 1.0:
            f_hat = sum(fracs) / len(fracs)
            cost = plan["k_bits"] + 32 * f_hat + 32 / plan["n"]
            self._calib.update(key_outlier_fraction_calibration=f_hat,
                               predicted_bpd_k_calibration=headline(cost, plan["sink"], self.regime, self.budget))

    def static_bytes(self) -> int:
        return codecs_static_bytes(self._k_codecs, self._v_codecs)

    def new_layer_state(self, layer):
        if self._k_codecs is None or self._v_codecs is None:
            raise RuntimeError("kvquant: calibrate() before new_layer_state()")
        return KVQuantLayerState(self._k_codecs[layer], self._v_codecs[layer], exact_first=self._plan["sink"])

    def knobs(self):
        if self._plan is None:
            return {}
        out = {k: v for k, v in self._plan.items() if k != "n"}
        out.update(outliers=float(self.outliers), fisher_scale=self.fisher_scale, budget=self.budget,
                   regime=describe(self.regime), vector_length=self._plan["n"], **self._calib)
        if self._k_codecs and isinstance(self._k_codecs[0], KeyCodec):
            out["lut_k_layer0"] = [float(c) for c in self._k_codecs[0].lut]
        return out

    def nominal_bpd(self, n_tokens):
        plan = self._plan
        f = float(self.outliers)
        out = []
        for side in ("k", "v"):
            b = plan[f"{side}_bits"]
            if b is None:
                out.append(16.0)
                continue
            cost = token_cost(side, b, f, plan["n"])
            share = min(plan["sink"], n_tokens) / max(1, n_tokens)
            out.append(cost + (16.0 - cost) * share)
        return tuple(out)


def _sample(st, side: str, layer: int) -> torch.Tensor:
    """The layer's calibration keys or values [N, H*d] (float64, uncentered, channels in projection
    order) from the harness's sample (stored centered at the statistics' mean)."""
    sample = getattr(st, f"{side}_sample")
    if sample is None:
        raise ValueError(
            f"kvquant: layer {layer} has no calibration {'key' if side == 'k' else 'value'} sample; "
            "collect the statistics with sample_tokens > 0 (the harness does: calibration_sample_tokens())")
    mu = getattr(st, f"mu_{side}").to(torch.float64)
    x = sample.to(torch.float64) + mu[:, None, :]  # [H, N, d]
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)
