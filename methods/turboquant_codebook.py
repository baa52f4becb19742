"""TurboQuant's codebooks (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874, Alg. 1):
the density f_d(y) ∝ (1 - y^2)^{(d-3)/2} on [-1, 1] of one coordinate of a uniform unit vector in
R^d and its Lloyd-Max quantizers, solved in float64 (docs/methods.md §16.1; the solver: §16.10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

MAX_BITS = 8  # widest code of the mse stage (256 centroids)
GL_NODES = 96  # Gauss-Legendre nodes per codebook cell
NEWTON_TOL = 1e-13  # centroid convergence, in units of 1/sqrt(d)


def _log_mass(d: int) -> float:
    """log of int_{-1}^{1} (1 - y^2)^{(d-3)/2} dy = sqrt(pi) Gamma((d-1)/2) / Gamma(d/2)."""
    return 0.5 * math.log(math.pi) + math.lgamma((d - 1) / 2) - math.lgamma(d / 2)


def coordinate_density(y: np.ndarray, d: int) -> np.ndarray:
    """f_d(y): the density of one coordinate of a uniform unit vector in R^d (d >= 2)."""
    y = np.asarray(y, dtype=np.float64)
    return np.power(np.clip(1.0 - y * y, 0.0, None), (d - 3) / 2) * math.exp(-_log_mass(d))


@lru_cache(maxsize=None)
def _gauss_legendre() -> tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(GL_NODES)


def cell_moments(lo: np.ndarray, hi: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int y^k f_d(y) dy over each cell [lo, hi] for k = 0, 1, 2 (float64). With y = sin(theta),
    f_d(y) dy ∝ cos^{d-2}(theta) d theta: a smooth integrand, integrated per cell by Gauss-Legendre,
    so the tail cells keep their relative precision."""
    nodes, weights = _gauss_legendre()
    a, b = np.arcsin(np.asarray(lo, np.float64)), np.arcsin(np.asarray(hi, np.float64))
    half = (b - a)[:, None] / 2
    theta = (b + a)[:, None] / 2 + half * nodes[None, :]
    w = np.cos(theta) ** (d - 2) * (half * weights[None, :]) * math.exp(-_log_mass(d))
    s = np.sin(theta)
    return w.sum(1), (w * s).sum(1), (w * s * s).sum(1)


def _cells(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boundaries, cell lows, cell highs) of the nearest-centroid quantizer on [-1, 1]."""
    t = (c[1:] + c[:-1]) / 2
    return t, np.concatenate([[-1.0], t]), np.concatenate([t, [1.0]])


def _lloyd_map(c: np.ndarray, d: int):
    """One Lloyd step: (centroids of the cells of c, boundaries, cell masses)."""
    t, lo, hi = _cells(c)
    m0, m1, _ = cell_moments(lo, hi, d)
    return m1 / m0, t, m0


def _newton_step(c: np.ndarray, d: int) -> tuple[np.ndarray, float]:
    """Newton on c = T(c) (T the Lloyd map): (new centroids, |T(c) - c|_inf at c). dT_i/dt_i =
    f(t_i)(t_i - T_i)/m_i (upper boundary), dT_i/dt_{i-1} = f(t_{i-1})(T_i - t_{i-1})/m_i, and
    t_i = (c_i + c_{i+1})/2: a tridiagonal Jacobian."""
    tc, t, m0 = _lloyd_map(c, d)
    n = c.size
    f = coordinate_density(t, d)
    up = f * (t - tc[:-1]) / m0[:-1]
    down = f * (tc[1:] - t) / m0[1:]
    jac = np.zeros((n, n))
    i = np.arange(n - 1)
    jac[i, i] += up / 2
    jac[i, i + 1] += up / 2
    jac[i + 1, i] += down / 2
    jac[i + 1, i + 1] += down / 2
    step = np.linalg.solve(np.eye(n) - jac, tc - c)
    return c + step, float(np.abs(tc - c).max())


def _residual(c: np.ndarray, d: int) -> float:
    return float(np.abs(_lloyd_map(c, d)[0] - c).max())


@dataclass(frozen=True)
class Codebook:
    """Lloyd-Max quantizer of f_d at b bits: centroids (ascending, symmetric), the 2^b - 1
    boundaries (midpoints) and the per-coordinate MSE E[(y - c(y))^2] (d MSE = D_mse of §16.1)."""

    bits: int
    dim: int
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse: float


@lru_cache(maxsize=None)
def lloyd_max(bits: int, d: int) -> Codebook:
    """The Lloyd-Max codebook of f_d with 2^bits levels (0 bits: the single centroid 0, MSE 1/d)."""
    if not (isinstance(bits, int) and 0 <= bits <= MAX_BITS):
        raise ValueError(f"bits must be an integer in 0..{MAX_BITS}, got {bits!r}")
    if not (isinstance(d, int) and d >= 2):
        raise ValueError(f"the coordinate density needs an integer dimension d >= 2, got {d!r}")
    if bits == 0:
        return Codebook(0, d, (0.0,), (), 1.0 / d)
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(d)
    p = torch.tensor((np.arange(levels) + 0.5) / levels, dtype=torch.float64)
    g = math.sqrt(3.0) * sigma * torch.special.ndtri(p).numpy()  # the f^(1/3) law of the Gaussian limit,
    c = g / np.sqrt(1.0 + g * g)  # mapped strictly into (-1, 1)
    for _ in range(200):
        new, res = _newton_step(c, d)
        if res < NEWTON_TOL * sigma:
            break
        ok = np.all(np.diff(new) > 0) and new[0] > -1 and new[-1] < 1 and _residual(new, d) < res
        c = new if ok else _lloyd_map(c, d)[0]
        c = (c - c[::-1]) / 2  # f_d is even
    else:
        raise RuntimeError(f"Lloyd-Max did not converge for b={bits}, d={d}")
    t, lo, hi = _cells(c)
    m0, m1, m2 = cell_moments(lo, hi, d)
    mse = float((m2 - 2 * c * m1 + c * c * m0).sum())
    return Codebook(bits, d, tuple(c.tolist()), tuple(t.tolist()), mse)


def unit_distortion(widths: tuple[int, ...], d: int) -> float:
    """D = E||u - u_hat||^2 of a unit vector in R^d with coordinate widths b_j (§16.7:
    (m D_hi + (d - m) D_lo)/d in per-coordinate form)."""
    return float(sum(lloyd_max(b, d).mse for b in widths))
