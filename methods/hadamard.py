"""Hadamard matrices and the variance-equalizing rotation of KV-COBRA (docs/methods.md §5.7).

Orders built here, each checked ``H H^T = n I`` on construction:

* Sylvester ``H_{2^a}`` (a >= 0);
* tabulated ``H_K`` for K a multiple of 4 that is not a power of two, from Paley's constructions
  computed in code over GF(q) (q a prime power): Paley I (q = 3 mod 4, K = q + 1) and Paley II
  (q = 1 mod 4, K = 2(q + 1)); no pasted tables;
* ``H_K (x) H_{2^a}`` for the remaining multiples.

``equalizing_rotation(eigvals, seed)`` returns an orthogonal R with diag(R diag(eigvals) R^T) equal
to the mean eigenvalue: a normalized Hadamard times seeded random signs when the order exists, else
a seeded Haar-orthogonal matrix followed by at most r - 1 Givens rotations (Bendel & Mickey 1978;
Davies & Higham 2000) that set each diagonal entry to the mean exactly.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import product

import numpy as np
import torch

MAX_TABULATED = 256


# ---- finite fields GF(p^n), just enough for the quadratic character -----------------------------


def prime_power(q: int) -> tuple[int, int] | None:
    """(p, n) with q = p^n, p prime, or None."""
    if q < 2:
        return None
    p = next(k for k in range(2, q + 1) if q % k == 0)
    n = 0
    while q % p == 0:
        q //= p
        n += 1
    return (p, n) if q == 1 else None


def _polymulmod(a: list[int], b: list[int], f: list[int], p: int) -> list[int]:
    """a * b mod (f, p); polynomials as coefficient lists, lowest degree first; f monic."""
    n = len(f) - 1
    prod = [0] * (2 * n - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            prod[i + j] = (prod[i + j] + x * y) % p
    for k in range(len(prod) - 1, n - 1, -1):
        c = prod[k]
        if c:
            for j in range(n + 1):
                prod[k - n + j] = (prod[k - n + j] - c * f[j]) % p
    return prod[:n]


def _irreducible(p: int, n: int) -> list[int]:
    """A monic irreducible polynomial of degree n over GF(p) (no monic factor of degree <= n/2)."""
    if n == 1:
        return [0, 1]
    for low in product(range(p), repeat=n):
        f = list(low) + [1]
        if f[0] == 0:
            continue
        if not any(_divides(list(g) + [1], f, p) for k in range(1, n // 2 + 1) for g in product(range(p), repeat=k)):
            return f
    raise AssertionError("no irreducible polynomial found")


def _divides(g: list[int], f: list[int], p: int) -> bool:
    r = list(f)
    k = len(g) - 1
    for i in range(len(r) - 1, k - 1, -1):
        c = r[i]
        if c:
            for j in range(k + 1):
                r[i - k + j] = (r[i - k + j] - c * g[j]) % p
    return not any(r[:k])


def jacobsthal(q: int) -> np.ndarray:
    """Q[a, b] = chi(a - b) over GF(q), chi the quadratic character."""
    p, n = prime_power(q)
    digits = np.array(list(product(range(p), repeat=n)))[:, ::-1]  # element e -> base-p digits, low first
    f = _irreducible(p, n)
    weights = p ** np.arange(n)
    squares = {int(np.dot(_polymulmod(list(x), list(x), f, p), weights)) for x in digits[1:]}
    chi = np.array([0] + [1 if e in squares else -1 for e in range(1, q)])
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    return chi[diff @ weights]


def _paley(k: int) -> np.ndarray | None:
    """A Hadamard matrix of order k from Paley I or II, or None if neither applies."""
    q = k - 1
    pp = prime_power(q)
    if pp and pp[0] > 2 and q % 4 == 3:  # Paley I: H = I + S, S skew conference matrix
        s = np.zeros((k, k), dtype=np.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jacobsthal(q)
        return np.eye(k, dtype=np.int64) + s
    q = k // 2 - 1
    pp = prime_power(q) if k % 2 == 0 else None
    if pp and pp[0] > 2 and q % 4 == 1:  # Paley II from the symmetric conference matrix C
        c = np.zeros((q + 1, q + 1), dtype=np.int64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, jacobsthal(q)
        return np.kron(c, np.array([[1, 1], [1, -1]])) + np.kron(np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]]))
    return None


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tabulated_orders(max_order: int = MAX_TABULATED) -> list[int]:
    """Orders K <= max_order (multiples of 4, not powers of 2) with a Paley construction."""
    out = []
    for k in range(12, max_order + 1, 4):
        if _is_pow2(k):
            continue
        q1, q2 = k - 1, k // 2 - 1
        p1, p2 = prime_power(q1), prime_power(q2)
        if (p1 and p1[0] > 2 and q1 % 4 == 3) or (p2 and p2[0] > 2 and q2 % 4 == 1):
            out.append(k)
    return out


TABULATED_K: tuple[int, ...] = tuple(tabulated_orders())


def sylvester(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n = 2^a (entries +-1, float64)."""
    if not _is_pow2(n):
        raise ValueError(f"Sylvester order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_factor(n: int) -> tuple[int, int] | None:
    """(K, 2^a) with n = K 2^a and H_K available (K = 1 for Sylvester), or None."""
    if _is_pow2(n):
        return 1, n
    a = 1
    while n % a == 0:
        k = n // a
        if k in TABULATED_K:
            return k, a
        a *= 2
    return None


@lru_cache(maxsize=None)
def _hadamard_np(n: int) -> np.ndarray | None:
    fac = hadamard_factor(n)
    if fac is None:
        return None
    k, a = fac
    base = np.ones((1, 1), dtype=np.int64) if k == 1 else _paley(k)
    h = np.kron(base, sylvester(a).numpy().astype(np.int64))
    if not np.array_equal(h @ h.T, n * np.eye(n, dtype=np.int64)):
        raise AssertionError(f"constructed H_{n} is not Hadamard")
    return h


def hadamard(n: int) -> torch.Tensor | None:
    """An (unnormalized, +-1) Hadamard matrix of order n, float64, or None if none is built here."""
    h = _hadamard_np(n)
    return None if h is None else torch.from_numpy(h.astype(np.float64))


# ---- equalizing rotation (§5.7) ------------------------------------------------------------------


def _generator(seed: int | torch.Generator) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))


def random_signs(n: int, seed: int | torch.Generator) -> torch.Tensor:
    gen = _generator(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2.0 - 1.0


def haar_orthogonal(n: int, seed: int | torch.Generator) -> torch.Tensor:
    """Haar-distributed orthogonal n x n (QR of a Gaussian matrix with the sign fix), float64."""
    z = torch.randn(n, n, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(z)
    return q * torch.sign(torch.diagonal(r))[None, :]


def _givens_equalize(o: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, int]:
    """Rotate R = o so that diag(R diag(lam) R^T) = mean(lam); returns (R, rotations used)."""
    r = lam.size
    target = lam.mean()
    rot = o.copy()
    a = (o * lam[None, :]) @ o.T
    tol = 1e-15 * r * max(abs(target), np.finfo(float).tiny)
    used = 0
    for _ in range(2 * r):
        dev = np.diag(a) - target
        i, j = int(np.argmin(dev)), int(np.argmax(dev))
        if dev[j] - dev[i] <= tol:
            break
        aii, ajj, aij = a[i, i] - target, a[j, j] - target, a[i, j]
        disc = aij * aij - aii * ajj  # >= aij^2 since aii < 0 < ajj
        t = (aij + math.copysign(math.sqrt(disc), aij)) / ajj
        c = 1.0 / math.sqrt(1.0 + t * t)
        s = c * t
        g = np.array([[c, -s], [s, c]])
        idx = [i, j]
        a[idx, :] = g @ a[idx, :]
        a[:, idx] = a[:, idx] @ g.T
        rot[idx, :] = g @ rot[idx, :]
        used += 1
    return rot, used


def equalizing_rotation(eigvals: torch.Tensor, seed: int | torch.Generator) -> tuple[torch.Tensor, str]:
    """Orthogonal R [r, r] (float64) with diag(R diag(eigvals) R^T) = mean(eigvals), and its branch.

    Branch ``"hadamard"``: R = H_r D_s / sqrt(r) (Sylvester or tabulated order, D_s random signs);
    ``"givens"``: R = G O, O seeded Haar, G <= r - 1 Givens rotations (Bendel-Mickey);
    ``"empty"`` for r = 0."""
    lam = eigvals.detach().to(torch.float64).cpu().reshape(-1)
    r = lam.numel()
    if r == 0:
        return torch.zeros(0, 0, dtype=torch.float64), "empty"
    gen = _generator(seed)
    h = hadamard(r)
    if h is not None:
        return h / math.sqrt(r) * random_signs(r, gen)[None, :], "hadamard"
    rot, used = _givens_equalize(haar_orthogonal(r, gen).numpy(), lam.numpy())
    if used > r - 1:
        raise AssertionError(f"Bendel-Mickey used {used} > r - 1 = {r - 1} rotations")
    return torch.from_numpy(rot), "givens"
