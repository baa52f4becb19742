"""FP16: the uncompressed reference (docs/methods.md §0: bpd = 16). Identity on every tensor.

The baseline whatever ``bpd`` says (docs/design.md §4): a budget target does not apply to it, so
``configure`` accepts any target and the cache always stores 16 bits per element."""

from __future__ import annotations

from dataclasses import dataclass

from .base import KVMethod
from .codec_state import CodecLayerState, ExactCodec


@dataclass
class Fp16(KVMethod):
    name = "fp16"
    rows_in_one_state = True
    holds_last_read = True

    def configure(self, shape, bpd_k, bpd_v):
        """Nothing to choose: 16 bits per element for any target."""

    def new_layer_state(self, layer):
        return CodecLayerState(ExactCodec(), ExactCodec())

    def nominal_bpd(self, n_tokens):
        return 16.0, 16.0
