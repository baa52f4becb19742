"""A cache layer for token-wise codecs: every token is encoded on its own, so Q-all = decoding.

Used by FP16, KQ-SVD, KV-COBRA, KV-COBRA+, KVQuant and TurboQuant (docs/methods.md §4, §5.9: "no
residual window; every token compressed on arrival"). Keys are encoded before RoPE when the key
codec says so (``pre_rope``), then decoded and rotated back to their positions for attention.

Storage: what ``stored_bits`` counts and nothing else (docs/design.md §2). A codec that keeps its
input (:class:`ExactCodec`, and the ``exact_first`` tokens) grows one tensor per side
(:class:`~methods.buffers.Growing`); any other stores the packed parts of each encode call end to
end (:class:`~methods.buffers.CallStore`). A call on an empty layer attends over what the encoder
returns; later calls decode the whole layer into a transient copy, the way a fused kernel reads
the codes: the calls of each run in one batched pass (:meth:`Codec.decode_calls`, the same bits as
decoding each call alone), pre-RoPE keys rotated with the sequence's shared tables
(:class:`~methods.buffers.RopeLog`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from .attention import causal_attention
from .base import LayerState, Rope, apply_rope
from .bookkeeping import decode_ops, host_ops
from .buffers import CallStore, Growing, RopeLog, log_rope


class Codec:
    """Encodes a block [B, H, T, d] into a packed object and back. ``pre_rope`` keys only."""

    pre_rope: bool = False
    #: the packed form is the input itself (no codes): a cache layer keeps it in a growing tensor
    keeps_input: bool = False

    def encode(self, x: torch.Tensor):
        raise NotImplementedError

    def decode(self, packed) -> torch.Tensor:
        raise NotImplementedError

    def bits(self, packed) -> int:
        raise NotImplementedError

    def static_bits(self) -> int:
        """Bits of the per-model constants the codec needs to decode (projections, steps, signs,
        means: docs/methods.md §0 "static bytes"), reported beside bpd, never in it."""
        return 0

    def encode_decode(self, x: torch.Tensor):
        """(packed, decoded) of a block: what a cache layer stores and what its first call reads.
        Codecs override it when they can decode without reading their packed stream back (the
        same result, fewer ops)."""
        packed = self.encode(x)
        return packed, self.decode(packed)

    def parts(self, packed) -> tuple[Hashable, dict, dict]:
        """(layout, parts, ragged) of one encode call, for :class:`methods.buffers.CallStore`:
        what decoding needs besides the tensors (shapes, dtypes), the stored tensors by name, and
        the 1-D stored tensors whose length varies from call to call."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its stored parts")

    def decode_calls(self, layout: Hashable, calls: int, parts: dict, ragged: dict) -> torch.Tensor:
        """[calls, B, H, t, d]: :meth:`decode` of ``calls`` consecutive encode calls of one
        ``layout``, their parts stacked on a new first axis (ragged parts concatenated), computed
        in one batched pass that gives each call the bits decoding it alone gives."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode stored calls")

    def decode_stored(self, store: CallStore) -> torch.Tensor:
        """Every call of ``store`` decoded, [B, H, tokens, d] in the arithmetic dtype, each token
        with the bits :meth:`decode` of its call gives: each run by :meth:`decode_calls`, the runs
        laid end to end."""
        return join_calls([self.decode_calls(*run) for run in store.runs()])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("bhte,hed->bhtd", x[s], w)`` of each of S stacked calls x [S, B, H, t, e] with
    w [H, e, d] -> [S, B, H, t, d], each call with the bits einsum gives it alone. einsum multiplies
    one call as one product per head over the call's (b, t) rows, and a product's rounding may
    depend on how many rows it multiplies at once; so S calls are S products per head, one batched
    product per head with the head's weight broadcast over the calls (not copied S times)."""
    s, b, h, t, e = x.shape
    if s == 1:
        return torch.einsum("bhte,hed->bhtd", x[0], w)[None]
    out = torch.empty(h, s, b * t, w.shape[-1], dtype=torch.result_type(x, w), device=x.device)
    for j in range(h):  # heads, not tokens: a handful of products whatever the number of calls
        torch.bmm(x[:, :, j].reshape(s, b * t, e), w[j].expand(s, e, w.shape[-1]), out=out[j])
    return out.view(h, s, b, t, -1).permute(1, 2, 0, 3, 4)


def join_calls(decoded: list[torch.Tensor]) -> torch.Tensor:
    """Runs of decoded calls [S, B, H, t, d] -> the tokens in order [B, H, sum of S t, d]."""
    parts = []
    for x in decoded:
        s, b, h, t, d = x.shape
        parts.append(x[0] if s == 1 else x.permute(1, 2, 0, 3, 4).reshape(b, h, s * t, d))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def codecs_static_bytes(*codec_lists) -> int:
    """Static bytes of a method's per-layer codecs (:meth:`Codec.static_bits`, rounded up)."""
    bits = sum(c.static_bits() for codecs in codec_lists for c in (codecs or ()))
    return (bits + 7) // 8


@dataclass
class Fp16Packed:
    data: torch.Tensor


class ExactCodec(Codec):
    """Keeps the tensor as it is (the model's own dtype) but counts 16 bits per element.

    The FP16 reference on a float32 CPU model: storing fp16 would round the cache, which the
    uncompressed baseline does not do."""

    keeps_input = True

    def encode(self, x):
        return Fp16Packed(x)

    def decode(self, packed):
        return packed.data

    def bits(self, packed):
        return packed.data.numel() * 16


@dataclass
class TokenSide:
    """One side of a token-wise cache: the tokens stored as they came (``exact``: the
    ``exact_first`` tokens, or every token of a codec that keeps its input) at positions
    0..exact.n-1, then the coded ones (``coded``: the packed parts of each call)."""

    exact: Growing = field(default_factory=Growing)
    coded: CallStore = field(default_factory=CallStore)
    n_coded: int = 0

    def keep(self, codec: Codec, packed, t: int) -> None:
        if codec.keeps_input:
            if self.n_coded:
                raise ValueError("tokens kept as they came must precede the coded ones")
            self.exact.append(codec.decode(packed))
            return
        self.coded.append(*codec.parts(packed))
        self.n_coded += t

    def decode_coded(self, codec: Codec, dtype: torch.dtype) -> torch.Tensor:
        """The coded tokens [B, H, n_coded, d] decoded (:meth:`Codec.decode_stored`) and cast to
        ``dtype`` (the cast of the per-call decode)."""
        return codec.decode_stored(self.coded).to(dtype)


@dataclass
class CodecLayerState(LayerState):
    """Token-wise codecs: every token encoded on arrival. ``exact_first`` tokens at the start of
    the sequence are stored exactly at 16 bits instead (docs/methods.md §5.9's first-token protection of
    outlier sink tokens; cost 16/T per side, counted)."""

    key_codec: Codec
    value_codec: Codec
    exact_first: int = 0
    _k: TokenSide = field(default_factory=TokenSide)
    _v: TokenSide = field(default_factory=TokenSide)
    _rope: RopeLog | None = None  # the sequence's (cos, sin), for a pre-RoPE key codec
    _dtype: torch.dtype | None = None  # the model's dtype: what attention reads
    _seen: int = 0
    _bits: tuple = (0, 0)

    def _encode_keys(self, codec, k, k_pre, rope, decode: bool):
        """(packed, post-RoPE decoded keys or None) of one run of keys."""
        x = k
        if codec.pre_rope:
            if k_pre is None or rope is None:
                raise ValueError("a pre-RoPE key codec needs k_pre and rope")
            x = k_pre
        if not decode:
            return codec.encode(x), None
        packed, k_hat = codec.encode_decode(x)
        k_hat = k_hat.to(k.dtype)
        return packed, (apply_rope(k_hat, rope) if codec.pre_rope else k_hat)

    def _store(self, key_codec, value_codec, k, v, k_pre, rope, decode: bool):
        """Encode and store one run of tokens with one pair of codecs; returns (packed K, packed V,
        decoded K, decoded V) (decoded None unless ``decode``)."""
        k_packed, k_hat = self._encode_keys(key_codec, k, k_pre, rope, decode)
        if decode:
            v_packed, v_hat = value_codec.encode_decode(v)
            v_hat = v_hat.to(v.dtype)
        else:
            v_packed, v_hat = value_codec.encode(v), None
        t = k.shape[2]
        self._k.keep(key_codec, k_packed, t)
        self._v.keep(value_codec, v_packed, t)
        return k_packed, v_packed, k_hat, v_hat

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill and self._seen:
            raise ValueError("prefill must be the first call on a layer state")
        n0, t = self._seen, k.shape[2]
        if self._dtype is None:
            self._dtype = k.dtype
        if self.key_codec.pre_rope and rope is not None:
            self._rope = log_rope(self._rope, n0, rope)
        first = not prefill and not n0  # attends over what the encoder returns
        e = max(0, min(self.exact_first - n0, t))  # tokens of this chunk stored exactly
        runs = []
        if e:
            runs.append((_EXACT, _EXACT, slice(0, e)))
        if e < t:
            runs.append((self.key_codec, self.value_codec, slice(e, t)))
        entries_k, entries_v, hats = [], [], []  # (codec, packed, tokens) per run
        for kc, vc, sl in runs:
            kp, vp, kh, vh = self._store(
                kc, vc, k[:, :, sl], v[:, :, sl], None if k_pre is None else k_pre[:, :, sl],
                None if rope is None else Rope(rope.cos[:, sl], rope.sin[:, sl]), first,
            )
            n = sl.stop - sl.start
            entries_k.append((kc, kp, n))
            entries_v.append((vc, vp, n))
            hats.append((kh, vh))
        prior_k, prior_v = self._bits
        self._bits = (prior_k + sum(c.bits(p) for c, p, _ in entries_k),
                      prior_v + sum(c.bits(p) for c, p, _ in entries_v))
        self._reads = None if prefill else self._call_reads(prior_k, prior_v, entries_k, entries_v)
        self._seen += t
        if prefill:
            return causal_attention(q, k, v, scaling)
        if first:
            keys = hats[0][0] if len(hats) == 1 else torch.cat([h[0] for h in hats], dim=2)
            values = hats[0][1] if len(hats) == 1 else torch.cat([h[1] for h in hats], dim=2)
            return causal_attention(q, keys, values, scaling)
        keys, values = self.read_kv()
        return causal_attention(q, keys, values, scaling)

    def _call_reads(self, prior_k, prior_v, entries_k, entries_v):
        """What each query of the call read (:meth:`LayerState.read_bits`): the bits held before it
        plus the call's bits spread evenly over each run's tokens."""
        return (cumulative_bits(prior_k, [(n, c.bits(p)) for c, p, n in entries_k]),
                cumulative_bits(prior_v, [(n, c.bits(p)) for c, p, n in entries_v]))

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, H, n, d] as a query at the next position reads them, in the model's dtype:
        the exact tokens as stored, the coded ones decoded (keys rotated to their positions). A
        side stored exactly is returned as it is held (no copy); otherwise a new tensor."""
        with decode_ops():
            return self._read(self._k, self.key_codec, True), self._read(self._v, self.value_codec, False)

    def _read(self, side: TokenSide, codec: Codec, keys: bool) -> torch.Tensor:
        exact = side.exact.data
        if not side.n_coded:
            return exact
        x = side.decode_coded(codec, self._dtype)
        if keys and codec.pre_rope:
            start = side.exact.n
            x = apply_rope(x, self._rope.rope(start, start + side.n_coded))
        return x if exact is None else torch.cat([exact, x], dim=2)

    def stored_bits(self):
        return self._bits

    @property
    def n_seen(self):
        return self._seen


_EXACT = ExactCodec()


def cumulative_bits(prior: float, runs: list[tuple[int, float]]) -> torch.Tensor:
    """Bits held after each new token, float64 CPU [sum of tokens]: ``prior`` plus the runs'
    bits (tokens, bits), spread evenly over each run's tokens. One run is a straight line (one
    op, on the host: :func:`methods.bookkeeping.host_ops`); one token (a decode step) no tensor
    arithmetic at all."""
    if len(runs) == 1 and runs[0][0] == 1:
        return torch.tensor([prior + runs[0][1]], dtype=torch.float64)
    with host_ops():  # CPU tensors: no kernel on a GPU (methods.bookkeeping.HOST_RANGE)
        if len(runs) == 1:
            n, b = runs[0]
            return torch.linspace(prior + b / n, prior + b, n, dtype=torch.float64)
        per = torch.cat([torch.full((n,), b / n, dtype=torch.float64) for n, b in runs])
        return per.cumsum_(0).add_(prior)
