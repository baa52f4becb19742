"""The real SmolLM2-135M (30 layers, 9 query / 3 KV heads, d = 64): the in-pass simulation equals
decoding through the compressed cache, and an exact codec reproduces FP16 (docs/methods.md §1.3).

The in-pass-vs-decoding checks through a rounding quantizer run the model in float64. In float32,
one forward of 256 tokens and 256 one-token forwards give keys ~1e-5 apart (the BLAS kernels block
the matmuls differently); a code ``floor(c/Δ)`` within that distance of a boundary flips, moves a
key by a whole step and every later logit with it (max |Δlogit| ~2 on AVX-512 MKL kernels, 0 on
AVX2 ones). Whether a flip happens depends on the CPU, not on the method; in float64 the two paths
agree to rounding noise on any CPU, which isolates the method's own logic.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvbench.fit.statistics import collect_stats
from kvbench.model.integrate import attach, model_shape
from methods import build_method

pytestmark = [pytest.mark.slow, pytest.mark.numerics]
T = 256


@pytest.fixture(scope="module")
def setup(smollm2):
    from kvbench.data.text import corpus_text
    from kvbench.data.windows import encode

    ids = encode(smollm2.tokenizer, corpus_text("ptb", "test")[:20_000])
    stats = collect_stats(smollm2.model, ids[: 4 * T].view(4, T))
    return smollm2.model, ids[4 * T : 5 * T][None], stats


def _method(model, stats, name, bpd, v_bpd=None, **options):
    method = build_method(name, **options)
    method.configure(model_shape(model), bpd, v_bpd)
    if method.needs_calibration:
        method.calibrate(stats, seed=0)
    return method


@contextlib.contextmanager
def float64(model):
    """The model in float64 for the duration (SmolLM2 135M: cheap), then back to float32."""
    model.to(torch.float64)
    try:
        yield model
    finally:
        model.to(torch.float32)


def _in_pass_and_steps(model, method, ids):
    comp = attach(model, method)
    try:
        with torch.no_grad():
            in_pass = model(input_ids=ids, use_cache=False).logits
            with comp.session():
                steps = torch.cat(
                    [comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(ids.shape[1])], 1
                )
    finally:
        comp.detach()
    return in_pass, steps


def test_cobra_without_quantization_at_full_rank_is_fp16(setup):
    model, ids, stats = setup
    method = _method(model, stats, "cobra_kl", 8.0, quantize=False)
    assert set(method.knobs()["ranks"]) == {64}  # full rank in every head
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        comp = attach(model, method)
        try:
            out = model(input_ids=ids, use_cache=False).logits
        finally:
            comp.detach()
    assert (out - ref).abs().max() < 1e-3


@pytest.mark.parametrize(
    "name,bpd,v_bpd,options",
    [("cobra_kl", 1.0, None, {})],  # H2O: tests/test_integration.py and tests/test_h2o.py (fast)
)
def test_in_pass_equals_decoding_on_smollm2(setup, name, bpd, v_bpd, options):
    """Calibrated on the float32 model's statistics, run in float64 (see the module docstring)."""
    model, ids, stats = setup
    with float64(model):
        method = _method(model, stats, name, bpd, v_bpd, **options)
        in_pass, steps = _in_pass_and_steps(model, method, ids)
    assert in_pass.dtype == torch.float64
    # measured 6e-14 with MKL_CBWR=AVX512 (in float32: 1.95 there, 2.5e-4 with MKL_CBWR=AVX2)
    assert (in_pass - steps).abs().max() < 1e-4


def test_kivi_in_pass_equals_decoding_on_smollm2_in_float64(setup):
    """KIVI's residual rule (§2.3) on the real model. With a min-max scale over a ~2-wide range, a
    few of the 30 x 3 x 64 x 32 codes of a group sit within float32's ~1e-5 path difference of a
    rounding boundary and flip; in float64 they do not (see the module docstring)."""
    model, ids, _ = setup
    with float64(model):
        method = _method(model, None, "kivi", 3.0, 3.0, residual=32)
        assert method.knobs()["bits"] == 2 and method.knobs()["group"] == 32
        in_pass, steps = _in_pass_and_steps(model, method, ids)
    assert (in_pass - steps).abs().max() < 1e-4  # measured 8e-6 (was 2.4 in float32)
