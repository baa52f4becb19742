"""GEAR's layer state (docs/methods.md §15.5): the compressed blocks and the fp16 buffer of each
side, the streaming rule (a block is compressed once the buffer holds n_b tokens, after the
attention of the step that filled it), attention over a chunk of queries and the bits each read.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import torch

from .attention import causal_attention, work_dtype
from .base import LayerState, held_bits, query_positions
from .blocked_attention import blocked_attention
from .bookkeeping import decode_ops, host_ops
from .buffers import Growing
from .gear_codec import PAPER_PROMPT_RANK, GearPacked, SideCodec, decode_blocks, draw_omegas, encode_blocks

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
