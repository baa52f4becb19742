"""Fixed-step Gaussian quantizer (docs/methods.md §1.1) against its table and naive references."""

import math

import pytest
import torch

from methods.gaussquant import (
    dequantize,
    gaussian_mse,
    optimal_step,
    pack_codes,
    quantize,
    unpack_codes,
)

pytestmark = pytest.mark.numerics

# docs/methods.md §1.1 (b <= 5 reproduces Max 1960)
TABLE_STEP = {1: 1.596, 2: 0.996, 3: 0.586, 4: 0.335, 5: 0.188, 6: 0.104, 7: 0.0569, 8: 0.0308}
TABLE_MSE = {1: 0.363, 2: 0.119, 3: 0.0374, 4: 0.0115, 5: 0.00350, 6: 0.00104, 7: 3.04e-4, 8: 8.77e-5}


def sig3(x: float) -> float:
    return float(f"{x:.3g}")


@pytest.mark.parametrize("bits", range(1, 9))
def test_table(bits):
    assert sig3(optimal_step(bits)) == sig3(TABLE_STEP[bits])
    assert sig3(gaussian_mse(bits)) == sig3(TABLE_MSE[bits])


def naive_quant(x: float, step: float, bits: int) -> float:
    half = 2 ** (bits - 1)
    code = min(max(math.floor(x / step) + half, 0), 2**bits - 1)
    return (code - half + 0.5) * step


def naive_mse(step: float, bits: int, n: int = 40000, lim: float = 10.0) -> float:
    """Midpoint-rule integral of (x - Q(x))^2 phi(x) over [-lim, lim] with a Python loop."""
    h = 2 * lim / n
    total = 0.0
    for i in range(n):
        x = -lim + (i + 0.5) * h
        e = x - naive_quant(x, step, bits)
        total += e * e * math.exp(-0.5 * x * x)
    return total * h / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_mse_and_optimality_vs_naive_integral(bits):
    s = optimal_step(bits)
    assert naive_mse(s, bits) == pytest.approx(gaussian_mse(bits), rel=2e-3)
    # a minimum: nudging the step either way does not lower the (naive) MSE
    for f in (0.97, 1.03):
        assert naive_mse(s * f, bits) > naive_mse(s, bits)


def test_monte_carlo_mse():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, dtype=torch.float64, generator=g)
    for bits in (2, 3):
        step = torch.tensor(optimal_step(bits), dtype=torch.float64)
        err = ((dequantize(quantize(x, step, bits), step, bits) - x) ** 2).mean()
        assert float(err) == pytest.approx(gaussian_mse(bits), rel=0.02)


def test_quantize_per_coordinate_vs_naive():
    g = torch.Generator().manual_seed(1)
    bits = torch.tensor([0, 1, 2, 3, 5, 8, 4, 2])
    step = torch.rand(8, dtype=torch.float64, generator=g) + 0.1
    x = torch.randn(50, 8, dtype=torch.float64, generator=g) * 3
    codes = quantize(x, step, bits)
    rec = dequantize(codes, step, bits)
    for i in range(x.shape[0]):
        for j in range(8):
            b = int(bits[j])
            if b == 0:
                assert float(rec[i, j]) == 0.0
                continue
            assert 0 <= int(codes[i, j]) < 2**b
            assert float(rec[i, j]) == pytest.approx(naive_quant(float(x[i, j]), float(step[j]), b), abs=1e-12)


def test_pack_mixed_widths_vs_naive_bitstring():
    g = torch.Generator().manual_seed(2)
    widths = torch.tensor([3, 3, 2, 2, 2, 7, 1, 8, 5])
    m = 13
    codes = torch.stack([torch.randint(0, 2 ** int(b), (m,), generator=g) for b in widths], 1)
    packed = pack_codes(codes, widths)
    nbits = m * int(widths.sum())
    assert packed.dtype == torch.uint8 and packed.numel() == (nbits + 7) // 8
    stream = []  # naive: row-major, each code LSB first
    for i in range(m):
        for j, b in enumerate(widths.tolist()):
            stream += [(int(codes[i, j]) >> k) & 1 for k in range(b)]
    stream += [0] * (-len(stream) % 8)
    expect = [sum(stream[8 * i + k] << k for k in range(8)) for i in range(len(stream) // 8)]
    assert packed.tolist() == expect
    assert torch.equal(unpack_codes(packed, widths, m), codes)


def test_pack_blocks_roundtrip(monkeypatch):
    import methods.gaussquant as gq

    monkeypatch.setattr(gq, "_BLOCK_BITS", 64)  # force many byte-aligned blocks
    g = torch.Generator().manual_seed(3)
    widths = torch.tensor([3, 5, 1])
    codes = torch.stack([torch.randint(0, 2 ** int(b), (101,), generator=g) for b in widths], 1)
    packed = gq.pack_codes(codes, widths)
    assert packed.numel() == (101 * 9 + 7) // 8
    assert torch.equal(gq.unpack_codes(packed, widths, 101), codes)
