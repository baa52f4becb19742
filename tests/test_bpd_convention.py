"""Measured bpd, convention v2 (METHODS.md §0): what the cache held when each query read it.

Every method's mean-over-positions figure (PPL track A, zero-shot) is checked against a direct
computation from its storage rule (METHODS.md §2.3-2.4, §3.3, §4.3, §5.10, §6.3-6.4, §7.3), written
here from the spec and not from the layer states; and the chunked pass against token-by-token
decoding. The prefill-exact figure (track B, generation) is the end of prefill plus the mean over
the decoded positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import configured_method, tiny_llama
from kvbench.calibrate import collect_stats
from kvbench.compressed_lm import CompressedLM, summarize_readings
from kvbench.integrate import attach, model_shape
from methods.kivi import KiviLayerState

T = 80
CASES = [
    ("fp16", {}, None, None),
    ("kivi", {"residual": 32, "group": 16, "v_group": 16}, 4.0, 3.0),
    ("kivi", {"residual": 32, "group": 16}, 3.0, None),
    ("svdq", {"group": 16}, 2.0, None),
    ("kqsvd", {}, 1.0, 4.0),
    ("cobra_kl", {}, 0.5, 4.0),
    ("cobra_kl", {"first_fp16": True}, 1.0, 4.0),
    ("h2o", {}, 4.0, None),
    ("h2o", {"count_indices": True}, 2.0, None),
]


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1).double()
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (4, 64), generator=g))


def direct_bpd(method, shape, t: int) -> tuple[list[float], list[float]]:
    """bpd_K, bpd_V per query position p = 0..t-1 from the METHODS.md storage rules."""
    d = shape.head_dim
    ks, vs = [], []
    knobs = method.knobs()
    for p in range(t):
        n = p + 1  # tokens the query reads
        if method.name == "kivi":  # §2.3: key s quantized iff s < R floor(p/R); value iff s < p - R
            r = knobs["residual"]
            nq = r * (p // r)
            ks.append((nq * (knobs["bits"] + 32 / knobs["group"]) + (n - nq) * 16) / n)
            if knobs["v_bits"] is None:
                vs.append(16.0)
            else:
                nv = max(0, p - r)
                vs.append((nv * (knobs["v_bits"] + 32 / knobs["v_group"]) + (n - nv) * 16) / n)
        elif method.name == "svdq":  # §3.3, calib basis: the KIVI key rule with R = G_t
            g, sched = knobs["group_tokens"], knobs["schedule"]
            active = sum(1 for b in sched if b > 0) / len(sched)
            nq = g * (p // g)
            ks.append((nq * (sum(sched) / len(sched) + active * 32 / g) + (n - nq) * 16) / n)
            vs.append(16.0)
        elif method.name == "h2o":  # §6.3: the query reads min(p, C_{p-1}) kept tokens + itself
            rho, floor = knobs["rho_qall"], knobs["min_budget"]  # the Q-all ρ
            cap_before = max(floor, math.ceil(rho * p - 1e-9)) if p else 0
            kept = min(p, cap_before) + 1
            per = 16 + 16 / d * (2 if knobs["count_indices"] else 1)
            ks.append(kept * per / n)
            vs.append(kept * per / n)
        else:  # token-wise codecs (§4.3, §5.10) and fp16: a fixed cost per token
            k, v = method.nominal_bpd(t)
            first = 16.0 if getattr(method, "first_fp16", False) else None  # §5.9: the sink at 16
            ks.append(k if first is None else (first + p * k) / n)
            vs.append(v if first is None else (first + p * v) / n)
    return ks, vs


@pytest.mark.parametrize("name,options,bpd,v_bpd", CASES, ids=lambda x: str(x))
def test_track_a_mean_over_positions_equals_direct_computation(model_and_stats, name, options, bpd, v_bpd):
    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(5))
    comp = attach(model, method)
    try:
        lm = CompressedLM(model, None, comp)
        lm.logits(ids)
        per_k, per_v = comp.read_bpd()
        reading = lm.readings[-1]
        with comp.session(), torch.no_grad():  # token by token: each step reads one position
            steps = []
            for t in range(T):
                comp.forward(ids[:, t : t + 1], t, prefill=False)
                steps.append(comp.read_bpd())
    finally:
        comp.detach()
    ks, vs = direct_bpd(method, model_shape(model), T)
    # token-wise bit streams pad the last byte of each encode call: < 8 bits per layer and call
    tol = 8 * 2 / (model_shape(model).n_heads_total * model_shape(model).head_dim)
    assert per_k.tolist() == pytest.approx(ks, abs=tol)
    assert per_v.tolist() == pytest.approx(vs, abs=tol)
    assert reading.mean == pytest.approx((sum(ks) / T, sum(vs) / T), abs=tol)
    stepped_k = torch.cat([s[0] for s in steps])
    stepped_v = torch.cat([s[1] for s in steps])
    assert stepped_k.tolist() == pytest.approx(ks, abs=tol)
    assert stepped_v.tolist() == pytest.approx(vs, abs=tol)


def test_kivi_example_of_methods_section_0():
    """KIVI b=2, G=32, R=128 at T=2048: 3.00 at the end of the window, 4.885 over positions.

    METHODS.md §0 quotes 4.86: that is the end-of-sequence formula §2.4 evaluated at every length
    t = p + 1, which counts a block of R keys as quantized from the query at p = R - 1 on; by §2.3
    that query still reads them at full precision (s < R floor(p/R) = 0), hence 4.885."""
    state = KiviLayerState(2, 32, 128, None, None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 64, generator=g) for _ in range(3))
    state.attend(q, k, v, scaling=0.125, prefill=False)
    bits_k, _ = state.read_bits()
    per_position = bits_k / (torch.arange(1, 2049, dtype=torch.float64) * 64)
    assert state.stored_bits()[0] / (2048 * 64) == pytest.approx(3.0)
    assert float(per_position.mean()) == pytest.approx(4.8848, abs=1e-4)


def test_prefill_exact_reports_end_of_prefill_and_the_mean_over_decoded_positions(model_and_stats):
    model, _ = model_and_stats
    method = configured_method(model, "snapkv", {"window": 8, "kernel": 3}, 4.0, None, None)
    lm = CompressedLM(model, None, attach(model, method))
    try:
        ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(2))
        lm.score(ids[:, :60], ids[:, 60:])
        lm.generate(ids[:, :60], 6)
    finally:
        lm.compressor.detach()
    scored, generated = lm.readings
    c = 15  # max(W + 1, round(60 * 4/16)) prompt tokens kept
    assert scored.mean == generated.mean == pytest.approx((16 * c / 60,) * 2)  # end of prefill
    # 19 teacher-forced targets read the kept prompt plus themselves (and the targets before)
    decoded = [16 * (c + i + 1) / (60 + i + 1) for i in range(19)]
    assert scored.decode_mean == pytest.approx((sum(decoded) / 19,) * 2)
    assert scored.end == pytest.approx((16 * (c + 19) / 79,) * 2)
    # generation: 6 tokens, 5 decode steps after the prefill (the last token is never fed back)
    decoded = [16 * (c + i + 1) / (60 + i + 1) for i in range(5)]
    assert generated.decode_mean == pytest.approx((sum(decoded) / 5,) * 2)
    summary = summarize_readings([scored, generated])
    assert summary["measured_k"] == pytest.approx(16 * c / 60)
    assert summary["decode_mean_k"] == pytest.approx(
        (scored.decode_mean[0] * 19 + generated.decode_mean[0] * 5) / 24)


def test_the_plain_model_reads_sixteen_bits(model_and_stats):
    model, _ = model_and_stats
    lm = CompressedLM(model, None)
    ids = torch.randint(0, 128, (1, 20))
    lm.logits(ids)
    lm.score(ids[:, :10], ids[:, 10:])
    summary = summarize_readings(lm.readings)
    assert (summary["measured_k"], summary["measured_v"], summary["end_k"]) == (16.0, 16.0, 16.0)


def test_first_token_protection_keeps_in_pass_equal_to_decoding(model_and_stats):
    """§5.9 ``first_fp16``: the first token is stored exactly; one pass still equals decoding and
    differs from the unprotected codec only through that token."""
    model, stats = model_and_stats
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(9))
    outs = {}
    for flag in (False, True):
        method = configured_method(model, "cobra_kl", {"first_fp16": flag}, 1.0, 4.0, stats)
        comp = attach(model, method)
        try:
            with torch.no_grad():
                in_pass = model(input_ids=ids, use_cache=False).logits
                with comp.session():
                    steps = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(T)], 1)
        finally:
            comp.detach()
        assert (in_pass - steps).abs().max() < 1e-9
        outs[flag] = in_pass
    with torch.no_grad():
        exact_first = model(input_ids=ids[:, :1], use_cache=False).logits[:, 0]
    assert (outs[True][:, 0] - exact_first).abs().max() < 1e-10  # position 0 reads only itself
    assert (outs[True] - outs[False]).abs().max() > 1e-6
