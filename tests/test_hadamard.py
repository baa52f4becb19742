"""Hadamard constructions and the equalizing rotation (docs/methods.md §5.7)."""

import pytest
import torch

from methods.hadamard import (
    TABULATED_K,
    jacobsthal,
    equalizing_rotation,
    hadamard,
    hadamard_factor,
    sylvester,
)

pytestmark = pytest.mark.numerics

SUPPORTED = [n for n in range(1, 257) if hadamard_factor(n) is not None]


def test_every_supported_order_is_hadamard():
    assert {12, 20, 28, 36, 40, 52, 60, 108} <= set(SUPPORTED)
    assert {1, 2, 4, 8, 16, 32, 64, 128, 256} <= set(SUPPORTED)
    for n in SUPPORTED:
        h = hadamard(n)
        assert h.shape == (n, n)
        assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n


def test_orders_and_tabulated_set():
    # orders must be 1, 2 or multiples of 4; every multiple of 4 up to 128 is covered but 92 and 116
    assert all(n in (1, 2) or n % 4 == 0 for n in SUPPORTED)
    assert [n for n in range(4, 129, 4) if n not in SUPPORTED] == [92, 116]
    assert all(k % 4 == 0 and k & (k - 1) for k in TABULATED_K)
    assert hadamard(6) is None and hadamard(92) is None


def legendre(a: int, p: int) -> int:
    a %= p
    if a == 0:
        return 0
    return 1 if pow(a, (p - 1) // 2, p) == 1 else -1


@pytest.mark.parametrize("q", [11, 13, 19])
def testjacobsthal_vs_legendre(q):
    jac = jacobsthal(q)
    for a in range(q):
        for b in range(q):
            assert jac[a, b] == legendre(a - b, q)


def test_prime_power_fields():
    # GF(9), GF(25), GF(27): every row of Q has (q-1)/2 ones and (q-1)/2 minus ones, Q J = 0,
    # Q Q^T = q I - J (the conference-matrix property the Paley constructions rely on)
    for q in (9, 25, 27):
        jac = torch.tensor(jacobsthal(q), dtype=torch.float64)
        ones = torch.ones(q, q, dtype=torch.float64)
        assert torch.equal(jac @ jac.T, q * torch.eye(q, dtype=torch.float64) - ones)
        assert torch.equal(jac.sum(1), torch.zeros(q, dtype=torch.float64))


def test_sylvester_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        sylvester(12)


@pytest.mark.parametrize("r", list(range(1, 33)) + [40, 52, 92, 100, 116, 126, 128])
def test_equalizing_rotation(r):
    g = torch.Generator().manual_seed(r)
    lam = torch.sort(torch.exp(3 * torch.randn(r, dtype=torch.float64, generator=g)), descending=True).values
    rot, branch = equalizing_rotation(lam, seed=7)
    assert branch == ("hadamard" if hadamard(r) is not None else "givens")
    eye = torch.eye(r, dtype=torch.float64)
    assert torch.allclose(rot @ rot.T, eye, atol=1e-12)
    diag = torch.diagonal(rot @ torch.diag(lam) @ rot.T)
    assert torch.allclose(diag, lam.mean().expand(r), rtol=1e-11, atol=0)


def test_equalizing_rotation_seeded():
    lam = torch.linspace(5, 0.1, 10, dtype=torch.float64)
    a, _ = equalizing_rotation(lam, seed=1)
    b, _ = equalizing_rotation(lam, seed=1)
    c, _ = equalizing_rotation(lam, seed=2)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    h1, branch = equalizing_rotation(torch.linspace(5, 0.1, 16, dtype=torch.float64), seed=3)
    # Hadamard branch: H_16 D_s / 4, i.e. |entries| = 1/4 and columns are +-(Sylvester columns)
    assert branch == "hadamard"
    assert torch.allclose(h1.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    signs = torch.sign(h1[0]) * torch.sign(sylvester(16)[0])
    assert torch.allclose(h1 * 4 * signs[None, :], sylvester(16))
    assert equalizing_rotation(torch.zeros(0), seed=0)[1] == "empty"
