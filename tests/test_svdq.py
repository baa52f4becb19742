"""SVDq (methods/svdq.py) against naive references of docs/methods.md §3 and §1.1."""

import math

import pytest
import torch

from methods import build_method
from methods.attention import causal_attention
from methods.base import LayerStats, ModelShape, Regime, Rope, Unsupported, apply_rope
from methods.groupquant import fake_quantize_groups
from methods.svdq import GAUSS_MSE, PAPER_SCHEDULE, SVDq, greedy_schedule

pytestmark = pytest.mark.numerics

B, HKV, HQ = 1, 2, 4


def _rope(t, d, offset=0):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(offset, offset + t).float()[:, None] * inv[None]
    e = torch.cat([f, f], dim=-1)
    return Rope(e.cos()[None].expand(B, t, d), e.sin()[None].expand(B, t, d))


def _mix(d, seed):
    """Per-head mixing with a decaying spectrum, so the latent order matters."""
    g = torch.Generator().manual_seed(seed)
    qmat, _ = torch.linalg.qr(torch.randn(HKV, d, d, generator=g))
    spec = torch.exp(-torch.arange(d).float() / (d / 6))
    return (qmat * spec[None, None, :]) @ qmat.transpose(-1, -2) * 3


def _keys(n, d, mix, seed, mean=0.7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, n, d, generator=g) @ mix + mean


def _stats(d, mix, n=6000):
    x = _keys(n, d, mix, seed=99)[0].double()
    mu = x.mean(1)
    xc = x - mu[:, None]
    cov = xc.transpose(1, 2) @ xc / n
    return LayerStats(mu, cov, mu, cov, cov, n)


def _data(t, d, seed=0):
    mix = _mix(d, seed)
    k_pre = _keys(t, d, mix, seed + 1)
    rope = _rope(t, d)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(B, HQ, t, d, generator=g)
    v = torch.randn(B, HKV, t, d, generator=g)
    return q, apply_rope(k_pre, rope), v, k_pre, rope, _stats(d, mix)


def _run(m, q, k, v, k_pre, rope, chunks, prefill_first=False):
    st = m.new_layer_state(0)
    outs, s0 = [], 0
    for i, c in enumerate(chunks):
        sl = slice(s0, s0 + c)
        r = Rope(rope.cos[:, sl], rope.sin[:, sl])
        outs.append(
            st.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=1 / math.sqrt(q.shape[-1]),
                      prefill=prefill_first and i == 0, k_pre=k_pre[:, :, sl], rope=r)
        )
        s0 += c
    return torch.cat(outs, dim=2), st


def ref_keys(k_pre, rope, mu, vecs, schedule, group):
    """Naive §3.2: latent c = V^T(k - mu), each latent group at its bits over token groups,
    dropped groups = 0, k_hat = mu + V c_hat, then RoPE. mu [H,d], vecs [H,d,d] descending."""
    n, d = k_pre.shape[2], k_pre.shape[3]
    nq = group * (n // group)
    m = d // 8
    out = torch.zeros(B, HKV, nq, d)
    for h in range(HKV):
        c = (k_pre[0, h, :nq].double() - mu[h]) @ vecs[h]
        c_hat = torch.zeros_like(c)
        for j, b in enumerate(schedule):
            if b:
                blk = c[:, j * m:(j + 1) * m].float()[None, None]
                deq = fake_quantize_groups(blk, b, group, axis=2)[0, 0]
                c_hat[:, j * m:(j + 1) * m] = deq.double()
        out[0, h] = (mu[h] + c_hat @ vecs[h].T).float()
    return apply_rope(out, Rope(rope.cos[:, :nq], rope.sin[:, :nq]))


def ref_attention(q, k, k_hat, v, group, prefill_len=0):
    """Naive per-query loop of the key rule: s quantized iff s < G*floor(t/G)."""
    n, d = k.shape[2], k.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    gq = q.shape[1] // k.shape[1]
    for t in range(n):
        for h in range(q.shape[1]):
            kh = h // gq
            keys = [
                k_hat[0, kh, s] if (t >= prefill_len and s < group * (t // group)) else k[0, kh, s]
                for s in range(t + 1)
            ]
            logits = torch.stack(keys).double() @ q[0, h, t].double() / math.sqrt(d)
            p = torch.softmax(logits, dim=0)
            out[0, h, t] = p @ v[0, kh, : t + 1].double()
    return out


def _calib_eig(stats):
    evals, evecs = torch.linalg.eigh(stats.cov_k)
    return evals.flip(-1), evecs.flip(-1)


def test_chunk_equals_token_by_token_and_reference():
    """In float64: two float32 paths through a rounding quantizer can flip a code with the CPU's
    BLAS kernels."""
    t, d, g = 150, 16, 32
    q, k, v, k_pre, rope, stats = _data(t, d)
    q, k, v, k_pre = q.double(), k.double(), v.double(), k_pre.double()
    rope = Rope(rope.cos.double(), rope.sin.double())
    m = SVDq(group=g, schedule=(4, 3, 2, 2, 1, 0, 0, 0))
    m.calibrate([stats])
    full, st_full = _run(m, q, k, v, k_pre, rope, [t])
    steps, st_steps = _run(m, q, k, v, k_pre, rope, [1] * t)
    mixed, _ = _run(m, q, k, v, k_pre, rope, [40, 1, 23, 86])
    assert (full - steps).abs().max() < 1e-5
    assert (full - mixed).abs().max() < 1e-5
    assert st_full.stored_bits() == st_steps.stored_bits()
    _, vecs = _calib_eig(stats)
    k_hat = ref_keys(k_pre, rope, stats.mu_k, vecs, m.schedule, g)
    assert (st_full.k_hat.data - k_hat).abs().max() < 1e-4
    kh_full = torch.cat([k_hat, k[:, :, k_hat.shape[2]:]], dim=2)
    ref = ref_attention(q, k, kh_full, v, g)
    assert (full.double() - ref).abs().max() < 1e-5
    assert (full - causal_attention(q, k, v, 1 / math.sqrt(d))).abs().max() > 1e-2


def test_prefill_basis_then_decode():
    t, p, d, g = 140, 70, 16, 16
    q, k, v, k_pre, rope, _ = _data(t, d, seed=3)
    m = SVDq(group=g, basis="prefill", schedule=(6, 4, 3, 2, 0, 0, 0, 0))
    out, st = _run(m, q, k, v, k_pre, rope, [p, 1, 29, t - p - 30], prefill_first=True)
    # reference basis: SVD of this sequence's centred prefill keys, stored as fp16
    kp = k_pre[0, :, :p].double()
    mu = kp.mean(1)
    _, _, vh = torch.linalg.svd(kp - mu[:, None], full_matrices=True)
    vecs = vh.transpose(-1, -2)  # right singular vectors, descending
    n_act = 4 * d // 8
    # singular vectors have a sign ambiguity: align to the implementation's
    sign = torch.sign((vecs[..., :n_act] * st.basis[0].double()).sum(1))
    vecs = vecs.clone()
    vecs[..., :n_act] *= sign[:, None, :]
    assert (st.basis[0].double() - vecs[..., :n_act].half().double()).abs().max() < 2e-3
    # keys from the stored fp16 basis, naive quantization
    full_v = torch.zeros(HKV, d, d, dtype=torch.float64)
    full_v[..., :n_act] = st.basis[0].double()
    k_hat = ref_keys(k_pre, rope, st.mu[0, :, 0].double(), full_v, m.schedule, g)
    assert (st.k_hat.data - k_hat).abs().max() < 1e-4
    kh_full = torch.cat([k_hat, k[:, :, k_hat.shape[2]:]], dim=2)
    ref = ref_attention(q, k, kh_full, v, g, prefill_len=p)
    assert (out.double() - ref).abs().max() < 1e-5


def test_prefill_basis_rejects_qall():
    q, k, v, k_pre, rope, _ = _data(8, 16)
    m = SVDq(basis="prefill", schedule=PAPER_SCHEDULE)
    with pytest.raises(ValueError, match="prefill-exact"):
        _run(m, q, k, v, k_pre, rope, [8])


def test_full_rank_8bit_is_nearly_exact_and_order_matters():
    t, d, g = 256, 64, 128
    q, k, v, k_pre, rope, stats = _data(t, d, seed=5)
    m = SVDq(group=g, schedule=(8,) * 8)
    m.calibrate([stats])
    _, st = _run(m, q, k, v, k_pre, rope, [t])
    # RoPE is orthogonal: compare post-RoPE errors with the centred pre-RoPE key energy
    energy = (k_pre - stats.mu_k.float()[None, :, None]).norm()
    rel = (st.k_hat.data - k).norm() / energy
    # 8-bit min-max over 128 Gaussian tokens: step ~ 5.2 sigma / 255, rms error step/sqrt(12)
    # ~ 0.006 sigma: the only error left at full rank is the quantizer's
    assert 3e-3 < rel < 1e-2
    # rank d/8 keeping the top eigen-directions: error close to the truncation energy
    m1 = SVDq(group=g, schedule=(8, 0, 0, 0, 0, 0, 0, 0))
    m1.calibrate([stats])
    _, st1 = _run(m1, q, k, v, k_pre, rope, [t])
    evals, _ = _calib_eig(stats)
    tail = (evals[:, d // 8:].sum() / evals.sum()).sqrt()
    rel1 = (st1.k_hat.data - k).norm() / energy
    assert rel1 == pytest.approx(float(tail), rel=0.15)
    # the last d/8 directions would be far worse (catches an ascending basis)
    head = (evals[:, : d - d // 8].sum() / evals.sum()).sqrt()
    assert rel1 < 0.6 * float(head)


@pytest.mark.parametrize("basis", ["calib", "prefill"])
@pytest.mark.parametrize("t", [40, 256, 300])
def test_measured_bpd_matches_formula(basis, t):
    d, g = 64, 128
    q, k, v, k_pre, rope, stats = _data(t, d, seed=6)
    sched = (8, 4, 2, 1, 1, 0, 0, 0)
    m = SVDq(group=g, basis=basis, schedule=sched)
    m.configure(ModelShape(1, HQ, HKV, d), None, None)
    m.calibrate([stats])
    _, st = _run(m, q, k, v, k_pre, rope, [t], prefill_first=basis == "prefill")
    bk, bv = st.stored_bits()
    el = B * HKV * t * d
    nb = t % g
    n_act = 5 * d // 8
    exp = ((t - nb) * (2 + n_act / d * 32 / g) + 16 * nb) / t
    if basis == "prefill":
        exp += 16 * (n_act + 1) / t
    assert bk / el == pytest.approx(exp, abs=1e-12)
    assert bv / el == 16.0
    assert m.nominal_bpd(t)[0] == pytest.approx(exp, abs=1e-12)


def test_bpd_paper_example_t2048():
    """§3.3: (8,4,2,1,1,0,0,0), d=128, T=2048: 2 + 0.156 (+ 0.633 with the prefill basis)."""
    t, d = 2048, 128
    for basis, expected in (("calib", 2.15625), ("prefill", 2.15625 + 16 * 81 / 2048)):
        m = SVDq(basis=basis, budget="mean")
        m.configure(ModelShape(1, 2, 1, d), 2.0, None)
        assert m._schedule() == PAPER_SCHEDULE
        assert m.nominal_bpd(t)[0] == pytest.approx(expected, abs=1e-12)
    assert 16 * 81 / 2048 == pytest.approx(0.63, abs=0.005)


def test_value_quantization_bpd():
    t, d = 96, 64
    q, k, v, k_pre, rope, stats = _data(t, d, seed=8)
    m = SVDq(group=32)
    m.configure(ModelShape(1, HQ, HKV, d), 2.0, 3.0)
    m.calibrate([stats])
    assert m.knobs()["v_bits"] == 2 and m.knobs()["v_group"] == 32
    out, st = _run(m, q, k, v, k_pre, rope, [t])
    steps, _ = _run(m, q, k, v, k_pre, rope, [1] * t)
    assert (out - steps).abs().max() < 1e-5
    assert st.stored_bits()[1] / (B * HKV * t * d) == 3.0
    assert m.nominal_bpd(t)[1] == 3.0


def test_gaussian_mse_table_against_numeric():
    """e(b) of §1.1: MSE-optimal mid-rise uniform quantizer of N(0,1), numeric integration."""
    def mse(step, b):
        half = 2 ** (b - 1)
        xs = torch.linspace(-8, 8, 32001, dtype=torch.float64)
        code = torch.clamp(torch.floor(xs / step) + half, 0, 2**b - 1)
        rec = (code - half + 0.5) * step
        pdf = torch.exp(-xs**2 / 2) / math.sqrt(2 * math.pi)
        tot = torch.trapezoid((xs - rec) ** 2 * pdf, xs)
        return float(tot)

    for b in range(1, 9):
        lo, hi = 0.01, 2.0  # golden-section search on the step
        for _ in range(22):
            a, c = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            if mse(a, b) < mse(c, b):
                hi = c
            else:
                lo = a
        assert GAUSS_MSE[b] == pytest.approx(mse((lo + hi) / 2, b), rel=0.01), b
    assert GAUSS_MSE[0] == 1.0


def test_greedy_schedule_properties():
    d = 128
    assert greedy_schedule(8, [1.0] * 8, d) == (1,) * 8
    assert greedy_schedule(8, [1e6] + [1.0] * 7, d) == (8, 0, 0, 0, 0, 0, 0, 0)
    assert greedy_schedule(64, [5, 4, 3, 2, 1, 1, 1, 1], d) == (8,) * 8
    # hand-computed: lambda = (1, 0.5, ...tiny): gains 0.637, 0.3185, then group 0 1->2 = 0.244
    assert greedy_schedule(3, [1.0, 0.5] + [1e-3] * 6, d) == (2, 1, 0, 0, 0, 0, 0, 0)
    s = greedy_schedule(13, [8, 4, 2, 1, 0.5, 0.25, 0.1, 0.05], d)
    assert sum(s) == 13 and list(s) == sorted(s, reverse=True)


SHAPE = ModelShape(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=16)


def test_configure_schedules_and_unsupported():
    _, _, _, _, _, stats = _data(8, 16)
    m = SVDq(budget="mean")
    m.configure(SHAPE, 2.0, None)
    m.calibrate([stats])
    assert tuple(m.knobs()["schedule"]) == PAPER_SCHEDULE
    m = SVDq(budget="mean")
    m.configure(SHAPE, 0.5, None)
    with pytest.raises(RuntimeError, match="calibrat"):
        m.new_layer_state(0)
    m.calibrate([stats])
    assert sum(m.knobs()["schedule"]) == 4
    m2 = SVDq(budget="mean")  # calibrate before configure gives the same schedule
    m2.calibrate([stats])
    m2.configure(SHAPE, 0.5, None)
    assert m2.knobs()["schedule"] == m.knobs()["schedule"]
    for bad in (0.01, 9.0):
        with pytest.raises(Unsupported):
            SVDq(budget="mean").configure(SHAPE, bad, None)
    # "total": asymptotic nominal (mean bits + metadata) within the target
    m = SVDq(budget="total")
    m.configure(SHAPE, 2.0, None)
    m.calibrate([stats])
    sched = m.knobs()["schedule"]
    nominal = sum(sched) / 8 + sum(b > 0 for b in sched) / 8 * 32 / 128
    assert nominal <= 2.0 and nominal > 2.0 - 0.125 - 0.04
    with pytest.raises(Unsupported, match="0.156"):
        SVDq(budget="total").configure(SHAPE, 0.15, None)
    with pytest.raises(ValueError):
        SVDq(basis="bogus")


def test_registry_builds_svdq():
    m = build_method("svdq", basis="prefill", group=64)
    assert isinstance(m, SVDq) and m.needs_calibration and m.name == "svdq"


def _measured_track_a(m, t, d, seed=0):
    """Mean over query positions of what one Q-all pass of t tokens read (convention v2)."""
    q, k, v, k_pre, rope, _ = _data(t, d, seed=seed)
    st = m.new_layer_state(0)
    st.attend(q, k, v, scaling=d**-0.5, prefill=False, k_pre=k_pre, rope=rope)
    bits_k, _ = st.read_bits()
    return float((bits_k / (torch.arange(1, t + 1, dtype=torch.float64) * B * HKV * d)).mean())


@pytest.mark.parametrize("target", [1.0, 2.0, 4.0])
def test_measured_budget_meets_the_target_in_track_a(target):
    """budget='measured' (default): the mean-over-positions bpd_K, buffer included, is within 2 %
    of the target; the prediction it was fitted with equals what the cache really read."""
    t, d = 2048, 64
    _, _, _, _, _, stats = _data(8, d)
    m = SVDq()
    m.set_regime(Regime("qall", t))
    m.configure(ModelShape(1, HQ, HKV, d), target, None)
    m.calibrate([stats])
    measured = _measured_track_a(m, t, d)
    assert measured == pytest.approx(m.knobs()["fit"]["predicted_bpd_k"], abs=1e-9)
    assert measured == pytest.approx(target, rel=0.02)
    assert m.knobs()["fit"]["basis"] == "calib" and m.knobs()["basis"] == "auto"


def test_measured_budget_below_reach_is_unsupported_with_the_range():
    m = SVDq()
    m.set_regime(Regime("qall", 2048))
    with pytest.raises(Unsupported, match=r"not reachable in Q-all over 2048 positions.*lies in \[0\.8"):
        m.configure(ModelShape(30, 9, 3, 64), 0.5, None)


def test_measured_budget_in_a_prefill_regime_counts_the_basis():
    d = 64
    m = SVDq()
    m.set_regime(Regime("prefill", 1536, 511))
    m.configure(ModelShape(1, HQ, HKV, d), 1.0, None)
    _, _, _, _, _, stats = _data(8, d)
    m.calibrate([stats])
    fit = m.knobs()["fit"]
    assert fit["basis"] == "prefill" and fit["predicted_bpd_k"] <= 1.02
    sched, g = m.knobs()["schedule"], m.knobs()["group_tokens"]
    n_act = sum(1 for b in sched if b > 0) * d // 8
    quant = sum(sched) / 8 + n_act / d * 32 / g
    basis = 16 * (n_act + 1)

    def held(n, nq):  # bits per element of a cache of n keys, nq of them quantized
        return (nq * quant + (n - nq) * 16 + basis) / n

    end = held(1536, g * (1536 // g))  # the stored prompt: every complete group quantized
    # docs/methods.md §0 v3: the 512 scored targets are the prefill's own prediction (the stored prompt)
    # and 511 decoded queries; the one at p reads p + 1 keys, those below g floor(p/g) quantized
    decoded = [held(p + 1, g * (p // g)) for p in range(1536, 2047)]
    direct = (end + sum(decoded)) / 512
    assert fit["predicted_bpd_k"] == pytest.approx(direct, abs=1e-12)
    # and the real cache after a 1536-token prefill holds the stored prompt, and the decoded
    # queries read what the prediction says
    q, k, v, k_pre, rope, _ = _data(2047, d, seed=4)
    _, st = _run(m, q, k, v, k_pre, rope, [1536, 511], prefill_first=True)
    read = st.read_bits()[0] / (B * HKV * d * torch.arange(1537, 2048, dtype=torch.float64))
    assert read.tolist() == pytest.approx(decoded, abs=1e-12)
    assert (end + float(read.sum())) / 512 == pytest.approx(fit["predicted_bpd_k"], abs=1e-12)
