"""methods/quantizer.py (the seed's primitives, fixed) against naive float64 loop references."""

import math

import numpy as np
import pytest
import torch

from methods.quantizer import (
    QuantizedTensor,
    dequantize,
    quantization_error,
    quantize_per_channel_asymmetric,
    quantize_per_channel_symmetric,
)

pytestmark = pytest.mark.numerics


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 7, 6)).astype(np.float32)
    x[..., 0] = np.abs(x[..., 0]) + 5.0  # all positive, far from 0
    x[..., 1] = -np.abs(x[..., 1]) - 3.0  # all negative
    x[..., 2] = 2.5  # constant
    x[..., 3] = 0.0  # constant zero
    x[..., 4] *= 100.0  # wide
    return x


def ref_symmetric(x, bits):
    """Naive mid-rise reference: 2^b levels over [-absmax, absmax]."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    n, c = flat.shape
    codes = np.zeros((n, c), dtype=np.int64)
    rec = np.zeros((n, c))
    scales = []
    for j in range(c):
        absmax = max(max(abs(v) for v in flat[:, j]), 1e-8)
        step = float(np.float32(2.0 * absmax / 2**bits))
        scales.append(step)
        for i in range(n):
            q = math.floor(flat[i, j] / step) + 2 ** (bits - 1)
            q = min(max(q, 0), 2**bits - 1)
            codes[i, j] = q
            rec[i, j] = (q - 2 ** (bits - 1) + 0.5) * step
    return codes.reshape(x.shape), np.array(scales), rec.reshape(x.shape)


def ref_asymmetric(x, bits):
    """Naive affine reference with the documented guard max(range, 1e-8, 1e-6 absmax)."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    n, c = flat.shape
    qmax = 2**bits - 1
    codes = np.zeros((n, c), dtype=np.int64)
    rec = np.zeros((n, c))
    zps, scales = [], []
    for j in range(c):
        lo, hi = min(flat[:, j]), max(flat[:, j])
        rng = max(hi - lo, 1e-8, 1e-6 * max(abs(lo), abs(hi)))
        s = float(np.float32(rng / qmax))
        zp = int(np.round(-lo / s))
        zps.append(zp)
        scales.append(s)
        for i in range(n):
            q = min(max(int(np.round(flat[i, j] / s)) + zp, 0), qmax)
            codes[i, j] = q
            rec[i, j] = (q - zp) * s
    return codes.reshape(x.shape), np.array(scales), np.array(zps), rec.reshape(x.shape)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_symmetric_matches_reference(bits, kind):
    x = _inputs(bits)
    xin = torch.from_numpy(x) if kind == "torch" else x
    qt = quantize_per_channel_symmetric(xin, bits)
    assert isinstance(qt.data, torch.Tensor if kind == "torch" else np.ndarray)
    data = np.asarray(qt.data)
    assert data.dtype == np.uint8 and data.shape == x.shape
    codes, scales, rec = ref_symmetric(x, bits)
    np.testing.assert_array_equal(data.astype(np.int64), codes)
    np.testing.assert_allclose(np.asarray(qt.scale, dtype=np.float64), scales, rtol=0, atol=0)
    out = dequantize(qt)
    assert isinstance(out, torch.Tensor if kind == "torch" else np.ndarray)
    np.testing.assert_allclose(np.asarray(out), rec, rtol=1e-6, atol=1e-30)
    # error bound: half a step everywhere (the top level clips by exactly half a step)
    err = np.abs(np.asarray(out, dtype=np.float64) - x)
    assert np.all(err <= scales / 2 * (1 + 1e-5) + 1e-30)


def test_symmetric_two_bit_uses_four_levels():
    x = np.linspace(-1, 1, 101, dtype=np.float32)[:, None]
    qt = quantize_per_channel_symmetric(x, 2)
    assert sorted(np.unique(qt.data).tolist()) == [0, 1, 2, 3]
    levels = sorted(np.unique(np.round(dequantize(qt), 6)).tolist())
    np.testing.assert_allclose(levels, [-0.75, -0.25, 0.25, 0.75], atol=1e-6)
    # the seed's restricted range for comparison: only 3 levels
    seed = quantize_per_channel_symmetric(x, 2, levels="seed")
    assert sorted(np.unique(np.round(dequantize(seed), 6)).tolist()) == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_symmetric_seed_levels_reference(bits):
    x = _inputs(3)
    qt = quantize_per_channel_symmetric(x, bits, levels="seed")
    qmax = 2 ** (bits - 1) - 1
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    for j in range(flat.shape[1]):
        s = float(np.float32(max(np.abs(flat[:, j]).max(), 1e-8) / qmax))
        assert float(qt.scale[j]) == s
        for i in range(flat.shape[0]):
            q = min(max(int(np.round(flat[i, j] / s)), -qmax), qmax)
            assert int(qt.data.reshape(flat.shape)[i, j]) == q + 2 ** (bits - 1)
            assert abs(float(dequantize(qt).reshape(flat.shape)[i, j]) - q * s) <= 1e-6 * abs(q * s)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_asymmetric_matches_reference(bits, kind):
    x = _inputs(10 + bits)
    xin = torch.from_numpy(x) if kind == "torch" else x
    qt = quantize_per_channel_asymmetric(xin, bits)
    data, zp = np.asarray(qt.data), np.asarray(qt.zero_point)
    assert data.dtype == np.uint8 and zp.dtype == np.int32
    codes, scales, zps, rec = ref_asymmetric(x, bits)
    np.testing.assert_array_equal(data.astype(np.int64), codes)
    np.testing.assert_array_equal(zp.astype(np.int64), zps)
    np.testing.assert_array_equal(np.asarray(qt.scale, dtype=np.float64), scales)
    np.testing.assert_allclose(np.asarray(dequantize(qt)), rec, rtol=1e-6, atol=1e-12)
    # all-positive / all-negative channels: zero points outside the code range are held exactly
    # (at 8 bits outside int8 too, where the seed overflowed)
    assert zps[0] < 0 and zps[1] > 2**bits - 1
    if bits == 8:
        assert zps[0] < -128 and zps[1] > 127 and codes.max() > 127
    # no overflow: every element within one step (integer zero point may shift by half a step)
    err = np.abs(np.asarray(dequantize(qt), dtype=np.float64) - x)
    assert np.all(err <= scales * (1 + 1e-5) + 1e-6 * np.abs(x))


def test_constant_channels_no_nan():
    x = np.full((5, 4), 3.0, dtype=np.float32)
    x[:, 1] = -7.0
    x[:, 2] = 0.0
    x[:, 3] = 1e7
    for fn in (quantize_per_channel_symmetric, quantize_per_channel_asymmetric):
        for bits in range(2, 9):
            qt = fn(x, bits)
            out = np.asarray(dequantize(qt))
            assert np.all(np.isfinite(out))
            assert np.all(np.isfinite(np.asarray(qt.scale))) and np.all(np.asarray(qt.scale) > 0)
    qt = quantize_per_channel_asymmetric(x, 8)
    np.testing.assert_allclose(np.asarray(dequantize(qt)), x, rtol=1e-6, atol=1e-7)


def test_numpy_and_torch_agree():
    x = _inputs(42)
    for fn in (quantize_per_channel_symmetric, quantize_per_channel_asymmetric):
        a, b = fn(x, 4), fn(torch.from_numpy(x), 4)
        for f in ("data", "scale", "zero_point"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), getattr(b, f).numpy())


def test_one_dim_input_is_per_element():
    x = np.array([1.0, -2.0, 3.0], dtype=np.float32)
    qt = quantize_per_channel_asymmetric(x, 8)
    np.testing.assert_allclose(np.asarray(dequantize(qt)), x, rtol=1e-6)


def test_quantization_error_matches_reference():
    x = _inputs(7)
    for fn in (quantize_per_channel_symmetric, quantize_per_channel_asymmetric):
        for bits in (2, 5):
            qt = fn(x, bits)
            rec = np.asarray(dequantize(qt), dtype=np.float64)
            diffs = [abs(a - b) for a, b in zip(x.ravel().astype(np.float64), rec.ravel())]
            m = quantization_error(x, qt)
            rmse = math.sqrt(sum(d * d for d in diffs) / len(diffs))
            assert m["rmse"] == pytest.approx(rmse, rel=1e-9)
            assert m["max_abs_error"] == pytest.approx(max(diffs), rel=1e-12)
            assert m["mean_abs_error"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-9)
            meta = np.asarray(qt.scale).nbytes + np.asarray(qt.zero_point).nbytes
            assert m["compression_ratio"] == pytest.approx(x.nbytes / (x.size + meta))
            packed = math.ceil(x.size * bits / 8)
            assert m["compression_ratio_packed"] == pytest.approx(x.nbytes / (packed + meta))
            mt = quantization_error(torch.from_numpy(x), fn(torch.from_numpy(x), bits))
            assert mt["rmse"] == pytest.approx(m["rmse"], rel=1e-12)


def test_bits_validation():
    x = np.ones((2, 2), dtype=np.float32)
    with pytest.raises(ValueError):
        quantize_per_channel_asymmetric(x, 9)
    with pytest.raises(ValueError):
        quantize_per_channel_symmetric(x, 1, levels="seed")
    with pytest.raises(ValueError):
        quantize_per_channel_symmetric(x, 4, levels="bogus")
    assert isinstance(quantize_per_channel_symmetric(x, 1), QuantizedTensor)
