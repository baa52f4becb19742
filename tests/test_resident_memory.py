"""Resident memory follows the stored bytes (docs/design.md §2).

A codec's layer state holds its stored representation and nothing else between calls: after a
prefill and decode steps, the bytes of the tensors the states hold are at most 1.15x what
``stored_bits`` counts, and what the layers share (the RoPE tables of a pre-RoPE codec) is counted
apart, once, and is no larger than one layer's K and V at 16 bits. The tiny random Llama runs in
bf16, the dtype of the GPU runs, so a full-precision token takes the 16 bits it is counted at.

Decoding the stored calls together (what attention reads after the first call) gives every call
the bits decoding it alone gives, for every codec of the token-wise cache.
"""

from __future__ import annotations

import pytest
import torch

from conftest import configured_method, tiny_llama
from kvbench.bench.memory import resident_bytes, shared_bytes
from kvbench.fit.statistics import collect_stats
from kvbench.model.integrate import attach
from methods.buffers import CallStore
from methods.codec_state import CodecLayerState

P, STEPS = 960, 8
RESIDENT_LIMIT = 1.15
CODECS = [
    ("kivi", {"residual": 32, "group": 16, "v_group": 16}, 4.0, 3.0),
    ("kvquant", {"fisher": False}, 2.0, 3.0),
    ("gear", {}, 8.0, 8.0),
    ("turboquant", {}, 2.0, 3.0),
    ("svdq", {"group": 16, "v_group": 16}, 1.5, 3.0),
    ("svdq", {"group": 16}, 2.0, None),
    ("kqsvd", {}, 1.0, 4.0),
    ("cobra_mse", {}, 2.0, None),
    ("cobra_kl", {}, 0.5, 4.0),
    ("cobra_plus", {}, 1.0, 2.0),
]


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1)
    g = torch.Generator().manual_seed(0)
    stats = collect_stats(model, torch.randint(0, 128, (4, 64), generator=g), sample_tokens=256)
    return model.to(torch.bfloat16), stats


@pytest.mark.parametrize("name,options,bpd,v_bpd", CODECS, ids=lambda x: str(x))
def test_states_hold_their_stored_bytes(one_thread, model_and_stats, name, options, bpd, v_bpd):
    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, P + STEPS), generator=torch.Generator().manual_seed(4))
    comp = attach(model, method)
    try:
        with torch.no_grad(), comp.session():
            comp.forward(ids[:, :P], 0, prefill=True)
            for t in range(P, P + STEPS):
                comp.forward(ids[:, t : t + 1], t, prefill=False)
            stored = sum(k + v for k, v in (s.stored_bits() for s in comp.states[0])) / 8
            static: set = set()
            resident_bytes(method, static)  # per-model constants
            shared: list = []
            resident = resident_bytes(comp.states[0], static, shared=shared)
            scratch = shared_bytes(shared, static)
            n = comp.states[0][0].n_seen
    finally:
        comp.detach()
    cfg = model.config
    one_layer = 2 * cfg.num_key_value_heads * n * cfg.head_dim * 2  # K and V of one layer at 16 bits
    assert resident <= RESIDENT_LIMIT * stored, (resident, stored, resident / stored)
    assert scratch <= one_layer, (scratch, one_layer)


TOKENWISE = [
    ("kqsvd", {}, 1.0, 4.0),
    ("kqsvd", {"quantize": False}, 1.0, None),
    ("cobra_mse", {}, 2.0, 3.0),
    ("cobra_kl", {}, 0.5, 4.0),
    ("cobra_plus", {}, 1.0, 2.0),
    ("kvquant", {"outliers": 0.01, "bits": 3, "v_bits": 3, "fisher": False}, None, None),
    ("turboquant", {"k_variant": "prod", "split": True}, 3.5, 3.0),
    ("turboquant", {}, 2.0, 3.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,options,bpd,v_bpd", TOKENWISE, ids=lambda x: str(x))
def test_stored_calls_decode_together_as_each_alone(model_and_stats, name, options, bpd, v_bpd, dtype):
    """Calls of several lengths and batch 2 (runs of equal calls among them), stored end to end:
    decoding them together equals decoding each call alone, bit for bit, for both codecs."""
    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    state = method.new_layer_state(1)
    assert isinstance(state, CodecLayerState)
    cfg = model.config
    g = torch.Generator().manual_seed(7)
    for codec in (state.key_codec, state.value_codec):
        if codec.keeps_input:
            continue
        store, alone = CallStore(), []
        for t in (37, 1, 1, 1, 5, 5, 1, 1):
            x = torch.randn(2, cfg.num_key_value_heads, t, cfg.head_dim, generator=g, dtype=dtype) * 3
            packed = codec.encode(x)
            store.append(*codec.parts(packed))
            alone.append(codec.decode(packed))
        assert torch.equal(codec.decode_stored(store), torch.cat(alone, dim=2))
