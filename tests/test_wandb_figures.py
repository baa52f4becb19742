"""The allocation figure: each method's ``allocation()`` (methods/, one number per layer and KV
head) and the PNG drawn from it (kvbench/store/figures.py)."""

from __future__ import annotations

import pytest
import torch

from methods import LayerStats, ModelShape, build_method

SHAPE = ModelShape(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_stats(seed: int = 0) -> list[LayerStats]:
    """Per layer, per KV head: zero means and random covariances with a decaying spectrum."""
    g = torch.Generator().manual_seed(seed)
    d, h = SHAPE.head_dim, SHAPE.n_kv_heads

    def spd():
        q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
        lam = torch.rand(h, d, generator=g, dtype=torch.float64) * torch.logspace(0, -3, d, dtype=torch.float64)
        return q @ torch.diag_embed(lam) @ q.transpose(-1, -2)

    zeros = torch.zeros(h, d, dtype=torch.float64)
    return [LayerStats(zeros, spd(), zeros, spd(), spd(), 1000) for _ in range(SHAPE.n_layers)]


def configured(name, bpd_k, bpd_v=None, **options):
    method = build_method(name, **options)
    method.configure(SHAPE, bpd_k, bpd_v)
    if method.needs_calibration:
        method.calibrate(synthetic_stats(), seed=0)
    return method


@pytest.mark.parametrize("name,bpd_k,bpd_v,options,names", [
    ("cobra_kl", 1.0, None, {}, {"k_rank", "k_bits", "k_bpd"}),
    ("cobra_plus", 1.0, 2.0, {}, {"k_rank", "k_bits", "k_bpd", "v_bpd"}),
    ("kqsvd", 1.0, None, {"step": "gauss"}, {"k_rank", "k_bits", "k_bpd"}),
    ("h2o", 4.0, None, {}, {"kept"}),
    ("snapkv", 4.0, None, {}, {"kept"}),
    ("fp16", None, None, {}, set()),
])
def test_allocation_is_one_number_per_layer_and_head(name, bpd_k, bpd_v, options, names):
    alloc = configured(name, bpd_k, bpd_v, **options).allocation()
    assert set(alloc) == names
    for values in alloc.values():
        assert values.shape == (SHAPE.n_layers, SHAPE.n_kv_heads) and values.dtype == torch.float64
    if "k_bpd" in alloc:  # the heads' budgets add up to the target (floor of bpd * d * N bits)
        total = float(alloc["k_bpd"].mean()) + (float(alloc["v_bpd"].mean()) if "v_bpd" in alloc else 0.0)
        target = bpd_k + (bpd_v if "v_bpd" in alloc else 0.0)  # KV-COBRA+: one joint K+V budget
        assert total == pytest.approx(target, abs=1 / (SHAPE.head_dim * 4))
        assert torch.allclose(alloc["k_bits"] * alloc["k_rank"] / SHAPE.head_dim, alloc["k_bpd"])
    if "kept" in alloc:
        assert 0 < float(alloc["kept"].min()) == float(alloc["kept"].max()) <= 1  # uniform by construction


def test_compose_shows_its_codec_and_its_kept_fraction():
    method = configured("compose", 8.0, 8.0, evict="h2o", codec="cobra_kl", split=0.5)
    alloc = method.allocation()
    assert {"kept", "k_rank", "k_bits", "k_bpd"} <= set(alloc)


def test_allocation_png(tmp_path):
    from kvbench.store.figures import ALLOCATION_FILE, allocation_png

    alloc = configured("cobra_kl", 1.0).allocation()
    path = allocation_png(alloc, tmp_path, "tiny / cobra_kl: target bpd K 1")
    assert path == tmp_path / ALLOCATION_FILE
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 5000
    assert allocation_png({}, tmp_path / "none", "nothing") is None
