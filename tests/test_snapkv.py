"""SnapKV (docs/methods.md §7) against a naive reference (Python loops, float64)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from methods.base import ModelShape, Unsupported
from methods.snapkv import SnapKV, SnapKVLayerState, pool1d


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


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


# ------------------------------------------------------------------------------------------------
# decode=evict (docs/methods.md §7.3): re-selection every decode_interval steps


def naive_pool(s, kernel, pooling):
    pad, n = kernel // 2, len(s)
    out = np.zeros(n)
    for j in range(n):
        win = [s[jj] for jj in range(j - pad, j + pad + 1) if 0 <= jj < n]
        out[j] = max(win) if pooling == "max" else sum(win) / kernel
    return out


def reference_evict_decode(q, k, v, scaling, n_prompt, window, kernel, pooling, gqa, cap, recap, interval):
    """decode=evict token by token, Python loops, float64: the prefill's selection (the reference
    above) at C = cap(P), then per decoded token append, attend over the held tokens, and after every
    ``interval`` steps re-select at C = recap(tokens seen): the last ``window`` queries (those of the
    last ``window`` positions, which are the last held tokens) over the held tokens, causal, summed
    over the window, pooled over the held order, group mean, top-(C - W) older + the window.
    Returns the decoded outputs, the held positions per storage head, and the tokens each decoded
    query read."""
    qn, kn, vn = (x.double().numpy() for x in (q, k, v))
    b_sz, hq, t, d = qn.shape
    hkv = kn.shape[1]
    g = hq // hkv
    heads = hkv if gqa == "mean" else hq
    c0 = cap(n_prompt)
    if n_prompt > c0:
        held = reference_selection(q[:, :, :n_prompt], k[:, :, :n_prompt], scaling, window, kernel,
                                   pooling, gqa, c0)
    else:
        held = {(b, h): list(range(n_prompt)) for b in range(b_sz) for h in range(heads)}
    kv_of = (lambda h: h) if gqa == "mean" else (lambda h: h // g)
    q_of = (lambda h: range(h * g, (h + 1) * g)) if gqa == "mean" else (lambda h: [h])
    out = np.zeros((b_sz, hq, t - n_prompt, d))
    reads = []
    for i, pos in enumerate(range(n_prompt, t)):
        for key in held:
            held[key].append(pos)
        reads.append(len(held[0, 0]))
        for (b, h), cols in held.items():
            for qh in q_of(h):
                p = softmax(kn[b, kv_of(h), cols] @ qn[b, qh, pos] * scaling)
                out[b, qh, i] = p @ vn[b, kv_of(h), cols]
        if (i + 1) % interval:
            continue
        c = recap(pos + 1)
        for (b, h), cols in held.items():
            n = len(cols)
            if n <= c:
                continue
            n_old, win = n - window, cols[-window:]
            assert win == list(range(pos - window + 1, pos + 1))
            pooled = []
            for qh in q_of(h):
                s = np.zeros(n_old)
                for p_i in win:
                    vis = [j for j in cols if j <= p_i]  # the older tokens, then the window's up to p_i
                    s += softmax(kn[b, kv_of(h), vis] @ qn[b, qh, p_i] * scaling)[:n_old]
                pooled.append(naive_pool(s, kernel, pooling))
            sc = np.mean(pooled, axis=0)
            older = sorted(range(n_old), key=lambda j: (sc[j], j), reverse=True)[: c - window]
            held[b, h] = [cols[j] for j in sorted(older)] + win
    return torch.from_numpy(out), held, reads


def _evict_method(window, kernel, pooling, gqa, interval, rho, g, d=16):
    m = SnapKV(window=window, kernel=kernel, pooling=pooling, gqa=gqa, decode="evict",
               decode_interval=interval)
    m.configure(ModelShape(2, 2 * g, 2, d), 16 * rho * (g if gqa == "repeat" else 1), None)
    return m


@pytest.mark.parametrize("gqa,pooling,interval", [
    ("mean", "max", 6), ("mean", "avg", 4), ("mean", "max", 9), ("repeat", "max", 6), ("repeat", "avg", 5),
])
def test_evict_decode_matches_a_naive_reference(gqa, pooling, interval):
    p, t, window, kernel, g = 40, 95, 6, 3, 2
    q, k, v = make_qkv(2, 2, g, t, 16, torch.float64, seed=interval + 3 * (gqa == "repeat"))
    m = _evict_method(window, kernel, pooling, gqa, interval, 0.3, g)
    state = m.new_layer_state(0)
    state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.4, prefill=True)
    out = state.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.4, prefill=False)
    ref, held, reads = reference_evict_decode(
        q, k, v, 0.4, p, window, kernel, pooling, gqa, m.capacity_for,
        lambda n: m.capacity_for(n, reselect=True), interval)
    assert (out - ref).abs().max() < 1e-10
    pos = state.kept_positions()
    assert {key: pos[key].tolist() for key in held} == held
    hs = pos.shape[1]
    assert torch.equal(state.read_bits()[0], 16.0 * 2 * hs * 16 * torch.tensor(reads, dtype=torch.float64))
    assert torch.equal(m.held_counts(p, t - p), torch.tensor(reads, dtype=torch.float64))
    assert state.stored_bits() == (16 * 2 * hs * pos.shape[-1] * 16,) * 2  # exactly what is held
    k_held, _ = state.kept_kv()
    kk = k if gqa == "mean" else k.repeat_interleave(g, 1)
    assert torch.equal(k_held, kk.gather(2, pos[..., None].expand(*pos.shape, 16)))
    assert len(held[0, 0]) < m.capacity_for(p) + t - p  # re-selections evicted tokens


def test_evict_repeat_compresses_an_uncompressed_prompt_at_the_first_reselection():
    q, k, v = make_qkv(1, 2, 3, 60, 16, torch.float64, seed=4)
    m = SnapKV(window=4, kernel=3, gqa="repeat", decode="evict", capacity=24)
    m.configure(ModelShape(2, 6, 2, 16), None, None)
    state = m.new_layer_state(0)
    state.attend(q[:, :, :20], k[:, :, :20], v[:, :, :20], scaling=0.25, prefill=True)
    assert state.kept_kv()[0].shape[1] == 2  # stored once per KV head while not compressed
    out = state.attend(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], scaling=0.25, prefill=False)
    ref, held, _ = reference_evict_decode(q, k, v, 0.25, 20, 4, 3, "max", "repeat", m.capacity_for,
                                          lambda n: m.capacity_for(n, reselect=True), 4)
    assert (out - ref).abs().max() < 1e-10
    assert state.kept_kv()[0].shape[1] == 6
    assert {key: state.kept_positions()[key].tolist() for key in held} == held


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
def test_evict_chunks_equal_token_by_token(gqa):
    p, t = 50, 130
    q, k, v = make_qkv(1, 2, 2, t, 16, torch.float64, seed=8)
    outs, kept = [], []
    for sizes in ([t - p], [1] * (t - p), [5, 17, 1, 22, 35]):
        state = _evict_method(8, 3, "max", gqa, 7, 0.25, 2).new_layer_state(0)
        state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.25, prefill=True)
        got, reads, s = [], [], p
        for n in sizes:
            got.append(state.attend(q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n],
                                    scaling=0.25, prefill=False))
            reads.append(state.read_bits()[0])
            s += n
        outs.append((torch.cat(got, 2), torch.cat(reads)))
        kept.append(state.kept_positions())
    for (o, r), pos in zip(outs[1:], kept[1:]):
        assert (o - outs[0][0]).abs().max() < 1e-12
        assert torch.equal(r, outs[0][1]) and torch.equal(pos, kept[0])


def test_evict_capacity_is_centred_on_the_reads_until_the_next_selection():
    """Written from the docstring: C_t = max(W+1, round(ρ(t + j̄) − j̄)), j̄ = (I+1)/2 at a
    re-selection, I/2 at the prefill (whose own prediction is one of the reads)."""
    for rho, w, iv in ((1 / 16, 32, 32), (0.25, 8, 5), (0.5, 4, 12)):
        m = SnapKV(window=w, decode="evict", decode_interval=iv)
        m.configure(ModelShape(2, 4, 2, 64), 16 * rho, None)
        for t in range(40, 2100, 3):
            re = max(w + 1, math.floor(rho * (t + (iv + 1) / 2) - (iv + 1) / 2 + 0.5))
            pre = max(w + 1, math.floor(rho * (t + iv / 2) - iv / 2 + 0.5))
            assert m.capacity_for(t, reselect=True) == re and m.capacity_for(t) == pre
    m = SnapKV(window=8, capacity=40, decode="evict")  # a fixed capacity: mean held = C
    assert m.capacity_for(500, reselect=True) == 40 - 4 and m.capacity_for(500) == 36  # 40 - 4.5, 40 - 4
    assert SnapKV(window=8).capacity_for(10_000) == 2048  # keep: the paper's count


def _track_b_reads(rho, decode, seed=0):
    """Track-B shape (1536-token exact prefill, 511 decoded targets after the prefill's own
    prediction; W = 32, I = W): (bits per position of the 512 scored reads / (t N d) over 16, the
    end-of-prefill held count)."""
    p, n_dec, d = 1536, 511, 16
    q, k, v = make_qkv(1, 2, 2, p + n_dec, d, seed=seed)
    m = SnapKV(decode=decode)
    m.configure(ModelShape(1, 4, 2, d), 16 * rho, None)
    state = m.new_layer_state(0)
    state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=d**-0.5, prefill=True)
    first = state.stored_bits()[0] / (p * 2 * d)  # the prefill's own prediction reads this
    state.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=d**-0.5, prefill=False)
    seen = torch.arange(p + 1, p + n_dec + 1, dtype=torch.float64)
    decoded = state.read_bits()[0] / (seen * 2 * d)
    return torch.cat([torch.tensor([first], dtype=torch.float64), decoded]), decoded, m, state


@pytest.mark.parametrize("rho", [1 / 16, 1 / 8, 1 / 4])
def test_evict_holds_the_budget_over_the_scored_positions(rho):
    """The invariant of §7.3 decode=evict: the bits each scored position read, averaged, are the
    target within 2%, whether or not the prefill's own prediction is counted; decode=keep reads
    far more (the cache grows by the 511 decoded tokens)."""
    target = 16 * rho
    scored, decoded, m, state = _track_b_reads(rho, "evict")
    assert float(scored.mean()) == pytest.approx(target, rel=0.02)
    assert float(decoded.mean()) == pytest.approx(target, rel=0.02)
    held = m.held_counts(1536, 511)
    assert torch.equal(state.read_bits()[0], held * 16 * 2 * 16) and state.n_kept == held[-1]
    # symmetric around the target between two selections: each whole interval's mean meets it
    for block in scored[: 1 + 32 * 15].split([33] + [32] * 14):
        assert float(block.mean()) == pytest.approx(target, rel=0.02)
    assert m.knobs()["decode"] == "evict" and m.knobs()["decode_interval"] == 32
    kept, _, mk, _ = _track_b_reads(rho, "keep")
    c, j = round(rho * 1536), torch.arange(512, dtype=torch.float64)  # C_0 = ρ P, then appended
    assert torch.allclose(kept, 16 * (c + j) / (1536 + j)) and mk.knobs()["decode_interval"] is None
    assert float(kept.mean()) > 1.4 * target


def test_evict_options_are_validated():
    for kwargs in ({"decode": "sometimes"}, {"decode_interval": 0}, {"decode_interval": 2.5},
                   {"decode_interval": True}):
        with pytest.raises(ValueError, match="decode"):
            SnapKV(**kwargs)
    with pytest.raises(ValueError, match="keep, evict"):
        SnapKV(decode="always")
    assert SnapKV(decode="evict", window=8).interval == 8
    assert SnapKV(decode="evict", decode_interval=3).interval == 3 and SnapKV().interval is None
