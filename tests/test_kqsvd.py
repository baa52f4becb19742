"""KQ-SVD harness baseline (docs/methods.md §4): factors, budget mapping, codec, bpd."""

import math

import pytest
import torch

from methods.base import LayerStats, ModelShape, Rope, Unsupported, apply_rope
from methods.gaussquant import optimal_step
from methods.kqsvd import KQSVD, candidates, cholesky_ridge, kq_factors

pytestmark = pytest.mark.numerics

F64 = torch.float64
SHAPE = ModelShape(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32)


def synthetic_stats(shape: ModelShape, seed: int = 0) -> list[LayerStats]:
    """Moments of sampled keys/queries with decaying spectra (n_tokens = samples)."""
    g = torch.Generator().manual_seed(seed)
    h, d, n = shape.n_kv_heads, shape.head_dim, 2000
    scale = torch.arange(1, d + 1, dtype=F64) ** -1.0
    out = []
    for _ in range(shape.n_layers):
        k = (torch.randn(h, n, d, dtype=F64, generator=g) * scale) @ torch.randn(h, d, d, dtype=F64, generator=g) + 0.5
        q = (torch.randn(h, n, d, dtype=F64, generator=g) * scale.sqrt()) @ torch.randn(h, d, d, dtype=F64, generator=g)
        v = torch.randn(h, n, d, dtype=F64, generator=g)
        kc = k - k.mean(1, keepdim=True)
        vc = v - v.mean(1, keepdim=True)
        out.append(LayerStats(
            mu_k=k.mean(1), cov_k=kc.transpose(1, 2) @ kc / n, mu_v=v.mean(1), cov_v=vc.transpose(1, 2) @ vc / n,
            m_q=q.transpose(1, 2) @ q / n, n_tokens=n,
        ))
    return out


STATS = synthetic_stats(SHAPE)


@pytest.mark.parametrize("rank", [1, 4, 10, 16])
def test_factors_give_best_rank_r_logits(rank):
    g = torch.Generator().manual_seed(rank)
    d = 16
    keys = torch.randn(300, d, dtype=F64, generator=g) @ torch.randn(d, d, dtype=F64, generator=g)
    queries = torch.randn(200, d, dtype=F64, generator=g) @ torch.randn(d, d, dtype=F64, generator=g)
    a, b, s, ridge = kq_factors(keys.T @ keys, queries.T @ queries, rank)
    assert float(ridge) == 0.0
    assert torch.allclose(b.T @ a, torch.eye(rank, dtype=F64), atol=1e-9)
    u, sv, vh = torch.linalg.svd(queries @ keys.T, full_matrices=False)
    best = u[:, :rank] * sv[:rank] @ vh[:rank]
    approx = (queries @ b) @ (keys @ a).T
    assert torch.allclose(approx, best, atol=1e-8 * float(sv[0]))
    assert torch.allclose(s, sv[:d], rtol=1e-9)
    # latents K A are decorrelated with equal (unit) variance per unit of the Gram matrix
    assert torch.allclose(a.T @ (keys.T @ keys) @ a, torch.eye(rank, dtype=F64), atol=1e-9)


def test_cholesky_ridge_on_rank_deficient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, dtype=F64, generator=g)
    chol, ridge = cholesky_ridge(x.T @ x)  # rank 5 < 8
    assert 0 < float(ridge) <= 1e-6
    assert torch.allclose(chol @ chol.T, x.T @ x, atol=1e-5)


def test_candidates():
    # docs/methods.md §4.3 lists (32,2)/(16,4) for 0.5; (8,8) also satisfies r*b = 64 with r even, b <= 8
    assert candidates(0.5, 128) == [(8, 8), (16, 4), (32, 2)]
    assert candidates(1.0, 128) == [(16, 8), (32, 4), (64, 2)]
    assert candidates(0.3, 64) == []
    with pytest.raises(Unsupported):
        KQSVD().configure(SHAPE, 0.3, None)
    with pytest.raises(Unsupported):
        KQSVD().configure(SHAPE, 1.0, 3.5)


def naive_quant(x: float, step: float, bits: int) -> float:
    half = 2 ** (bits - 1)
    return (min(max(math.floor(x / step) + half, 0), 2**bits - 1) - half + 0.5) * step


def built(method, bpd, v_bpd=None):
    method.configure(SHAPE, bpd, v_bpd)
    method.calibrate(STATS, seed=0)
    return method


@pytest.mark.parametrize("proxy", ["eig", "kq"])
def test_codec_vs_naive(proxy):
    m = built(KQSVD(proxy=proxy), 1.0)
    r, bits = m.knobs()["rank"], m.knobs()["bits"]
    assert r * bits == 32 and (r, bits) in candidates(1.0, 32)
    codec = m.new_layer_state(1).key_codec
    st = STATS[1]
    g = torch.Generator().manual_seed(1)
    k_pre = torch.randn(1, 2, 4, 32, dtype=F64, generator=g)
    k_hat = codec.decode(codec.encode(k_pre))
    for h in range(2):
        a, b = codec.enc[h].T, codec.dec[h].T  # A, B [d, r]
        assert torch.allclose(b.T @ a, torch.eye(r, dtype=F64), atol=1e-8)
        var = torch.diagonal(a.T @ st.cov_k[h] @ a)
        assert torch.allclose(var, torch.full_like(var, 1.0 / st.n_tokens), rtol=1e-8)  # equal variance
        assert torch.allclose(codec.step[h], optimal_step(bits) * var.sqrt(), rtol=1e-12)
        for t in range(4):
            c = a.T @ (k_pre[0, h, t] - st.mu_k[h])
            c_hat = torch.tensor([naive_quant(float(c[j]), float(codec.step[h, j]), bits) for j in range(r)], dtype=F64)
            assert torch.allclose(k_hat[0, h, t], st.mu_k[h] + b @ c_hat, atol=1e-10)


def test_exact_at_full_rank_without_quantization():
    m = built(KQSVD(quantize=False), 8.0)  # (r, b) = (32, 8): full rank
    assert (m.knobs()["rank"], m.knobs()["bits"]) == (32, 8)
    g = torch.Generator().manual_seed(2)
    k_pre = torch.randn(1, 2, 5, 32, generator=g)
    codec = m.new_layer_state(0).key_codec
    assert torch.allclose(codec.decode(codec.encode(k_pre)), k_pre, atol=1e-5)


@pytest.mark.parametrize("bpd", [0.5, 1.0, 2.0, 4.0])
def test_measured_bpd(bpd):
    t = 8
    m = built(KQSVD(), bpd, v_bpd=2)
    assert m.nominal_bpd(t) == (bpd, 2.0)
    g = torch.Generator().manual_seed(3)
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=F64) / 32))
    emb = torch.arange(t, dtype=F64)[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    rope = Rope(emb.cos()[None].float(), emb.sin()[None].float())
    bits_k = bits_v = 0
    for layer in range(SHAPE.n_layers):
        q = torch.randn(1, 4, t, 32, generator=g)
        k_pre = torch.randn(1, 2, t, 32, generator=g)
        v = torch.randn(1, 2, t, 32, generator=g)
        state = m.new_layer_state(layer)
        out = state.attend(q, apply_rope(k_pre, rope), v, scaling=32**-0.5, prefill=False, k_pre=k_pre, rope=rope)
        assert out.shape == q.shape and torch.isfinite(out).all()
        bk, bv = state.stored_bits()
        bits_k, bits_v = bits_k + bk, bits_v + bv
    elements = t * SHAPE.n_heads_total * 32
    assert bits_k / elements == bpd and bits_v / elements == 2.0


def test_registry_shape():
    assert KQSVD.name == "kqsvd" and KQSVD.needs_calibration
