"""KV-COBRA method (docs/methods.md §5): codec vs naive reference, exactness, decode equivalence, bpd."""

import math

import pytest
import torch

from methods.attention import causal_attention
from methods.base import LayerStats, ModelShape, Rope, Unsupported, apply_rope
from methods.cobra import Cobra, CobraKL, CobraMSE, quant_factor, rope_average
from methods.cobra_alloc import split_bits
from methods.gaussquant import gaussian_mse, optimal_step

pytestmark = pytest.mark.numerics

SHAPE = ModelShape(n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=64)
F64 = torch.float64


def random_spd(n: int, d: int, decay: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[n, d, d] = Q diag(i^-decay) Q^T with Haar-like Q (decaying spectra)."""
    q, _ = torch.linalg.qr(torch.randn(n, d, d, dtype=F64, generator=g))
    lam = torch.arange(1, d + 1, dtype=F64)[None] ** (-decay[:, None])
    return (q * lam[:, None, :]) @ q.transpose(-1, -2)


def synthetic_stats(shape: ModelShape, seed: int = 0) -> list[LayerStats]:
    g = torch.Generator().manual_seed(seed)
    h, d = shape.n_kv_heads, shape.head_dim
    out = []
    for _ in range(shape.n_layers):
        decay = torch.rand(h, dtype=F64, generator=g) * 2.0 + 0.5  # heterogeneous heads
        out.append(LayerStats(
            mu_k=0.3 * torch.randn(h, d, dtype=F64, generator=g),
            cov_k=random_spd(h, d, decay, g),
            mu_v=0.1 * torch.randn(h, d, dtype=F64, generator=g),
            cov_v=random_spd(h, d, torch.full((h,), 0.4, dtype=F64), g),
            m_q=random_spd(h, d, torch.full((h,), 1.0, dtype=F64), g),
            n_tokens=4096,
        ))
    return out


STATS = synthetic_stats(SHAPE)


def make_rope(t: int, d: int, start: int = 0, dtype=torch.float32) -> Rope:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=F64) / d))
    ang = torch.arange(start, start + t, dtype=F64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return Rope(emb.cos()[None].to(dtype), emb.sin()[None].to(dtype))


def inputs(t: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = SHAPE.head_dim
    q = torch.randn(1, SHAPE.n_q_heads, t, d, dtype=F64, generator=g).to(dtype)
    k_pre = torch.randn(1, SHAPE.n_kv_heads, t, d, dtype=F64, generator=g).to(dtype)
    v = torch.randn(1, SHAPE.n_kv_heads, t, d, dtype=F64, generator=g).to(dtype)
    return q, k_pre, v


def built(method, bpd=1.0, v_bpd=None, seed=0):
    method.configure(SHAPE, bpd, v_bpd)
    method.calibrate(STATS, seed=seed)
    return method


def naive_quant(x: float, step: float, bits: int) -> float:
    half = 2 ** (bits - 1)
    return (min(max(math.floor(x / step) + half, 0), 2**bits - 1) - half + 0.5) * step


def test_key_codec_vs_naive_reference():
    m = built(CobraKL(), bpd=1.0)
    codec = m.new_layer_state(1).key_codec
    _, k_pre, _ = inputs(5, dtype=F64, seed=1)
    k_hat = codec.decode(codec.encode(k_pre))
    for h in range(SHAPE.n_kv_heads):
        p, step, width = codec.enc[h], codec.step[h], codec.width[h]
        r = int((width > 0).sum())
        for t in range(5):
            c = p[:r] @ (k_pre[0, h, t] - codec.mu[h])
            c_hat = torch.tensor([naive_quant(float(c[j]), float(step[j]), int(width[j])) for j in range(r)], dtype=F64)
            expect = codec.mu[h] + p[:r].T @ c_hat
            assert torch.allclose(k_hat[0, h, t], expect, atol=1e-10)


def test_operator_construction_per_head():
    """P = R U_r^T: orthonormal rows spanning the top-r eigenvectors (reordered by w), equalized
    diagonal, steps s*(b_j) sigma_bar, widths per §5.5, budgets summing to B_tot."""
    m = built(CobraKL(), bpd=2.0)
    kn = m.knobs()
    assert sum(kn["budgets"]) == 2 * 64 * 8
    for layer in range(SHAPE.n_layers):
        codec = m.new_layer_state(layer).key_codec
        for h in range(SHAPE.n_kv_heads):
            n = layer * SHAPE.n_kv_heads + h
            cov, mq = STATS[layer].cov_k[h], STATS[layer].m_q[h]
            lam, u = torch.linalg.eigh(cov)
            w = [float(lam[i] * (u[:, i] @ mq @ u[:, i])) for i in range(64)]
            order = sorted(range(64), key=lambda i: -w[i])
            r, budget = kn["ranks"][n], kn["budgets"][n]
            widths = codec.width[h][codec.width[h] > 0].tolist()
            assert len(widths) == r and widths == split_bits(budget, r)
            p = codec.enc[h, :r]
            ur = u[:, order[:r]]
            assert torch.allclose(p @ p.T, torch.eye(r, dtype=F64), atol=1e-10)
            assert torch.allclose(p.T @ p, ur @ ur.T, atol=1e-8)
            sigma2 = float(lam[order[:r]].mean())
            assert torch.allclose(torch.diagonal(p @ cov @ p.T), torch.full((r,), sigma2, dtype=F64), rtol=1e-9)
            expect = torch.tensor([optimal_step(b) for b in widths], dtype=F64) * math.sqrt(sigma2)
            assert torch.allclose(codec.step[h, :r], expect, rtol=1e-12)


@pytest.mark.parametrize("cls", [CobraMSE, CobraKL])
def test_exact_when_not_quantizing_at_full_rank(cls):
    m = built(cls(quantize=False), bpd=8.0)  # B_h = 1024 -> r = d for every head
    assert set(m.knobs()["ranks"]) == {64}
    q, k_pre, v = inputs(6)
    for layer in range(SHAPE.n_layers):
        state = m.new_layer_state(layer)
        k_hat = state.key_codec.decode(state.key_codec.encode(k_pre))
        assert torch.allclose(k_hat, k_pre, atol=1e-5)
        rope = make_rope(6, 64)
        k = apply_rope(k_pre, rope)
        out = state.attend(q, k, v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
        assert torch.allclose(out, causal_attention(q, k, v, 0.125), atol=1e-5)


@pytest.mark.parametrize("v_bpd", [None, 3])
def test_chunk_equals_token_by_token(v_bpd):
    m = built(CobraKL(), bpd=0.5, v_bpd=v_bpd)
    t = 9
    q, k_pre, v = inputs(t, dtype=F64, seed=2)
    rope = make_rope(t, 64, dtype=F64)
    k = apply_rope(k_pre, rope)
    chunk = m.new_layer_state(2)
    out_chunk = chunk.attend(q, k, v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
    step = m.new_layer_state(2)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        r = Rope(rope.cos[:, sl], rope.sin[:, sl])
        outs.append(step.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=0.125, prefill=False,
                                k_pre=k_pre[:, :, sl], rope=r))
    assert torch.allclose(out_chunk, torch.cat(outs, 2), atol=1e-10)
    assert chunk.n_seen == step.n_seen == t
    # one stream per call: the per-token calls pad each token to a byte, the chunk once
    (kc, vc), (ks, vs) = chunk.stored_bits(), step.stored_bits()
    assert kc <= ks <= kc + 8 * t and vc == vs


@pytest.mark.parametrize("bpd", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("cls", [CobraMSE, CobraKL])
def test_measured_bpd_equals_target(cls, bpd):
    t = 16
    for v_bpd, v_expect in [(None, 16.0), (4, 4.0)]:
        m = built(cls(), bpd=bpd, v_bpd=v_bpd)
        assert m.nominal_bpd(t) == (bpd, v_expect)
        bits_k = bits_v = 0
        for layer in range(SHAPE.n_layers):
            q, k_pre, v = inputs(t, seed=layer)
            rope = make_rope(t, 64)
            state = m.new_layer_state(layer)
            state.attend(q, apply_rope(k_pre, rope), v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
            bk, bv = state.stored_bits()
            bits_k, bits_v = bits_k + bk, bits_v + bv
        elements = t * SHAPE.n_heads_total * SHAPE.head_dim
        assert bits_k / elements == bpd
        assert bits_v / elements == v_expect


def test_gaussian_keys_match_distortion_model():
    """Keys drawn from N(mu, Sigma): measured MSE = truncation + sum_j e(b_j) sigma_bar^2 (§1.1)."""
    m = built(CobraMSE(q_model="gauss"), bpd=1.0)
    g = torch.Generator().manual_seed(5)
    layer = 0
    st = STATS[layer]
    codec = m.new_layer_state(layer).key_codec
    chol = torch.linalg.cholesky(st.cov_k)
    z = torch.randn(SHAPE.n_kv_heads, 20000, 64, dtype=F64, generator=g)
    keys = st.mu_k[:, None, :] + z @ chol.transpose(-1, -2)
    k_hat = codec.decode(codec.encode(keys[None]))[0]
    for h in range(SHAPE.n_kv_heads):
        mse = float(((k_hat[h] - keys[h]) ** 2).sum(-1).mean())
        p, width = codec.enc[h], codec.width[h]
        pc = p @ st.cov_k[h] @ p.T
        quant = sum(gaussian_mse(int(b)) * float(pc[j, j]) for j, b in enumerate(width.tolist()) if b > 0)
        model = float(torch.trace(st.cov_k[h]) - torch.trace(pc)) + quant
        assert mse == pytest.approx(model, rel=0.05)


def quarter_turn(a: int) -> torch.Tensor:
    c, s = round(math.cos(a * math.pi / 2)), round(math.sin(a * math.pi / 2))
    return torch.tensor([[c, -s], [s, c]], dtype=F64)


def test_rope_average_vs_naive():
    """E over independent uniform angles per RoPE pair of R^T M R, exact with quarter turns:
    diagonal blocks average R_a^T M_ii R_a over 4 angles; cross blocks E[R]^T M_ij E[R] = 0."""
    g = torch.Generator().manual_seed(3)
    d = 8
    m = random_spd(1, d, torch.tensor([0.7], dtype=F64), g)[0]
    mean_rot = sum(quarter_turn(a) for a in range(4)) / 4
    avg = torch.zeros(d, d, dtype=F64)
    for i in range(d // 2):
        for j in range(d // 2):
            rows, cols = [i, i + d // 2], [j, j + d // 2]
            block = m[rows][:, cols]
            if i == j:
                new = sum(quarter_turn(a).T @ block @ quarter_turn(a) for a in range(4)) / 4
            else:
                new = mean_rot.T @ block @ mean_rot
            for x, rr in enumerate(rows):
                for y, cc in enumerate(cols):
                    avg[rr, cc] = new[x, y]
    assert torch.allclose(rope_average(m[None])[0], avg, atol=1e-12)


def test_rotated_kl_term_vs_naive():
    g = torch.Generator().manual_seed(4)
    lam = torch.rand(2, 6, dtype=F64, generator=g)
    sq = torch.rand(2, 6, dtype=F64, generator=g)
    w = sq * lam
    rot = quant_factor(lam, sq, w, "kl", "rotated", "hadamard")
    seed = quant_factor(lam, sq, w, "kl", "seed", "hadamard")
    for h in range(2):
        for r in range(1, 7):
            assert float(rot[h, r]) == pytest.approx(float(lam[h, :r].mean() * sq[h, :r].sum()))
            assert float(seed[h, r]) == pytest.approx(float(w[h, :r].sum()))
    assert torch.equal(quant_factor(lam, sq, w, "kl", "rotated", "none"), seed)


def test_options_and_variants():
    assert CobraMSE.name == "cobra_mse" and CobraKL.name == "cobra_kl"
    assert CobraMSE().variant == "mse" and CobraKL().variant == "kl"
    assert CobraKL.needs_calibration and CobraKL.seeded
    with pytest.raises(TypeError):
        CobraMSE(variant="kl")
    with pytest.raises(ValueError):
        Cobra(rotation="quarot")
    kn = {}
    for c2 in (True, False, "exact"):
        kn[c2] = built(CobraKL(c2=c2, q_model="gauss", kl_term="rotated", q_stat="rope_avg"), bpd=1.0).knobs()
        assert sum(kn[c2]["budgets"]) == 64 * 8
    assert set(kn[False]["budgets"]) == {64}
    assert kn["exact"]["distortion_total"] <= kn[True]["distortion_total"] * (1 + 1e-12)
    none = built(CobraMSE(rotation="none", step_scale="coord"), bpd=1.0)
    assert set(none.knobs()["rotation_branches"]) == {"none"}
    codec = none.new_layer_state(0).key_codec  # P = U_r^T: steps s*(b_j) sqrt(lambda_j)
    lam = torch.linalg.eigvalsh(STATS[0].cov_k[0]).flip(0)
    r = none.knobs()["ranks"][0]
    expect = torch.tensor([optimal_step(int(b)) for b in codec.width[0, :r]], dtype=F64) * lam[:r].sqrt()
    assert torch.allclose(codec.step[0, :r], expect, rtol=1e-9)
    assert set(built(CobraMSE(), bpd=1.0).knobs()["rotation_branches"]) <= {"hadamard", "givens"}


def test_seed_changes_signs_only():
    a = built(CobraKL(), bpd=1.0, seed=0)
    b = built(CobraKL(), bpd=1.0, seed=1)
    assert a.knobs()["budgets"] == b.knobs()["budgets"]
    assert not torch.equal(a.new_layer_state(0).key_codec.enc, b.new_layer_state(0).key_codec.enc)


def test_unsupported_budgets():
    for bpd, v_bpd in [(0.01, None), (9.0, None), (1.0, 2.5), (1.0, 0)]:
        with pytest.raises(Unsupported):
            CobraKL().configure(SHAPE, bpd, v_bpd)
    with pytest.raises(Unsupported):
        CobraKL(v_quant="kivi").configure(SHAPE, 1.0, 4.5)  # b = 4.5 - 32/32 is not an integer


def test_kivi_values_and_exact_keys():
    m = built(CobraKL(v_quant="kivi"), bpd=None, v_bpd=4)  # b = 3, G = 32
    assert m.nominal_bpd(8) == (16.0, 4.0)
    q, k_pre, v = inputs(8)
    rope = make_rope(8, 64)
    state = m.new_layer_state(0)
    state.attend(q, apply_rope(k_pre, rope), v, scaling=0.125, prefill=False, k_pre=k_pre, rope=rope)
    bk, bv = state.stored_bits()
    assert bk == 16 * 8 * 2 * 64 and bv == 4 * 8 * 2 * 64
