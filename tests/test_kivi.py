"""KIVI (methods/kivi.py) against a naive per-query implementation of docs/methods.md §2.3 and §2.4."""

import math

import pytest
import torch

from methods import build_method
from methods.attention import causal_attention
from methods.base import ModelShape, Unsupported
from methods.groupquant import fake_quantize_groups
from methods.kivi import Kivi, kivi_bpd

pytestmark = pytest.mark.numerics

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
    import methods.blocked_attention as blocked_mod

    t = 120
    q, k, v = _qkv(t, seed=9)
    whole, _ = _run(Kivi(**KNOBS), q, k, v, [t])
    monkeypatch.setattr(blocked_mod, "MAX_LOGIT_ELEMENTS", HQ * t * 7)  # blocks of 7 queries
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
    assert bv / (t * d) == 3.8125  # 3.81 in docs/methods.md §2.4
    assert kivi_bpd(2048, 2, 32, 0) == 3.0 and kivi_bpd(2048, 2, 32, 128) == 3.8125


SHAPE = ModelShape(n_layers=2, n_q_heads=32, n_kv_heads=8, head_dim=128)


@pytest.mark.parametrize(
    "target,expected",
    [(2.0, (1, 32)), (2.25, (2, 128)), (2.3, (2, 128)), (3.0, (2, 32)), (4.0, (3, 32)),
     (4.25, (4, 128)), (5.0, (4, 32)), (16.0, (8, 32)), (1.25, (1, 128))],
)
def test_configure_mapping(target, expected):
    m = Kivi(budget="nominal")
    m.configure(SHAPE, target, None)
    kn = m.knobs()
    assert (kn["bits"], kn["group"]) == expected
    assert kn["v_bits"] is None and m.nominal_bpd(2048)[1] == 16.0
    assert (kn["residual"], kn["budget"], kn["fitted"]) == (128, "nominal", False)


@pytest.mark.parametrize("target", [1.0, 0.5, 1.2])
def test_unreachable_targets(target):
    with pytest.raises(Unsupported, match="1.25"):
        Kivi(budget="nominal").configure(SHAPE, target, None)


def test_value_mapping_respects_head_dim_and_overrides():
    m = Kivi(budget="nominal")
    m.configure(ModelShape(1, 9, 3, 64), 3.0, 2.5)  # values: G <= d = 64
    assert m.knobs()["v_bits"] == 2 and m.knobs()["v_group"] == 64
    with pytest.raises(Unsupported, match="1.5"):  # floor for values at d=64: 1 + 32/64
        Kivi(budget="nominal").configure(ModelShape(1, 9, 3, 64), 3.0, 1.25)
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


# ---- budget="measured": (b, G, R) fitted to the measured headline of the job's regime ---------

from methods.base import Regime  # noqa: E402
from methods.kivi import FIT_BITS, headline_bpd, residual_grid  # noqa: E402

QALL = Regime("qall", 2048)
TRACK_B = Regime("prefill", 1536, 511)  # PPL track B: the prefill's prediction + 511 decoded


def naive_headline(bits, group, residual, regime, side, d=128):
    """docs/methods.md §0 v3 / §2.3 counted bit by bit, one scored position at a time: codes of b bits,
    a 16-bit scale and a 16-bit minimum per group of G, 16 bits per full-precision element."""
    def held(n, quant):  # bits of one channel (keys) or one token row's share (values), per element
        if side == "k":  # quant tokens of one channel in quant / G groups, the rest fp16
            return (quant * bits + (quant // group) * 32 + (n - quant) * 16) / n
        return (quant * (d * bits + (d // group) * 32) / d + (n - quant) * 16) / n

    if regime.kind == "qall":
        positions = list(range(regime.tokens))
        first = []
    else:
        p0 = regime.tokens
        positions = list(range(p0, p0 + regime.decode))
        stored = residual * (p0 // residual) if side == "k" else max(0, p0 - residual)
        first = [held(p0, stored)]  # the prefill's own prediction reads the stored prompt
    reads = [held(p + 1, residual * (p // residual) if side == "k" else max(0, p - residual))
             for p in positions]
    out = first + reads
    return sum(out) / len(out)


@pytest.mark.parametrize("regime", [QALL, TRACK_B, Regime("prefill", 300, 0), Regime("qall", 100)], ids=str)
@pytest.mark.parametrize("point", [(2, 32, 128), (1, 64, 64), (3, 128, 128), (8, 32, 96)])
def test_headline_prediction_counts_every_bit(regime, point):
    for side in ("k", "v"):
        assert headline_bpd(*point, regime, side) == pytest.approx(naive_headline(*point, regime, side), abs=1e-12)
    # no decoded positions: the end-of-prefill figure, the §2.4 formula
    if regime.kind == "prefill" and regime.decode == 0:
        b, g, r = point
        assert headline_bpd(b, g, r, regime, "k") == pytest.approx(kivi_bpd(300, b, g, 300 % r), abs=1e-12)


def _measure(state_method, regime, d=64, seed=0):
    """The headline a KIVI layer state reports in ``regime`` on random inputs: Q-all, one pass;
    else an exact prefill (its prediction counted at the stored prompt) then one decode chunk."""
    n = regime.tokens + (regime.decode if regime.kind == "prefill" else 0)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (2, 1, 1))
    st = state_method.new_layer_state(0)
    if regime.kind == "qall":
        st.attend(q, k, v, scaling=d**-0.5, prefill=False)
        bk, bv = st.read_bits()
        held = torch.arange(1, n + 1, dtype=torch.float64) * d
        return float((bk / held).mean()), float((bv / held).mean())
    p = regime.tokens
    st.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=d**-0.5, prefill=True)
    ek, ev = (x / (p * d) for x in st.stored_bits())
    st.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=d**-0.5, prefill=False)
    bk, bv = st.read_bits()
    held = torch.arange(p + 1, n + 1, dtype=torch.float64) * d
    return (float((ek + (bk / held).sum()) / (1 + regime.decode)),
            float((ev + (bv / held).sum()) / (1 + regime.decode)))


FIT_CASES = [(QALL, 4.0, None), (QALL, 6.0, None), (QALL, 5.0, 5.0), (QALL, 8.0, 8.0),
             (TRACK_B, 2.0, None), (TRACK_B, 3.0, None), (TRACK_B, 3.0, 3.0), (TRACK_B, 4.0, 4.0),
             (TRACK_B, 2.0, 4.0), (QALL, 6.0, 4.0)]


@pytest.mark.parametrize("regime,bpd,v_bpd", FIT_CASES, ids=str)
def test_fit_meets_the_measured_target(regime, bpd, v_bpd):
    m = Kivi()
    m.set_regime(regime)
    m.configure(ModelShape(1, 2, 1, 64), bpd, v_bpd)
    kn = m.knobs()
    assert kn["budget"] == "measured" and kn["fitted"] and kn["fit"]["regime"]["kind"] == regime.kind
    assert kn["bits"] in FIT_BITS and kn["residual"] in residual_grid() and kn["residual"] % kn["group"] == 0
    mk, mv = _measure(m, regime)
    assert mk <= 1.02 * bpd  # the state's own reads, under the ceiling
    assert mk == pytest.approx(kn["fit"]["predicted_bpd_k"], abs=1e-9)
    if v_bpd is None:
        assert kn["v_bits"] is None and mv == 16.0
    else:
        assert mv <= 1.02 * v_bpd
        assert mv == pytest.approx(kn["fit"]["predicted_bpd_v"], abs=1e-9)
    # nothing the preference ranks higher is under the ceiling (more key bits, then a larger R)
    for b in FIT_BITS:
        for r in residual_grid():
            for grp in (32, 64, 128):
                if r % grp == 0 and (b, r) > (kn["bits"], kn["residual"]) and v_bpd is None:
                    assert naive_headline(b, grp, r, regime, "k") > 1.02 * bpd


def test_fit_prefers_more_bits_then_the_larger_window():
    # Q-all at 2048, target 5: (3, 32, 64) measures 5.004 and (3, 128, 128) 5.099, both in the band
    m = Kivi()
    m.configure(SHAPE, 5.0, None)
    assert (m.knobs()["bits"], m.knobs()["group"], m.knobs()["residual"]) == (3, 128, 128)
    assert naive_headline(3, 32, 64, QALL, "k") == pytest.approx(5.004, abs=1e-3)


def test_fit_end_to_end_on_the_tiny_model():
    """Through the harness: the headline of a Q-all pass and of a track-B score equals the fit's
    prediction and lies under the ceiling of the target (tiny Llama, head_dim 64, random tokens)."""
    from conftest import tiny_llama
    from kvbench.model.compressed_lm import CompressedLM
    from kvbench.model.integrate import attach, model_shape

    model = tiny_llama(head_dim=64)
    ids = torch.randint(0, 128, (1, 1024), generator=torch.Generator().manual_seed(3))
    for regime, bpd, v_bpd in ((Regime("qall", 1024), 4.0, None), (Regime("qall", 1024), 5.25, 5.25),
                               (Regime("prefill", 768, 255), 3.0, 3.0)):
        m = Kivi()
        m.set_regime(regime)
        m.configure(model_shape(model), bpd, v_bpd)
        lm = CompressedLM(model, None, attach(model, m))
        try:
            if regime.kind == "qall":
                lm.logits(ids)
            else:
                lm.score(ids[:, :768], ids[:, 768:])
        finally:
            lm.compressor.detach()
        mk, mv = lm.readings[-1].mean
        assert lm.readings[-1].positions == (1024 if regime.kind == "qall" else 256)
        assert mk == pytest.approx(m.knobs()["fit"]["predicted_bpd_k"], abs=1e-9)
        assert mk <= 1.02 * bpd
        assert (mv == 16.0) if v_bpd is None else mv <= 1.02 * v_bpd


@pytest.mark.parametrize("regime,target,match", [
    (QALL, 2.0, r"reachable range \[2\.67, 10\.01\]"),     # below every grid point in Q-all
    (QALL, 1.0, r"reachable range \[2\.67, 10\.01\]"),
    (TRACK_B, 1.0, r"reachable range \[1\.76, 9\.25\]"),
    (QALL, 2.6, r"the cheapest 2\.669 at \(b=1, G=32, R=32\)"),  # 2.6% over: above the ceiling
])
def test_fit_unsupported_names_the_reachable_range(regime, target, match):
    m = Kivi()
    m.set_regime(regime)
    with pytest.raises(Unsupported, match=match):
        m.configure(SHAPE, target, None)


def test_no_shared_window_is_unsupported():
    # track B at 1.8/1.8: keys get under the ceiling only at R in {64, 128}, values only at R = 32
    # (KIVI shares one R)
    m = Kivi()
    m.set_regime(TRACK_B)
    with pytest.raises(Unsupported, match=r"only at R in \[64, 128\].*only at R in \[32\]"):
        m.configure(ModelShape(1, 9, 3, 64), 1.8, 1.8)


def test_the_budget_is_a_ceiling():
    """docs/methods.md §0.1: a point 2.2 % over the target is not admissible, one 9 % under is.
    Q-all at 2048, d = 64: the cheapest key point is (b=1, G=32, R=32) at 2.669."""
    cheapest = naive_headline(1, 32, 32, QALL, "k")
    assert cheapest == pytest.approx(2.6689, abs=1e-4)
    m = Kivi()
    with pytest.raises(Unsupported, match=r"reachable range \[2\.67, .*the cheapest 2\.669"):
        m.configure(ModelShape(1, 2, 1, 64), cheapest / 1.022, None)
    target = cheapest / 0.91
    cands = m.knob_candidates(ModelShape(1, 2, 1, 64), target, None)
    assert {"bits": 1, "group": 32, "residual": 32, "v_bits": None, "v_group": None} in cands
    for knobs in cands:  # every candidate is run as chosen, under the ceiling
        m.use_knobs(knobs)
        m.configure(ModelShape(1, 2, 1, 64), target, None)
        kn = m.knobs()
        assert {k: kn[k] for k in knobs} == knobs and kn["fit"]["chosen_by"] == "held-out knob search"
        assert kn["fit"]["predicted_bpd_k"] <= 1.02 * target
    m.use_knobs({"bits": 2, "group": 32, "residual": 128, "v_bits": None, "v_group": None})
    with pytest.raises(Unsupported, match="not admissible"):
        m.configure(ModelShape(1, 2, 1, 64), target, None)


@pytest.mark.parametrize("regime,bpd,v_bpd", [(QALL, 4.0, None), (QALL, 6.0, None), (QALL, 5.0, 5.0),
                                              (TRACK_B, 4.85, None), (TRACK_B, 3.0, 3.0)], ids=str)
def test_knob_candidates_are_admissible_spread_and_lead_with_the_paper_setting(regime, bpd, v_bpd):
    m = Kivi()
    m.set_regime(regime)
    shape = ModelShape(1, 2, 1, 64)
    every = m.knob_candidates(shape, bpd, v_bpd)
    cands = m.knob_candidates(shape, bpd, v_bpd, 27)
    assert cands == every[:27] and len(cands) == min(27, len(every)) and len(every) == len(
        {tuple(sorted(c.items())) for c in every})
    paper = {"bits": 2, "group": 32, "residual": 128, "v_bits": None if v_bpd is None else 2,
             "v_group": None if v_bpd is None else 32}
    pk = naive_headline(2, 32, 128, regime, "k")
    pv = None if v_bpd is None else naive_headline(2, 32, 128, regime, "v")
    paper_ok = pk <= 1.02 * bpd and (pv is None or pv <= 1.02 * v_bpd)
    assert (cands[0] == paper) == paper_ok and (paper in every) == paper_ok
    for c in every:
        assert naive_headline(c["bits"], c["group"], c["residual"], regime, "k") <= 1.02 * bpd + 1e-9
        if v_bpd is not None:
            assert naive_headline(c["v_bits"], c["v_group"], c["residual"], regime, "v") <= 1.02 * v_bpd + 1e-9
    # every bit width of the admissible points is among the first candidates (spread over the grid)
    widths = {(c["bits"], c["v_bits"]) for c in every}
    assert widths <= {(c["bits"], c["v_bits"]) for c in cands[:len(widths) + 1]}
    assert m.knob_candidates(shape, None, None) == [] and Kivi(bits=2).knob_candidates(shape, bpd, v_bpd) == []


def test_explicit_knobs_run_as_set_and_say_so():
    m = Kivi(bits=2, group=32, residual=128)  # the paper's setting
    m.configure(SHAPE, 4.0, None)
    kn = m.knobs()
    assert (kn["bits"], kn["group"], kn["residual"], kn["fitted"]) == (2, 32, 128, False)
    assert "explicit knobs" in kn["not_fitted"] and "residual=128" in kn["not_fitted"]
    assert kn["predicted"]["bpd_k"] == pytest.approx(4.8848, abs=1e-4)  # docs/methods.md §0's example
    m = Kivi(residual=32)  # one knob given: the others mapped as budget=nominal maps them
    m.configure(SHAPE, 4.0, None)
    assert (m.knobs()["bits"], m.knobs()["group"], m.knobs()["fitted"]) == (3, 32, False)
    m = Kivi()
    m.configure(SHAPE, None, None)  # no target: KIVI-2
    assert (m.knobs()["bits"], m.knobs()["group"], m.knobs()["residual"], m.knobs()["fitted"]) == (2, 32, 128, False)


def test_budget_option_is_validated():
    with pytest.raises(ValueError, match="measured"):
        Kivi(budget="mean")
    with pytest.raises(ValueError, match="residual"):
        Kivi(residual=0)
    assert build_method("kivi", budget="nominal").budget == "nominal"
