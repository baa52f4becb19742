"""The calibrated fixed step of docs/methods.md §1.1b: the search, its use by KQ-SVD (default), KV-COBRA
(``step="calibrated"``) and the rotated value codec, and the calibration sample it needs."""

import math

import pytest
import torch

from methods.base import LayerStats, ModelShape
from methods.cobra import CobraKL
from methods.gaussquant import STEP_BRACKET, calibrated_multipliers, optimal_step
from methods.kqsvd import KQSVD
from methods.latent_codec import SAMPLE_TOKENS, build_value_codecs

pytestmark = pytest.mark.numerics

F64 = torch.float64


def naive_mse(x: torch.Tensor, step: float, bits: int) -> float:
    """Empirical MSE of the clamped mid-rise quantizer of §1.1, written out again (float64)."""
    x = x.reshape(-1).to(F64)
    half = 2 ** (bits - 1)
    code = torch.clamp(torch.floor(x / step) + half, 0, 2**bits - 1)
    return float(((code - half + 0.5) * step - x).pow(2).mean())


def naive_best(x: torch.Tensor, bits: int, points: int = 1201) -> tuple[float, float]:
    """Brute force over a fine log grid of multipliers in the §1.1b bracket: (m, MSE)."""
    best = (math.inf, math.nan)
    for m in torch.logspace(math.log10(STEP_BRACKET[0]), math.log10(STEP_BRACKET[1]), points, dtype=F64).tolist():
        f = naive_mse(x, m * optimal_step(bits), bits)
        if f < best[0]:
            best = (f, m)
    return best[1], best[0]


def heavy_tailed(n: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "student":  # Student-t, 3 degrees of freedom, unit variance
        z = torch.randn(n, dtype=F64, generator=g)
        chi2 = (torch.randn(n, 3, dtype=F64, generator=g) ** 2).sum(1)
        return z / torch.sqrt(chi2 / 3) / math.sqrt(3.0)
    x = torch.randn(n, dtype=F64, generator=g)  # Gaussian plus 0.1 % outliers at +-25 sigma
    idx = torch.randperm(n, generator=g)[: n // 1000]
    x[idx] = 25.0 * torch.sign(x[idx])
    return x


# ---- the search (methods.gaussquant) --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["student", "outliers"])
def test_heavy_tails_widen_the_step_and_beat_the_gaussian_step(kind):
    x = heavy_tailed(20000, 0, kind)
    bits = [2, 4, 6, 8]
    mult, mse = calibrated_multipliers([x] * len(bits), bits)
    for b, m, f in zip(bits, mult.tolist(), mse.tolist()):
        assert STEP_BRACKET[0] <= m <= STEP_BRACKET[1]
        assert naive_mse(x, m * optimal_step(b), b) == pytest.approx(f, rel=1e-5)  # MSE reported = MSE at the step
        gauss = naive_mse(x, optimal_step(b), b)
        assert f < gauss * (0.9 if b >= 4 else 1.0)
        if b >= 4:
            assert m > 1.5  # the tails widen the step instead of being clipped
        # no better step in the bracket (brute force on a grid 0.46 % apart)
        m_ref, f_ref = naive_best(x, b)
        assert f <= f_ref * (1 + 1e-4), (b, m, m_ref)


@pytest.mark.parametrize("bits", range(2, 9))
def test_gaussian_data_gives_the_gaussian_step(bits):
    x = torch.randn(1_000_000, dtype=F64, generator=torch.Generator().manual_seed(bits))
    mult, _ = calibrated_multipliers([x], [bits])
    assert float(mult[0]) == pytest.approx(1.0, abs=0.03)


def test_bracket_groups_and_determinism():
    g = torch.Generator().manual_seed(5)
    wide = 1e4 * torch.randn(4000, dtype=F64, generator=g)  # sigma badly underestimated: capped at 64
    narrow = 1e-4 * torch.randn(4000, dtype=F64, generator=g)  # overestimated: capped at 1/4
    t = heavy_tailed(5000, 1, "student").reshape(50, 100)  # any shape, flattened
    groups, bits = [wide, narrow, t], [3, 3, 5]
    m1, f1 = calibrated_multipliers(groups, bits)
    m2, f2 = calibrated_multipliers(groups, bits)
    assert torch.equal(m1, m2) and torch.equal(f1, f2)
    assert float(m1[0]) == pytest.approx(STEP_BRACKET[1], rel=1e-3)
    assert float(m1[1]) == pytest.approx(STEP_BRACKET[0], rel=1e-3)
    alone, _ = calibrated_multipliers([t], [5])  # groups do not interact
    assert float(alone[0]) == float(m1[2])
    with pytest.raises(ValueError, match="1..16"):
        calibrated_multipliers([t], [0])
    with pytest.raises(ValueError, match="at least one sample"):
        calibrated_multipliers([torch.zeros(0)], [2])


# ---- methods ----------------------------------------------------------------------------------------

SHAPE = ModelShape(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16)


def stats_with_samples(shape: ModelShape, n: int = 6000, n_sample: int = 3000, seed: int = 0):
    """Moments of sampled keys/values/queries whose keys have a few huge outlier tokens (sinks),
    and the centered float16 sample of ``n_sample`` of the tokens (as kvbench.fit.statistics stores it)."""
    g = torch.Generator().manual_seed(seed)
    h, d = shape.n_kv_heads, shape.head_dim
    idx = torch.randperm(n, generator=g)[:n_sample].sort().values
    scale = torch.arange(1, d + 1, dtype=F64) ** -0.7
    out = []
    for _ in range(shape.n_layers):
        k = (torch.randn(h, n, d, dtype=F64, generator=g) * scale) @ torch.randn(h, d, d, dtype=F64, generator=g) + 0.3
        k[:, ::200] += 30.0 * torch.randn(h, 1, d, dtype=F64, generator=g) * scale  # a sink every 200 tokens
        v = torch.randn(h, n, d, dtype=F64, generator=g) * (1 + 3 * (torch.rand(h, n, 1, dtype=F64, generator=g) < 0.01))
        q = torch.randn(h, n, d, dtype=F64, generator=g) @ torch.randn(h, d, d, dtype=F64, generator=g)
        mk, mv = k.mean(1), v.mean(1)
        kc, vc = k - mk[:, None], v - mv[:, None]
        out.append(LayerStats(
            mu_k=mk, cov_k=kc.transpose(1, 2) @ kc / n, mu_v=mv, cov_v=vc.transpose(1, 2) @ vc / n,
            m_q=q.transpose(1, 2) @ q / n, n_tokens=n,
            k_sample=kc[:, idx].to(torch.float16), v_sample=vc[:, idx].to(torch.float16),
        ))
    return out


STATS = stats_with_samples(SHAPE)


def sample_keys(layer: int) -> torch.Tensor:
    st = STATS[layer]
    return (st.k_sample.to(F64) + st.mu_k[:, None]).unsqueeze(0)  # [1, H, n, d]


def codec_mse(method, layer: int) -> float:
    codec = method.new_layer_state(layer).key_codec
    k = sample_keys(layer)
    return float((codec.decode(codec.encode(k)) - k).pow(2).mean())


def built(method, bpd, v_bpd=None, stats=STATS):
    method.configure(SHAPE, bpd, v_bpd)
    method.calibrate(stats, seed=0)
    return method


def test_kqsvd_calibrated_step_vs_naive():
    m = built(KQSVD(), 8.0)  # full rank, 8 bits; the default step is calibrated
    knobs = m.knobs()
    assert knobs["step"] == "calibrated" and knobs["step_sample_tokens"] == 3000
    lo, hi = knobs["step_multiplier_range"]
    assert STEP_BRACKET[0] <= lo <= hi <= STEP_BRACKET[1] and hi > 1.5  # the sinks widen the step
    g = built(KQSVD(step="gauss"), 8.0)
    assert g.knobs()["step"] == "gauss"
    mults = []
    for layer in range(SHAPE.n_layers):
        cal, gau = m.new_layer_state(layer).key_codec, g.new_layer_state(layer).key_codec
        assert torch.equal(cal.enc, gau.enc)
        for h in range(SHAPE.n_kv_heads):
            ratio = cal.step[h] / gau.step[h]  # one multiplier per head, Delta_j = m sqrt(var_j) s*(b)
            assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-12)
            mults.append(float(ratio[0]))
            # independent: the head's sample latents A^T (k - mu), normalized by sqrt(var_j)
            a = cal.enc[h].T
            var = torch.diagonal(a.T @ STATS[layer].cov_k[h] @ a)
            z = (sample_keys(layer)[0, h] - STATS[layer].mu_k[h]) @ a / var.sqrt()
            m_ref, f_ref = naive_best(z, 8, points=401)
            assert naive_mse(z, ratio[0].item() * optimal_step(8), 8) <= f_ref * (1 + 1e-3), (m_ref, ratio[0])
        assert codec_mse(m, layer) < codec_mse(g, layer)
    assert [min(mults), max(mults)] == pytest.approx([lo, hi], rel=1e-12)


def test_cobra_calibrated_step_per_head_and_width():
    m = built(CobraKL(step="calibrated"), 3.0)  # fractional mean bits: two widths in some heads
    g = built(CobraKL(), 3.0)
    assert m.knobs()["step"] == "calibrated" and g.knobs()["step"] == "gauss"
    assert m.knobs()["budgets"] == g.knobs()["budgets"]
    two_widths = 0
    for layer in range(SHAPE.n_layers):
        cal, gau = m.new_layer_state(layer).key_codec, g.new_layer_state(layer).key_codec
        assert torch.equal(cal.enc, gau.enc) and torch.equal(cal.width, gau.width)
        for h in range(SHAPE.n_kv_heads):
            width = cal.width[h]
            p = cal.enc[h][width > 0]
            z = (sample_keys(layer)[0, h] - STATS[layer].mu_k[h]) @ p.T  # latents P (k - mu_K)
            sigma_bar = gau.step[h, 0] / optimal_step(int(width[0]))
            widths = width[width > 0]
            two_widths += int(torch.unique(widths).numel() == 2)
            for b in torch.unique(widths).tolist():
                sel = widths == b
                ratio = cal.step[h][width > 0][sel] / gau.step[h][width > 0][sel]
                assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-12)  # one per (head, b)
                group = z[:, sel] / sigma_bar
                m_ref, f_ref = naive_best(group, b, points=401)
                assert naive_mse(group, ratio[0].item() * optimal_step(b), b) <= f_ref * (1 + 1e-3)
        assert codec_mse(m, layer) < codec_mse(g, layer)
    assert two_widths > 0


def test_value_codec_calibrated_step():
    cal, knobs = build_value_codecs(STATS, 4, "hadamard", 32, 0, False, step="calibrated")
    gau, gknobs = build_value_codecs(STATS, 4, "hadamard", 32, 0, False)
    assert knobs["v_step"] == "calibrated" and gknobs["v_step"] == "gauss"
    assert knobs["v_step_sample_tokens"] == 3000
    for layer, st in enumerate(STATS):
        v = (st.v_sample.to(F64) + st.mu_v[:, None]).unsqueeze(0)
        errs = []
        for codec in (cal[layer], gau[layer]):
            errs.append(float((codec.decode(codec.encode(v)) - v).pow(2).mean()))
        assert errs[0] < errs[1]
        for h in range(SHAPE.n_kv_heads):
            y = v[0, h] @ cal[layer].rot[h].T / (gau[layer].step[h] / optimal_step(4))  # rotated, / sigma_V
            m_ref, f_ref = naive_best(y, 4, points=401)
            assert naive_mse(y, float(cal[layer].step[h] / gau[layer].step[h]) * optimal_step(4), 4) <= f_ref * (1 + 1e-3)


def test_sample_request():
    from kvbench.fit.statistics import CalibrationSpec, sample_request, with_sample

    def configured(method, bpd, v_bpd=None):
        method.configure(SHAPE, bpd, v_bpd)
        return method

    assert sample_request(KQSVD()) == SAMPLE_TOKENS >= 4096  # asked before configure (the harness order)
    assert sample_request(CobraKL()) == 0 and sample_request(CobraKL(step="calibrated")) == SAMPLE_TOKENS
    assert sample_request(configured(KQSVD(), 1.0)) == SAMPLE_TOKENS
    assert sample_request(configured(KQSVD(step="gauss"), 1.0)) == 0
    assert sample_request(configured(KQSVD(), None)) == 0  # nothing quantized
    assert sample_request(configured(KQSVD(), None, 4)) == SAMPLE_TOKENS  # rotated values
    assert sample_request(configured(CobraKL(), 1.0)) == 0
    assert sample_request(configured(CobraKL(step="calibrated"), 1.0)) == SAMPLE_TOKENS
    assert with_sample(CalibrationSpec(), configured(KQSVD(), 1.0)).sample_tokens == SAMPLE_TOKENS
    with pytest.raises(ValueError, match="gauss"):
        KQSVD(step="empirical")
    with pytest.raises(ValueError, match="calibrated"):
        CobraKL(step="mse")
    # statistics without a sample: the Gaussian step, and the knobs say so
    bare = [LayerStats(**{**st.__dict__, "k_sample": None, "v_sample": None}) for st in STATS]
    m = built(KQSVD(), 8.0, 4, stats=bare)
    assert m.knobs()["step"] == "gauss" and "step_fallback" in m.knobs() and "v_step_fallback" in m.knobs()
    g = built(KQSVD(step="gauss"), 8.0, stats=bare)
    assert torch.equal(m.new_layer_state(0).key_codec.step, g.new_layer_state(0).key_codec.step)


# ---- the calibration sample (kvbench.fit.statistics) ------------------------------------------------------

def test_sample_collection_on_tiny_llama(tiny_model):
    from kvbench.fit.statistics import collect_stats, sample_positions

    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 128, (3, 40), generator=g)
    keys, values = {}, {}
    attn = [layer.self_attn for layer in tiny_model.model.layers]
    hooks = [a.k_proj.register_forward_hook(lambda m, i, o, l=l: keys.setdefault(l, []).append(o)) for l, a in enumerate(attn)]
    hooks += [a.v_proj.register_forward_hook(lambda m, i, o, l=l: values.setdefault(l, []).append(o)) for l, a in enumerate(attn)]
    with torch.no_grad():
        for w in windows:
            tiny_model(input_ids=w[None], use_cache=False)
    for h in hooks:
        h.remove()
    stats = collect_stats(tiny_model, windows, sample_tokens=50, seed=3)
    plain = collect_stats(tiny_model, windows)
    pos = sample_positions(windows.numel(), 50, 3)
    assert pos.numel() == 50 and torch.equal(pos, pos.unique())
    for l, st in enumerate(stats):
        assert st.k_sample.shape == st.v_sample.shape == (2, 50, 16) and st.k_sample.dtype == torch.float16
        assert plain[l].k_sample is None and plain[l].v_sample is None
        assert torch.equal(st.cov_k, plain[l].cov_k)  # the moments do not change
        for side, outs, mu, smp in (("k", keys, st.mu_k, st.k_sample), ("v", values, st.mu_v, st.v_sample)):
            full = torch.cat([o.reshape(-1, 2, 16) for o in outs[l]]).transpose(0, 1).to(F64)  # [H, N, d]
            ref = (full[:, pos] - mu[:, None]).to(torch.float16)
            assert torch.allclose(smp.to(F64), ref.to(F64), atol=1e-3, rtol=1e-3), side
    again = collect_stats(tiny_model, windows, sample_tokens=50, seed=3)
    assert torch.equal(again[0].k_sample, stats[0].k_sample)
    other = collect_stats(tiny_model, windows, sample_tokens=50, seed=4)
    assert not torch.equal(other[0].k_sample, stats[0].k_sample)
    everything = collect_stats(tiny_model, windows, sample_tokens=10_000, seed=0)  # capped at all tokens
    assert everything[0].k_sample.shape[1] == windows.numel()


def test_sample_cached_and_loaded(tiny_model, tmp_path, monkeypatch):
    import json

    import kvbench.fit.statistics as calib

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    windows = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(calib, "calibration_windows", lambda tok, spec: windows)
    spec = calib.CalibrationSpec(n_windows=2, seqlen=48, seed=0, sample_tokens=64)
    bare = calib.CalibrationSpec(n_windows=2, seqlen=48, seed=0)
    legacy = {k: v for k, v in bare.__dict__.items() if k != "sample_tokens"}  # key before §1.1b
    assert bare.key("m") == __import__("hashlib").sha256(json.dumps({"model": "m", **legacy}, sort_keys=True).encode()).hexdigest()[:16]
    assert spec.key("m") != bare.key("m")
    first, _, hit1 = calib.statistics(tiny_model, None, "tiny", spec)
    second, _, hit2 = calib.statistics(tiny_model, None, "tiny", spec)
    assert (hit1, hit2) == (False, True)
    assert second[1].k_sample.shape == (2, 64, 16) and second[1].k_sample.dtype == torch.float16
    assert torch.equal(first[1].k_sample, second[1].k_sample) and torch.equal(first[0].v_sample, second[0].v_sample)
    without, _, hit3 = calib.statistics(tiny_model, None, "tiny", bare)
    assert not hit3 and without[0].k_sample is None
    assert len(list((tmp_path / "calibration").glob("*.pt"))) == 2
