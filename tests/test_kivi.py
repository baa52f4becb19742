"""KIVI (methods/kivi.py) against a naive per-query implementation of METHODS.md §2.3 and §2.4."""

import math

import pytest
import torch

from methods import build_method
from methods.attention import causal_attention
from methods.base import ModelShape, Unsupported
from methods.groupquant import fake_quantize_groups
from methods.kivi import Kivi, kivi_bpd

B, HKV, HQ, D = 1, 2, 4, 16
SCALING = 1 / math.sqrt(D)


def _qkv(t, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, t, d, generator=g)
    k = torch.randn(B, HKV, t, d, generator=g) * 2 + 0.5
    v = torch.randn(B, HKV, t, d, generator=g)
    return q, k, v


def reference(q, k, v, *, bits, group, residual, v_bits, v_group, prefill_len=0):
    """Naive loop over query positions and heads, float64 softmax, the §2.3 rule verbatim."""
    n = k.shape[2]
    nk = group * (n // group)
    k_hat = k.clone()
    k_hat[:, :, :nk] = fake_quantize_groups(k[:, :, :nk], bits, group, axis=2)
    v_hat = v if v_bits is None else fake_quantize_groups(v, v_bits, v_group, axis=3)
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(n):
        for h in range(q.shape[1]):
            kh = h // g
            keys, vals = [], []
            for s in range(t + 1):
                exact = t < prefill_len
                kq = (not exact) and s < residual * (t // residual)
                vq = (not exact) and v_bits is not None and s < t - residual
                keys.append((k_hat if kq else k)[0, kh, s].double())
                vals.append((v_hat if vq else v)[0, kh, s].double())
            logits = torch.stack(keys) @ q[0, h, t].double() * SCALING
            p = torch.softmax(logits, dim=0)
            out[0, h, t] = p @ torch.stack(vals)
    return out


def _run(method, q, k, v, chunks, prefill_first=False):
    state = method.new_layer_state(0)
    outs, start = [], 0
    for i, c in enumerate(chunks):
        sl = slice(start, start + c)
        outs.append(
            state.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=SCALING,
                         prefill=prefill_first and i == 0)
        )
        start += c
    assert start == k.shape[2]
    return torch.cat(outs, dim=2), state


KNOBS = dict(bits=2, group=8, residual=32, v_bits=3, v_group=8)


def test_chunk_equals_token_by_token_and_reference():
    t = 150
    q, k, v = _qkv(t)
    m = Kivi(**KNOBS)
    full, st_full = _run(m, q, k, v, [t])
    steps, st_steps = _run(m, q, k, v, [1] * t)
    mixed, _ = _run(m, q, k, v, [37, 1, 70, 42])
    assert (full - steps).abs().max() < 1e-5
    assert (full - mixed).abs().max() < 1e-5
    assert st_full.stored_bits() == st_steps.stored_bits()
    ref = reference(q, k, v, **KNOBS)
    assert (full.double() - ref).abs().max() < 1e-5
    # and the quantization does something (the rule is not vacuous)
    exact = causal_attention(q, k, v, SCALING)
    assert (full - exact).abs().max() > 1e-2


def test_query_blocking_is_exact(monkeypatch):
    import methods.kivi as kivi_mod

    t = 120
    q, k, v = _qkv(t, seed=9)
    whole, _ = _run(Kivi(**KNOBS), q, k, v, [t])
    monkeypatch.setattr(kivi_mod, "MAX_LOGIT_ELEMENTS", HQ * t * 7)  # blocks of 7 queries
    blocked, _ = _run(Kivi(**KNOBS), q, k, v, [t])
    assert (whole - blocked).abs().max() < 1e-6


def test_values_exact_when_no_value_bits():
    t = 100
    q, k, v = _qkv(t, seed=1)
    knobs = dict(KNOBS, v_bits=None, v_group=None)
    out, st = _run(Kivi(**knobs), q, k, v, [t])
    ref = reference(q, k, v, **knobs)
    assert (out.double() - ref).abs().max() < 1e-5
    assert st.stored_bits()[1] == B * HKV * t * D * 16


def test_prefill_then_decode_equals_reference():
    t, p = 170, 75
    q, k, v = _qkv(t, seed=2)
    m = Kivi(**KNOBS)
    out, st = _run(m, q, k, v, [p, 1, 1, 30, t - p - 32], prefill_first=True)
    ref = reference(q, k, v, prefill_len=p, **KNOBS)
    assert (out.double() - ref).abs().max() < 1e-5
    # prefill is exact attention
    exact = causal_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], SCALING)
    assert (out[:, :, :p] - exact).abs().max() == 0


def test_stored_state_after_prefill_follows_rule():
    p, r = 75, 32
    q, k, v = _qkv(p, seed=3)
    _, st = _run(Kivi(**KNOBS), q, k, v, [p], prefill_first=True)
    assert st.k.n_quant == p - p % r == 64 and st.k.res.shape[2] == p % r
    assert st.v.n_quant == p - r and st.v.res.shape[2] == r


def test_short_sequence_is_exact():
    t = 31  # < R: everything stays full precision, in Q-all too
    q, k, v = _qkv(t, seed=4)
    out, st = _run(Kivi(**KNOBS), q, k, v, [t])
    assert (out - causal_attention(q, k, v, SCALING)).abs().max() < 1e-6
    assert st.stored_bits() == (B * HKV * t * D * 16,) * 2


@pytest.mark.parametrize("t", [1, 31, 32, 33, 64, 100, 161])
@pytest.mark.parametrize("prefill", [False, True])
def test_measured_bpd_equals_formula(t, prefill):
    q, k, v = _qkv(t, seed=5)
    m = Kivi(**KNOBS)
    _, st = _run(m, q, k, v, [t], prefill_first=prefill)
    bk, bv = st.stored_bits()
    el = B * HKV * t * D
    r = KNOBS["residual"]
    # §2.4 written out independently
    exp_k = ((t - t % r) * (2 + 32 / 8) + 16 * (t % r)) / t
    exp_v = ((t - min(t, r)) * (3 + 32 / 8) + 16 * min(t, r)) / t
    assert bk / el == pytest.approx(exp_k, abs=1e-12)
    assert bv / el == pytest.approx(exp_v, abs=1e-12)
    assert m.nominal_bpd(t) == pytest.approx((exp_k, exp_v), abs=1e-12)


def test_bpd_paper_point_t2048():
    t, d = 2048, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, t, d, generator=g)
    k = torch.randn(1, 1, t, d, generator=g)
    v = torch.randn(1, 1, t, d, generator=g)
    m = Kivi(bits=2, group=32, residual=128, v_bits=2, v_group=32)
    st = m.new_layer_state(0)
    st.attend(q, k, v, scaling=1.0, prefill=True)
    bk, bv = st.stored_bits()
    assert bk / (t * d) == 3.0
    assert bv / (t * d) == 3.8125  # 3.81 in METHODS.md §2.4
    assert kivi_bpd(2048, 2, 32, 0) == 3.0 and kivi_bpd(2048, 2, 32, 128) == 3.8125


SHAPE = ModelShape(n_layers=2, n_q_heads=32, n_kv_heads=8, head_dim=128)


@pytest.mark.parametrize(
    "target,expected",
    [(2.0, (1, 32)), (2.25, (2, 128)), (2.3, (2, 128)), (3.0, (2, 32)), (4.0, (3, 32)),
     (4.25, (4, 128)), (5.0, (4, 32)), (16.0, (8, 32)), (1.25, (1, 128))],
)
def test_configure_mapping(target, expected):
    m = Kivi()
    m.configure(SHAPE, target, None)
    kn = m.knobs()
    assert (kn["bits"], kn["group"]) == expected
    assert kn["v_bits"] is None and m.nominal_bpd(2048)[1] == 16.0


@pytest.mark.parametrize("target", [1.0, 0.5, 1.2])
def test_unreachable_targets(target):
    with pytest.raises(Unsupported, match="1.25"):
        Kivi().configure(SHAPE, target, None)


def test_value_mapping_respects_head_dim_and_overrides():
    m = Kivi()
    m.configure(ModelShape(1, 9, 3, 64), 3.0, 2.5)  # values: G <= d = 64
    assert m.knobs()["v_bits"] == 2 and m.knobs()["v_group"] == 64
    with pytest.raises(Unsupported, match="1.5"):  # floor for values at d=64: 1 + 32/64
        Kivi().configure(ModelShape(1, 9, 3, 64), 3.0, 1.25)
    m = Kivi(bits=4)
    m.configure(SHAPE, 4.4, None)
    assert (m.knobs()["bits"], m.knobs()["group"]) == (4, 128)
    m = Kivi(residual=32)  # keys: G must divide R
    m.configure(SHAPE, 2.3, None)
    assert m.knobs()["group"] == 32
    m = Kivi(v_bits=4)  # explicit value bits without a value target
    m.configure(SHAPE, 3.0, None)
    assert m.knobs()["v_bits"] == 4 and m.knobs()["v_group"] == 32


def test_registry_builds_kivi():
    m = build_method("kivi", bits=2, residual=32)
    assert isinstance(m, Kivi) and m.name == "kivi" and not m.needs_calibration
