"""SnapKV (METHODS.md §7) against a naive reference (Python loops, float64)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from methods.base import ModelShape, Unsupported
from methods.snapkv import SnapKV, SnapKVLayerState, pool1d


pytestmark = pytest.mark.usefixtures("one_thread")


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_selection(q, k, scaling, window, kernel, pooling, gqa, capacity):
    """Kept prompt positions per storage head {(b, head): [...]}, Python loops."""
    q, k = q.double().numpy(), k.double().numpy()
    b_sz, hq, t, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n = t - window
    pad = kernel // 2
    pooled = np.zeros((b_sz, hq, n))
    for b in range(b_sz):
        for qh in range(hq):
            s = np.zeros(n)
            for i in range(n, t):
                s += softmax(k[b, qh // g, : i + 1] @ q[b, qh, i] * scaling)[:n]
            for j in range(n):
                win = [s[jj] for jj in range(j - pad, j + pad + 1) if 0 <= jj < n]
                pooled[b, qh, j] = max(win) if pooling == "max" else sum(win) / kernel
    kept = {}
    for b in range(b_sz):
        heads = range(hkv) if gqa == "mean" else range(hq)
        for h in heads:
            sc = pooled[b, h * g : (h + 1) * g].mean(0) if gqa == "mean" else pooled[b, h]
            older = sorted(range(n), key=lambda j: (sc[j], j), reverse=True)[: capacity - window]
            kept[b, h] = sorted(older) + list(range(n, t))
    return kept


def reference_decode(q, k, v, scaling, kept, n_prompt, gqa):
    """Outputs of the queries after the prompt over kept prompt tokens + all later tokens."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    b_sz, hq, t, _ = q.shape
    g = hq // k.shape[1]
    out = np.zeros((b_sz, hq, t - n_prompt, v.shape[-1]))
    for b in range(b_sz):
        for qh in range(hq):
            idx = kept[b, qh // g] if gqa == "mean" else kept[b, qh]
            for i, pos in enumerate(range(n_prompt, t)):
                cols = idx + list(range(n_prompt, pos + 1))
                p = softmax(k[b, qh // g, cols] @ q[b, qh, pos] * scaling)
                out[b, qh, i] = p @ v[b, qh // g, cols]
    return torch.from_numpy(out)


def make_qkv(b, hkv, g, t, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, t, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    return q, k, v


def exact_causal(q, k, v, scaling):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    logits = (q @ kk.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, -1) @ vv


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("gqa", ["mean", "repeat"])
@pytest.mark.parametrize("g", [2, 3])
def test_selection_prefill_and_decode_match_reference(pooling, gqa, g):
    p, t, window, kernel, cap = 72, 84, 8, 5 if g == 2 else 7, 30
    q, k, v = make_qkv(2, 2, g, t, 16, torch.float64, seed=g + 7 * (pooling == "max"))
    m = SnapKV(window=window, kernel=kernel, pooling=pooling, gqa=gqa, capacity=cap)
    m.configure(ModelShape(2, 2 * g, 2, 16), None, None)
    state = m.new_layer_state(0)
    out_p = state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.4, prefill=True)
    assert (out_p - exact_causal(q[:, :, :p], k[:, :, :p], v[:, :, :p], 0.4)).abs().max() < 1e-12
    ref_kept = reference_selection(q[:, :, :p], k[:, :, :p], 0.4, window, kernel, pooling, gqa, cap)
    pos = state.kept_prompt_positions()
    assert pos.shape == (2, 2 if gqa == "mean" else 2 * g, cap)
    assert {(b, h): pos[b, h].tolist() for b, h in ref_kept} == ref_kept
    out_d = state.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.4, prefill=False)
    ref_d = reference_decode(q, k, v, 0.4, ref_kept, p, gqa)
    assert (out_d - ref_d).abs().max() < 1e-12
    assert state.n_seen == t and state.n_kept == cap + t - p


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
def test_decode_chunk_equals_token_by_token(gqa):
    p, t = 100, 140
    q, k, v = make_qkv(1, 2, 3, t, 32, seed=3)
    outs = []
    for sizes in ([t - p], [1] * (t - p)):
        state = SnapKV(window=16, gqa=gqa, capacity=48).new_layer_state(0)
        state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=32**-0.5, prefill=True)
        got, s = [], p
        for n in sizes:
            got.append(state.attend(q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n],
                                    scaling=32**-0.5, prefill=False))
            s += n
        outs.append(torch.cat(got, 2))
    assert (outs[0] - outs[1]).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", [1, 5, 7])
def test_pool1d_matches_torch_pooling(kernel):
    x = torch.rand(2, 3, 4, 29)
    ref_max = F.max_pool1d(x.reshape(-1, 1, 29), kernel, 1, kernel // 2).reshape(x.shape)
    ref_avg = F.avg_pool1d(x.reshape(-1, 1, 29), kernel, 1, kernel // 2).reshape(x.shape)
    assert torch.equal(pool1d(x, kernel, "max"), ref_max)
    assert (pool1d(x, kernel, "avg") - ref_avg).abs().max() < 1e-6


def test_short_prompt_is_not_compressed():
    q, k, v = make_qkv(1, 2, 2, 40, 16)
    for gqa in ("mean", "repeat"):
        m = SnapKV(window=8, gqa=gqa, capacity=40)
        m.configure(ModelShape(2, 4, 2, 16), None, None)
        state = m.new_layer_state(0)
        state.attend(q, k, v, scaling=0.25, prefill=True)
        assert state.n_kept == 40 and state.stored_bits() == (40 * 2 * 16 * 16,) * 2
        assert m.nominal_bpd(40) == (16.0, 16.0)


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
def test_measured_bpd_matches_formula(gqa):
    t, d, window = 1024, 64, 16
    q, k, v = make_qkv(1, 2, 2, t, d, seed=5)
    for target in (0.5, 1.0, 2.0, 4.0):
        m = SnapKV(window=window, gqa=gqa)
        m.configure(ModelShape(2, 4, 2, d), target, None)
        copies = 2 if gqa == "repeat" else 1
        c = max(window + 1, math.floor(target / 16 / copies * t + 0.5))
        assert m.capacity_for(t) == c
        state = m.new_layer_state(0)
        state.attend(q, k, v, scaling=d**-0.5, prefill=True)
        bk, bv = state.stored_bits()
        mk, mv = bk / (2 * t * d), bv / (2 * t * d)
        assert mk == mv == pytest.approx(16 * c * copies / t)
        assert (mk, mv) == pytest.approx(m.nominal_bpd(t))
        if c > window + 1:  # floor not binding: within one token of the target
            assert abs(mk - target) <= 16 * copies / t
    # generated tokens add 16 bits per element each
    state.attend(q[:, :, :3], k[:, :, :3], v[:, :, :3], scaling=d**-0.5, prefill=False)
    assert state.stored_bits()[0] == bk + 3 * 2 * copies * d * 16


def test_explicit_capacity_repeat_counts_g_times():
    m = SnapKV(capacity=64, gqa="repeat")
    m.configure(ModelShape(2, 6, 2, 64), None, None)
    assert m.nominal_bpd(1024) == pytest.approx((16 * 64 * 3 / 1024,) * 2)
    m = SnapKV()
    m.configure(ModelShape(2, 6, 2, 64), None, None)
    assert m.capacity_for(10_000) == 2048  # official default


def test_bad_inputs():
    shape = ModelShape(2, 4, 2, 64)
    assert SnapKV.name == "snapkv" and SnapKV.supports_in_pass is False
    with pytest.raises(Unsupported, match="share one budget"):
        SnapKV().configure(shape, 1.0, 2.0)
    for target in (0.0, 20.0):
        with pytest.raises(Unsupported):
            SnapKV().configure(shape, target, None)
    with pytest.raises(ValueError, match="not both"):
        SnapKV(capacity=512).configure(shape, 1.0, None)
    for kwargs in ({"pooling": "min"}, {"gqa": "sum"}, {"kernel": 4}, {"kernel": 0},
                   {"window": 0}, {"capacity": 32}):
        with pytest.raises(ValueError):
            SnapKV(**kwargs)
    q, k, v = make_qkv(1, 2, 2, 12, 16)
    state = SnapKV().new_layer_state(0)
    with pytest.raises(Unsupported, match="prefill-exact"):
        state.attend(q, k, v, scaling=0.25, prefill=False)
    state.attend(q, k, v, scaling=0.25, prefill=True)
    with pytest.raises(ValueError, match="first call"):
        state.attend(q, k, v, scaling=0.25, prefill=True)
    with pytest.raises(ValueError, match="query heads"):
        SnapKV().new_layer_state(0).attend(q[:, :3], k, v, scaling=0.25, prefill=True)
    assert SnapKVLayerState(8, 7, "max", "mean", lambda t: 16).stored_bits() == (0, 0)
