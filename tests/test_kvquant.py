"""KVQuant (docs/methods.md §14): parity with the official simulator, calibration, bit count, budget map,
regimes.

The official code (SqueezeAILab/KVQuant, ``quant/kvquant/simquant_module_quantizer.py`` at its
current main, 852 lines) is transcribed below as naive reference functions (``official_*``), each
docstring naming the lines it mirrors; the parity tests feed both the same inputs. Inputs are
fp16-representable, as the official simulator's are (its projections run in fp16), so exactness is
not lost to the fp16 storage of outliers and per-token extremes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import configured_method, tiny_llama
from kvbench.fit.fisher import collect_fisher, with_fisher
from kvbench.fit.statistics import collect_stats
from kvbench.model.integrate import attach
from methods import build_method
from methods.base import LayerStats, ModelShape, Regime, Rope, Unsupported, apply_rope
from methods.kvquant import (
    KeyCodec,
    KVQuant,
    KVQuantLayerState,
    ValueCodec,
    headline,
    key_calibration,
    kmeans_1d,
    nearest_codes,
    outlier_level,
    token_cost,
    value_calibration,
    value_outlier_count,
)

pytestmark = pytest.mark.numerics

F64 = torch.float64
SMOL = ModelShape(n_layers=30, n_q_heads=9, n_kv_heads=3, head_dim=64)
LLAMA = ModelShape(n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128)


# ---------------------------------------------------------------------------------------------
# the official code, transcribed (SqueezeAILab/KVQuant quant/kvquant/simquant_module_quantizer.py)


def official_round_to_nearest_pole(w, poles):
    """Lines 10-28 ``round_to_nearest_pole_sim``: |w - c| for every pole, argmin (first minimum),
    the pole's value."""
    diff = torch.stack([(w - c).abs() for c in poles])
    idx = diff.argmin(dim=0)
    aug = 0
    for i, c in enumerate(poles):
        aug = aug + (idx == i) * c
    return aug


def official_get_outliers(w, upper, lower, channel=0, first_few_fp16=-1):
    """Lines 30-78 ``get_outliers`` without ``cap_outliers``: x < lower or x > upper (static
    thresholds), the first ``first_few_fp16`` rows marked."""
    mask = (w < lower.unsqueeze(channel)) | (w > upper.unsqueeze(channel))
    if first_few_fp16 > -1:
        mask[:first_few_fp16, :] = True
    return mask


def official_get_outliers_dynamic(w, channel=-1, thresh=0.999, first_few_fp16=-1):
    """Lines 80-114 ``get_outliers_dynamic``: t = 1 - (1 - thresh)/2, ``torch.quantile`` at t and
    1 - t of w.float() along ``channel``, x >= upper or x <= lower."""
    t = 1 - ((1 - thresh) / 2)
    w = w.float()
    upper = torch.quantile(w, t, dim=channel).unsqueeze(channel)
    lower = torch.quantile(w, 1 - t, dim=channel).unsqueeze(channel)
    mask = (w <= lower) | (w >= upper)
    if first_few_fp16 > -1:
        mask[:first_few_fp16, :] = True
    return mask


def official_nuq_recon(inp, qchannel, dynamic, include_sparse, outlier_mask, maxval, minval, lut,
                       first_few_fp16=-1):
    """Lines 265-362 ``quant_fn_nuq_recon`` (Q-Norm off): dynamic thresholds from the median-trimmed
    max/min (lines 302-315), offset and half-range (318-322), subtract, zero the outliers, divide
    (325-333), nearest pole (336-338), rescale (346), restore outliers (349-351), add the offset
    (354), keep the first rows (358-359), ``.float()`` (361; skipped for float64 inputs)."""
    orig = inp
    if dynamic:
        if include_sparse:
            outliers = inp * outlier_mask
            median = torch.median(inp, dim=qchannel).values.unsqueeze(qchannel)
            tmp = inp - outliers + median * outlier_mask
            maxval = torch.max(tmp, dim=qchannel).values
            minval = torch.min(tmp, dim=qchannel).values
        else:
            maxval = torch.max(inp, dim=qchannel).values
            minval = torch.min(inp, dim=qchannel).values
    offset = ((maxval + minval) / 2).unsqueeze(qchannel)
    rangeval = ((maxval - minval) / 2).unsqueeze(qchannel)
    inp = inp - offset
    if include_sparse:
        outliers = inp * outlier_mask
        inp = inp - outliers
    scaled = inp / rangeval
    q = official_round_to_nearest_pole(scaled.flatten(), lut.to(scaled.dtype)).reshape(inp.shape)
    out = q * rangeval
    if include_sparse:
        out[outlier_mask] = 0
        out = out + outliers
    out = out + offset
    out = torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)
    if first_few_fp16 > -1:
        out[:first_few_fp16, :] = orig[:first_few_fp16, :]
    return out if out.dtype == F64 else out.float()


def official_thresholds(data: np.ndarray, qchannel: int, sparsity_threshold: float, include_sparse: bool,
                        first_few_fp16: int = -1, window: int = 2048):
    """Lines 400-498 ``SimQuant.quantize`` (no cap): t (412-415), ``np.percentile`` at t and 1 - t
    along ``qchannel`` (464-466), normalize by the zero point and range (474-484), |z| > 1 masked
    (488), the first rows of each ``window``-token sample masked (491-495, the code's 2048).
    Returns (upper, lower, normalized data, mask)."""
    t = 1 - ((1 - sparsity_threshold) / 2) if include_sparse else 1
    upper = np.percentile(data, t * 100, axis=qchannel)
    lower = np.percentile(data, (1 - t) * 100, axis=qchannel)
    data = torch.tensor(data)
    upper = torch.tensor(upper).unsqueeze(qchannel)
    lower = torch.tensor(lower).unsqueeze(qchannel)
    z = (data - (upper + lower) / 2) / ((upper - lower) / 2)
    mask = (z > 1) | (z < -1)
    if first_few_fp16 > -1:
        for i in range(data.shape[0] // window):
            mask[i * window : i * window + first_few_fp16, :] = True
    return upper.flatten(), lower.flatten(), z, mask


def official_kmeans(z: torch.Tensor, mask: torch.Tensor, bits: int, fisher=None) -> np.ndarray:
    """Lines 500-525: sklearn ``KMeans(n_clusters=2^b, random_state=0, n_init="auto",
    max_iter=50)`` on the unmasked normalized elements (float32), ``sample_weight`` = Fisher."""
    from sklearn.cluster import KMeans

    keep = ~mask.flatten()
    data = z.flatten()[keep].float().numpy().reshape(-1, 1)
    weight = None if fisher is None else fisher.flatten()[keep].numpy()
    km = KMeans(n_clusters=2**bits, random_state=0, n_init="auto", max_iter=50).fit(data, sample_weight=weight)
    return np.sort(km.cluster_centers_.ravel())


# ---------------------------------------------------------------------------------------------
# helpers


def fp16_grid(x: torch.Tensor) -> torch.Tensor:
    """Values the official simulator sees: fp16 activations, here in float64."""
    return x.half().to(F64)


def student_t(shape: tuple, dof: int, g: torch.Generator) -> torch.Tensor:
    """Student-t samples (float64) from ``g``: z / sqrt(chi2_dof / dof)."""
    chi2 = (torch.randn((dof, *shape), generator=g, dtype=F64) ** 2).sum(0)
    return torch.randn(shape, generator=g, dtype=F64) / (chi2 / dof).sqrt()


def activations(tokens: int, n: int, seed: int) -> torch.Tensor:
    """Random "k_proj outputs" [tokens, n]: per-channel offsets and scales, planted outlier channels
    and heavy-tailed tokens (Student-t), on the fp16 grid."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, generator=g, dtype=F64) * 2 + 0.2
    scale[torch.randperm(n, generator=g)[: max(1, n // 16)]] *= 8  # outlier channels
    x = student_t((tokens, n), 4, g) * scale + torch.randn(n, generator=g, dtype=F64)
    return fp16_grid(x)


def sorted_lut(bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.rand(2**bits, generator=g, dtype=F64) * 2 - 1).values.half()


def weighted_sse(x, c, w=None) -> float:
    c = torch.as_tensor(c, dtype=F64)
    err = (x - c[nearest_codes(x, c)]) ** 2
    return float(err.sum() if w is None else (w * err).sum())


def as_block(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, H*d] -> [1, H, T, d] (the codecs' input layout)."""
    t, n = rows.shape
    return rows.reshape(1, t, heads, n // heads).permute(0, 2, 1, 3)


def as_rows(block: torch.Tensor) -> torch.Tensor:
    b, h, t, d = block.shape
    return block.permute(0, 2, 1, 3).reshape(b * t, h * d)


# ---------------------------------------------------------------------------------------------
# primitives


def test_outlier_level_and_value_counts_match_the_official_function():
    """§14.3: t = 0.995 for the "-1%" setting; the official dynamic outlier mask marks exactly
    (n - ceil((n-1)t)) + (floor((n-1)(1-t)) + 1) entries of a token of distinct values:
    6 / 12 / 42 for n = 512 / 1024 / 4096 (and 2 for SmolLM2's n = 192)."""
    assert outlier_level(0.01) == 1 - ((1 - 0.99) / 2)
    assert outlier_level(0.0) == 1.0
    g = torch.Generator().manual_seed(0)
    for n, expected in ((512, 6), (1024, 12), (4096, 42), (192, 2)):
        x = torch.randn(8, n, generator=g, dtype=F64)
        counts = official_get_outliers_dynamic(x, -1, 0.99).sum(-1)
        assert value_outlier_count(n, outlier_level(0.01)) == expected
        assert counts.tolist() == [expected] * 8
        codec = ValueCodec(sorted_lut(2, 0), 2, outlier_level(0.01))
        assert codec._mask(x).sum(-1).tolist() == [expected] * 8


def test_nearest_codes_equals_the_official_argmin():
    """Lines 10-28: nearest pole by argmin of |w - c|, ties to the first pole in stored order."""
    for bits in (1, 2, 3, 4, 5):
        lut = sorted_lut(bits, bits).to(F64)
        z = torch.randn(5000, dtype=F64, generator=torch.Generator().manual_seed(bits)) * 0.8
        z[:8] = (lut[:-1] + lut[1:])[:8] / 2 if lut.numel() > 8 else z[:8]  # exact midpoints: ties
        assert torch.equal(lut[nearest_codes(z, lut)], official_round_to_nearest_pole(z, lut))


# ---------------------------------------------------------------------------------------------
# calibration parity (§14.8 test 1)


@pytest.mark.parametrize("f", [0.0, 0.01])
def test_key_calibration_matches_the_official_thresholds_and_kmeans(f):
    """Keys per channel (SimQuant qchannel=0): fp16 thresholds equal the official percentiles
    (lines 464-466, rounded to fp16 where ``QuantLinearSim`` stores them, lines 601-602); the LUT's
    k-means objective on the official inlier set is within 2 % of sklearn's (ours is our own
    Lloyd iteration from a companding init, not k-means++: the centroids are another local optimum
    of the same objective, not sklearn's)."""
    x = activations(2 * 1024, 64, seed=1)
    bits = 3
    up, lo, z, mask = official_thresholds(x.float().numpy(), 0, 1 - f, f > 0)
    u16, l16, lut, frac = key_calibration(x, outlier_level(f), bits)
    assert torch.equal(u16, up.half()) and torch.equal(l16, lo.half())
    ours = z.flatten()[~mask.flatten()].to(F64)
    sk = official_kmeans(z, mask, bits)
    assert weighted_sse(ours, lut.to(F64)) <= 1.02 * weighted_sse(ours, sk)
    if f > 0:  # the key outlier fraction on the calibration data itself (§14.8 test 3)
        assert frac == pytest.approx(0.01, abs=1e-3)  # 2048 tokens: 11 of 2048 per tail are above
        frac = key_calibration(activations(16384, 16, seed=3), outlier_level(f), 1)[3]
        assert frac == pytest.approx(0.01, abs=5e-4)


def test_value_calibration_matches_the_official_kmeans_per_token():
    """Values per calibration token (SimQuant with qchannel=-1): per-token percentiles, |z| > 1
    left out; the objective is within 2 % of sklearn's on the same inliers."""
    x = activations(1024, 96, seed=2)
    up, lo, z, mask = official_thresholds(x.float().numpy(), -1, 0.99, True)
    lut = value_calibration(x, outlier_level(0.01), 2)
    ours = z.flatten()[~mask.flatten()].to(F64)
    assert weighted_sse(ours, lut.to(F64)) <= 1.02 * weighted_sse(ours, official_kmeans(z, mask, 2))


@pytest.mark.parametrize("bits", [1, 2, 4, 5])
def test_weighted_kmeans_against_sklearn(bits):
    """Weighted 1-D k-means (the Fisher-weighted fit of lines 508-519): objective within 2 % of
    sklearn's with the official settings, on a heavy-tailed sample with random weights."""
    g = torch.Generator().manual_seed(bits)
    x = (student_t((40000,), 3, g) / 4).clamp(-1, 1)
    w = torch.rand(40000, generator=g, dtype=F64)
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=2**bits, random_state=0, n_init="auto", max_iter=50)
    sk = km.fit(x.float().numpy().reshape(-1, 1), sample_weight=w.numpy()).cluster_centers_.ravel()
    ours = kmeans_1d(x, 2**bits, w)
    assert torch.all(ours[1:] >= ours[:-1])
    assert weighted_sse(x, ours, w) <= 1.02 * weighted_sse(x, sk, w)


def test_uniform_fisher_is_unweighted_and_paper_scale_changes_the_lut():
    """§14.8 test 7: F = 1 reproduces unweighted k-means exactly; ``fisher_scale="paper"``
    (F s^2) moves the centroids when token scales differ."""
    x = torch.randn(5000, dtype=F64, generator=torch.Generator().manual_seed(3)).clamp(-1, 1)
    assert torch.equal(kmeans_1d(x, 8, torch.ones_like(x)), kmeans_1d(x, 8))
    v = activations(512, 64, seed=4) * torch.linspace(0.1, 10, 512, dtype=F64)[:, None]
    code = value_calibration(v, outlier_level(0.01), 3, "code")
    paper = value_calibration(v, outlier_level(0.01), 3, "paper")
    assert not torch.equal(code, paper)


def naive_lloyd(x, w, centers, iters=50, tol=1e-4):
    """Weighted Lloyd by definition, float64: every point to its nearest centroid (the first on a
    tie), each centroid to its cluster's weighted mean (kept when empty); stops as kmeans_1d."""
    bound = tol * float(x.var(unbiased=False))
    assign = None
    for _ in range(iters):
        new = (x[:, None] - centers[None, :]).abs().argmin(1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        moved = centers.clone()
        for j in range(centers.numel()):
            sel = assign == j
            if bool(sel.any()) and float(w[sel].sum()) > 0:
                moved[j] = (w[sel] * x[sel]).sum() / w[sel].sum()
        moved = moved.sort().values
        shift = float(((moved - centers) ** 2).sum())
        centers = moved
        if shift <= bound:
            break
    return centers


def test_fisher_weighted_kmeans_matches_a_naive_weighted_lloyd_and_its_objective():
    """k-means weighted by Fisher information (paper Eq. 7): kmeans_1d equals the naive weighted
    Lloyd iteration from the same start, and its weighted objective is at most that of the
    unweighted centroids; ``lut_weights`` is F (``"code"``) or F s² (``"paper"``: the Fisher
    information of the normalized element, ∂L/∂z = s ∂L/∂x)."""
    from methods.kvquant import companding_init
    from methods.kvquant.calibration import lut_weights

    g = torch.Generator().manual_seed(40)
    x = (torch.randn(3000, dtype=F64, generator=g) * 0.4).clamp(-1, 1)
    w = torch.rand(3000, dtype=F64, generator=g) ** 4 * 1e-6  # squared gradients: tiny, heavy-tailed
    xs, order = x.sort()
    ours = kmeans_1d(x, 8, w)
    ref = naive_lloyd(xs, w[order], companding_init(xs, w[order], 8))
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12)
    plain = kmeans_1d(x, 8)
    assert weighted_sse(x, ours, w) <= weighted_sse(x, plain, w)
    z = torch.randn(6, 5, dtype=F64, generator=g)
    half = torch.rand(1, 5, dtype=F64, generator=g) + 0.5
    fisher = torch.rand(6, 5, dtype=F64, generator=g)
    assert torch.equal(lut_weights(z, half, fisher, "code"), fisher)
    assert torch.allclose(lut_weights(z, half, fisher, "paper"), fisher * half**2, rtol=1e-15, atol=0)
    assert lut_weights(z, half, None, "code") is None
    cal = activations(512, 32, seed=41)
    f_cal = torch.rand(512, 32, dtype=F64, generator=g)
    t = outlier_level(0.01)
    u, lo, lut, _ = key_calibration(cal, t, 2, "paper", f_cal)
    up, low = (torch.quantile(cal, q, dim=0) for q in (t, 1 - t))
    zk = (cal - (up + low) / 2) / ((up - low) / 2)
    keep = zk.abs() <= 1
    want = kmeans_1d(zk[keep], 4, (f_cal * ((up - low) / 2) ** 2)[keep]).half()
    assert torch.equal(lut, want)
    assert not torch.equal(lut, key_calibration(cal, t, 2, "paper")[2])


def test_fisher_pass_matches_a_naive_autograd_reference():
    """kvbench/fit/fisher.py: the squared gradient of each window's mean next-token loss (HF's
    ``labels=`` loss) w.r.t. the k_proj/v_proj outputs, at the key/value sample's positions, equals
    a naive reference: the official route (retain_grad on each projection output, backward of the
    ``labels=input_ids`` loss, here recomputed in float64), read position by position."""
    from kvbench.fit.statistics import sample_positions

    model = tiny_llama(seed=2).to(F64)
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(5))
    n_sample = 20
    got = collect_fisher(model, ids, n_sample, seed=3)
    stats = collect_stats(model, ids, sample_tokens=n_sample, seed=3)
    heads, d = 2, 16
    positions = sample_positions(ids.numel(), n_sample, 3).tolist()
    want = [([], []) for _ in model.model.layers]
    for w in range(ids.shape[0]):
        outs = []

        def keep(module, args, out):
            out.retain_grad()
            outs.append(out)

        hooks = [proj.register_forward_hook(keep)
                 for layer in model.model.layers for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        model.zero_grad()
        out = model(input_ids=ids[w : w + 1], labels=ids[w : w + 1], use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[w, 1:])  # HF's loss, in float64
        assert float(loss.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-6)  # HF: float32
        loss.backward()
        for h in hooks:
            h.remove()
        for p in positions:
            if p // 24 != w:
                continue
            for i, o in enumerate(outs):
                want[i // 2][i % 2].append(o.grad[0, p % 24].reshape(heads, d) ** 2)
    model.zero_grad()
    assert all(p.grad is None or not bool(p.grad.any()) for p in model.parameters())
    for layer, (kf, vf) in enumerate(got):
        assert kf.shape == vf.shape == stats[layer].k_sample.shape == (heads, n_sample, d)
        assert kf.dtype == F64
        for mine, ref in ((kf, want[layer][0]), (vf, want[layer][1])):
            ref = torch.stack(ref, 1)
            assert torch.allclose(mine, ref, rtol=1e-10, atol=1e-300)
            assert float(ref.abs().max()) > 0


# ---------------------------------------------------------------------------------------------
# quantizer parity (§14.8 test 2)


@pytest.mark.parametrize("f", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_key_quantizer_matches_the_official_static_path(f, dtype):
    """Static per-channel keys (``QuantLinearSim.forward`` lines 713-729 with
    ``dynamicquantization=False``: fp16 thresholds, ``get_outliers``, ``quant_fn_nuq_recon``):
    inliers bit-equal; outliers equal to the input (the code's x - offset + offset: <= 1 ulp)."""
    data = activations(2048 + 300, 96, seed=5)  # one distribution: calibration, then fresh tokens
    t = outlier_level(f)
    u16, l16, lut, _ = key_calibration(data[:2048], t, 3)
    x = data[2048:].to(dtype)
    codec = KeyCodec(u16, l16, lut, 3, f > 0)
    _, ours = codec.encode_decode(as_block(x, 3))
    ours = as_rows(ours)
    mask = official_get_outliers(x, u16, l16) if f > 0 else torch.zeros_like(x, dtype=torch.bool)
    ref = official_nuq_recon(x, 0, False, f > 0, mask, u16, l16, lut)
    assert ours.dtype == dtype
    assert torch.equal(ours[~mask], ref[~mask])
    assert torch.equal(ours[mask], x[mask])
    ulp = torch.finfo(dtype).eps * x[mask].abs().clamp(min=1)
    assert bool(((ref[mask] - x[mask]).abs() <= ulp).all())
    if f > 0:
        assert 0 < int(mask.sum()) < x.numel() // 20


@pytest.mark.parametrize("f", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_value_quantizer_matches_the_official_dynamic_path(f, dtype):
    """Dynamic per-token values (lines 713-719 ``get_outliers_dynamic``, then
    ``quant_fn_nuq_recon`` with ``dynamicquantization=True``): the median-trimmed extremes,
    inliers bit-equal, outliers exact."""
    lut = value_calibration(activations(1024, 192, seed=7), outlier_level(f), 4)
    x = activations(200, 192, seed=8).to(dtype)
    codec = ValueCodec(lut, 4, outlier_level(f))
    _, ours = codec.encode_decode(as_block(x, 3))
    ours = as_rows(ours)
    if f > 0:
        mask = official_get_outliers_dynamic(x, -1, 1 - f)
    else:
        mask = torch.zeros_like(x, dtype=torch.bool)
    ref = official_nuq_recon(x, -1, True, f > 0, mask, None, None, lut)
    assert torch.equal(ours[~mask], ref[~mask])
    assert torch.equal(ours[mask], x[mask])
    ulp = torch.finfo(dtype).eps * x.abs().amax(-1, keepdim=True).expand_as(x)[mask]
    assert bool(((ref[mask] - x[mask]).abs() <= ulp).all())
    if f > 0:  # 2 per token of distinct entries; ties on the fp16 grid can add some
        distinct = torch.tensor([row.unique().numel() == row.numel() for row in x])
        assert bool((mask.sum(-1)[distinct] == value_outlier_count(192, outlier_level(f))).all())
        assert bool((mask.sum(-1) >= 2).all()) and int(distinct.sum()) > 0


def test_sink_rows_match_the_official_first_few_fp16():
    """``--first_few_fp16 1`` (lines 75-76, 110-111, 358-359): the first token is returned as it
    came, in K and V; the cache layer does that with ``exact_first`` (and stores it at 16 bits)."""
    lut_k = key_calibration(activations(1024, 32, seed=9), 1.0, 2)
    lut_v = value_calibration(activations(1024, 32, seed=10), 1.0, 2)
    state = KVQuantLayerState(KeyCodec(lut_k[0], lut_k[1], lut_k[2], 2, False), ValueCodec(lut_v, 2), exact_first=1)
    k = as_block(activations(12, 32, seed=11), 2)
    v = as_block(activations(12, 32, seed=12), 2)
    q = torch.randn(1, 4, 12, 16, dtype=F64)
    rope = Rope(torch.ones(1, 12, 16, dtype=F64), torch.zeros(1, 12, 16, dtype=F64))
    state.attend(q, k, v, scaling=0.25, prefill=False, k_pre=k, rope=rope)
    ref_k = official_nuq_recon(as_rows(k), 0, False, False, None, lut_k[0], lut_k[1], lut_k[2], first_few_fp16=1)
    ref_v = official_nuq_recon(as_rows(v), -1, True, False, None, None, None, lut_v, first_few_fp16=1)
    keys, values = state.read_kv()
    assert torch.equal(as_rows(keys), ref_k)
    assert torch.equal(as_rows(values), ref_v)
    assert torch.equal(keys[:, :, 0], k[:, :, 0]) and torch.equal(values[:, :, 0], v[:, :, 0])


def test_keys_are_quantized_before_rope():
    """§14.1 / §14.8 test 6: the cache's key is RoPE(dequantized pre-RoPE key), which differs from
    quantizing the rotated key; the sink token is bit-exact after rotation."""
    cal = activations(1024, 32, seed=13)
    u, l, lut, _ = key_calibration(cal, 1.0, 2)
    codec = KeyCodec(u, l, lut, 2, False)
    k_pre = as_block(activations(10, 32, seed=14), 2)
    ang = torch.arange(10, dtype=F64)[:, None] * torch.cat([torch.linspace(0.1, 1, 8, dtype=F64)] * 2)
    rope = Rope(ang.cos()[None], ang.sin()[None])
    k_post = apply_rope(k_pre, rope)
    state = KVQuantLayerState(codec, ValueCodec(lut, 2), exact_first=1)
    q = torch.randn(1, 2, 10, 16, dtype=F64)
    state.attend(q, k_post, k_pre, scaling=0.25, prefill=False, k_pre=k_pre, rope=rope)
    pre_then_rope = apply_rope(codec.encode_decode(k_pre)[1], rope)
    keys = state.read_kv()[0]
    assert torch.equal(keys[:, :, 1:], pre_then_rope[:, :, 1:])
    assert torch.equal(keys[:, :, 0], k_post[:, :, 0])
    assert (codec.encode_decode(k_post)[1] - pre_then_rope).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# stored representation and bits (§14.5, §14.8 test 4)


@pytest.mark.parametrize("side", ["k", "v"])
def test_stored_bytes_decode_to_the_working_copy_and_bits_are_counted(side):
    """decode(stored) == what attention reads; bits = b n per token + 32 per outlier (fp16 value,
    int16 index) + a 32-bit pointer per token (+ 32 bits of fp16 max/min per value token)."""
    cal = activations(1024, 64, seed=15)
    t = outlier_level(0.02)
    if side == "k":
        u, l, lut, _ = key_calibration(cal, t, 3)
        codec = KeyCodec(u, l, lut, 3, True)
    else:
        codec = ValueCodec(value_calibration(cal, t, 3), 3, t)
    x = torch.stack([as_block(activations(40, 64, seed=16 + b), 4)[0] for b in range(2)])  # batch 2
    packed, dec = codec.encode_decode(x)
    assert torch.equal(codec.decode(packed), dec)
    mask = codec._mask(as_rows(x))
    outliers = int(mask.sum())
    assert outliers == packed.values.numel() == packed.index.numel() > 0
    tokens = 2 * 40
    meta = 32 * tokens if side == "v" else 0
    assert codec.bits(packed) == tokens * 64 * 3 + 32 * outliers + 32 * tokens + meta
    per_pos = mask.reshape(2, 40, 64).sum(-1).sum(0).to(F64)
    assert torch.equal(packed.token_bits, 2 * (64 * 3 + 32) + meta / 40 + 32 * per_pos)
    assert packed.values.dtype == torch.float16 and packed.index.dtype == torch.int16
    assert packed.pointer.dtype == torch.int32


def test_measured_reads_equal_a_direct_count_per_position():
    """Q-all over T tokens through the layer state: query t reads 16 n for the sink and, per
    ordinary token, b n + 32 (pointer) + 32 per outlier (keys) — counted here from the masks."""
    n, t_len, b = 32, 120, 2
    cal = activations(2048, n, seed=17)
    t = outlier_level(0.03)
    u, l, lut, _ = key_calibration(cal, t, b)
    kc = KeyCodec(u, l, lut, b, True)
    vc = ValueCodec(value_calibration(cal, t, b), b, t)
    state = KVQuantLayerState(kc, vc, exact_first=1)
    k = as_block(activations(t_len, n, seed=18), 2)
    v = as_block(activations(t_len, n, seed=19), 2)
    rope = Rope(torch.ones(1, t_len, 16, dtype=F64), torch.zeros(1, t_len, 16, dtype=F64))
    state.attend(torch.randn(1, 4, t_len, 16, dtype=F64), k, v, scaling=0.25, prefill=False, k_pre=k, rope=rope)
    reads_k, reads_v = state.read_bits()
    ck = kc._mask(as_rows(k)).sum(-1).to(F64)
    cv = vc._mask(as_rows(v)).sum(-1).to(F64)
    per_k = torch.cat([torch.tensor([16.0 * n], dtype=F64), (b * n + 32 + 32 * ck)[1:]])
    per_v = torch.cat([torch.tensor([16.0 * n], dtype=F64), (b * n + 64 + 32 * cv)[1:]])
    assert torch.equal(reads_k, per_k.cumsum(0)) and torch.equal(reads_v, per_v.cumsum(0))
    assert state.stored_bits() == (int(per_k.sum()), int(per_v.sum()))


def test_prediction_equals_the_measured_headline_without_outliers():
    """§14.5 with f = 0: the mean over T positions of bits_t / (t n) is b + (16 - b) H_T / T."""
    n, t_len = 32, 257
    cal = activations(1024, n, seed=20)
    u, l, lut, _ = key_calibration(cal, 1.0, 3)
    state = KVQuantLayerState(KeyCodec(u, l, lut, 3, False), ValueCodec(value_calibration(cal, 1.0, 3), 3),
                              exact_first=1)
    k = as_block(activations(t_len, n, seed=21), 2)
    rope = Rope(torch.ones(1, t_len, 16, dtype=F64), torch.zeros(1, t_len, 16, dtype=F64))
    state.attend(torch.randn(1, 2, t_len, 16, dtype=F64), k, k, scaling=0.25, prefill=False, k_pre=k, rope=rope)
    reads_k, reads_v = state.read_bits()
    pos = torch.arange(1, t_len + 1, dtype=F64) * n
    harmonic = sum(1 / i for i in range(1, t_len + 1))
    assert float((reads_k / pos).mean()) == pytest.approx(3 + 13 * harmonic / t_len, rel=1e-12)
    assert float((reads_k / pos).mean()) == pytest.approx(headline(3.0, 1, Regime("qall", t_len)), rel=1e-12)
    v_cost = token_cost("v", 3, 0.0, n)
    assert v_cost == 3 + 32 / n
    assert float((reads_v / pos).mean()) == pytest.approx(headline(v_cost, 1, Regime("qall", t_len)), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# budget map (§14.6, §8 "Additions")


@pytest.mark.parametrize("shape", [SMOL, LLAMA], ids=["d64", "d128"])
def test_budget_grid_in_q_all_and_prefill(shape):
    """docs/methods.md §14.6 at f = 0 (``outliers=0``): 0.5 unreachable; 1 and 2 run without the
    sink in Q-all over 2048 positions (its share would put them 6 % / 2.8 % over), 3 and 4 keep it;
    after a 1536-token prefill every row keeps it. The most bits under the 1.02 x ceiling."""
    expected = {"qall": {1: (1, 0), 2: (2, 0), 3: (3, 1), 4: (4, 1)},
                "prefill": {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (4, 1)}}
    for regime in (Regime("qall", 2048), Regime("prefill", 1536, 511)):
        for target, (b, sink) in expected[regime.kind].items():
            m = KVQuant(outliers=0.0)
            m.set_regime(regime)
            m.configure(shape, float(target), None)
            knobs = m.knobs()
            assert (knobs["k_bits"], knobs["sink"], knobs["v_bits"], knobs["k_outliers"]) == (b, sink, None, 0.0)
            assert target * 0.98 <= knobs["predicted_bpd_k"] <= 1.02 * target
        m = KVQuant()
        m.set_regime(regime)
        with pytest.raises(Unsupported, match=r"reachable range \[1\.00"):
            m.configure(shape, 0.5, None)


def test_value_budget_and_explicit_knobs():
    """Values cost b + 32/n: at f = 0 on SmolLM2 (n = 192) v_bpd = 4 takes nuq3 (3.17, under the
    ceiling), on Llama-3.1-8B (n = 1024) v_bpd = 3 is nuq3 at 3.03 without the sink (3.08 with it,
    over 1.02 x, and one sink serves both sides). Explicit bits run as set; the paper's nuq4-1 % on
    Llama is 4.35 + 32/n; an explicit sink over the ceiling is unsupported."""
    m = KVQuant(outliers=0.0)
    m.configure(SMOL, 4.0, 4.0)
    assert (m.knobs()["v_bits"], m.knobs()["predicted_bpd_v"]) == (3, pytest.approx(3 + 32 / 192 + 13 * 0.0040, abs=2e-3))
    m = KVQuant(outliers=0.0)
    m.configure(LLAMA, 4.0, 3.0)
    knobs = m.knobs()
    assert (knobs["k_bits"], knobs["v_bits"], knobs["sink"]) == (4, 3, 0)
    assert knobs["predicted_bpd_v"] == pytest.approx(3 + 32 / 1024)
    m = KVQuant(bits=4, outliers=0.01, budget="nominal")
    m.configure(LLAMA, None, None)
    assert m.knobs()["predicted_bpd_k"] == pytest.approx(4 + 0.32 + 32 / 1024)
    with pytest.raises(Unsupported):
        KVQuant(sink=1, outliers=0.0).configure(SMOL, 1.0, None)
    m = KVQuant(sink=0, outliers=0.0)
    m.configure(SMOL, 3.0, None)
    assert m.knobs()["sink"] == 0


def test_outliers_per_side_counts_and_bits():
    """``outliers`` (keys) and ``v_outliers`` (values, default = ``outliers``) are separate: each
    side's stored outliers are counted per token, and the stored bits equal §14.5's per-token cost
    from the counted outliers (keys: measured f_K; values: the exact count of §14.3)."""
    n, heads = 64, 2
    cal = activations(2048, n, seed=30)
    x = as_block(activations(40, n, seed=31), heads)
    for fk, fv in ((0.02, 0.0), (0.0, 0.02), (0.01, 0.005)):
        m = KVQuant(bits=2, v_bits=3, outliers=fk, v_outliers=fv, fisher=False)
        m.configure(ModelShape(1, 4, heads, n // heads), None, None)
        kn = m.knobs()
        assert (kn["k_outliers"], kn["v_outliers"]) == (fk, fv)
        tk, tv = outlier_level(fk), outlier_level(fv)
        u, lo, lut, _ = key_calibration(cal, tk, 2)
        key, value = KeyCodec(u, lo, lut, 2, fk > 0), ValueCodec(value_calibration(cal, tv, 3), 3, tv)
        pk, pv = key.encode(x), value.encode(x)
        assert (pk.pointer is None) == (fk == 0) and (pv.pointer is None) == (fv == 0)
        n_k = 0 if pk.values is None else pk.values.numel()
        assert pk.bits() == 40 * (2 * n + (32 if fk else 0)) + 32 * n_k
        assert pk.bits() == pytest.approx(40 * n * token_cost("k", 2, n_k / (40 * n), n) if fk else 40 * n * 2)
        per_token = value_outlier_count(n, tv)
        assert (0 if pv.values is None else pv.values.numel()) == 40 * per_token
        assert pv.bits() == pytest.approx(40 * n * token_cost("v", 3, fv, n))
        assert m.nominal_bpd(10**9)[1] == pytest.approx(token_cost("v", 3, fv, n), rel=1e-6)


def test_presets_are_explicit_knobs():
    """``preset`` (the paper's nuq4/3/2-1 %, sink 1) sets the knobs and runs as set at its measured
    bpd, without a search; it excludes the single knobs; a wrong name lists the valid ones."""
    m = KVQuant(preset="nuq4-1%")
    assert m.searches() == () and m.knob_candidates(LLAMA, 4.0, 4.0, 27) == []
    m.configure(LLAMA, 4.0, 4.0)
    kn = m.knobs()
    assert (kn["k_bits"], kn["v_bits"], kn["k_outliers"], kn["v_outliers"], kn["sink"]) == (4, 4, 0.01, 0.01, 1)
    assert kn["predicted_bpd_k"] == pytest.approx(headline(4 + 0.32 + 32 / 1024, 1, Regime()))
    assert kn["chosen_by"] == "run as set" and kn["preset"] == "nuq4-1%"
    m = KVQuant(preset="nuq2-1%")
    m.configure(SMOL, 3.0, None)
    assert (m.knobs()["k_bits"], m.knobs()["v_bits"]) == (2, None)
    with pytest.raises(ValueError, match="nuq4-1%"):
        KVQuant(preset="nuq4")
    with pytest.raises(ValueError, match="drop"):
        KVQuant(preset="nuq3-1%", bits=3)


def test_ceiling_admits_cheaper_configurations_and_refuses_3_percent_over():
    """docs/methods.md §0.1: admissible iff the predicted headline is at most 1.02 x the target; a
    cheaper configuration is admissible, one 3 % over is not (also for the joint mean)."""
    from methods.kvquant.budget import configurations

    regime = Regime("qall", 2048)
    grids = {"k": ((3,), (0.0,))}
    p = headline(3.0, 1, regime)
    assert configurations({"k": p / 1.019}, grids, (1,), 192, regime, "measured")
    assert not configurations({"k": p / 1.03}, grids, (1,), 192, regime, "measured")
    assert configurations({"k": 10.0}, grids, (1,), 192, regime, "measured")  # far under: admissible
    both = {"k": ((2,), (0.0,)), "v": ((2,), (0.0,))}
    mean = (2.0 + 2 + 32 / 192) / 2
    assert configurations({"k": 1, "v": 1}, both, (0,), 192, regime, "measured", target_kv=mean / 1.019)
    assert not configurations({"k": 1, "v": 1}, both, (0,), 192, regime, "measured", target_kv=mean / 1.03)


def test_knob_candidates_paper_preset_first_and_at_most_27():
    """With no knob given the held-out search chooses (``searches()``): the candidates are under
    the ceiling, at most 27, the richest admissible paper preset first, then one per bit width;
    a given knob turns the search off."""
    m = KVQuant()
    m.set_regime(Regime("qall", 2048))
    assert m.searches() == ("knobs",)
    for bpd, first in ((2.0, {"bits": 2, "outliers": 0.0, "sink": 0}),
                       (3.0, {"bits": 2, "outliers": 0.01, "sink": 1}),
                       (4.0, {"bits": 3, "outliers": 0.01, "sink": 1})):
        cands = m.knob_candidates(SMOL, bpd, None, 27)
        assert 1 <= len(cands) <= 27
        assert {k: cands[0][k] for k in first} == first
        for c in cands:
            probe = KVQuant()
            probe.set_regime(Regime("qall", 2048))
            probe.use_knobs(c)
            probe.configure(SMOL, bpd, None)
            assert probe.knobs()["predicted_bpd_k"] <= 1.02 * bpd + 1e-12
            assert probe.knobs()["chosen_by"] == "held-out knob search"
    assert KVQuant(outliers=0.0).searches() == ()
    assert KVQuant(budget="nominal").searches() == ()
    probe = KVQuant()
    probe.use_knobs({"bits": 5, "outliers": 0.0, "v_bits": None, "v_outliers": None, "sink": 0})
    with pytest.raises(Unsupported, match="not admissible"):
        probe.configure(SMOL, 2.0, None)


def test_joint_kv_reaches_2_with_outliers_on_the_values():
    """``joint_kv`` at bpd_KV = 2 on SmolLM2 (n = 192): keys nuq2-0 % (2.000) and values nuq1 with
    f_V = 2 % (4 of 192 entries: 1 + 32/192 + 32*4/192 + 32/192 = 2.000) is a candidate whose mean
    is exactly 2; every candidate's mean is under the ceiling."""
    m = KVQuant(joint_kv=True)
    m.set_regime(Regime("qall", 2048))
    cands = m.knob_candidates(SMOL, 2.0, 2.0, 27)
    assert {"bits": 2, "outliers": 0.0, "v_bits": 1, "v_outliers": 0.02, "sink": 0} in cands
    assert value_outlier_count(192, outlier_level(0.02)) == 4
    assert token_cost("v", 1, 0.02, 192) == pytest.approx(2.0, abs=1e-12)
    for c in cands:
        probe = KVQuant(joint_kv=True)
        probe.set_regime(Regime("qall", 2048))
        probe.use_knobs(c)
        probe.configure(SMOL, 2.0, 2.0)
        kn = probe.knobs()
        assert (kn["predicted_bpd_k"] + kn["predicted_bpd_v"]) / 2 <= 2.04 + 1e-12 and kn["joint_kv"] == 2.0


def test_registry_and_yaml_give_the_defaults():
    """``method=kvquant`` builds from its YAML, whose options are the dataclass defaults."""
    import dataclasses
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "method" / "kvquant.yaml").read_text())
    assert cfg.pop("name") == "kvquant"
    built = build_method("kvquant", **cfg)
    assert isinstance(built, KVQuant) and built.needs_calibration
    defaults = {f.name: f.default for f in dataclasses.fields(KVQuant) if f.init}
    assert cfg == defaults


def test_bad_options_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 4, 5\)"):
        KVQuant(bits=6)
    with pytest.raises(ValueError, match="code"):
        KVQuant(fisher_scale="fisher")
    with pytest.raises(ValueError, match="true, false"):
        KVQuant(fisher="yes")
    with pytest.raises(ValueError, match="outlier fraction"):
        KVQuant(outliers=0.7)
    with pytest.raises(ValueError, match="measured"):
        KVQuant(budget="exact")
    with pytest.raises(TypeError, match="valid options"):
        build_method("kvquant", sparsity=0.01)


def test_calibration_needs_the_sample_and_asks_for_it():
    m = KVQuant()
    assert m.calibration_sample_tokens() == 4096  # asked before configure (the harness's order)
    m.configure(SMOL, None, None)
    assert m.calibration_sample_tokens() == 0  # both sides exact
    h, d = 2, 16
    stats = [LayerStats(torch.zeros(h, d, dtype=F64), torch.eye(d, dtype=F64).repeat(h, 1, 1),
                        torch.zeros(h, d, dtype=F64), torch.eye(d, dtype=F64).repeat(h, 1, 1),
                        torch.eye(d, dtype=F64).repeat(h, 1, 1), 100)]
    m = KVQuant()
    m.configure(ModelShape(1, 4, h, d), 2.0, None)
    assert m.calibration_fisher() and not KVQuant(fisher=False).calibration_fisher()
    with pytest.raises(ValueError, match="sample_tokens"):
        m.calibrate(stats)
    stats[0].k_sample = torch.randn(h, 50, d, dtype=F64).half()
    stats[0].v_sample = torch.randn(h, 50, d, dtype=F64).half()
    with pytest.raises(ValueError, match="fisher=false"):
        m.calibrate(stats)


# ---------------------------------------------------------------------------------------------
# inside the model: both regimes (§14.4, §14.8 test 5)

T = 80


@pytest.fixture(scope="module")
def model64_and_stats():
    """The tiny float64 Llama with calibration statistics that hold the key/value sample and its
    Fisher information."""
    model = tiny_llama(seed=1).to(F64)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    stats = collect_stats(model, ids, sample_tokens=4096)
    return model, with_fisher(stats, collect_fisher(model, ids, 4096))


OPTS = [({"bits": 2, "v_bits": 3, "outliers": 0.05}, 2.0, 3.0), ({}, 4.0, None)]


@pytest.mark.parametrize("options,bpd,v_bpd", OPTS, ids=["sparse-kv", "k-track"])
def test_in_pass_equals_token_by_token_decoding(model64_and_stats, options, bpd, v_bpd):
    """Q-all (one pass from an empty cache) equals token-by-token decoding, logits and every
    query's read bits, through the rounding quantizer in float64."""
    model, stats = model64_and_stats
    method = configured_method(model, "kvquant", options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        comp = attach(model, method)
        try:
            in_pass = model(input_ids=ids, use_cache=False).logits
            reads_pass = comp.read_bpd()
            with comp.session():
                steps, reads = [], []
                for t in range(T):
                    steps.append(comp.forward(ids[:, t : t + 1], t, prefill=False))
                    reads.append(comp.read_bpd())
        finally:
            comp.detach()
    stepped = torch.cat(steps, 1)
    assert (in_pass - stepped).abs().max() < 1e-9
    assert (in_pass - ref).abs().max() > 1e-5  # the method changed the computation
    for side in (0, 1):
        assert torch.allclose(reads_pass[side], torch.cat([r[side] for r in reads]), rtol=1e-12, atol=0)
    if v_bpd is None:
        assert torch.equal(reads_pass[1], torch.full((T,), 16.0, dtype=F64))


def test_prefill_then_chunk_equals_prefill_then_steps(model64_and_stats):
    """Prefill-exact (§14.4): exact prompt attention, then compressed; the targets scored in one
    chunk equal decoding them one by one; layer 0 (whose inputs do not depend on the attention mode)
    stores the prompt in the bits of one Q-all pass."""
    model, stats = model64_and_stats
    method = configured_method(model, "kvquant", OPTS[0][0], 2.0, 3.0, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    p = 50
    with torch.no_grad():
        comp = attach(model, method)
        try:
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=True)
                prompt_bits = [s.stored_bits() for s in comp.states[0]]
                chunk = comp.forward(ids[:, p:], p, prefill=False)
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=True)
                steps = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(p, T)], 1)
            with comp.session():
                comp.forward(ids[:, :p], 0, prefill=False)
                qall_bits = [s.stored_bits() for s in comp.states[0]]
        finally:
            comp.detach()
    assert (chunk - steps).abs().max() < 1e-9
    assert prompt_bits[0] == qall_bits[0]


def test_static_bytes_and_nominal_bpd(model64_and_stats):
    """Static bytes per layer: 2 fp16 thresholds per key channel and the 2^b-entry fp16 LUTs
    (§14.2); the nominal formula at T tokens includes the sink share."""
    model, stats = model64_and_stats
    method = configured_method(model, "kvquant", OPTS[0][0], 2.0, 3.0, stats)
    n = 2 * 16  # tiny Llama: 2 KV heads of 16
    assert method.static_bytes() == 2 * (2 * 16 * n + 16 * 4 + 16 * 8) // 8
    k, v = method.nominal_bpd(T)
    ck = 2 + 32 * 0.05 + 32 / n
    assert k == pytest.approx(ck + (16 - ck) / T)
    cv = token_cost("v", 3, 0.05, n)
    assert cv == pytest.approx(3 + 32 / n + 32 * value_outlier_count(n, outlier_level(0.05)) / n + 32 / n)
    assert v == pytest.approx(cv + (16 - cv) / T)
    assert math.isfinite(method.knobs()["key_outlier_fraction_calibration"])
