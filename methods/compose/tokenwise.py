"""A token eviction holding the tokens of a token-wise codec (``CodecLayerState``: FP16, KQ-SVD,
KV-COBRA and later ones): each kept token costs the codec's bits, an evicted one nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerState
from ..codec_state import Codec
from .positions import KeptPositions, position_bits
from .view import (
    ComposedState,
    gather_rope,
    gather_tokens,
    kept_positions,
    read_counts,
    rotate,
    state_token_bits,
)


@dataclass
class TokenwiseComposedState(ComposedState):
    """An eviction state holding token-wise-decoded tokens; bits = held tokens x codec bits per
    token + the eviction's state + (a pre-RoPE key codec) the held positions, :class:`KeptPositions`,
    rebuilt after every call from the eviction's kept set."""

    evict: LayerState
    key_codec: Codec
    value_codec: Codec

    def __post_init__(self):
        self._codec_bits = [0, 0]  # bits of every encode call, K and V
        self._encoded = 0  # token slots (all heads) encoded
        self._positions: KeptPositions | None = None

    @property
    def stores_positions(self) -> bool:
        return bool(self.key_codec.pre_rope)

    def _encode(self, k, v, k_pre, cos, sin):
        kc, vc = self.key_codec, self.value_codec
        if kc.pre_rope:
            if k_pre is None or cos is None:
                raise ValueError("a pre-RoPE key codec needs k_pre and rope")
            pk = kc.encode(k_pre)
            k_hat = rotate(kc.decode(pk).to(k.dtype), cos, sin)
        else:
            pk = kc.encode(k)
            k_hat = kc.decode(pk).to(k.dtype)
        pv = vc.encode(v)
        self._codec_bits[0] += kc.bits(pk)
        self._codec_bits[1] += vc.bits(pv)
        self._encoded += k.shape[2]
        return k_hat, vc.decode(pv).to(v.dtype)

    def codec_token_bits(self) -> tuple[float, float]:
        """Codec bits per token slot (all heads and batch), K and V."""
        n = max(self._encoded, 1)
        return self._codec_bits[0] / n, self._codec_bits[1] / n

    def _store_positions(self) -> None:
        if self.stores_positions:
            self._positions = KeptPositions(kept_positions(self.evict), self.evict.n_seen)

    def position_bits(self) -> int:
        """Bits of the stored positions now (0 for a post-RoPE key codec)."""
        return 0 if self._positions is None else self._positions.bits()

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            self._store_positions()
            # a pre-RoPE key is rotated at the position its cache stores
            pos = kept_positions(self.evict) if self._positions is None else self._positions.positions()
            kp = None if k_pre is None else gather_tokens(k_pre, pos)
            cos = sin = None
            if rope is not None:
                cos, sin = gather_rope(rope.cos, pos), gather_rope(rope.sin, pos)
            k_hat, v_hat = self._encode(gather_tokens(k, pos), gather_tokens(v, pos), kp, cos, sin)
            self.evict.replace_kept_kv(k_hat, v_hat)
            self._reads = None
            return out
        cos = sin = None
        if rope is not None:
            cos, sin = rope.cos[:, None], rope.sin[:, None]
        n0 = self.evict.n_seen
        k_hat, v_hat = self._encode(k, v, k_pre, cos, sin)
        out = self.evict.attend(q, k_hat, v_hat, scaling=scaling, prefill=False)
        self._store_positions()
        counts = read_counts(self.evict)
        (ck, cv), (sk, sv) = self.codec_token_bits(), state_token_bits(self.evict)
        reads_k = counts * (ck + sk)
        if self.stores_positions:
            b, h = self._positions.shape[:2]
            seen = torch.arange(n0 + 1, n0 + k.shape[2] + 1, dtype=torch.float64)
            reads_k = reads_k + b * h * position_bits(counts, seen)
        self._reads = (reads_k, counts * (cv + sv))
        return out

    def stored_bits(self):
        n = self.evict.n_kept
        if n == 0:
            return 0, 0
        (ck, cv), (sk, sv) = self.codec_token_bits(), state_token_bits(self.evict)
        return round(n * (ck + sk)) + self.position_bits(), round(n * (cv + sv))
