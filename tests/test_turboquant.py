"""TurboQuant (methods/turboquant.py) against docs/methods.md §16.9's checks.

There is no official TurboQuant code (§16), so the oracle is written here from the paper's
equations: a Lloyd-Max fixed point on a 2·10^6-point grid of f_d (not the module's quadrature and
Newton solver), Haar rotations, and Monte Carlo against Theorems 1-2. The QJL stage is checked
against a line-by-line transcription of the official code (amirzandieh/QJL).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import configured_method, tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.integrate import attach
from methods import build_method
from methods.base import LayerStats, ModelShape, Regime, Unsupported
from methods.turboquant import (
    InstancePlan,
    TurboInstance,
    TurboQuant,
    budget_plan,
    lloyd_max,
    outlier_channels,
    plain_plan,
    rotation,
    sketch_matrix,
    unit_distortion,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]

F64 = torch.float64
REPO = Path(__file__).resolve().parents[1]

# §16.1: d * MSE of the f_d codebooks (computed for the spec), b = 1..4
SPEC_DMSE = {128: (0.3609, 0.1160, 0.0340, 0.0093), 32: (0.3534, 0.1116, 0.0323, 0.0088)}
MAX_1960 = (0.3634, 0.1175, 0.03454, 0.009497)  # d -> infinity


# ---- §16.9 test 1: codebooks against a from-scratch grid reference ------------------------------


def grid_lloyd(bits: int, d: int, n: int = 2_000_000, tol: float = 1e-15, max_iter: int = 20_000):
    """Lloyd-Max of f_d(y) ∝ (1 - y^2)^((d-3)/2) by fixed-point iteration on an n-point midpoint
    grid of [-1, 1]: cumulative integrals of f and y f at the grid edges, cell integrals by linear
    interpolation at the boundaries. Returns (centroids, d * MSE)."""
    edges = np.linspace(-1.0, 1.0, n + 1)
    y = (edges[1:] + edges[:-1]) / 2
    f = (1.0 - y * y) ** ((d - 3) / 2)
    f /= f.sum() * (2.0 / n)
    h = 2.0 / n
    cum0 = np.concatenate([[0.0], np.cumsum(f * h)])
    cum1 = np.concatenate([[0.0], np.cumsum(y * f * h)])
    levels = 1 << bits
    c = np.linspace(-2.0, 2.0, levels) / math.sqrt(d)
    for _ in range(max_iter):
        t = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
        m0 = np.diff(np.interp(t, edges, cum0))
        m1 = np.diff(np.interp(t, edges, cum1))
        new = m1 / m0
        done = np.abs(new - c).max() < tol
        c = new
        if done:
            break
    cell = np.clip(np.searchsorted((c[1:] + c[:-1]) / 2, y), 0, levels - 1)
    mse = float(((y - c[cell]) ** 2 * f * h).sum())
    return c, d * mse


@pytest.mark.parametrize("d,max_bits", [(32, 4), (64, 5), (128, 4)])
def test_codebooks_match_a_grid_lloyd_max_reference(d, max_bits):
    for b in range(1, max_bits + 1):
        cb = lloyd_max(b, d)
        c = np.array(cb.centroids)
        ref, ref_dmse = grid_lloyd(b, d)
        assert np.abs(c - ref).max() < 1e-8 / math.sqrt(d), (b, d)
        assert np.array_equal(c, -c[::-1])  # symmetric
        assert np.all(np.diff(c) > 0)
        assert np.allclose(cb.boundaries, (c[1:] + c[:-1]) / 2, rtol=0, atol=1e-15)
        assert d * cb.mse == pytest.approx(ref_dmse, abs=1e-7)


@pytest.mark.parametrize("d", [32, 128])
def test_distortion_matches_the_spec_and_theorem_1(d):
    for b in range(1, 5):
        dmse = d * lloyd_max(b, d).mse
        assert dmse == pytest.approx(SPEC_DMSE[d][b - 1], abs=1e-4)
        assert dmse <= math.sqrt(3) * math.pi / 2 * 4.0**-b  # Theorem 1's bound
    # the Gaussian limit (Max 1960) as d grows
    for b in range(1, 5):
        assert 4096 * lloyd_max(b, 4096).mse == pytest.approx(MAX_1960[b - 1], rel=2e-3)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_one_bit_centroid_is_the_mean_absolute_coordinate(d):
    closed = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    assert lloyd_max(1, d).centroids == pytest.approx((-closed, closed), rel=1e-12)
    if d == 128:
        assert closed == pytest.approx(0.07066, abs=5e-6)


def test_zero_bits_and_bad_widths():
    cb = lloyd_max(0, 64)
    assert cb.centroids == (0.0,) and cb.mse == pytest.approx(1 / 64)
    with pytest.raises(ValueError, match="0..8"):
        lloyd_max(9, 64)
    with pytest.raises(ValueError, match="d >= 2"):
        lloyd_max(2, 1)


# ---- §16.9 test 2: Haar rotations ----------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_is_orthogonal_and_isotropic(d):
    pi = rotation(d, 3)
    assert (pi @ pi.T - torch.eye(d, dtype=F64)).abs().max() < 1e-12
    u = torch.zeros(d, dtype=F64)
    u[0] = 0.6
    u[1] = 0.8
    ys = torch.stack([rotation(d, s) @ u for s in range(2000 if d == 64 else 800)])
    var = ys.pow(2).mean(0)  # E y_j = 0 by symmetry; 2000 * 64 or 800 * 128 draws in all
    assert float(var.mean()) * d == pytest.approx(1.0, rel=0.02)
    assert float(var.max()) * d < 1.15 and float(var.min()) * d > 0.85


# ---- §16.9 test 3: Monte Carlo against Theorems 1 and 2 ------------------------------------------


def _instance(d, widths, qjl=False, seed=0, sketch="gaussian"):
    plan = InstancePlan("all", d, tuple(widths), qjl)
    s = sketch_matrix(d, seed + 1, sketch)[None] if qjl else None
    return TurboInstance(plan, rotation(d, seed)[None], s, None)


def _unit(n, d, seed):
    x = torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return x / x.norm(dim=-1, keepdim=True)


def _decoded(inst, x, chunk=25_000):
    """x_hat of unit vectors [1, 1, n, d], encoded in chunks (bounded temporaries)."""
    return torch.cat([inst.encode(x[:, :, i : i + chunk])[1] for i in range(0, x.shape[2], chunk)], 2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_monte_carlo_mse_distortion(bits):
    d = 128
    x = _unit(100_000, d, bits)
    x_hat = _decoded(_instance(d, (bits,) * d), x)
    err = (x_hat - x).pow(2).sum(-1)
    assert float(err.mean()) == pytest.approx(SPEC_DMSE[d][bits - 1], rel=0.03)
    # mse is biased: E<x, x_hat> = 1 - D (§16.3)
    inner = (x_hat * x).sum(-1)
    assert float(inner.mean()) == pytest.approx(1 - d * lloyd_max(bits, d).mse, abs=3e-3)


PROD_SPEC = {1: 1.57, 2: 0.56, 3: 0.18}  # §16.2 D_prod * d, b = 1..3 (b = 4: see below)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_monte_carlo_prod_is_unbiased_with_theorem_2_variance(bits):
    """Slope of <y, x_hat> on <y, x> is 1 ± 0.01; the error variance is within 10 % of the exact
    QJL variance E[gamma^2] (pi/2 - 1/d) / d (unit y independent of x), and of §16.2's values for
    b = 1..3. (§16.2's b = 4 value 0.047/d is 12 % below the exact 0.053/d: not checked.)"""
    d, n = 128, 100_000
    x = _unit(n, d, 10 + bits)
    y = _unit(n, d, 20 + bits)
    x_hat = _decoded(_instance(d, (bits - 1,) * d, qjl=True), x)
    a = (y * x).sum(-1).reshape(-1)
    e = (y * x_hat).sum(-1).reshape(-1)
    assert float((a * e).sum() / (a * a).sum()) == pytest.approx(1.0, abs=0.01)
    var = float((e - a).var())
    d_prev = d * lloyd_max(bits - 1, d).mse
    assert var == pytest.approx(d_prev * (math.pi / 2 - 1 / d) / d, rel=0.10)
    if bits in PROD_SPEC:
        assert var * d == pytest.approx(PROD_SPEC[bits], rel=0.10)
    assert var <= math.sqrt(3) * math.pi**2 / d * 4.0**-bits  # Theorem 2's bound


# ---- §16.9 test 4: the QJL stage against the official code -------------------------------------


def qjl_qunatize_official(data, outlier_mask, proj_dir_quant):
    """amirzandieh/QJL models/llama2_utils_qjl.py, ``QJLSketch.qjl_qunatize``, line by line (the
    official pins ``enc_vec`` to device='cuda'; here it lives on the CPU)."""
    s = proj_dir_quant.shape[0]
    key_states_outlier = data * outlier_mask.unsqueeze(-2)
    key_states_inlier = data * (1 - outlier_mask.unsqueeze(-2))
    sketched_key_outlier = torch.einsum("...nd,...sd -> ...ns", key_states_outlier.to(proj_dir_quant.dtype),
                                        proj_dir_quant)
    sketched_key_inlier = torch.einsum("...nd,...sd -> ...ns", key_states_inlier.to(proj_dir_quant.dtype),
                                       proj_dir_quant)
    bit_pack_len = 8
    sketched_key_outlier = sketched_key_outlier.view(*sketched_key_outlier.shape[:-1], -1, bit_pack_len)
    sketched_key_inlier = sketched_key_inlier.view(*sketched_key_inlier.shape[:-1], -1, bit_pack_len)
    mask_outlier = sketched_key_outlier > 0
    mask_inlier = sketched_key_inlier > 0
    enc_vec = 2 ** torch.arange(bit_pack_len, dtype=torch.uint8).view(1, 1, 1, -1)
    hash_key_outlier_simhash = (mask_outlier * enc_vec).sum(dim=-1, dtype=torch.uint8)
    hash_key_inlier_simhash = (mask_inlier * enc_vec).sum(dim=-1, dtype=torch.uint8)
    hash_key_outlier_simhash = hash_key_outlier_simhash[:, :, :, :, : s // 16]
    return hash_key_inlier_simhash, hash_key_outlier_simhash


def qjl_score_official(query, key_quant, key_norm, proj_dir_score):
    """qjl_kernel/csrc/qjl_score_kernel.cu ``calc_score_kernel`` without outliers: the query sketch
    ``query @ proj_dir_score`` (llama2_utils_qjl.py ``calc_score``), k_inner_prod = sum over bits of
    (bit ? q_sketch : -q_sketch), score = sqrt(M_PI_2) / sketch_dim * norm_k * k_inner_prod."""
    sketch_dim = proj_dir_score.shape[1]
    q_sketch = query @ proj_dir_score  # [..., m]
    bits = ((key_quant[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(*key_quant.shape[:-1], -1)
    k_inner_prod = torch.where(bits.bool(), q_sketch[..., None, :], -q_sketch[..., None, :]).sum(-1)
    return math.sqrt(math.pi / 2) / sketch_dim * key_norm * k_inner_prod


def init_rot_dir_official(proj_dir):
    """llama2_utils_qjl.py ``QJLSketch.init_rot_dir`` (dim = (d, m)): QR per d-column chunk, * sqrt(d)."""
    d, m = proj_dir.shape
    rot_matrices = []
    for i in range((m + d - 1) // d):
        q, _ = torch.linalg.qr(proj_dir[:, i * d : (i + 1) * d], mode="reduced")
        rot_matrices.append(q)
    return torch.cat(rot_matrices, dim=-1) * math.sqrt(d)


@pytest.mark.parametrize("sketch", ["gaussian", "orthogonal"])
@pytest.mark.parametrize("mse_bits", [0, 2])
def test_qjl_stage_matches_the_official_sketch_and_estimator(sketch, mse_bits):
    d, t = 64, 40
    inst = _instance(d, (mse_bits,) * d, qjl=True, seed=5, sketch=sketch)
    s = inst.sketch[0]  # [m, d]: proj_dir_quant; proj_dir_score = s.T
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, t, d, generator=g, dtype=F64) * 3
    q = torch.randn(1, 1, 1, d, generator=g, dtype=F64)
    packed, x_hat = inst.encode(x)
    # what the sign bits sketch: the unit residual rho = u - u_hat (u itself without an mse stage)
    u = x / x.norm(dim=-1, keepdim=True)
    u_hat = torch.zeros_like(u)
    if mse_bits:
        u_hat = TurboInstance(InstancePlan("all", d, (mse_bits,) * d, False), inst.rot, None, None).encode(u)[1]
    rho = u - u_hat
    official, _ = qjl_qunatize_official(rho[:, :, None], torch.zeros(1, 1, 1, d, dtype=F64), s)
    assert torch.equal(packed.signs, official[:, :, 0])  # identical sign bits, byte for byte
    nu = packed.norm.to(F64)
    gamma = 1.0 if packed.gamma is None else packed.gamma.to(F64)
    score = qjl_score_official(q[0, 0], official[0, 0, 0], (nu * gamma)[0, 0], s.T)
    ours = (x_hat - nu[..., None] * u_hat) @ q[0, 0, 0]  # the QJL term of <q, x_hat>
    assert (ours[0, 0] - score[0]).abs().max() < 1e-6 * float(score.abs().max())
    if sketch == "orthogonal":  # S^T = init_rot_dir of the same Gaussian draw
        gauss = sketch_matrix(d, 6, "gaussian")
        assert torch.allclose(init_rot_dir_official(gauss), s.T, atol=1e-13, rtol=0)


# ---- §16.9: float32 vs the float64 reference; test 5: scale equivariance -------------------------


def test_float32_agrees_with_float64_except_at_boundaries():
    d = 64
    inst = _instance(d, (4,) * 48 + (3,) * 16, seed=2)
    x = torch.randn(1, 1, 3000, d, generator=torch.Generator().manual_seed(4), dtype=F64)
    ref = inst.encode(x)[1]
    got = inst.encode(x.float())[1].double()
    y = torch.einsum("bhtd,ed->bhte", x / x.norm(dim=-1, keepdim=True), inst.rot[0])
    bnd = torch.tensor(lloyd_max(4, d).boundaries + lloyd_max(3, d).boundaries, dtype=F64)
    near = ((y[..., :, None] - bnd).abs() < 1e-6).any(-1).any(-1)  # [1, 1, T]
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(near.double().mean()) < 0.05
    assert float(rel[~near].max()) < 1e-5


@pytest.mark.parametrize("alpha", [4.0, 0.25, 3.0])
def test_scale_equivariance(alpha):
    d = 64
    for inst in (_instance(d, (2,) * d), _instance(d, (1,) * d, qjl=True)):
        x = torch.randn(1, 1, 200, d, generator=torch.Generator().manual_seed(8), dtype=F64)
        a, b = inst.encode(x)[1], inst.encode(alpha * x)[1]
        # fp16 rounding of nu (and gamma) is exact under powers of two, < 2^-11 relative otherwise
        tol = 0.0 if math.log2(alpha).is_integer() else 2.0**-10
        rel = (b - alpha * a).norm(dim=-1) / (alpha * a).norm(dim=-1)
        assert float(rel.max()) <= tol + 1e-15


# ---- §16.9 test 6: budget -------------------------------------------------------------------------

# §16.7's table with the d = 64 arithmetic (SmolLM2) beside d = 128: target -> (bits @, norms)
TABLE = {
    128: {0.5: {1: 48, 0: 80}, 1.0: {1: 112, 0: 16}, 1.5: {2: 48, 1: 80}, 2.0: {2: 112, 1: 16},
          3.0: {3: 112, 2: 16}, 4.0: {4: 112, 3: 16}},
    64: {0.5: {1: 16, 0: 48}, 1.0: {1: 48, 0: 16}, 1.5: {2: 16, 1: 48}, 2.0: {2: 48, 1: 16},
         3.0: {3: 48, 2: 16}, 4.0: {4: 48, 3: 16}},
}


def _shape(d, layers=2, kv=2):
    return ModelShape(n_layers=layers, n_q_heads=2 * kv, n_kv_heads=kv, head_dim=d)


def _counts(widths):
    out = {}
    for b in widths:
        out[b] = out.get(b, 0) + 1
    return out


def _stored_bits_per_vector(method, d, side="k", t=24):
    state = method.new_layer_state(0)
    x = torch.randn(1, method._shape.n_kv_heads, t, d, generator=torch.Generator().manual_seed(0), dtype=F64)
    codec = state.key_codec if side == "k" else state.value_codec
    packed, _ = codec.encode_decode(x)
    return codec.bits(packed) / (t * method._shape.n_kv_heads)


@pytest.mark.parametrize("d", [64, 128])
def test_budget_map_reaches_the_table_and_stores_exactly_that(d):
    for target, widths in TABLE[d].items():
        m = TurboQuant()
        m.configure(_shape(d), target, target)
        m.calibrate(None)
        plan = m._plans["k"]
        assert _counts(plan.instances[0].widths) == widths and plan.norms == 1
        assert m.nominal_bpd(10) == (target, target)
        assert _stored_bits_per_vector(m, d) == target * d == sum(plan.instances[0].widths) + 16
        assert _stored_bits_per_vector(m, d, "v") == target * d
        assert m.knobs()["k_headline_bpd"] == target


@pytest.mark.parametrize("d", [64, 128])
def test_plain_paper_rows_and_prod_rows(d):
    for b in (1, 2, 3, 4):
        for variant, bits in (("mse", b * d + 16), ("prod", (b - 1) * d + d + 16 * (1 + (b > 1)))):
            m = TurboQuant(bits=b, k_variant=variant)
            m.configure(_shape(d), 3.0, None)  # a plain row runs as set, whatever the target
            m.calibrate(None)
            assert _stored_bits_per_vector(m, d) == bits
            assert m.nominal_bpd(1) == (bits / d, 16.0)
    assert plain_plan(1, 128, "prod", False).bits / 128 == 1.125  # QJL alone plus nu (§16.7)
    assert plain_plan(2, 128, "mse", True).bits / 128 == 2.5  # the paper's split (§16.4)
    assert plain_plan(3, 128, "mse", True).bits / 128 == 3.5
    m = TurboQuant(split=True)
    m.configure(_shape(128), 2.5, None)
    assert [_counts(i.widths) for i in m._plans["k"].instances] == [{3: 32}, {2: 96}]


def test_unreachable_budgets_name_the_range():
    for d, variant, target, low in ((64, "prod", 1.0, "1.25"), (128, "prod", 1.0, "1.125"), (64, "mse", 0.2, "0.2656")):
        m = TurboQuant(k_variant=variant)
        with pytest.raises(Unsupported, match=f"reachable {low}"):
            m.configure(_shape(d), target, None)
    with pytest.raises(Unsupported, match=r"\.\.8\.25"):
        TurboQuant().configure(_shape(64), 0.2, None)


def test_off_grid_targets_take_the_nearest_plan_within_two_percent():
    for regime in (Regime("qall", 2048), Regime("prefill", 1536, 511)):
        plan = budget_plan(1.3, _shape(64, kv=3), "mse", False, regime)
        assert plan.bits == 83  # round(1.3 * 64)
    m = TurboQuant()
    m.set_regime(Regime("prefill", 1536, 511))
    m.configure(_shape(64, kv=3), 1.3, None)
    assert m.knobs()["k_headline_bpd"] == pytest.approx(1.3, rel=0.02)


def test_static_bytes_count_codebooks_seed_and_outlier_sets():
    m = TurboQuant()
    m.configure(_shape(64), 2.0, None)
    assert m.static_bytes() == 4 * (4 + 2) + 8  # the (2, 64) and (1, 64) codebooks, the seed
    m = TurboQuant(split=True)
    m.configure(_shape(64), 2.0, 2.0)
    books = {(b, i.dim) for i in m._plans["k"].instances for b in i.widths}
    assert m.static_bytes() == sum(4 << b for b, _ in books) + 8 + 2 * 4 * 32 // 8


# ---- §16.4 split; §16.9 test 8 ---------------------------------------------------------------------


def test_outlier_pairs_are_the_largest_energy_rope_pairs():
    energy = torch.ones(2, 16, dtype=F64)
    energy[0, 3] = energy[0, 11] = 5.0  # pair 3 (channels 3 and 11)
    energy[1, 8 + 6] = 9.0  # pair 6 through its second channel
    out, rest = outlier_channels(energy, 4)  # 2 pairs per head
    assert out[0, [0, 2]].tolist() == [3, 11] and 6 in out[1].tolist() and 14 in out[1].tolist()
    for h in range(2):
        assert sorted(out[h].tolist() + rest[h].tolist()) == list(range(16))


@pytest.mark.parametrize("d_i", [32, 96])
def test_split_instances_pass_alone_at_their_dimension(d_i):
    """§16.9 test 8: an instance of the 128-channel split is TurboQuant at its own dimension."""
    b = 3 if d_i == 32 else 2
    for bits in (1, 2, b):
        ref, _ = grid_lloyd(bits, d_i)
        assert np.abs(np.array(lloyd_max(bits, d_i).centroids) - ref).max() < 1e-8 / math.sqrt(d_i)
    pi = rotation(d_i, 1)
    assert (pi @ pi.T - torch.eye(d_i, dtype=F64)).abs().max() < 1e-12
    x = _unit(40_000, d_i, d_i)
    err = (_decoded(_instance(d_i, (b,) * d_i), x) - x).pow(2).sum(-1)
    assert float(err.mean()) == pytest.approx(d_i * lloyd_max(b, d_i).mse, rel=0.03)


def test_split_codec_puts_each_instance_on_its_channels():
    d = 128
    m = TurboQuant(split=True)
    m.configure(_shape(d, layers=1, kv=1), 2.5, None)
    energy = torch.linspace(1.0, 2.0, d, dtype=F64)
    stats = [LayerStats(torch.zeros(1, d, dtype=F64), torch.diag(energy)[None], torch.zeros(1, d, dtype=F64),
                        torch.eye(d, dtype=F64)[None], torch.eye(d, dtype=F64)[None], 10)]
    m.calibrate(stats, seed=0)
    codec = m.new_layer_state(0).key_codec
    out, rest = (i.channels[0] for i in codec.instances)
    assert out.tolist() == list(range(48, 64)) + list(range(112, 128))  # the 16 highest-energy pairs
    x = torch.randn(1, 1, 500, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    packed, x_hat = codec.encode_decode(x)
    for inst, ch in ((codec.instances[0], out), (codec.instances[1], rest)):
        alone = TurboInstance(inst.plan, inst.rot, None, None).encode(x[..., ch])[1]
        assert torch.equal(x_hat[..., ch], alone)
    assert torch.equal(codec.decode(packed), x_hat)
    assert codec.bits(packed) == 500 * 320


# ---- codec round trip, debias ---------------------------------------------------------------------


@pytest.mark.parametrize("opts,bpd", [({}, 2.0), ({"k_variant": "prod"}, 3.0), ({"split": True}, 2.5),
                                      ({"bits": 3, "debias": True}, None)])
def test_decoding_the_stored_bytes_gives_the_working_copy(opts, bpd):
    d = 64
    m = TurboQuant(**opts)
    m.configure(_shape(d), bpd, None)
    energy = torch.arange(1.0, d + 1, dtype=F64)
    st = LayerStats(torch.zeros(2, d, dtype=F64), torch.diag(energy).expand(2, d, d), torch.zeros(2, d, dtype=F64),
                    torch.eye(d, dtype=F64).expand(2, d, d), torch.eye(d, dtype=F64).expand(2, d, d), 10)
    m.calibrate([st, st], seed=1)
    codec = m.new_layer_state(1).key_codec
    for dtype in (F64, torch.float32):
        x = torch.randn(2, 2, 37, d, generator=torch.Generator().manual_seed(2), dtype=dtype)
        packed, x_hat = codec.encode_decode(x)
        assert torch.equal(codec.decode(packed), x_hat)


def test_debias_scales_mse_keys_by_one_over_one_minus_d():
    d = 64
    plain, debiased = TurboQuant(bits=2), TurboQuant(bits=2, debias=True)
    x = _unit(20_000, d, 4)[0].expand(2, -1, -1).unsqueeze(0).contiguous()
    outs = []
    for m in (plain, debiased):
        m.configure(_shape(d), None, None)
        m.calibrate(None, seed=0)
        outs.append(m.new_layer_state(0).key_codec.encode_decode(x)[1])
    dist = unit_distortion((2,) * d, d)
    assert torch.allclose(outs[1], outs[0] / (1 - dist), rtol=1e-12, atol=0)
    assert float((outs[1] * x).sum(-1).mean()) == pytest.approx(1.0, abs=5e-3)  # unbiased in expectation


# ---- §16.6, §16.9 test 7: inside a model: Q-all equals decoding; prefill-exact ------------------

T = 48
MODEL_CASES = [
    ({}, 2.0, 3.0),
    ({"k_variant": "prod"}, 3.0, None),
    ({"split": True, "pre_rope": True}, 2.5, 2.0),
    ({"bits": 4}, None, None),
]


@pytest.fixture(scope="module")
def model64():
    """A tiny float64 Llama with SmolLM2's head_dim 64 (one pass and per-token passes agree to
    ~1e-16 in float64, so codes do not flip between them)."""
    model = tiny_llama(seed=1, head_dim=64).to(F64)
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (2, 64), generator=g))


def _step_by_step(comp, ids, start=0):
    return torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(start, ids.shape[1])], 1)


@pytest.mark.parametrize("opts,bpd,v_bpd", MODEL_CASES, ids=str)
def test_in_pass_equals_token_by_token_decoding(model64, opts, bpd, v_bpd):
    model, stats = model64
    method = configured_method(model, "turboquant", opts, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        comp = attach(model, method)
        try:
            in_pass = model(input_ids=ids, use_cache=False).logits
            bpd_in_pass = comp.measured_bpd()
            reads = comp.read_bpd()  # what each query read (docs/methods.md §0): the same at every position
            with comp.session():
                stepped = _step_by_step(comp, ids)
            bpd_stepped = comp.measured_bpd()
        finally:
            comp.detach()
    assert (in_pass - stepped).abs().max() < 1e-9
    assert (in_pass - ref).abs().max() > 1e-3  # the cache really was compressed
    nominal = method.nominal_bpd(T)
    assert bpd_in_pass == pytest.approx(nominal, abs=1e-12) and bpd_stepped == pytest.approx(nominal, abs=1e-12)
    assert torch.allclose(reads[0], torch.full((T,), nominal[0], dtype=F64), rtol=1e-12)
    assert torch.allclose(reads[1], torch.full((T,), nominal[1], dtype=F64), rtol=1e-12)


def test_prefill_is_exact_then_chunk_equals_steps(model64):
    model, stats = model64
    method = configured_method(model, "turboquant", {}, 2.0, 3.0, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    p = 30
    with torch.no_grad():
        ref = model(input_ids=ids[:, :p], use_cache=False).logits
        comp = attach(model, method)
        try:
            with comp.session():
                prefill = comp.forward(ids[:, :p], 0, prefill=True)
                chunk = comp.forward(ids[:, p:], p, prefill=False)
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=True)
                steps = _step_by_step(comp, ids, p)
        finally:
            comp.detach()
    assert (prefill - ref[:, -prefill.shape[1]:]).abs().max() < 1e-9  # exact prefill attention
    assert (chunk - steps).abs().max() < 1e-9


# ---- registry and config ---------------------------------------------------------------------------


def test_registry_yaml_and_options():
    cfg = yaml.safe_load((REPO / "conf" / "method" / "turboquant.yaml").read_text())
    name = cfg.pop("name")
    m = build_method(name, **cfg)
    assert isinstance(m, TurboQuant) and m.needs_calibration and m.seeded
    with pytest.raises(TypeError, match="valid options"):
        build_method("turboquant", bitz=3)
    with pytest.raises(ValueError, match="k_variant"):
        TurboQuant(k_variant="qjl")
    with pytest.raises(ValueError, match="sketch"):
        TurboQuant(sketch="hadamard")
    with pytest.raises(ValueError, match="1..8"):
        TurboQuant(bits=9).configure(_shape(64), None, None)
