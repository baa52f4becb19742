"""A cache layer for token-wise codecs: every token is encoded on its own, so Q-all = decoding.

Used by FP16, KQ-SVD and KV-COBRA (docs/methods.md §4, §5.9: "no residual window; every token
compressed on arrival"). Keys are encoded before RoPE when the key codec says so (``pre_rope``),
then decoded and rotated back to their positions for attention.

Storage: the packed codes (counted by ``stored_bits``) plus a decoded working copy that the
attention reads; a fused kernel would dequantize on the fly instead, so the working copy is not
part of the cache's bits. The working copy grows in a preallocated buffer (:class:`Growing`), so a
decode step writes its token instead of copying the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import causal_attention
from .base import LayerState, Rope, apply_rope
from .bookkeeping import host_ops
from .buffers import Growing


class Codec:
    """Encodes a block [B, H, T, d] into a packed object and back. ``pre_rope`` keys only."""

    pre_rope: bool = False

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
        """(packed, decoded) of a block: what a cache layer stores and the working copy it reads.
        Codecs override it when they can decode without reading their packed stream back (the
        same result, fewer ops)."""
        packed = self.encode(x)
        return packed, self.decode(packed)


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

    def encode(self, x):
        return Fp16Packed(x)

    def decode(self, packed):
        return packed.data

    def bits(self, packed):
        return packed.data.numel() * 16


@dataclass
class CodecLayerState(LayerState):
    """Token-wise codecs: every token encoded on arrival. ``exact_first`` tokens at the start of
    the sequence are stored exactly at 16 bits instead (docs/methods.md §5.9's first-token protection of
    outlier sink tokens; cost 16/T per side, counted)."""

    key_codec: Codec
    value_codec: Codec
    exact_first: int = 0
    _k_packed: list = field(default_factory=list)
    _v_packed: list = field(default_factory=list)
    _k: Growing = field(default_factory=Growing)  # decoded working copy, post-RoPE
    _v: Growing = field(default_factory=Growing)
    _seen: int = 0
    _bits: tuple = (0, 0)

    def _encode_keys(self, codec, k, k_pre, rope):
        if codec.pre_rope:
            if k_pre is None or rope is None:
                raise ValueError("a pre-RoPE key codec needs k_pre and rope")
            packed, k_hat = codec.encode_decode(k_pre)
            return packed, apply_rope(k_hat.to(k.dtype), rope)
        packed, k_hat = codec.encode_decode(k)
        return packed, k_hat.to(k.dtype)

    def _store(self, key_codec, value_codec, k, v, k_pre, rope):
        """Encode one run of tokens with one pair of codecs; returns decoded (k, v) and their bits."""
        k_packed, k_hat = self._encode_keys(key_codec, k, k_pre, rope)
        v_packed, v_hat = value_codec.encode_decode(v)
        self._k_packed.append((key_codec, k_packed))
        self._v_packed.append((value_codec, v_packed))
        return k_hat, v_hat.to(v.dtype), key_codec.bits(k_packed), value_codec.bits(v_packed)

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill and self._seen:
            raise ValueError("prefill must be the first call on a layer state")
        n0, t = self._seen, k.shape[2]
        e = max(0, min(self.exact_first - n0, t))  # tokens of this chunk stored exactly
        runs = []
        if e:
            runs.append((_EXACT, _EXACT, slice(0, e)))
        if e < t:
            runs.append((self.key_codec, self.value_codec, slice(e, t)))
        bits_k, bits_v = [], []  # (tokens, bits) per run
        for kc, vc, sl in runs:
            kh, vh, bk, bv = self._store(
                kc, vc, k[:, :, sl], v[:, :, sl], None if k_pre is None else k_pre[:, :, sl],
                None if rope is None else Rope(rope.cos[:, sl], rope.sin[:, sl]),
            )
            self._k.append(kh)
            self._v.append(vh)
            n = sl.stop - sl.start
            bits_k.append((n, bk))
            bits_v.append((n, bv))
        prior_k, prior_v = self._bits
        self._bits = (prior_k + sum(b for _, b in bits_k), prior_v + sum(b for _, b in bits_v))
        self._reads = None if prefill else (cumulative_bits(prior_k, bits_k), cumulative_bits(prior_v, bits_v))
        self._seen += t
        if prefill:
            return causal_attention(q, k, v, scaling)
        return causal_attention(q, self._k.data, self._v.data, scaling)

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
