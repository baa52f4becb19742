"""GEAR's codec (Kang et al., arXiv 2403.05527; opengear-project/GEAR
``GEARLM/Simulated/compress_function.py``): a block of n tokens X ~ D + S + L, the uniform backbone
D (§15.2), the exact sparse outliers S (§15.3) and the low-rank residual L from the power iteration
(§15.4), as pure tensor steps and the stored form of blocks. docs/methods.md §15.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import work_dtype
from .groupquant import fp16_scale_min
from .packing import pack_bits, unpack_bits

#: the run templates' GEAR setting (docs/methods.md §15.6): b, G, s, r, n_b
PAPER = {"bits": 2, "group": 64, "sparsity": 0.02, "rank": 2, "block": 64}
PAPER_PROMPT_RANK = 4
LEVELS = ("harness", "official")
KCOUNTS = ("harness", "official")
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
    [B, H, blocks, d, r] (§15.4): one draw [H, d, r] per (seed, layer, side, block length) from its
    own generator, shared by every block of that layer and side and by every row, so that any set
    of blocks (a whole pass, or one block at a time while decoding) and any batch of rows is
    compressed as each row alone, with one draw."""
    side_id = 0 if side == "k" else 1
    g = torch.Generator().manual_seed(_mix(seed, layer, side_id, n))
    omega = torch.rand((1, *shape[1:]), generator=g, dtype=torch.float64).to(device=like.device, dtype=like.dtype)
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
