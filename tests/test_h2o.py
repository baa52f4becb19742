"""H2O (docs/methods.md §6) against a naive reference with explicit kept lists per head."""

import math

import numpy as np
import pytest
import torch

from methods.base import ModelShape, Regime, Unsupported
from methods.h2o import H2O, H2OLayerState


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def h2o_reference(q, k, v, scaling, heavy, recent, min_budget=8, n_prefill=0):
    """Python loops, float64. Prefill (real drop, §6.2) of the first ``n_prefill`` tokens, then
    one decode step per token (§6.2, or the Q-all budget of §6.3 without a prefill)."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    b_sz, hq, t_len, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    rho = heavy + recent
    out = np.zeros_like(q)
    kept_final = {}
    for b in range(b_sz):
        for h in range(hkv):
            heads = range(h * g, (h + 1) * g)
            kept, scores, fixed = [], {}, None
            if n_prefill:
                p_len = n_prefill
                col = np.zeros(p_len)
                for qh in heads:
                    for i in range(p_len):
                        p = softmax(k[b, h, : i + 1] @ q[b, qh, i] * scaling)
                        out[b, qh, i] = p @ v[b, h, : i + 1]
                        col[: i + 1] += p / g
                c_h = math.floor(heavy * p_len + 0.5)
                c_r = math.floor(recent * p_len + 0.5)
                if c_h + c_r < min_budget:
                    c_r = math.floor(min_budget * recent / rho + 0.5)
                    c_h = min_budget - c_r
                fixed = (c_h + c_r, c_r)
                if p_len <= c_h + c_r:
                    kept = list(range(p_len))
                else:
                    older = sorted(range(p_len - c_r), key=lambda j: (col[j], j), reverse=True)
                    kept = sorted(set(older[:c_h]) | set(range(p_len - c_r, p_len)))
                scores = {j: col[j] for j in kept}
            for t in range(n_prefill, t_len):
                kept.append(t)
                scores[t] = 0.0
                for qh in heads:
                    p = softmax(k[b, h, kept] @ q[b, qh, t] * scaling)
                    out[b, qh, t] = p @ v[b, h, kept]
                    for j, pj in zip(kept, p):
                        scores[j] += pj / g
                if fixed is not None:
                    cap, c_r = fixed
                else:
                    cap = max(min_budget, math.ceil(rho * (t + 1) - 1e-9))
                    c_r = math.floor(cap * recent / rho + 0.5)
                while len(kept) > cap:
                    victim = min((j for j in kept if j <= t - c_r), key=lambda j: (scores[j], j))
                    kept.remove(victim)
            kept_final[b, h] = kept
    return torch.from_numpy(out), kept_final


def make_qkv(b, hkv, g, t, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, t, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    return q, k, v


def run_chunks(state, q, k, v, sizes, scaling, prefill_first=False):
    outs, s = [], 0
    for i, n in enumerate(sizes):
        sl = slice(s, s + n)
        outs.append(
            state.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=scaling,
                         prefill=prefill_first and i == 0)
        )
        s += n
    assert s == q.shape[2]
    return torch.cat(outs, dim=2)


def kept_lists(state):
    pos = state.kept_positions()
    return {(b, h): pos[b, h].tolist() for b in range(pos.shape[0]) for h in range(pos.shape[1])}


@pytest.mark.parametrize(
    "g,heavy,recent,min_budget",
    [(2, 0.1, 0.1, 8), (3, 0.1, 0.1, 8), (3, 0.15, 0.05, 4), (2, 0.12, 0.0, 6)],
)
def test_qall_matches_naive_reference(g, heavy, recent, min_budget):
    q, k, v = make_qkv(2, 2, g, 80, 16, torch.float64, seed=g)
    state = H2OLayerState(heavy, recent, min_budget)
    out = state.attend(q, k, v, scaling=0.4, prefill=False)
    ref, ref_kept = h2o_reference(q, k, v, 0.4, heavy, recent, min_budget)
    assert (out - ref).abs().max() < 1e-10
    assert kept_lists(state) == ref_kept


@pytest.mark.parametrize("g,n_prefill", [(2, 60), (3, 60), (3, 9)])
def test_prefill_then_decode_matches_naive_reference(g, n_prefill):
    q, k, v = make_qkv(2, 2, g, 90, 16, torch.float64, seed=10 + g)
    state = H2OLayerState(0.1, 0.1, 8)
    out = run_chunks(state, q, k, v, [n_prefill, 90 - n_prefill], 0.4, prefill_first=True)
    ref, ref_kept = h2o_reference(q, k, v, 0.4, 0.1, 0.1, 8, n_prefill=n_prefill)
    assert (out - ref).abs().max() < 1e-10
    assert kept_lists(state) == ref_kept


@pytest.mark.parametrize("g", [2, 3])
def test_chunk_equals_token_by_token_qall(g):
    t = 160
    q, k, v = make_qkv(2, 2, g, t, 32, seed=20 + g)
    whole = H2OLayerState(0.1, 0.1)
    out = whole.attend(q, k, v, scaling=32**-0.5, prefill=False)
    for sizes in ([1] * t, [7, 1, 30, 2, 100, 20]):
        state = H2OLayerState(0.1, 0.1)
        got = run_chunks(state, q, k, v, sizes, 32**-0.5)
        assert (got - out).abs().max() < 1e-5
        assert kept_lists(state) == kept_lists(whole)
        assert state.n_seen == t


@pytest.mark.parametrize("g", [2, 3])
def test_chunk_equals_token_by_token_after_prefill(g):
    p, t = 100, 160
    q, k, v = make_qkv(1, 2, g, t, 32, seed=30 + g)
    whole = H2OLayerState(0.1, 0.1)
    out = run_chunks(whole, q, k, v, [p, t - p], 32**-0.5, prefill_first=True)
    steps = H2OLayerState(0.1, 0.1)
    got = run_chunks(steps, q, k, v, [p] + [1] * (t - p), 32**-0.5, prefill_first=True)
    assert (got - out).abs().max() < 1e-5
    assert kept_lists(steps) == kept_lists(whole)


@pytest.mark.parametrize("prefill", [False, True])
def test_future_tokens_never_change_earlier_outputs(prefill):
    q, k, v = make_qkv(2, 2, 2, 96, 16, seed=40)
    cut = 70
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, cut:] = torch.randn_like(x[:, :, cut:]) * 3
    sizes = [50, 46] if prefill else [96]
    a = run_chunks(H2OLayerState(0.1, 0.1), q, k, v, sizes, 0.25, prefill_first=prefill)
    b = run_chunks(H2OLayerState(0.1, 0.1), q2, k2, v2, sizes, 0.25, prefill_first=prefill)
    assert (a[:, :, :cut] - b[:, :, :cut]).abs().max() < 1e-6
    assert (a[:, :, cut:] - b[:, :, cut:]).abs().max() > 1e-3


def test_kept_sizes_follow_the_budget():
    q, k, v = make_qkv(1, 2, 2, 200, 16, seed=50)
    state = H2OLayerState(0.05, 0.05, 8)
    for t in range(200):
        state.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], scaling=0.25,
                     prefill=False)
        cap = max(8, math.ceil(0.1 * (t + 1) - 1e-9))
        assert state.n_kept == min(t + 1, cap)
    # after a prefill the budget is fixed: C_h + C_r = round(.05·150)·2 = 16
    state = H2OLayerState(0.05, 0.05, 8)
    state.attend(q[:, :, :150], k[:, :, :150], v[:, :, :150], scaling=0.25, prefill=True)
    assert state.n_kept == 16
    for t in range(150, 200):
        state.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], scaling=0.25,
                     prefill=False)
        assert state.n_kept == 16
    # the recent window C_r = 8 is always kept
    assert state.kept_positions()[0, 0, -8:].tolist() == list(range(192, 200))


def test_short_prompts_floor_and_keep_all():
    q, k, v = make_qkv(1, 2, 2, 40, 16, seed=60)
    state = H2OLayerState(0.05, 0.05, 8)  # round(.05*40)*2 = 4 < min_budget 8
    state.attend(q, k, v, scaling=0.25, prefill=True)
    assert state.n_kept == 8
    assert state.kept_positions()[0, 0, -4:].tolist() == [36, 37, 38, 39]
    state = H2OLayerState(0.5, 0.5, 8)  # C = 18 + 18 >= P = 36: keep everything
    state.attend(q[:, :, :36], k[:, :, :36], v[:, :, :36], scaling=0.25, prefill=True)
    assert state.n_kept == 36
    state.attend(q[:, :, 36:], k[:, :, 36:], v[:, :, 36:], scaling=0.25, prefill=False)
    assert state.n_kept == 36 and state.n_seen == 40


def measured(state, b, hkv, t, d):
    bk, bv = state.stored_bits()
    return bk / (b * hkv * t * d), bv / (b * hkv * t * d)


@pytest.mark.parametrize("count_indices", [False, True])
def test_measured_bpd_matches_formula(count_indices):
    t, d = 1024, 64
    q, k, v = make_qkv(1, 2, 2, t, d, seed=70)
    per = 16 + 16 / d * (2 if count_indices else 1)
    for target in (0.5, 1.0, 2.0, 4.0):
        m = H2O(count_indices=count_indices, budget="nominal")
        m.configure(ModelShape(2, 4, 2, d), target, None)
        assert m.nominal_bpd(t) == pytest.approx((target, target))
        assert m.knobs()["rho"] == pytest.approx(target / per)
        state = m.new_layer_state(0)
        state.attend(q, k, v, scaling=d**-0.5, prefill=True)
        mk, mv = measured(state, 1, 2, t, d)
        assert mk == mv
        assert abs(mk - target) <= per / t + 1e-12  # rounding of C_h and C_r: one token at most
    # Q-all: C_{T-1} = ceil(ρT) kept at the end
    m = H2O(count_indices=count_indices, budget="nominal")
    m.configure(ModelShape(2, 4, 2, d), 1.0, 1.0)
    state = m.new_layer_state(0)
    state.attend(q, k, v, scaling=d**-0.5, prefill=False)
    assert state.n_kept == math.ceil(t / per - 1e-9)
    assert abs(measured(state, 1, 2, t, d)[0] - 1.0) <= per / t


def test_configure_defaults_and_ratio_options():
    shape = ModelShape(2, 4, 2, 128)
    m = H2O(budget="nominal")
    m.configure(shape, None, None)
    assert (m.knobs()["heavy_ratio"], m.knobs()["recent_ratio"]) == (0.1, 0.1)
    m.configure(shape, 1.0, None)
    assert m.knobs()["rho"] == pytest.approx(1.0 / 16.125)  # §6.4 at d = 128
    m = H2O(recent_ratio=0.02, budget="nominal")
    m.configure(shape, 1.0, None)
    assert m.knobs()["heavy_ratio"] == pytest.approx(1.0 / 16.125 - 0.02)
    assert H2O.name == "h2o" and H2O.supports_in_pass


def test_bad_inputs():
    shape = ModelShape(2, 4, 2, 64)
    with pytest.raises(Unsupported, match="share one budget"):
        H2O().configure(shape, 1.0, 2.0)
    for target in (0.0, -1.0, 17.0):
        with pytest.raises(Unsupported):
            H2O().configure(shape, target, None)
    with pytest.raises(ValueError, match="at most one ratio"):
        H2O(heavy_ratio=0.1, recent_ratio=0.1).configure(shape, 1.0, None)
    with pytest.raises(Unsupported):
        H2O(recent_ratio=0.5).configure(shape, 1.0, None)
    for kwargs in (
        {"heavy_ratio": 1.5},
        {"recent_ratio": -0.1},
        {"min_budget": 0},
        {"heavy_ratio": 0.0, "recent_ratio": 0.0},
        {"heavy_ratio": 0.7, "recent_ratio": 0.7},
    ):
        with pytest.raises(ValueError):
            H2O(**kwargs)
    with pytest.raises(RuntimeError):
        H2O().nominal_bpd(100)
    q, k, v = make_qkv(1, 2, 2, 12, 16)
    state = H2OLayerState(0.1, 0.1)
    state.attend(q, k, v, scaling=0.25, prefill=True)
    with pytest.raises(ValueError, match="first call"):
        state.attend(q, k, v, scaling=0.25, prefill=True)
    with pytest.raises(ValueError, match="query heads"):
        H2OLayerState(0.1, 0.1).attend(q[:, :3], k, v, scaling=0.25, prefill=False)
    assert H2OLayerState(0.1, 0.1).stored_bits() == (0, 0)


@pytest.mark.parametrize("target", [1.0, 2.0, 4.0])
def test_measured_budget_holds_the_target_over_query_positions(target):
    """Default budget='measured': in Q-all ρ is fitted so that what the queries read, averaged
    over positions (docs/methods.md §0, min_budget floor and the query itself included), is the
    target; the §6.4 ratios (what a prefill of that method keeps) stay beside it."""
    t, d = 1024, 64
    q, k, v = make_qkv(1, 2, 2, t, d, seed=71)
    per = 16 + 16 / d
    m = H2O()
    m.set_regime(Regime("qall", t))
    m.configure(ModelShape(2, 4, 2, d), target, None)
    state = m.new_layer_state(0)
    with torch.no_grad():
        state.attend(q, k, v, scaling=d**-0.5, prefill=False)
    bits_k, bits_v = state.read_bits()
    mean = float((bits_k / (torch.arange(1, t + 1, dtype=torch.float64) * 2 * d)).mean())
    assert mean == pytest.approx(m.knobs()["predicted_qall_bpd"], abs=1e-12)
    assert mean == pytest.approx(target, rel=0.02) and mean <= target + 1e-12
    assert m.knobs()["rho_qall"] < target / per  # the floor and the query itself are paid for
    # a state that starts with an exact prefill keeps the formula: its end of prefill is at target
    assert m.knobs()["rho"] == pytest.approx(target / per)
    state = m.new_layer_state(0)
    state.attend(q, k, v, scaling=d**-0.5, prefill=True)
    assert abs(state.stored_bits()[0] / (2 * t * d) - target) <= per / t + 1e-12


@pytest.mark.parametrize("target", [0.5, 1.0, 2.0])
def test_measured_budget_in_a_prefill_regime_holds_the_target_over_the_scored_positions(target):
    """After a P-token exact prefill the kept count C stays fixed while the held positions grow:
    the fit takes the C whose mean over the 1 + D scored positions (the prompt's own prediction at
    the stored prompt, then each decoded position's read) is closest to the target; the state's
    own reads give exactly that figure, within 2 % of the target, and the end of prefill above it."""
    from methods.h2o import prefill_mean_bpd

    p, dec, d = 768, 255, 64
    q, k, v = make_qkv(1, 2, 2, p + dec, d, seed=72)
    per = 16 + 16 / d
    m = H2O()
    m.set_regime(Regime("prefill", p, dec))
    m.configure(ModelShape(2, 4, 2, d), target, target)
    kn = m.knobs()
    state = m.new_layer_state(0)
    with torch.no_grad():
        state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=d**-0.5, prefill=True)
        end_of_prefill = state.stored_bits()[0] / (p * 2 * d)
        state.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=d**-0.5, prefill=False)
    bits_k, bits_v = state.read_bits()
    held = torch.arange(p + 1, p + dec + 1, dtype=torch.float64) * 2 * d
    mean = (end_of_prefill + float((bits_k / held).sum())) / (1 + dec)
    assert torch.equal(bits_k, bits_v)
    assert mean == pytest.approx(kn["predicted_prefill_bpd"], abs=1e-12)
    assert abs(mean - target) <= 0.02 * target
    kept = round(kn["rho"] * p)
    assert kn["predicted_prefill_bpd"] == pytest.approx(prefill_mean_bpd(kept, p, dec, per), abs=1e-12)
    for other in (kept - 1, kept + 1):  # the closest kept count
        assert abs(prefill_mean_bpd(other, p, dec, per) - target) >= abs(mean - target) - 1e-12
    assert end_of_prefill > target


def test_measured_budget_below_the_floor_is_unsupported():
    m = H2O()
    m.set_regime(Regime("qall", 64))
    with pytest.raises(Unsupported, match="min_budget=8"):
        m.configure(ModelShape(2, 4, 2, 64), 0.5, None)


def test_prefill_regime_is_not_held_to_the_qall_floor():
    """PPL track B / LongBench: the Q-all floor (min_budget tokens at every early position) must
    not make a target that a prefill regime reaches unsupported (0.5 bpd over a 1536-token prefill
    and 511 decoded positions keeps 54 tokens, stored exactly as fitted)."""
    t, d = 1536, 64
    m = H2O()
    m.set_regime(Regime("prefill", t, 511))
    m.configure(ModelShape(2, 4, 2, d), 0.5, None)
    assert m.knobs()["predicted_prefill_bpd"] == pytest.approx(0.5, rel=0.02)
    kept = round(m.knobs()["rho"] * t)
    assert kept == 54
    q, k, v = make_qkv(1, 2, 2, t, d, seed=5)
    state = m.new_layer_state(0)
    state.attend(q, k, v, scaling=d**-0.5, prefill=True)
    assert state.stored_bits()[0] == kept * 2 * d * (16 + 16 / d)
    m.set_regime(Regime("qall", t))  # the same target in Q-all is below the floor
    with pytest.raises(Unsupported, match="min_budget=8"):
        m.configure(ModelShape(2, 4, 2, d), 0.5, None)
