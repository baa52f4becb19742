"""FP16: the uncompressed reference (METHODS.md §0: bpd = 16). Identity on every tensor."""

from __future__ import annotations

from dataclasses import dataclass

from .base import KVMethod, Unsupported
from .codec_state import CodecLayerState, ExactCodec


@dataclass
class Fp16(KVMethod):
    name = "fp16"

    def configure(self, shape, bpd_k, bpd_v):
        for side, target in (("bpd", bpd_k), ("v_bpd", bpd_v)):
            if target is not None and target != 16:
                raise Unsupported(f"fp16 stores 16 bits per element; {side}={target} is not 16")

    def new_layer_state(self, layer):
        return CodecLayerState(ExactCodec(), ExactCodec())

    def nominal_bpd(self, n_tokens):
        return 16.0, 16.0
