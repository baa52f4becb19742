"""methods/groupquant.py (KIVI min-max group quantizer) against a naive float64 loop reference."""

import numpy as np
import pytest
import torch

from methods.groupquant import (
    dequantize_groups,
    fake_quantize_groups,
    group_codes,
    quantize_dequantize_groups,
    quantize_groups,
)

pytestmark = pytest.mark.numerics


def _x(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    return x


def ref_params(x, bits, group, axis):
    """Naive loop: fp16 (s, mn) per group along ``axis`` (float64 statistics, then fp16)."""
    xm = np.moveaxis(x.double().numpy(), axis, -1)
    lead, n = xm.shape[:-1], xm.shape[-1]
    s16 = np.zeros(lead + (n // group,))
    mn16 = np.zeros_like(s16)
    for idx in np.ndindex(*lead):
        for j in range(n // group):
            vals = [float(v) for v in xm[idx][j * group : (j + 1) * group]]
            lo, hi = min(vals), max(vals)
            s = max((hi - lo) / (2**bits - 1), 1e-8)
            s16[idx + (j,)] = max(float(np.float16(s)), 2.0**-24)
            mn16[idx + (j,)] = float(np.float16(lo))
    return s16, mn16


def ref_codes(x, bits, group, axis, s16, mn16):
    """Naive loop: codes and reconstruction from given (stored) s, mn; flags near-ties."""
    xm = np.moveaxis(x.double().numpy(), axis, -1)
    codes = np.zeros(xm.shape, dtype=np.int64)
    rec = np.zeros(xm.shape)
    tie = np.zeros(xm.shape, dtype=bool)
    for idx in np.ndindex(*xm.shape):
        j = idx[-1] // group
        s, mn = s16[idx[:-1] + (j,)], mn16[idx[:-1] + (j,)]
        u = (xm[idx] - mn) / s
        tie[idx] = abs(u - np.floor(u) - 0.5) < 1e-4
        q = min(max(int(np.round(u)), 0), 2**bits - 1)  # np.round: half to even
        codes[idx] = q
        rec[idx] = q * s + mn
    return codes, rec, tie


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("axis,group", [(2, 8), (3, 4), (-1, 16)])
def test_matches_reference(bits, axis, group):
    x = _x((1, 2, 32, 16), seed=bits)
    x[0, 0, :, 0] = x[0, 0, :, 0].abs() + 4  # all-positive channel
    x[0, 1, :, 1] = -x[0, 1, :, 1].abs() - 4  # all-negative channel
    x[0, 1, :8, 2] = 1.5  # constant token-group
    x[0, 0, 3, :] = -0.25  # constant channel-group
    gp = quantize_groups(x, bits, group, axis=axis)
    s16, mn16 = ref_params(x, bits, group, axis)
    got_s, got_mn = gp.scale.double().numpy(), gp.minimum.double().numpy()
    assert gp.scale.dtype == torch.float16 and gp.minimum.dtype == torch.float16
    np.testing.assert_array_equal(got_mn, mn16)
    # float32 vs float64 statistics may straddle an fp16 rounding boundary: allow 1 fp16 ulp
    np.testing.assert_allclose(got_s, s16, rtol=2**-10, atol=0)
    assert (got_s == s16).mean() > 0.95
    codes, rec, tie = ref_codes(x, bits, group, axis, got_s, got_mn)
    got_codes = group_codes(gp).reshape(codes.shape).numpy()
    assert np.array_equal(got_codes[~tie], codes[~tie])
    got = np.moveaxis(dequantize_groups(gp).double().numpy(), axis, -1)
    assert dequantize_groups(gp).shape == x.shape
    ok = ~tie
    np.testing.assert_allclose(got[ok], rec[ok], rtol=1e-6, atol=1e-6)
    # constant groups reconstruct to the fp16 minimum exactly
    xm = np.moveaxis(x.numpy(), axis, -1)
    for idx in np.ndindex(*xm.shape[:-1]):
        for j in range(xm.shape[-1] // group):
            seg = xm[idx][j * group : (j + 1) * group]
            if np.all(seg == seg[0]):
                assert np.all(got[idx][j * group : (j + 1) * group] == float(np.float16(seg[0])))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound(bits):
    x = _x((2, 3, 64, 32), seed=7)
    gp = quantize_groups(x, bits, 32, axis=2)
    xh = dequantize_groups(gp)
    s = gp.scale.float().repeat_interleave(32, dim=-1).transpose(-1, -2)  # [2,3,64,32]
    mn_err = 2.0**-10 * x.abs().amax()  # fp16 rounding of the minimum
    assert torch.all((x - xh).abs() <= s / 2 + mn_err + 1e-6)


def test_bits_counts_stored_tensors():
    x = _x((1, 2, 128, 64))
    for bits in (1, 2, 3, 4, 8):
        for group, axis in ((32, 2), (64, 3), (128, 2)):
            gp = quantize_groups(x, bits, group, axis=axis)
            n = x.numel()
            assert gp.bits() == n * bits + (n // group) * 32
            assert gp.codes.dtype == torch.uint8
            assert gp.codes.numel() == n * bits // 8


def test_half_to_even_and_dtype():
    # group [0, 3]: 2 bits -> s = 1, codes exact; (0.5, 1.5, 2.5) ties -> 0, 2, 2
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 3.0]])
    gp = quantize_groups(x, 2, 8, axis=1)
    assert group_codes(gp).reshape(-1).tolist() == [0, 0, 2, 2, 3, 1, 2, 3]
    xb = x.to(torch.bfloat16)
    assert fake_quantize_groups(xb, 2, 8).dtype == torch.bfloat16


def test_rejects_incomplete_groups_and_bad_bits():
    with pytest.raises(ValueError):
        quantize_groups(torch.zeros(1, 30), 2, 32)
    with pytest.raises(ValueError):
        quantize_groups(torch.zeros(1, 32), 9, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits,axis", [(1, 2), (2, 2), (3, 3), (4, 2), (8, 3)])
def test_reconstruction_from_codes_is_the_unpacked_one(dtype, bits, axis):
    """quantize_dequantize_groups reconstructs from the codes before packing: bit for bit
    dequantize_groups of the pack it returns (what the layer states store and read)."""
    x = (torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    x[0, 0, :32, 0] = 1.25  # a constant group (scale at the fp16 floor)
    gp, hat = quantize_dequantize_groups(x, bits, 16, axis=axis)
    assert hat.dtype == dtype and hat.shape == x.shape
    assert torch.equal(hat, dequantize_groups(gp))
    assert torch.equal(gp.codes, quantize_groups(x, bits, 16, axis=axis).codes)
