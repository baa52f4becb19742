"""A cache layer for token-wise codecs: every token is encoded on its own, so Q-all = decoding.

Used by FP16, KQ-SVD and KV-COBRA (METHODS.md §4, §5.9: "no residual window; every token
compressed on arrival"). Keys are encoded before RoPE when the key codec says so (``pre_rope``),
then decoded and rotated back to their positions for attention.

Storage: the packed codes (counted by ``stored_bits``) plus a decoded working copy that the
attention reads; a fused kernel would dequantize on the fly instead, so the working copy is not
part of the cache's bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import causal_attention
from .base import LayerState, Rope, apply_rope


class Codec:
    """Encodes a block [B, H, T, d] into a packed object and back. ``pre_rope`` keys only."""

    pre_rope: bool = False

    def encode(self, x: torch.Tensor):
        raise NotImplementedError

    def decode(self, packed) -> torch.Tensor:
        raise NotImplementedError

    def bits(self, packed) -> int:
        raise NotImplementedError


@dataclass
class Fp16Packed:
    data: torch.Tensor


class Fp16Codec(Codec):
    """Stores 16-bit floats: the uncompressed baseline, 16 bits per element."""

    def encode(self, x):
        return Fp16Packed(x.to(torch.bfloat16) if x.dtype == torch.bfloat16 else x.half())

    def decode(self, packed):
        return packed.data

    def bits(self, packed):
        return packed.data.numel() * 16


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
    key_codec: Codec
    value_codec: Codec
    _k_packed: list = field(default_factory=list)
    _v_packed: list = field(default_factory=list)
    _k: torch.Tensor | None = None
    _v: torch.Tensor | None = None
    _seen: int = 0

    def _encode_keys(self, k, k_pre, rope):
        if self.key_codec.pre_rope:
            if k_pre is None or rope is None:
                raise ValueError("a pre-RoPE key codec needs k_pre and rope")
            packed = self.key_codec.encode(k_pre)
            return packed, apply_rope(self.key_codec.decode(packed).to(k.dtype), rope)
        packed = self.key_codec.encode(k)
        return packed, self.key_codec.decode(packed).to(k.dtype)

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        k_packed, k_hat = self._encode_keys(k, k_pre, rope)
        v_packed = self.value_codec.encode(v)
        v_hat = self.value_codec.decode(v_packed).to(v.dtype)
        self._k_packed.append(k_packed)
        self._v_packed.append(v_packed)
        if prefill and self._k is not None:
            raise ValueError("prefill must be the first call on a layer state")
        if prefill:
            out = causal_attention(q, k, v, scaling)
        self._k = k_hat if self._k is None else torch.cat([self._k, k_hat], dim=2)
        self._v = v_hat if self._v is None else torch.cat([self._v, v_hat], dim=2)
        self._seen += k.shape[2]
        if not prefill:
            out = causal_attention(q, self._k, self._v, scaling)
        return out

    def stored_bits(self):
        return (
            sum(self.key_codec.bits(p) for p in self._k_packed),
            sum(self.value_codec.bits(p) for p in self._v_packed),
        )

    @property
    def n_seen(self):
        return self._seen
