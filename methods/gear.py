"""GEAR: quantization backbone + exact sparse outliers + low-rank residual, in a streaming buffer.

Kang, Zhang, Kundu, Jeong, Liu, Krishna, Zhao, "GEAR: An Efficient Error Reduction Framework for KV
Cache Compression in LLM Inference", arXiv 2403.05527 (v4, NeurIPS 2024 ENLSP, PMLR 262:305-321);
code opengear-project/GEAR (``GEARLM/Simulated/compress_function.py``). Specification: docs/methods.md
§15 (regimes §1.3, measured bpd §0, budget map §8 and its "Additions" table).

* **Decomposition** (§15.1): per layer, every block of ``n`` tokens X ~ D + S + L, keys **post-RoPE**
  (what the attention sees; no calibration).
* **Backbone D** (§15.2): keys per channel over groups of ``G`` consecutive tokens of the block,
  values per token over groups of ``G`` consecutive entries of the token's concatenated H_kv d
  vector; asymmetric min-max with fp16 scale and minimum (:func:`methods.groupquant.fp16_scale_min`),
  code = round_half_even((x - mn)/s) clamped to [0, levels]. ``levels="harness"``: 2^b - 1;
  ``"official"``: b^2 - 1 on the sparse path (a side with ``sparsity > 0``: ``gears_channelQ`` /
  ``gears_tokenQ``), 2^b - 1 without S (``GEARL``); codes are packed at ceil(log2(levels + 1))
  bits (b = 3 official: 9 levels, 4 bits stored).
* **Sparse S** (§15.3): the k largest and k smallest entries, per channel along the block's tokens
  for keys, per token over the H_kv d vector for values, are replaced by the vector's mean (over all
  its entries, outliers included) before the group min/max, then restored exactly after
  dequantization (so the residual is 0 there). ``kcount="harness"``: keys k = floor(s n / 2), values
  k = floor(s H_kv d / 2); ``"official"``: k = int(int(B H n d s) / B / n / 2) on both sides (the
  key fraction is then 2k/n). Each outlier stores its value (16 bits) and its index (``index_bits``
  16, or 32).
* **Low rank L** (§15.4): per head, R = X - (D + S) [n, d]; Omega ~ U[0,1)^{d x r}; ``loop`` rounds of
  q <- R Omega, Omega <- R^T q with QR only in the last round (first of Omega, then of q):
  ``fake_poweriteration_group``, L = Q P^T with Q = orth(R (R^T R)^{loop-1} Omega) [n, r] and
  P = R^T Q [d, r], both stored in fp16 and used rounded (what is stored is what is used).
* **Streaming** (§15.5, harness default of §15.8, ``prompt="chunked"``): new tokens wait in an fp16
  buffer; once it holds ``n_b`` tokens (after the attention of the step that filled it) they are
  compressed as one block. For query t, K and V of token s are read compressed iff
  s < n_b floor(t / n_b). A prefill stores its first n_b floor(P / n_b) tokens as n_b-token blocks
  (rank r each, so Q-all and prefill-exact store the same thing) and buffers the rest.
  ``prompt="one_block"`` (the paper's scheme of §15.5): the prefill's n_b floor(P / n_b) tokens form
  one block at rank ``prompt_rank`` (r_p, default 4 as the run templates).
* **bpd** (§15.7), per block of n tokens and head: b + 32/G + 2k(16 + iota)/n (keys; values
  2k(16 + iota)/(H_kv d)) + 16 r (n + d)/(n d), plus the fp16 buffer share. Measured by
  ``stored_bits`` from the stored tensors (packed codes, fp16 scales/minima, outlier values and
  indices, fp16 factors, fp16 buffer).

Grid reached (``budget="measured"``, Q-all over 2048 positions, K-track, rank >= 1; the most
preferred admissible point, which a job's knob search may replace by another admissible one):

| bpd_K | d = 64 (SmolLM2-135M, H_kv = 3)   | d = 128 (Llama-3.1-8B, H_kv = 8)    |
|-------|------------------------------------|-------------------------------------|
| 0.5   | no (reachable 3.17-12.2)           | no (reachable 3.06-11.7)            |
| 1     | no                                 | no                                  |
| 2     | no                                 | no                                  |
| 3     | no (the cheapest point is 3.17)    | 3.06 at b=1, G=64, n_b=64, r=1      |
| 4     | 3.98 at b=1, G=32, n_b=96, r=1     | 3.97 at b=2, G=64, n_b=64, r=1      |

The fp16 buffer is what keeps low targets out of reach in Q-all: a query at t reads t mod n_b + 1
tokens at 16 bits, 0.084 of the reads at n_b = 64 (1.1 bpd at a 3-bit cache) and 0.145 at
n_b = 128. ``budget="nominal"`` (the per-block formula of §15.7 without that share, docs/methods.md
§15.8's map) reaches 2 at d = 64 with b=1, G=64, n_b=64, r=1 (2.00), 3 with b=2 there (3.00) and 4
with b=3, G=64, n_b=256, s=1 %, r=1 (4.06). After a 1536-token prefill with 511 decoded positions
(PPL track B) the buffer weighs less: d = 64 reaches 3 (3.01 at b=1, G=32, n_b=192, r=1) and 4
(4.07 at b=3, G=128, n_b=128, r=1), not 2 (reachable from 2.14).

Decisions where docs/methods.md is silent:

* **Budget** (``budget``). ``"measured"`` (default, docs/methods.md §0): the target is the job's
  measured headline in its regime (``set_regime``: Q-all, the mean over the T positions of what each
  query read; after a P-token prefill, the prefill's own prediction at the stored prompt and the D
  decoded positions), predicted exactly from the bit counts (:meth:`SideCodec.block_bits`, :func:`headline`).
  ``"nominal"``: the per-block figure of §15.7 (the end of a complete block, no buffer share). Grid:
  b in 1..8, G in {32, 64, 128} (value groups divide H_kv d), n_b a multiple of the key G up to 256,
  s in {0, 1 %, 2 %} (deduplicated by the outlier count it gives), r in 1..4 (L is GEAR's error
  reduction; r = 0 would be KIVI with R = n_b). One n_b for both sides (one buffer). A point is
  **admissible** when it is at most 1.02 x the target (docs/methods.md §0.1; each side at its own;
  under is allowed). In a job the held-out knob search chooses among them (``"knobs"``,
  :meth:`Gear.knob_candidates`, kvbench/fit/knob_search.py); without one, the most backbone bits,
  then the smallest groups (finer groups, KIVI's rule), then the largest rank, then the most
  outliers, then the closest; keys decide first, values second. None admissible ->
  :class:`Unsupported` naming the reachable range and the cheapest point. ``joint_kv=True`` (the KV-track rows): the pair whose
  *mean* is within 2 % of bpd_KV, the most balanced first (:mod:`methods.joint_budget`).
* Explicit knobs override the fit: with any of ``bits, group, sparsity, rank, block`` (or their
  ``v_`` forms) given, the job runs them, the others at the run templates' GEAR setting (§15.6:
  b = 2, G = 64, s = 2 %, r = 2, n_b = 64), and reports its measured bpd without a target check.
  No key target: that setting, not fitted. Values stay exact (16 bits) unless ``bpd_v`` or
  ``v_bits`` is given.
* **Omega** is drawn once per (seed, layer, side, block length) from its own generator (all heads
  at once) and shared by the blocks of that layer and side (the official code draws a new one at
  every compression). Each block's Omega is still U[0,1), drawn independently of its data, so no
  block's power iteration changes in distribution; sharing it lets one pass and token-by-token
  decoding compress every block identically with one draw (a draw per block would be a generator
  and a copy per block, ops that grow with the window). ``seed`` defaults to the global torch
  seed at ``configure`` (the job seeds torch with its seed). Only encoding needs Omega: decoding
  reads Q and P, so ``static_bytes`` is 0.
* Outlier values are kept in the model's dtype (exact, as the fp16 buffer) and counted 16 bits each;
  indices are int16 (``index_bits=16``) or int32, counted at their width.
* Codes are clamped above at ``levels`` as well (the official clamps below only; its float32 scale
  never leaves the range, the stored fp16 minimum can); the scale is floored at 2^-24
  (:mod:`methods.groupquant`), where the official divides by zero on a constant group.
* Arithmetic in float32 (float64 for float64 inputs); the state holds the stored tensors alone,
  each grown along its block axis, and attention reads the reconstruction D + S + L of every block
  (one pass over all of them, each block computed as when it was compressed) in the model's dtype,
  a transient copy (docs/design.md §2).
* Attention of a chunk of queries: :func:`methods.blocked_attention.blocked_attention`, one fused
  SDPA call over the chunk with a mask that gives each query the compressed keys/values before its
  block start and the exact ones from it (a long CPU chunk: one call per n_b-block of queries);
  a single decode step reads the decoded blocks followed by the fp16 buffer.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .attention import causal_attention, work_dtype
from .base import KVMethod, LayerState, Regime, Unsupported, held_bits, query_positions
from .blocked_attention import blocked_attention
from .bookkeeping import decode_ops, host_ops
from .budget import (AT_TARGET, describe, no_joint_pair, over_ceiling, scored_reads, side_unreachable, spread,
                     under_ceiling, unreachable)
from .buffers import Growing
from .groupquant import fp16_scale_min
from .joint_budget import best_pair
from .packing import pack_bits, unpack_bits

FIT_BITS = tuple(range(1, 9))
GROUP_GRID = (32, 64, 128)
MAX_BLOCK = 256
SPARSITY_GRID = (0.0, 0.01, 0.02)
RANK_GRID = (1, 2, 3, 4)
#: the run templates' GEAR setting (docs/methods.md §15.6): b, G, s, r, n_b
PAPER = {"bits": 2, "group": 64, "sparsity": 0.02, "rank": 2, "block": 64}
PAPER_PROMPT_RANK = 4
LEVELS = ("harness", "official")
KCOUNTS = ("harness", "official")
PROMPTS = ("chunked", "one_block")
BUDGETS = ("measured", "nominal")
SIDE_KNOBS = ("bits", "group", "sparsity", "rank")
_EPS = 1e-9


# ---- one side's codec -------------------------------------------------------------------------

@dataclass(frozen=True)
class SideCodec:
    """The knobs of one side (``"k"``: per-channel keys, ``"v"``: per-token values)."""

    side: str
    bits: int
    group: int
    sparsity: float
    rank: int
    levels_rule: str = "harness"
    kcount: str = "harness"
    index_bits: int = 16
    loop: int = 3

    def __post_init__(self):
        if self.side not in ("k", "v"):
            raise ValueError(f"gear: side must be 'k' or 'v', got {self.side!r}")
        if not (isinstance(self.bits, int) and 1 <= self.bits <= 8):
            raise ValueError(f"gear: bits must be an integer in 1..8, got {self.bits!r}")
        if not (isinstance(self.group, int) and self.group >= 1):
            raise ValueError(f"gear: group must be a positive integer, got {self.group!r}")
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"gear: sparsity must be in [0, 1), got {self.sparsity!r}")
        if not (isinstance(self.rank, int) and self.rank >= 0):
            raise ValueError(f"gear: rank must be a non-negative integer, got {self.rank!r}")
        if self.levels_rule not in LEVELS:
            raise ValueError(f"gear: levels must be one of {LEVELS}, got {self.levels_rule!r}")
        if self.kcount not in KCOUNTS:
            raise ValueError(f"gear: kcount must be one of {KCOUNTS}, got {self.kcount!r}")
        if self.index_bits not in (16, 32):
            raise ValueError(f"gear: index_bits must be 16 or 32, got {self.index_bits!r}")
        if not (isinstance(self.loop, int) and self.loop >= 1):
            raise ValueError(f"gear: loop must be a positive integer, got {self.loop!r}")
        if self.levels == 0:
            raise ValueError("gear: levels=official with b = 1 on the sparse path gives b^2 - 1 = 0 levels")

    @property
    def levels(self) -> int:
        """Top code: 2^b - 1, or b^2 - 1 on the official sparse path (§15.2)."""
        if self.levels_rule == "official" and self.sparsity > 0:
            return self.bits**2 - 1
        return (1 << self.bits) - 1

    @property
    def code_bits(self) -> int:
        """Bits per stored code: enough for levels + 1 values."""
        return max(1, math.ceil(math.log2(self.levels + 1)))

    def outliers(self, n: int, heads: int, d: int, batch: int = 1) -> int:
        """k, the outliers per side of each vector (k largest and k smallest), §15.3."""
        if self.sparsity <= 0:
            return 0
        if self.kcount == "official":
            return int(int(batch * heads * n * d * self.sparsity) / batch / n / 2)
        length = n if self.side == "k" else heads * d
        return math.floor(self.sparsity * length / 2 + _EPS)

    def block_bits(self, n: int, heads: int, d: int) -> int:
        """Exact stored bits of one block of n tokens over all heads (what ``stored_bits`` counts):
        codes, fp16 scale and minimum per group, outlier values (16) and indices, fp16 factors."""
        k = self.outliers(n, heads, d)
        elements = heads * n * d
        groups = elements // self.group
        n_out = 2 * k * (heads * d if self.side == "k" else n)
        factors = heads * 16 * self.rank * (n + d)
        return elements * self.code_bits + 32 * groups + n_out * (16 + self.index_bits) + factors

    def cost(self, n: int, heads: int, d: int) -> float:
        """Bits per element of a compressed block (§15.7 without the buffer share)."""
        return self.block_bits(n, heads, d) / (heads * n * d)

    def check(self, n: int, heads: int, d: int) -> None:
        """Raise ValueError when a block of n tokens cannot be coded with these knobs."""
        length = n if self.side == "k" else heads * d
        if length % self.group:
            what = "n_b" if self.side == "k" else f"H_kv d = {heads * d}"
            raise ValueError(f"gear: {self.side} group {self.group} must divide {what} (got {length})")
        if self.rank > min(n, d):
            raise ValueError(f"gear: rank {self.rank} exceeds min(n, d) = {min(n, d)}")
        k = self.outliers(n, heads, d)
        if 2 * k > (n if self.side == "k" else heads * d):
            raise ValueError(f"gear: {2 * k} outliers per vector exceed its length")


# ---- the pure tensor steps --------------------------------------------------------------------

def fill_outliers(x: torch.Tensor, k: int):
    """§15.3 along the last axis: the k smallest and k largest entries replaced by the vector's mean
    (all entries, outliers included). Returns (filled, indices [.., 2k], values [.., 2k]), smallest
    first (the official order of the restoring scatters)."""
    if k == 0:
        return x, None, None
    lo_v, lo_i = torch.topk(x, k, dim=-1, largest=False)
    hi_v, hi_i = torch.topk(x, k, dim=-1, largest=True)
    mean = x.mean(dim=-1, keepdim=True)
    idx = torch.cat([lo_i, hi_i], dim=-1)
    filled = x.scatter(-1, idx, mean.expand(*idx.shape))
    return filled, idx, torch.cat([lo_v, hi_v], dim=-1)


def restore_outliers(x: torch.Tensor, idx, vals) -> torch.Tensor:
    """Write the stored outliers back (smallest first, then largest, as the official)."""
    if idx is None:
        return x
    k = idx.shape[-1] // 2
    idx = idx.long()
    vals = vals.to(x.dtype)
    x = x.scatter(-1, idx[..., :k], vals[..., :k])
    return x.scatter(-1, idx[..., k:], vals[..., k:])


def backbone_codes(xg: torch.Tensor, levels: int):
    """Asymmetric min-max over the last axis of groups ``xg`` (§15.2) with the stored fp16 scale and
    minimum: (codes as floats, fp16 scale, fp16 minimum, dequantized groups)."""
    s16, mn16 = fp16_scale_min(xg, float(levels))
    scale, low = s16.to(xg.dtype)[..., None], mn16.to(xg.dtype)[..., None]
    q = ((xg - low) / scale).round().clamp(0, levels)
    return q, s16, mn16, q * scale + low


def power_iteration(r: torch.Tensor, omega: torch.Tensor, loop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§15.4 ``fake_poweriteration_group`` on R [..., n, d] from Omega [..., d, r]: (Q [..., n, r],
    P [..., d, r]) with L = Q P^T; QR only in the last of the ``loop`` rounds (of Omega, then of q)."""
    p = omega
    q = None
    for i in range(loop):
        if i == loop - 1:
            p = torch.linalg.qr(p).Q
        q = r @ p
        if i == loop - 1:
            q = torch.linalg.qr(q).Q
        p = r.transpose(-1, -2) @ q
    return q, p


def _mix(*parts: int) -> int:
    """A deterministic 63-bit seed from integers."""
    h = 0
    for v in parts:
        h = (h * 1_000_003 + int(v) + 1) % (2**63 - 1)
    return h


def draw_omegas(seed: int, layer: int, side: str, blocks: int, n: int, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """Omega ~ U[0,1) [B, H, d, r] (``shape``) for ``blocks`` blocks of ``n`` tokens, as the view
    [B, H, blocks, d, r] (§15.4): one draw per (seed, layer, side, block length) from its own
    generator, shared by every block of that layer and side, so that any set of blocks (a whole
    pass, or one block at a time while decoding) is compressed identically, with one draw."""
    side_id = 0 if side == "k" else 1
    g = torch.Generator().manual_seed(_mix(seed, layer, side_id, n))
    omega = torch.rand(shape, generator=g, dtype=torch.float64).to(device=like.device, dtype=like.dtype)
    return omega[:, :, None].expand(shape[0], shape[1], blocks, *shape[2:])


@dataclass
class GearPacked:
    """The stored form of J blocks of n tokens of one side: packed codes, fp16 scale and minimum per
    group, outlier indices and values, fp16 low-rank factors Q [B, H, J, n, r] and P [B, H, J, d, r].
    Keys: codes and groups per (B, H, J, channel) along tokens, outliers [B, H, J, d, 2k] (token
    index in the block); values: per (B, J, token) along the H d vector, outliers [B, J, n, 2k]."""

    side: str
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    out_idx: torch.Tensor | None
    out_val: torch.Tensor | None
    q: torch.Tensor | None
    p: torch.Tensor | None
    code_bits: int
    group: int
    shape: tuple  # (B, H, J, n, d)
    dtype: torch.dtype

    def bits(self) -> int:
        """Stored bits, measured from the tensors (outlier values at 16 bits each)."""
        total = 8 * self.codes.numel() + 16 * (self.scale.numel() + self.minimum.numel())
        if self.out_idx is not None:
            total += 8 * self.out_idx.element_size() * self.out_idx.numel() + 16 * self.out_val.numel()
        if self.q is not None:
            total += 16 * (self.q.numel() + self.p.numel())
        return total


def _vectors(x: torch.Tensor, side: str) -> torch.Tensor:
    """[B, H, J, n, d] -> the vectors S and D act on: keys [B, H, J, d, n] (channels along tokens),
    values [B, J, n, H d] (a token's concatenated heads)."""
    if side == "k":
        return x.transpose(-1, -2)
    b, h, j, n, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(b, j, n, h * d)


def _blocks_of(vecs: torch.Tensor, side: str, shape: tuple) -> torch.Tensor:
    """Inverse of :func:`_vectors`."""
    if side == "k":
        return vecs.transpose(-1, -2)
    b, h, j, n, d = shape
    return vecs.reshape(b, j, n, h, d).permute(0, 3, 1, 2, 4)


def sparse_backbone(x: torch.Tensor, codec: SideCodec):
    """D + S of blocks x [B, H, J, n, d] (work dtype): (D + S, codes, scale, minimum, idx, vals)."""
    b, h, _, n, d = x.shape
    vecs = _vectors(x, codec.side)
    filled, idx, vals = fill_outliers(vecs, codec.outliers(n, h, d, b))
    xg = filled.reshape(*filled.shape[:-1], -1, codec.group)
    q, s16, mn16, deq = backbone_codes(xg, codec.levels)
    ds = restore_outliers(deq.reshape(filled.shape), idx, vals)
    return _blocks_of(ds, codec.side, x.shape), q, s16, mn16, idx, vals


def _code_rows(side: str, shape: tuple) -> tuple:
    """Leading axes of the packed code rows, one row per block: keys (B, H, J), values (B, J)."""
    b, h, j = shape[:3]
    return (b, h, j) if side == "k" else (b, j)


def encode_blocks(x: torch.Tensor, codec: SideCodec, n: int, omega: torch.Tensor | None):
    """Compress m = J n tokens x [B, H, m, d] as J blocks of n: (GearPacked, reconstruction
    D + S + L [B, H, m, d] in x's dtype). ``omega`` [B, H, J, d, r] (None when r = 0)."""
    b, h, m, d = x.shape
    if m % n:
        raise ValueError(f"gear: {m} tokens are not a whole number of {n}-token blocks")
    codec.check(n, h, d)
    dt = work_dtype(x)
    xb = x.to(dt).reshape(b, h, m // n, n, d)
    ds, q, s16, mn16, idx, vals = sparse_backbone(xb, codec)
    codes = pack_bits(q.to(torch.uint8).reshape(*_code_rows(codec.side, xb.shape), -1), codec.code_bits)
    qf = pf = None
    hat = ds
    if codec.rank:
        qf, pf = power_iteration(xb - ds, omega.to(dt), codec.loop)
        qf, pf = qf.half(), pf.half()
        hat = ds + qf.to(dt) @ pf.to(dt).transpose(-1, -2)
    if idx is not None:
        idx = idx.to(torch.int16 if codec.index_bits == 16 else torch.int32)
        vals = vals.to(x.dtype)
    packed = GearPacked(codec.side, codes, s16, mn16, idx, vals, qf, pf, codec.code_bits, codec.group,
                        tuple(xb.shape), x.dtype)
    return packed, hat.reshape(b, h, m, d).to(x.dtype)


def decode_blocks(packed: GearPacked) -> torch.Tensor:
    """D + S + L [B, H, J n, d] read back from the stored tensors alone."""
    b, h, j, n, d = packed.shape
    dt = torch.float64 if packed.dtype == torch.float64 else torch.float32
    vec_shape = (b, h, j, d, n) if packed.side == "k" else (b, j, n, h * d)
    q = unpack_bits(packed.codes, packed.code_bits, n * d * (1 if packed.side == "k" else h), dtype=torch.uint8)
    q = q.to(dt)
    xg = q.reshape(*vec_shape[:-1], -1, packed.group)
    deq = xg * packed.scale.to(dt)[..., None] + packed.minimum.to(dt)[..., None]
    vecs = restore_outliers(deq.reshape(vec_shape), packed.out_idx, packed.out_val)
    x = _blocks_of(vecs, packed.side, packed.shape)
    if packed.q is not None:
        x = x + packed.q.to(dt) @ packed.p.to(dt).transpose(-1, -2)
    return x.reshape(b, h, j * n, d).to(packed.dtype)


# ---- budget: the measured headline and the fit ------------------------------------------------

def headline(cost: float, block: int, regime: Regime, prompt_cost: float | None = None) -> float:
    """The measured bpd of one side in ``regime`` (docs/methods.md §0): the mean over the scored
    positions of what each read, bits / tokens held, with ``cost`` bits per compressed element,
    16 per buffered one. Query p reads n_b floor(p / n_b) tokens compressed (the prefill's own
    prediction: the stored prompt). ``prompt_cost``: the one-block prompt's cost (``prompt=
    "one_block"`` after a prefill)."""
    held, quant = scored_reads(regime, block, "k")
    bits = quant * cost + (held - quant) * 16.0
    if prompt_cost is not None and regime.kind == "prefill":
        m = block * (regime.tokens // block)
        bits = bits + m * (prompt_cost - cost)
    return float((bits / held).mean())


def _side_points(side: str, target: float, heads: int, d: int, block: int, regime: Regime, opts: dict,
                 budget: str, prompt_rank: int | None) -> list:
    """(predicted, preference, knobs) of every grid point of one side at n_b = ``block``."""
    length = block if side == "k" else heads * d
    out, seen = [], set()
    for b in FIT_BITS:
        for g in GROUP_GRID:
            if length % g:
                continue
            for s in SPARSITY_GRID:
                for r in RANK_GRID:
                    if r > min(block, d):
                        continue
                    try:
                        codec = SideCodec(side, b, g, s, r, **opts)
                    except ValueError:
                        continue
                    k = codec.outliers(block, heads, d)
                    if (b, g, k, r) in seen:
                        continue
                    seen.add((b, g, k, r))
                    pred = _predict(codec, block, heads, d, regime, budget, prompt_rank)
                    miss = abs(pred - target) / target
                    out.append((pred, (b, -g, r, k, -miss), {"bits": b, "group": g, "sparsity": s, "rank": r}))
    return out


def _predict(codec: SideCodec, block: int, heads: int, d: int, regime: Regime, budget: str,
             prompt_rank: int | None) -> float:
    cost = codec.cost(block, heads, d)
    if budget == "nominal":
        return cost
    prompt_cost = None
    if prompt_rank is not None and regime.kind == "prefill" and regime.tokens >= block:
        m = block * (regime.tokens // block)
        prompt_cost = dataclasses.replace(codec, rank=min(prompt_rank, m, d)).cost(m, heads, d)
    return headline(cost, block, regime, prompt_cost)


def block_grid() -> tuple[int, ...]:
    """n_b tried by the fit: multiples of the smallest group up to :data:`MAX_BLOCK`."""
    g = min(GROUP_GRID)
    return tuple(range(g, MAX_BLOCK + 1, g))


def _best_per_family(points: list) -> list:
    """Of one side's points at one n_b, the most preferred of each (b, r), in preference order."""
    best: dict = {}
    for x in points:
        fam = (x[2]["bits"], x[2]["rank"])
        if fam not in best or x[1] > best[fam][1]:
            best[fam] = x
    return sorted(best.values(), key=lambda x: x[1], reverse=True)


def admissible_fits(target_k: float, target_v: float | None, heads: int, d: int, regime: Regime, opts: dict,
                    budget: str = "measured", prompt_rank: int | None = None) -> list[dict]:
    """The admissible grid points (predicted bpd under the ceiling of each target,
    :func:`methods.budget.under_ceiling`, docs/methods.md §0.1), one n_b for both sides, in the
    preference of the module docstring (keys first, values second). With a value target, at each
    n_b the pairs of each side's most preferred point of each (b, r) (every pair would be up to
    288 x 288 per n_b)."""
    ranked = []
    for nb in block_grid():
        keys = [x for x in _side_points("k", target_k, heads, d, nb, regime, opts, budget, prompt_rank)
                if under_ceiling(x[0], target_k)]
        keys = keys if target_v is None else _best_per_family(keys)
        vals = [None] if target_v is None else _best_per_family(
            [x for x in _side_points("v", target_v, heads, d, nb, regime, opts, budget, prompt_rank)
             if under_ceiling(x[0], target_v)])
        ranked += [((k[1], () if v is None else v[1]), _fit(nb, k, v)) for k in keys for v in vals]
    ranked.sort(key=lambda x: x[0], reverse=True)
    return [fit for _, fit in ranked]


def _fit(nb: int, k, v) -> dict:
    return {"block": nb, "k": k[2], "v": None if v is None else v[2], "predicted_bpd_k": k[0],
            "predicted_bpd_v": None if v is None else v[0]}


def knob_options(fit: dict) -> dict:
    """The knobs of a fit (what ``Gear.use_knobs`` takes): n_b and each side's b, G, s, r."""
    return {"block": fit["block"], "k": fit["k"], "v": fit["v"]}


def chosen_fit(choice: dict, target_k: float, target_v: float | None, heads: int, d: int, regime: Regime,
               opts: dict, budget: str = "measured", prompt_rank: int | None = None) -> dict:
    """The fit of the knobs ``choice`` ({"block", "k", "v"}); :class:`Unsupported` unless both
    sides code a block and are under their ceilings."""
    nb = int(choice["block"])
    out = {"block": nb, "k": choice["k"], "v": choice["v"] if target_v is not None else None}
    for side, target in (("k", target_k), ("v", target_v)):
        if target is None:
            out["predicted_bpd_v"] = None
            continue
        knobs = out[side]
        try:
            codec = SideCodec(side, int(knobs["bits"]), int(knobs["group"]), float(knobs["sparsity"]),
                              int(knobs["rank"]), **opts)
            codec.check(nb, heads, d)
        except (ValueError, TypeError, KeyError) as err:
            raise Unsupported(f"gear: knobs {choice} do not code a block: {err}") from err
        pred = _predict(codec, nb, heads, d, regime, budget, prompt_rank)
        if not under_ceiling(pred, target):
            raise Unsupported(f"gear: knobs {choice} are not admissible: {side} predicts {pred:.3f} over "
                              f"{1 + AT_TARGET:g} x {target:g} in {describe(regime)}")
        out[f"predicted_bpd_{side}"] = pred
    return out


def fit_knobs(target_k: float, target_v: float | None, heads: int, d: int, regime: Regime, opts: dict,
              budget: str = "measured", prompt_rank: int | None = None, choice: dict | None = None) -> dict:
    """The knobs ``choice`` when given and admissible (:func:`chosen_fit`), else the most preferred
    admissible grid point (:func:`admissible_fits`); :class:`Unsupported` when none is."""
    if choice is not None:
        return chosen_fit(choice, target_k, target_v, heads, d, regime, opts, budget, prompt_rank)
    fits = admissible_fits(target_k, target_v, heads, d, regime, opts, budget, prompt_rank)
    if not fits:
        raise Unsupported(why_unreachable(target_k, target_v, heads, d, regime, opts, budget, prompt_rank))
    return fits[0]


def fit_joint(target_kv: float, heads: int, d: int, regime: Regime, opts: dict, budget: str = "measured",
              prompt_rank: int | None = None) -> dict:
    """``joint_kv``: the (key point, value point) pair at one n_b whose mean predicted bpd is within
    :data:`AT_TARGET` of ``target_kv``, the most balanced first (:func:`methods.joint_budget.best_pair`),
    then the per-side preference (keys first); :class:`Unsupported` when none is."""
    pairs = []
    for nb in block_grid():
        keys = _side_points("k", target_kv, heads, d, nb, regime, opts, budget, prompt_rank)
        vals = _side_points("v", target_kv, heads, d, nb, regime, opts, budget, prompt_rank)
        # only pairs near the band go to best_pair: up to 288 x 288 per n_b otherwise
        lo, hi = 2 * target_kv * (1 - AT_TARGET) - _EPS, 2 * target_kv * (1 + AT_TARGET) + _EPS
        pairs += [((k, nb), (v, nb)) for k in keys for v in vals if lo <= k[0] + v[0] <= hi]
    best = best_pair(pairs, lambda p: p[0][0], target_kv, AT_TARGET, lambda kp, vp: (kp[0][1], vp[0][1]))
    if best is None:
        raise Unsupported(no_joint_pair("gear", target_kv, regime, " at one n_b") + "; "
                          + why_unreachable(target_kv, target_kv, heads, d, regime, opts, budget, prompt_rank))
    (k, nb), (v, _) = best
    return {"block": nb, "k": k[2], "v": v[2], "predicted_bpd_k": k[0], "predicted_bpd_v": v[0]}


def why_unreachable(target_k, target_v, heads, d, regime, opts, budget, prompt_rank) -> str:
    """Each side's reachable range on the grid and the points nearest its target."""
    what = ("the per-block figure of docs/methods.md §15.7" if budget == "nominal" else
            f"the measured headline in {describe(regime)}, fp16 buffer included")
    parts = []
    for side, target, name in (("k", target_k, "bpd"), ("v", target_v, "v_bpd")):
        if target is None:
            continue
        pts = [(x[0], nb, x[2]) for nb in block_grid()
               for x in _side_points(side, target, heads, d, nb, regime, opts, budget, prompt_rank)]
        inside = any(under_ceiling(p[0], target) for p in pts)
        why = ("under the ceiling only at an n_b where the other side has no admissible point" if inside
               else over_ceiling(pts, target, lambda p: f"{p[0]:.3f} at (b={p[2]['bits']}, G={p[2]['group']}, "
                                 f"s={p[2]['sparsity']}, r={p[2]['rank']}, n_b={p[1]})", key=lambda x: x[0]))
        parts.append(side_unreachable(name, target, [p[0] for p in pts], f", {why}"))
    grid = (f"b in 1..8, G in {list(GROUP_GRID)}, n_b a multiple of G up to {MAX_BLOCK}, s in "
            f"{list(SPARSITY_GRID)}, r in {list(RANK_GRID)}")
    return unreachable("gear", f"({what}; grid {grid})", parts,
                       " (budget=nominal maps the per-block formula; explicit knobs run as set)")


# ---- the cache ---------------------------------------------------------------------------------

#: the axis along which J blocks stack in each stored part of a side (:class:`GearPacked`)
_BLOCK_AXIS = {"k": {"codes": 2, "scale": 2, "minimum": 2, "out_idx": 2, "out_val": 2, "q": 2, "p": 2},
               "v": {"codes": 1, "scale": 1, "minimum": 1, "out_idx": 1, "out_val": 1, "q": 2, "p": 2}}
_PARTS = ("codes", "scale", "minimum", "out_idx", "out_val", "q", "p")


@dataclass
class _Blocks:
    """Compressed blocks of one length and rank, in position order: each part of
    :class:`GearPacked` grown along its block axis (a decode step's block appends)."""

    side: str
    code_bits: int
    group: int
    n: int  # tokens per block
    dtype: torch.dtype
    key: tuple  # (n, rank, code bits, group, stored parts): what blocks of one run share
    parts: dict = field(default_factory=dict)
    blocks: int = 0

    def append(self, packed: GearPacked) -> None:
        for name in _PARTS:
            x = getattr(packed, name)
            if x is None:
                continue
            buf = self.parts.get(name)
            if buf is None:
                buf = self.parts[name] = Growing(axis=_BLOCK_AXIS[self.side][name], min_spare=1)
            buf.append(x)
        self.blocks += packed.shape[2]

    def decoded(self, heads: int, d: int) -> torch.Tensor:
        """D + S + L of every block [B, H, J n, d] (:func:`decode_blocks`: one pass over all the
        blocks, each computed as when it was compressed)."""
        get = {k: (self.parts[k].data if k in self.parts else None) for k in _PARTS}
        b = get["codes"].shape[0]
        packed = GearPacked(self.side, get["codes"], get["scale"], get["minimum"], get["out_idx"], get["out_val"],
                            get["q"], get["p"], self.code_bits, self.group, (b, heads, self.blocks, self.n, d),
                            self.dtype)
        return decode_blocks(packed)


@dataclass
class _Side:
    """One side's cache: the compressed blocks (positions < ``n_comp``; runs of blocks of one
    length and rank, :class:`_Blocks`) and the fp16 buffer ``tail`` (positions ``n_comp..``);
    ``ends``/``cum`` the end position and cumulative stored bits of each compressed block."""

    codec: SideCodec | None
    tail: Growing = field(default_factory=lambda: Growing(min_spare=4))
    runs: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    cum: list = field(default_factory=list)
    n_comp: int = 0
    _shape: tuple | None = None  # (B, H, d)

    @property
    def packed_bits(self) -> int:
        return self.cum[-1] if self.cum else 0

    @property
    def n(self) -> int:
        return self.n_comp + self.tail.n

    def compressed_bits_at(self, end: int) -> int:
        """Stored bits of the blocks ending at or before position ``end``."""
        i = bisect.bisect_right(self.ends, end)
        return self.cum[i - 1] if i else 0

    def compressed_bits(self, ends: torch.Tensor) -> torch.Tensor:
        """:meth:`compressed_bits_at` elementwise (float64 CPU)."""
        if not self.ends:
            return torch.zeros_like(ends)
        e = torch.tensor(self.ends, dtype=torch.float64)
        c = torch.tensor([0.0] + [float(x) for x in self.cum], dtype=torch.float64)
        return c[torch.searchsorted(e, ends, right=True)]

    def exact_tail(self, x_new: torch.Tensor) -> torch.Tensor:
        """Positions n_comp.. at full precision once ``x_new`` is appended (a new tensor or x_new)."""
        if not self.tail.n:
            return x_new
        return torch.cat([self.tail.data, x_new.to(self.tail.data.dtype)], dim=2)

    def append(self, x_new: torch.Tensor) -> None:
        self._shape = (x_new.shape[0], x_new.shape[1], x_new.shape[3])
        self.tail.append(x_new)

    def compress(self, upto: int, n: int, omega_fn, rank: int | None = None) -> torch.Tensor | None:
        """Compress positions n_comp..upto-1 as blocks of n tokens and drop them from the fp16
        buffer; returns their reconstruction (None when nothing completed)."""
        m = upto - self.n_comp
        if m <= 0 or self.codec is None:
            return None
        codec = self.codec if rank is None else dataclasses.replace(self.codec, rank=rank)
        x = self.tail.data[:, :, :m]
        starts = range(self.n_comp, upto, n)
        omega = omega_fn(len(starts), n, (x.shape[0], x.shape[1], x.shape[3], codec.rank)) if codec.rank else None
        packed, hat = encode_blocks(x, codec, n, omega)
        key = (n, codec.rank, codec.code_bits, codec.group, tuple(k for k in _PARTS if getattr(packed, k) is not None))
        run = self.runs[-1] if self.runs else None
        if run is None or run.key != key:
            run = _Blocks(codec.side, codec.code_bits, codec.group, n, x.dtype, key)
            self.runs.append(run)
        run.append(packed)
        per_block = packed.bits() // len(starts)
        for s in starts:
            self.ends.append(s + n)
            self.cum.append(self.packed_bits + per_block)
        self.tail.drop_front(m)
        self.n_comp = upto
        return hat

    def decoded(self) -> torch.Tensor | None:
        """The compressed positions [B, H, n_comp, d] read back from the stored blocks."""
        with decode_ops():
            return self._decoded()

    def _decoded(self) -> torch.Tensor | None:
        if not self.n_comp:
            return None
        _, h, d = self._shape
        parts = [run.decoded(h, d) for run in self.runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def read(self) -> torch.Tensor | None:
        """What a single query at the next position reads: the compressed blocks decoded, then the
        fp16 buffer."""
        with decode_ops():
            hat = self._decoded()
            if hat is None:
                return self.tail.data
            return hat if not self.tail.n else torch.cat([hat, self.tail.data], dim=2)

    def reads(self, n_read, ends, row: int):
        """Bits held when a query reads ``n_read`` tokens, those below ``ends`` compressed."""
        if isinstance(ends, torch.Tensor):
            comp = self.compressed_bits(ends)
        else:
            comp = self.compressed_bits_at(ends)
        return held_bits(n_read, ends, 0.0, 16.0 * row, comp)

    def stored_bits(self, row: int) -> int:
        return self.packed_bits + self.tail.n * 16 * row


@dataclass
class GearLayerState(LayerState):
    layer: int
    block: int
    key_codec: SideCodec
    value_codec: SideCodec | None
    seed: int
    prompt: str = "chunked"
    prompt_rank: int | None = None
    k: _Side = field(init=False)
    v: _Side = field(init=False)
    _seen: int = 0

    def __post_init__(self):
        self.k = _Side(self.key_codec)
        self.v = _Side(self.value_codec)

    def _omega_fn(self, side: str, like: torch.Tensor):
        dt = work_dtype(like)
        probe = torch.empty(0, dtype=dt, device=like.device)
        return lambda blocks, n, shape: draw_omegas(self.seed, self.layer, side, blocks, n, shape, probe)

    def _compress(self, upto: int, like: torch.Tensor, n: int | None = None, rank: int | None = None):
        """Compress both sides up to position ``upto``; their new reconstructions (or None)."""
        n = n or self.block
        return (self.k.compress(upto, n, self._omega_fn("k", like), rank),
                self.v.compress(upto, n, self._omega_fn("v", like), rank))

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        nb = self.block
        if prefill:
            self.store_prompt(k, v)
            return causal_attention(q, k, v, scaling)
        n0, t = self._seen, k.shape[2]
        n = n0 + t
        if t == 1:  # the query at n0 reads the compressed blocks below n_b floor(n0/n_b): the cache as stored
            self.k.append(k)
            self.v.append(v)
            out = causal_attention(q, self.k.read(), self.v.read(), scaling)
            self._compress(nb * (n // nb), k)
            self._seen = n
            self._reads = self._read_bits(n0, 1, k)
            return out
        c0 = self.k.n_comp
        before = self.k.decoded(), self.v.decoded()
        k_ex = self.k.exact_tail(k)
        v_ex = None if self.value_codec is None else self.v.exact_tail(v)
        self.k.append(k)
        self.v.append(v)
        new = self._compress(nb * (n // nb), k)
        self._seen = n
        with host_ops():
            self._reads = self._read_bits(n0, t, k)
        k_all, v_all = (_joined(p, x, side.tail.data) for p, x, side in zip(before, new, (self.k, self.v)))
        return self._chunk_attention(q, k_all, v_all, k_ex, v_ex, c0, n, scaling)

    def _chunk_attention(self, q, k_all, v_all, k_ex, v_ex, c0, n, scaling):
        """Queries n0..n-1: those of the n_b-block at B = j n_b read the compressed reconstruction
        below B and the exact tokens from B on (§15.5), K and V alike; positions below ``c0`` were
        compressed before the chunk (``k_all``, ``v_all``: every position, compressed ones in their
        reconstruction). :func:`methods.blocked_attention.blocked_attention` (one masked SDPA call,
        or one call per n_b-block of queries for long CPU chunks)."""
        kp, k_hat = k_all[:, :, :c0], k_all[:, :, c0:n]
        vp = v_all[:, :, :c0]
        if self.value_codec is None:  # one version of the values: exact
            return blocked_attention(q, kp, k_ex, k_hat, self.block, vp, v_all[:, :, c0:n], None, None, scaling)
        return blocked_attention(q, kp, k_ex, k_hat, self.block, vp, v_ex, v_all[:, :, c0:n], None, scaling)

    def store_prompt(self, k, v) -> None:
        """Store a P-token prompt as GEAR does at the end of an exact prefill: its first
        n_b floor(P/n_b) tokens compressed (``chunked``: n_b-token blocks at rank r; ``one_block``:
        one block at rank r_p), the rest in the fp16 buffer."""
        if self._seen:
            raise ValueError("prefill must be the first call on a layer state")
        p, nb = k.shape[2], self.block
        m = nb * (p // nb)
        self.k.append(k)
        self.v.append(v)
        if self.prompt == "one_block" and m:
            rank = min(self.prompt_rank if self.prompt_rank is not None else PAPER_PROMPT_RANK, m, k.shape[3])
            self._compress(m, k, n=m, rank=rank)
        else:
            self._compress(m, k)
        self._seen = p
        self._reads = None

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, H, n, d] as a single query at the next position reads them, in the model's
        dtype."""
        return self.k.read(), self.v.read()

    def _read_bits(self, n0, t, k):
        """Per query position p: K and V below n_b floor(p / n_b) compressed, the rest at 16 bits."""
        nb, row = self.block, k.shape[0] * k.shape[1] * k.shape[3]
        if t == 1:
            end = nb * (n0 // nb)
            bits_k = torch.tensor([self.k.reads(n0 + 1, end, row)], dtype=torch.float64)
            bits_v = torch.tensor([self.v.reads(n0 + 1, end if self.value_codec else 0, row)],
                                  dtype=torch.float64)
            return bits_k, bits_v
        p = query_positions(n0, t)
        ends = nb * torch.floor(p / nb)
        bits_v = self.v.reads(p + 1, ends if self.value_codec else torch.zeros_like(p), row)
        return self.k.reads(p + 1, ends, row), bits_v

    def stored_bits(self):
        if self.k._shape is None:
            return 0, 0
        b, h, d = self.k._shape
        row = b * h * d
        return self.k.stored_bits(row), self.v.stored_bits(row)

    @property
    def n_seen(self):
        return self._seen



def _joined(*parts) -> torch.Tensor:
    """The non-empty parts concatenated along the token axis."""
    parts = [p for p in parts if p is not None and p.shape[2]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


# ---- the method --------------------------------------------------------------------------------

@dataclass
class Gear(KVMethod):
    """GEAR (Kang et al., arXiv 2403.05527), docs/methods.md §15; see the module docstring.

    bits/group/sparsity/rank: the key side's b, G, s, r; ``v_`` forms: the value side's; block: n_b.
    None = fitted by ``configure`` (any given = run as set, the rest at the §15.6 setting).
    levels: "harness" (2^b - 1) | "official" (b^2 - 1 on the sparse path); kcount: "harness" |
    "official" (the outlier count of §15.3); index_bits: 16 | 32; loop: power-iteration rounds;
    prompt: "chunked" | "one_block" (the prefill's blocks, §15.5/§15.8) with prompt_rank (r_p);
    budget: "measured" | "nominal"; seed: Omega's seed (None = the torch seed at ``configure``);
    joint_kv: with both targets, fit their mean instead of each side (:func:`fit_joint`)."""

    name = "gear"
    seeded = True

    bits: int | None = None
    group: int | None = None
    sparsity: float | None = None
    rank: int | None = None
    v_bits: int | None = None
    v_group: int | None = None
    v_sparsity: float | None = None
    v_rank: int | None = None
    block: int | None = None
    levels: str = "harness"
    kcount: str = "harness"
    index_bits: int = 16
    loop: int = 3
    prompt: str = "chunked"
    prompt_rank: int | None = None
    budget: str = "measured"
    seed: int | None = None
    joint_kv: bool = False

    def __post_init__(self):
        for name, value, choices in (("levels", self.levels, LEVELS), ("kcount", self.kcount, KCOUNTS),
                                     ("prompt", self.prompt, PROMPTS), ("budget", self.budget, BUDGETS)):
            if value not in choices:
                raise ValueError(f"gear: {name} must be one of {choices}, got {value!r}")
        if self.index_bits not in (16, 32):
            raise ValueError(f"gear: index_bits must be 16 or 32, got {self.index_bits!r}")
        if self.block is not None and (isinstance(self.block, bool) or int(self.block) != self.block
                                       or self.block < 1):
            raise ValueError(f"gear: block must be a positive integer (or null), got {self.block!r}")

    def _opts(self) -> dict:
        return {"levels_rule": self.levels, "kcount": self.kcount, "index_bits": self.index_bits,
                "loop": self.loop}

    def _explicit(self) -> list[str]:
        names = [*SIDE_KNOBS, *(f"v_{k}" for k in SIDE_KNOBS), "block"]
        return [f"{k}={getattr(self, k)}" for k in names if getattr(self, k) is not None]

    def _side(self, side: str, knobs: dict | None) -> SideCodec | None:
        if knobs is None:
            return None
        return SideCodec(side, int(knobs["bits"]), int(knobs["group"]), float(knobs["sparsity"]),
                         int(knobs["rank"]), **self._opts())

    def _given(self, prefix: str) -> dict:
        return {k: (getattr(self, prefix + k) if getattr(self, prefix + k) is not None else PAPER[k])
                for k in SIDE_KNOBS}

    def configure(self, shape, bpd_k, bpd_v):
        h, d = shape.n_kv_heads, shape.head_dim
        self._shape = (h, d)
        self._seed = self.seed if self.seed is not None else torch.initial_seed()
        explicit = self._explicit()
        self._fit = self._not_fitted = None
        prompt_rank = self._prompt_rank() if self.prompt == "one_block" else None
        joint = self.joint_kv and bpd_k is not None and bpd_v is not None
        if joint and not explicit:
            fit = fit_joint((float(bpd_k) + float(bpd_v)) / 2, h, d, self.regime, self._opts(), self.budget,
                            prompt_rank)
        elif bpd_k is not None and not explicit:
            fit = fit_knobs(float(bpd_k), None if bpd_v is None else float(bpd_v), h, d, self.regime,
                            self._opts(), self.budget, prompt_rank, self.chosen_knobs)
        if bpd_k is not None and not explicit:
            block, kk, vk = fit["block"], fit["k"], fit["v"]
            self._fit = {"regime": dataclasses.asdict(self.regime), "band": AT_TARGET, "budget": self.budget,
                         "predicted_bpd_k": fit["predicted_bpd_k"], "predicted_bpd_v": fit["predicted_bpd_v"]}
            if joint:
                self._fit["joint_kv"] = (float(bpd_k) + float(bpd_v)) / 2
            else:
                self._fit["chosen_by"] = "held-out knob search" if self.chosen_knobs else "preference"
        else:
            block = self.block or PAPER["block"]
            kk = self._given("")
            vk = self._given("v_") if (bpd_v is not None or self.v_bits is not None) else None
            self._not_fitted = ("no key target: the run templates' GEAR setting (docs/methods.md §15.6)"
                                if bpd_k is None else
                                f"explicit knobs ({', '.join(explicit)}): not fitted to the target, reported "
                                "at the measured bpd")
        self._resolved = (int(block), self._side("k", kk), self._side("v", vk))
        self._check()

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: the fit's admissible points are chosen among on held-out text."""
        return () if self._explicit() else ("knobs",)

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The admissible points of the fit in the job's regime (side by side; none for
        ``joint_kv`` with both targets), :func:`admissible_fits`: the §15.6 setting first when
        admissible, then one point per (b, r) of the keys (and of the values in the KV-track) in
        turn, the most bits and the largest rank first, each family's points in preference order
        (:func:`methods.budget.spread`)."""
        if bpd_k is None or self._explicit() or (self.joint_kv and bpd_v is not None):
            return []
        h, d = shape.n_kv_heads, shape.head_dim
        tv = None if bpd_v is None else float(bpd_v)
        prompt_rank = self._prompt_rank() if self.prompt == "one_block" else None
        fits = admissible_fits(float(bpd_k), tv, h, d, self.regime, self._opts(), self.budget, prompt_rank)
        side = {k: PAPER[k] for k in SIDE_KNOBS}
        paper = {"block": PAPER["block"], "k": side, "v": None if tv is None else dict(side)}
        try:
            chosen_fit(paper, float(bpd_k), tv, h, d, self.regime, self._opts(), self.budget, prompt_rank)
        except Unsupported:
            paper = None

        def family(o):
            v = o["v"] or {"bits": 0, "rank": 0}
            return o["k"]["bits"], o["k"]["rank"], v["bits"], v["rank"]

        return spread([knob_options(f) for f in fits], family, limit, first=paper)

    def _prompt_rank(self) -> int:
        return self.prompt_rank if self.prompt_rank is not None else PAPER_PROMPT_RANK

    def _knobs(self):
        resolved = getattr(self, "_resolved", None)
        if resolved is None:
            raise RuntimeError("gear: call configure(shape, bpd_k, bpd_v) before new_layer_state()")
        return resolved

    def _check(self):
        block, kc, vc = self._knobs()
        h, d = self._shape
        kc.check(block, h, d)
        if vc is not None:
            vc.check(block, h, d)

    def new_layer_state(self, layer):
        block, kc, vc = self._knobs()
        return GearLayerState(layer, block, kc, vc, self._seed, self.prompt,
                              self._prompt_rank() if self.prompt == "one_block" else None)

    def knobs(self):
        block, kc, vc = self._knobs()
        h, d = self._shape

        def side(c):
            if c is None:
                return None
            return {"bits": c.bits, "group": c.group, "sparsity": c.sparsity, "rank": c.rank,
                    "outliers_per_vector": 2 * c.outliers(block, h, d), "levels": c.levels,
                    "code_bits": c.code_bits, "block_bpd": c.cost(block, h, d)}

        out = {"block": block, "k": side(kc), "v": side(vc), "levels": self.levels, "kcount": self.kcount,
               "index_bits": self.index_bits, "loop": self.loop, "prompt": self.prompt,
               "prompt_rank": self._prompt_rank() if self.prompt == "one_block" else None,
               "budget": self.budget, "seed": self._seed, "fitted": self._fit is not None, "fit": self._fit,
               "predicted": self._predicted()}
        if self._not_fitted:
            out["not_fitted"] = self._not_fitted
        return out

    def _predicted(self) -> dict:
        """The measured headline the knobs give in the job's regime."""
        block, kc, vc = self._knobs()
        h, d = self._shape
        pr = self._prompt_rank() if self.prompt == "one_block" else None
        pk = _predict(kc, block, h, d, self.regime, "measured", pr)
        pv = 16.0 if vc is None else _predict(vc, block, h, d, self.regime, "measured", pr)
        return {"regime": dataclasses.asdict(self.regime), "bpd_k": pk, "bpd_v": pv}

    def nominal_bpd(self, n_tokens):
        """End of a sequence of ``n_tokens`` (chunked blocks): n_b floor(T/n_b) tokens compressed."""
        block, kc, vc = self._knobs()
        h, d = self._shape
        t = n_tokens
        m = block * (t // block)

        def one(c):
            return 16.0 if c is None else (m * c.cost(block, h, d) + 16.0 * (t - m)) / t

        return one(kc), one(vc)
