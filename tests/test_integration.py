"""Methods inside a real transformers model (docs/design.md §2, docs/methods.md §1.3).

The central invariant: the single teacher-forced pass (Q-all: perplexity track A, zero-shot) must
give exactly what token-by-token decoding through the compressed cache gives. Every method but
SnapKV (which has no single-pass form) is checked on a tiny random Llama with GQA.
"""

from __future__ import annotations

import pytest
import torch

from conftest import configured_method, tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.compressed_lm import CompressedLM, NotInPass
from kvbench.model.integrate import attach
from methods.fp16 import Fp16

pytestmark = pytest.mark.numerics

T = 80
# (name, options, bpd, v_bpd): budgets that exercise each method's machinery on 80 tokens
CASES = [
    ("kivi", {"residual": 32, "group": 16, "v_group": 16}, 4.0, 3.0),
    ("svdq", {"group": 16}, 2.0, None),
    ("kqsvd", {}, 1.0, 4.0),
    ("cobra_mse", {}, 1.0, None),
    ("cobra_kl", {}, 0.5, 4.0),
    ("cobra_kl", {"c2": False, "rotation": "none"}, 2.0, None),
    ("gear", {"block": 16, "group": 8, "sparsity": 0.25, "rank": 2, "v_bits": 3, "v_group": 8,
              "v_sparsity": 0.1, "v_rank": 1}, 4.0, 3.0),
    ("turboquant", {}, 2.0, 3.0),
    ("kvquant", {"bits": 2, "v_bits": 3, "outliers": 0.05, "fisher": False}, 2.0, 3.0),
    ("h2o", {}, 4.0, None),
]


def _stats(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    # with the key/value sample: KVQuant fits its signposts on it, the calibrated step uses it
    return collect_stats(model, torch.randint(0, 128, (4, 64), generator=g), sample_tokens=256)


def _step_by_step(comp, ids):
    with comp.session():
        return torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(ids.shape[1])], 1)


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1)
    return model, _stats(model)


# Exactness checks through a rounding quantizer in float64
@pytest.fixture(scope="module")
def model64_and_stats():
    """The same tiny Llama in float64. In float32 one pass and per-token passes differ by ~2e-7
    (BLAS kernels); a code within that distance of a rounding boundary flips on some CPUs and not
    on others (tests/test_smollm2.py). In float64 the paths agree to ~1e-16 on any CPU."""
    model = tiny_llama(seed=1).to(torch.float64)
    return model, _stats(model)


def test_fp16_state_path_is_bit_identical_to_the_unpatched_model(model_and_stats):
    model, _ = model_and_stats
    ids = torch.randint(0, 128, (1, T))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        comp = attach(model, Fp16())
        try:
            patched = model(input_ids=ids, use_cache=False).logits
            stepped = _step_by_step(comp, ids)
        finally:
            comp.detach()
        after = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(patched, ref)
    assert (stepped - ref).abs().max() < 1e-5
    assert torch.equal(after, ref)  # detach restores the model


@pytest.mark.parametrize("name,options,bpd,v_bpd", CASES, ids=lambda x: str(x))
def test_in_pass_equals_token_by_token_decoding(model64_and_stats, name, options, bpd, v_bpd):
    model, stats = model64_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        comp = attach(model, method)
        try:
            in_pass = model(input_ids=ids, use_cache=False).logits
            bpd_in_pass = comp.measured_bpd()
            stepped = _step_by_step(comp, ids)
            bpd_stepped = comp.measured_bpd()
        finally:
            comp.detach()
    assert (in_pass - stepped).abs().max() < 1e-4
    assert (in_pass - ref).abs().max() > 1e-3  # the method really changed the computation
    assert bpd_in_pass == pytest.approx(bpd_stepped)


@pytest.mark.parametrize("name,options,bpd,v_bpd", CASES[:2] + CASES[-1:], ids=lambda x: str(x))
def test_prefill_then_chunk_equals_prefill_then_steps(model64_and_stats, name, options, bpd, v_bpd):
    """Track B scores its targets in one chunk; that must equal decoding them one by one."""
    model, stats = model64_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    p = 50
    with torch.no_grad():
        comp = attach(model, method)
        try:
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=True)
                chunk = comp.forward(ids[:, p:], p, prefill=False)
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=True)
                steps = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(p, T)], 1)
        finally:
            comp.detach()
    assert (chunk - steps).abs().max() < 1e-4


def test_measured_bpd_of_a_codec_in_the_model(model_and_stats):
    model, stats = model_and_stats
    method = configured_method(model, "cobra_kl", {}, 1.0, 4.0, stats)
    comp = attach(model, method)
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, T)), use_cache=False)
        k, v = comp.measured_bpd()
    finally:
        comp.detach()
    assert k == pytest.approx(1.0, abs=1e-9) and v == pytest.approx(4.0, abs=1e-9)


def test_snapkv_has_no_single_pass_but_scores_and_generates(model_and_stats):
    model, _ = model_and_stats
    method = configured_method(model, "snapkv", {"window": 8, "kernel": 3}, 4.0, None, None)
    lm = CompressedLM(model, None, attach(model, method))
    try:
        ids = torch.randint(0, 128, (1, T))
        with pytest.raises(NotInPass, match="prefill"):
            lm.logits(ids)
        logprobs = lm.score(ids[:, :60], ids[:, 60:])
        assert logprobs.shape == (1, T - 60) and torch.isfinite(logprobs).all()
        k, v = lm.measured_bpd
        # C = max(W + 1, round(60 * 4/16)) = 15 prompt tokens kept, 19 decoded, 79 seen
        assert k == v == pytest.approx(16 * (15 + 19) / 79)
        assert len(lm.generate(ids[:, :60], 5)) == 5
    finally:
        lm.compressor.detach()


def test_generation_matches_the_plain_model_for_fp16(model_and_stats):
    model, _ = model_and_stats
    ids = torch.randint(0, 128, (1, 20))
    plain = CompressedLM(model, None).generate(ids, 8)
    comp = attach(model, Fp16())
    try:
        ours = CompressedLM(model, None, comp).generate(ids, 8)
    finally:
        comp.detach()
    assert ours == plain


def test_single_sequence_forms_refuse_a_batch(model_and_stats):
    model, _ = model_and_stats
    comp = attach(model, Fp16())
    try:
        with pytest.raises(ValueError, match="_rows"):
            CompressedLM(model, None, comp).generate(torch.zeros(2, 8, dtype=torch.long), 2)
    finally:
        comp.detach()


def test_attaching_twice_is_an_error(model_and_stats):
    model, _ = model_and_stats
    comp = attach(model, Fp16())
    try:
        with pytest.raises(RuntimeError, match="already attached"):
            attach(model, Fp16())
    finally:
        comp.detach()
