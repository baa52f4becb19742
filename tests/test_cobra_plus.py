"""cobra_plus (docs/methods.md §13): budgets, switches, joint K/V allocation, KKT vs brute force,
alpha plumbing, in-pass == decode."""

import itertools
import math

import pytest
import torch

from methods import build_method
from methods.base import Rope, apply_rope
from methods.cobra_alloc import (
    c1_batch,
    exact_allocate,
    kkt_allocate,
    prefix_terms,
    solve_table,
)
from methods.cobra_plus import CobraPlus, LatentValueCodec
from test_cobra import SHAPE, inputs, make_rope, synthetic_stats
from test_cobra_alloc import spectra

pytestmark = pytest.mark.numerics

F64 = torch.float64


def with_samples(stats, n=256, seed=0):
    """Synthetic statistics plus heavy-tailed key/value samples (the calibrated step needs them)."""
    g = torch.Generator().manual_seed(seed)
    for st in stats:
        h, d = st.mu_k.shape
        st.k_sample = (torch.randn(h, n, d, generator=g, dtype=F64) * torch.rand(h, n, 1, generator=g, dtype=F64) * 2).half()
        st.v_sample = torch.randn(h, n, d, generator=g, dtype=F64).half()
    return stats


STATS = with_samples(synthetic_stats(SHAPE))


def built(bpd=1.0, v_bpd=None, **opts) -> CobraPlus:
    m = build_method("cobra_plus", **opts)
    m.configure(SHAPE, bpd, v_bpd)
    m.calibrate(STATS, seed=0)
    return m


def stored(m, t=16):
    """(bits_k, bits_v) of one teacher-forced chunk of t tokens over all layers."""
    bk = bv = 0
    for layer in range(SHAPE.n_layers):
        q, k_pre, v = inputs(t, seed=layer)
        rope = make_rope(t, SHAPE.head_dim)
        state = m.new_layer_state(layer)
        state.attend(q, apply_rope(k_pre, rope), v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
        k, vv = state.stored_bits()
        bk, bv = bk + k, bv + vv
    return bk, bv


@pytest.mark.parametrize("variant", ["kl", "mse"])
@pytest.mark.parametrize("bpd", [0.5, 1.0, 2.0])
def test_k_track_budget_met_exactly(variant, bpd):
    m = built(bpd, variant=variant)
    t = 16
    bk, bv = stored(m, t)
    elements = t * SHAPE.n_heads_total * SHAPE.head_dim
    assert bk / elements == bpd and bv / elements == 16.0
    assert m.nominal_bpd(t) == (bpd, 16.0)


@pytest.mark.parametrize("bpd, v_bpd", [(1.0, 4.0), (0.5, 2.0), (2.0, 3.0)])
def test_joint_kv_total_bits_equal_target(bpd, v_bpd):
    m = built(bpd, v_bpd)
    n, d = SHAPE.n_heads_total, SHAPE.head_dim
    total = math.floor((bpd + v_bpd) * d * n)
    kb, vb = m._budgets, m._v_budgets
    assert int(kb.sum()) + int(vb.sum()) == total
    assert int(vb.min()) >= d and int(vb.max()) <= 8 * d and int(kb.min()) >= 4
    t = 16
    bk, bv = stored(m, t)
    assert bk + bv == t * total  # measured = target (t * sum B multiple of 8: no padding)
    nk, nv = m.nominal_bpd(t)
    assert nk + nv == pytest.approx(bpd + v_bpd)
    assert (nk, nv) != (bpd, v_bpd)  # the solver moved the split
    assert isinstance(m._v_codecs[0], LatentValueCodec) and not m._v_codecs[0].pre_rope


def test_joint_allocation_is_optimal_on_its_table():
    """Joint K/V optimum vs brute force on one layer with two heads' tables (small grid)."""
    m = build_method("cobra_plus")
    m.configure(SHAPE, 1.0, 4.0)
    kb, vb = m.joint_allocate(STATS)
    # objective of the solver's choice vs. every one-bit exchange between any two of the 2N heads
    from methods.cobra import key_spectra, quant_factor

    mu, lam, u, sq, w = key_spectra(STATS, "kl", True, m.q_stat)
    tail, qsum = prefix_terms(w)[0], quant_factor(lam, sq, w, "kl", "rotated", "hadamard")

    def total(kb, vb):
        dk = c1_batch(tail, qsum, kb.double(), q_model="gauss")[2].sum()
        dv = m._value_distortion(STATS, vb.double()[:, None])[:, 0].sum()
        return float(dk + dv)

    best = total(kb, vb)
    both = torch.cat([kb, vb])
    n = kb.numel()
    for i, j in itertools.permutations(range(2 * n), 2):
        trial = both.clone()
        trial[i] += 1
        trial[j] -= 1
        k2, v2 = trial[:n], trial[n:]
        if int(k2.min()) < 4 or int(k2.max()) > 512 or int(v2.min()) < 64 or int(v2.max()) > 512:
            continue
        assert total(k2, v2) >= best * (1 - 1e-12)


def test_solve_table_with_infeasible_entries_vs_brute_force():
    g = torch.Generator().manual_seed(3)
    grid = torch.arange(2, 12)
    k = grid.numel()
    table = torch.rand(3, k, generator=g, dtype=F64).sort(1, descending=True).values.cumsum(1).flip(1)
    table[1, :4] = float("inf")  # head 1: budgets >= 6 only
    table[2, -3:] = float("inf")  # head 2: budgets <= 8 only
    for tot in range(14, 28):
        got = solve_table(grid, table, tot)
        assert int(got.sum()) == tot
        val = float(sum(table[h, int(got[h]) - 2] for h in range(3)))
        best = min(
            float(table[0, a - 2] + table[1, b - 2] + table[2, tot - a - b - 2])
            for a, b in itertools.product(range(2, 12), repeat=2)
            if 2 <= tot - a - b <= 11
        )
        assert val == pytest.approx(best, rel=1e-12)


def test_kkt_vs_brute_force_small():
    """KKT slope equalization + exchange polish reaches the brute-force optimum (gauss q) closely."""
    w = spectra(3, 8, seed=5)
    tail, head = prefix_terms(w)
    grid = torch.arange(4, 65, dtype=F64)
    table = torch.stack([c1_batch(tail[h : h + 1], head[h : h + 1], grid[None], q_model="gauss")[2][0] for h in range(3)])
    for tot in (12, 20, 33, 50, 97, 150, 192):
        best = min(
            float(table[0, a - 4] + table[1, b - 4] + table[2, tot - a - b - 4])
            for a, b in itertools.product(range(4, 65), repeat=2)
            if 4 <= tot - a - b <= 64
        )
        got = kkt_allocate(w, tot, q_model="gauss")
        assert int(got.sum()) == tot and int(got.min()) >= 4 and int(got.max()) <= 64
        value = float(sum(table[h, int(got[h]) - 4] for h in range(3)))
        assert value <= best * (1 + 2e-3)


def test_kkt_beats_seed_c2_and_nears_exact():
    w = spectra(64, 64, seed=11)
    tail, head = prefix_terms(w)
    from methods.cobra_alloc import c2_allocate

    for bpd in (0.5, 1.0, 2.0):
        tot = int(bpd * 64 * 64)
        obj = {name: float(c1_batch(tail, head, f(w, tot, q_model="gauss").double(), q_model="gauss")[2].sum())
               for name, f in [("c2", c2_allocate), ("kkt", kkt_allocate), ("exact", exact_allocate)]}
        assert obj["exact"] <= obj["kkt"] * (1 + 1e-12) <= obj["c2"]
        assert obj["kkt"] <= obj["exact"] * 1.01


def test_alpha_ones_reproduces_plain_allocation_and_alpha_moves_bits():
    plain = built(1.0)
    m = build_method("cobra_plus", sensitivity=True)
    m.configure(SHAPE, 1.0, None)
    assert "layer_sensitivity" in m.searches() and m.sensitivity_sides() == ("k",)
    d_ref = m.reference_distortion(STATS)["k"]
    m.set_layer_sensitivity({"k": d_ref.tolist()})  # increase proportional to D_ref: alpha = 1
    m.calibrate(STATS, 0)
    assert m.knobs()["alpha_k"] == pytest.approx([1.0] * SHAPE.n_layers)
    assert torch.equal(m._budgets, plain._budgets)
    hot = (d_ref * torch.tensor([1.0, 1.0, 1.0, 50.0], dtype=F64)).tolist()
    m.set_layer_sensitivity({"k": hot})
    m.calibrate(STATS, 0)
    per_layer = m._budgets.reshape(SHAPE.n_layers, -1).sum(1)
    base = plain._budgets.reshape(SHAPE.n_layers, -1).sum(1)
    assert int(per_layer[3]) > int(base[3]) and int(m._budgets.sum()) == int(plain._budgets.sum())


def test_switches_change_what_they_should():
    base = built(1.0)
    kn = base.knobs()
    assert kn["alloc"] == "kkt" and kn["step"] == "gauss"
    assert built(1.0, step="calibrated").knobs()["step"] == "calibrated"
    assert built(1.0, c2=True).knobs()["alloc"] == "seed"
    assert built(1.0, c2="exact").knobs()["alloc"] == "exact"
    # q model and KL term change the allocation's objective, hence the budgets / ranks
    assert not torch.equal(built(1.0, q_model="seed")._budgets, base._budgets)
    assert built(1.0, kl_term="seed").knobs()["distortion_total"] != pytest.approx(kn["distortion_total"])
    # the calibrated step changes steps only, never the budgets
    calibrated = built(1.0, step="calibrated")
    assert torch.equal(calibrated._budgets, base._budgets)
    assert not torch.equal(calibrated._k_codecs[0].step, base._k_codecs[0].step)
    # joint_kv=false keeps the fixed split (one global b_V)
    fixed = built(1.0, 4.0, joint_kv=False)
    assert fixed.nominal_bpd(16) == (1.0, 4.0) and fixed._v_budgets is None
    with pytest.raises(ValueError, match="sensitivity_metric"):
        build_method("cobra_plus", sensitivity_metric="mse")
    # ablate=<part> puts exactly that part back to its plain / seed-literal choice (step and
    # sensitivity, whose defaults are that choice: switched on)
    for part, (key, value) in {"q_model": ("q_model", "seed"), "kl_term": ("kl_term", "seed"), "alloc": ("c2", True),
                               "step": ("step", "calibrated"), "sensitivity": ("sensitivity", True),
                               "joint_kv": ("joint_kv", False), "q_stat": ("q_stat", "plain"),
                               "clip": ("clip_scale", 1.0)}.items():
        m = build_method("cobra_plus", ablate=part)
        assert getattr(m, key) == value
        others = {f: getattr(m, f) for f in ("q_model", "kl_term", "c2", "step", "joint_kv", "q_stat", "clip_scale",
                                             "sensitivity") if f != key}
        assert others == {f: getattr(CobraPlus(), f) for f in others}
    with pytest.raises(ValueError, match="ablate"):
        build_method("cobra_plus", ablate="c2")


def test_in_pass_equals_decode_float64():
    m = built(1.0, 3.0)
    t = 9
    q, k_pre, v = inputs(t, dtype=F64, seed=2)
    rope = make_rope(t, SHAPE.head_dim, dtype=F64)
    k = apply_rope(k_pre, rope)
    chunk = m.new_layer_state(1)
    out_chunk = chunk.attend(q, k, v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
    step = m.new_layer_state(1)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        r = Rope(rope.cos[:, sl], rope.sin[:, sl])
        outs.append(step.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=0.125, prefill=False,
                                k_pre=k_pre[:, :, sl], rope=r))
    assert torch.allclose(out_chunk, torch.cat(outs, 2), atol=1e-10)


def test_value_codec_vs_naive_reference():
    m = built(1.0, 3.0)
    codec = m._v_codecs[0]
    _, _, v = inputs(5, dtype=F64, seed=4)
    got = codec.decode(codec.encode(v))
    for h in range(SHAPE.n_kv_heads):
        p, step, width = codec.enc[h], codec.step[h], codec.width[h]
        c = (v[0, h] - codec.mu[h]) @ p.T
        half = 2.0 ** (width.double() - 1)
        code = torch.clamp(torch.floor(c / step) + half, torch.zeros_like(half), 2 * half - 1)
        ref = codec.mu[h] + ((code - half + 0.5) * step) @ p
        assert torch.allclose(got[0, h], ref, atol=1e-12)


def test_plan_reference_and_power():
    """sensitivity_ref="plan": the probe carries the method's own alpha = 1 allocation; power 0
    flattens any measurement to alpha = 1."""
    plain = built(1.0)
    m = build_method("cobra_plus", sensitivity=True, sensitivity_ref="plan")
    m.configure(SHAPE, 1.0, None)
    assert torch.equal(m.reference_budgets(STATS)["k"], plain._budgets)
    probe = m.sensitivity_probe(STATS, 0)
    assert torch.equal(probe.k_codecs[2].width, plain._k_codecs[2].width)
    flat = build_method("cobra_plus", sensitivity=True, sensitivity_power=0.0)
    flat.configure(SHAPE, 1.0, None)
    flat.set_layer_sensitivity({"k": [1.0, 5.0, 0.1, 2.0]})
    flat.calibrate(STATS, 0)
    assert torch.equal(flat._budgets, plain._budgets)


def test_sensitivity_measure_on_tiny_llama():
    from conftest import tiny_llama
    from kvbench.fit.statistics import collect_stats
    from kvbench.model.integrate import model_shape
    from kvbench.fit.layer_sensitivity import measure

    model = tiny_llama(layers=3)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 128, (2, 64), generator=g)
    stats = collect_stats(model, windows, sample_tokens=64, seed=0)
    m = build_method("cobra_plus", sensitivity=True)
    m.configure(model_shape(model), 1.0, 2.0)
    assert m.sensitivity_sides() == ("k", "v")
    probe = m.sensitivity_probe(stats, 0)
    assert m.sensitivity_whole()  # joint KV-track: the exchange rate is measured too
    out = measure(model, probe, windows[:1, :32], m.sensitivity_sides(), whole=True)
    assert out["passes"] == 1 + 2 * 3 + 2
    assert all(len(out["increase"][s]) == 3 and all(x >= -1e-9 for x in out["increase"][s]) for s in "kv")
    assert set(out["whole"]) == {"k", "v"} and min(out["whole"].values()) > 0
    m.set_layer_sensitivity(out["increase"], {"passes": out["passes"]}, out["whole"])
    m.calibrate(stats, 0)
    kn = m.knobs()
    assert len(kn["alpha_k"]) == 3 and kn["alpha_v"] and kn["sensitivity_passes"] == 9
    assert sum(kn["alpha_k"]) == pytest.approx(3.0, abs=1.5e-5)  # knobs round each alpha to 5 decimals
    d_ref = m.reference_distortion(stats)
    rate = {s: out["whole"][s] / float(d_ref[s].sum()) for s in "kv"}
    assert kn["exchange_v_per_k"] == pytest.approx(rate["v"] / rate["k"])


def test_exchange_rate_moves_the_split():
    """A dearer value side (exchange rate > 1) moves bits from keys to values, the total fixed."""
    par = built(1.0, 3.0, joint_exchange="par")
    m = build_method("cobra_plus")
    m.configure(SHAPE, 1.0, 3.0)
    d_ref = m.reference_distortion(STATS)
    m.set_layer_sensitivity({}, None, {"k": float(d_ref["k"].sum()), "v": 20.0 * float(d_ref["v"].sum())})
    m.calibrate(STATS, 0)
    assert m.knobs()["exchange_v_per_k"] == pytest.approx(20.0)
    assert int(m._v_budgets.sum()) > int(par._v_budgets.sum())
    assert int(m._v_budgets.sum()) + int(m._budgets.sum()) == int(par._v_budgets.sum()) + int(par._budgets.sum())
