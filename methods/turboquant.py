"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874, ICLR 2026) with QJL's 1-bit
inner-product stage (Zandieh, Daliri, Han, arXiv 2406.03482; amirzandieh/QJL). docs/methods.md §16.

Per vector x in R^d (one token of one KV head, one side), an *instance* stores

* **TurboQuant_mse** (§16.1, Alg. 1): nu = ||x|| (fp16), u = x / nu, y = Pi u with Pi Haar
  orthogonal; coordinate j is coded as the nearest of the 2^{b_j} Lloyd-Max centroids of the exact
  coordinate density f_d(y) ∝ (1 - y^2)^{(d-3)/2} on [-1, 1]; x_hat = nu Pi^T c[code].
* **TurboQuant_prod** (§16.2, Alg. 2): the mse stage on u, residual rho = u - u_hat,
  gamma = ||rho|| (fp16), z = sign(S rho) (bit [S rho > 0], QJL's convention, so 0 -> -1) with
  S in R^{d x d}; x_hat = nu (u_hat + gamma sqrt(pi/2) / d S^T z). With no mse bits, gamma = ||u|| = 1
  is not stored (§16.2: b = 1 prod is QJL alone plus nu).

Without the split one instance covers the d channels; with ``split=True`` (§16.4) two independent
instances (own Pi, S, codebooks and norm) cover an outlier set and the rest.

Budget (§16.7, docs/methods.md §0): a vector costs sum_j b_j + 16 #norms (+ d_i sign bits per prod
instance); codes are packed (:func:`methods.gaussquant.pack_codes`, one stream per instance and
encode call), sign bits with :func:`methods.packing.pack_bits` (QJL's byte layout), norms fp16.
Every token costs the same, so the measured headline is the per-vector cost / d in any regime, up
to the last partial byte of each call's code stream (:func:`headline_bpd`, counted exactly).
The equal-budget mapping takes round(bpd d) bits per vector and spreads the code bits over the
exchangeable rotated coordinates: ceil(b_bar) bits on m of them, floor(b_bar) on the rest (hi first).
Reached (``k_variant="mse"``; 0 bits = coordinate dropped):

============  =====================================  =====================================
bpd_K         d = 64 (SmolLM2)                       d = 128 (Llama, Mistral, Qwen)
============  =====================================  =====================================
0.5           16 @1 + 48 @0 + nu                     48 @1 + 80 @0 + nu
1             48 @1 + 16 @0 + nu                     112 @1 + 16 @0 + nu
2             48 @2 + 16 @1 + nu                     112 @2 + 16 @1 + nu
3             48 @3 + 16 @2 + nu                     112 @3 + 16 @2 + nu
4             48 @4 + 16 @3 + nu                     112 @4 + 16 @3 + nu
============  =====================================  =====================================

mse reaches (16 + 1)/d .. 8 + 16/d (0.27..8.25 at d = 64) on the 1/d grid. ``k_variant="prod"``
adds d sign bits and gamma: QJL alone (1 + 16/d) .. 8 + 32/d; bpd_K 0.5 and 1 unsupported on
d = 64 (min 1.25) and d = 128 (min 1.125); 2 = 32 @1 + 32 @0 + QJL (d = 64), 96 @1 + 32 @0 + QJL
(d = 128); 3 and 4 likewise. The plain-paper rows (§16.7 "unsplit integer b") run as set with
``bits=b``: b bits on every coordinate and one norm (b + 16/d), prod b - 1 bits + QJL + 2 norms.

Decisions where docs/methods.md is silent:

* Codebooks (§16.1 [decision]: from f_d itself): Lloyd-Max conditions solved by Newton's method on
  the Lloyd map (its Jacobian is tridiagonal: dc_i/dt = f(t)(t - c_i)/mass_i), started from the
  companding (f^{1/3}) quantizer, with a plain Lloyd step whenever Newton does not reduce the
  residual, to |dc| < 1e-13 / sqrt(d); the cell integrals of f_d, y f_d, y^2 f_d are Gauss-Legendre
  quadratures in theta = asin(y) (no cancellation in the tails). float64, cached per (b, d).
* Seed: Pi (and S) are drawn per (layer, KV head, side, instance) from the harness seed
  (:func:`methods.latent_codec.sub_seed`); the harness passes its seed only through ``calibrate``,
  so the method is calibrated (``needs_calibration``). The quantizer reads nothing from the
  statistics; the split reads the pair energies E[x_i^2 + x_{i+d/2}^2] (§16.4, uncentered, from
  mu and the covariance's diagonal). Static bytes: the fp32 centroids of every (b, d_i) codebook in
  use, the seed (8 bytes; Pi and S are regenerated from it, ``rotation_bytes_if_stored`` in the
  knobs says what storing them in fp32 would cost) and, with the split, one bit per RoPE pair per
  (layer, KV head, side) for the outlier set.
* Split (§16.4): d/8 RoPE pairs (d/4 channels: 32 of 128, the paper's set, 16 of 64) with the
  largest calibration energy per (layer, KV head, side) — for values too, by the same rule. Code
  bits C are shared as in the paper's split (outliers one bit more per coordinate): the outlier
  instance gets round(d_o (C + d_r) / d), the rest the remainder, each spread as above; at d = 128
  and 2.5 bpd that is 32 @3 + 96 @2 + 2 norms (§16.4, 16.7).
* Sketch (§16.2): ``sketch="gaussian"`` S i.i.d. N(0, 1) (the paper); ``"orthogonal"`` QJL's
  ``rot=True`` (``QJLSketch.init_rot_dir``: S^T = sqrt(d) Q, Q from the QR of a Gaussian d x d, no
  sign correction).
* ``debias`` (§16.3 ablation): mse keys x_hat / (1 - D) with D = sum_j MSE_j of the instance's
  widths (the unit-vector distortion at mixed widths); keys only, ignored for prod.
* Nearest plan: the reachable bits per vector closest to bpd d (ties: fewer bits), then the
  headline in the job's regime (padding included) must be within 2 % of the target, else
  :class:`~methods.base.Unsupported` with the reachable range.
* Arithmetic in float64 for float64 inputs, else float32; norms stored fp16 (a norm above 65504
  would overflow; key and value norms of the supported models are far below it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch

from .base import KVMethod, ModelShape, Regime, Unsupported
from .budget import in_band
from .codec_state import Codec, CodecLayerState, ExactCodec, head_matmul, join_calls
from .gaussquant import pack_codes, prepare_layout, rows_per_byte_boundary, unpack_calls, unpack_codes
from .hadamard import haar_orthogonal
from .latent_codec import sub_seed
from .packing import pack_bits, unpack_bits

MAX_BITS = 8  # widest code of the mse stage (256 centroids)
NORM_BITS = 16  # nu and gamma are fp16
GL_NODES = 96  # Gauss-Legendre nodes per codebook cell
NEWTON_TOL = 1e-13  # centroid convergence, in units of 1/sqrt(d)
VARIANTS = ("mse", "prod")
SKETCHES = ("gaussian", "orthogonal")
SIDES = ("k", "v")
QJL_SCALE = math.sqrt(math.pi / 2.0)  # x_hat = gamma sqrt(pi/2)/m S^T z (QJL's scl)


# ---- the coordinate density f_d and its Lloyd-Max codebooks (§16.1) ------------------------------


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


# ---- plans: how many bits each rotated coordinate gets (§16.4, §16.7) ---------------------------


def spread(total: int, n: int) -> tuple[int, ...]:
    """§16.7: ``total`` code bits over n exchangeable coordinates, ceil(b_bar) on the first
    m = total mod n, floor(b_bar) on the rest."""
    lo, m = divmod(int(total), n)
    return (lo + 1,) * m + (lo,) * (n - m)


@dataclass(frozen=True)
class InstancePlan:
    """One TurboQuant instance: ``part`` "all" | "outlier" | "rest" channels, their number, the
    widths of its rotated coordinates (descending) and whether a QJL stage follows."""

    part: str
    dim: int
    widths: tuple[int, ...]
    qjl: bool

    @property
    def code_bits(self) -> int:
        return sum(self.widths)

    @property
    def norms(self) -> int:
        """nu, plus gamma for prod with an mse stage (gamma = 1 when the stage is empty)."""
        return 1 + int(self.qjl and self.code_bits > 0)

    @property
    def bits(self) -> int:
        """Bits per vector: codes + sign bits + fp16 norms."""
        return self.code_bits + (self.dim if self.qjl else 0) + NORM_BITS * self.norms

    def label(self) -> str:
        counts: dict[int, int] = {}
        for b in self.widths:
            counts[b] = counts.get(b, 0) + 1
        codes = " + ".join(f"{n} @{b}" for b, n in counts.items())
        return codes + (f" + QJL({self.dim})" if self.qjl else "")


@dataclass(frozen=True)
class SidePlan:
    """The instances of one side (K or V) and their cost."""

    instances: tuple[InstancePlan, ...]

    @property
    def bits(self) -> int:
        return sum(i.bits for i in self.instances)

    @property
    def norms(self) -> int:
        return sum(i.norms for i in self.instances)

    def label(self) -> str:
        parts = [f"{i.part}: {i.label()}" if len(self.instances) > 1 else i.label() for i in self.instances]
        return "; ".join(parts) + f" + {self.norms} fp16 norm{'s' if self.norms > 1 else ''}"


def split_dims(d: int) -> tuple[int, int]:
    """(outlier channels, the rest): d/8 RoPE pairs (§16.4's 32 of 128)."""
    if d % 8:
        raise Unsupported(f"turboquant split: head_dim {d} has no d/8 RoPE pairs (needs d % 8 == 0)")
    return d // 4, d - d // 4


def _share(c: int, d_out: int, d_rest: int) -> tuple[int, int]:
    """Code bits (outlier, rest) of a split: the outliers one bit more per coordinate (§16.4)."""
    d = d_out + d_rest
    c_out = round(d_out * (c + d_rest) / d)
    c_out = min(max(c_out, c - MAX_BITS * d_rest, 0), c, MAX_BITS * d_out)
    return c_out, c - c_out


def plan_for_code_bits(code_bits: int, d: int, variant: str, split: bool) -> SidePlan:
    """The plan that spends ``code_bits`` on the mse stage(s)."""
    qjl = variant == "prod"
    if not split:
        return SidePlan((InstancePlan("all", d, spread(code_bits, d), qjl),))
    d_out, d_rest = split_dims(d)
    c_out, c_rest = _share(code_bits, d_out, d_rest)
    return SidePlan((InstancePlan("outlier", d_out, spread(c_out, d_out), qjl),
                     InstancePlan("rest", d_rest, spread(c_rest, d_rest), qjl)))


def reachable_plans(d: int, variant: str, split: bool) -> list[SidePlan]:
    """Every plan the equal-budget mapping may choose, by ascending bits per vector: at least one
    code bit for mse (nothing coded otherwise), from QJL alone for prod."""
    first = 1 if variant == "mse" else 0
    return [plan_for_code_bits(c, d, variant, split) for c in range(first, MAX_BITS * d + 1)]


def plain_plan(bits: int, d: int, variant: str, split: bool) -> SidePlan:
    """§16.7's plain-paper rows: b bits per coordinate (prod: b - 1 + QJL), one norm per
    instance (prod: two); with the split, the outliers get b + 1 (§16.4's 32 @3 + 96 @2)."""
    top = MAX_BITS + (variant == "prod")  # prod: b - 1 <= MAX_BITS mse bits + QJL
    if not (isinstance(bits, int) and 1 <= bits <= top):
        raise ValueError(f"turboquant bits={bits!r}: an integer in 1..{top} for k_variant={variant!r}")
    b = bits - (variant == "prod")
    qjl = variant == "prod"
    if not split:
        return SidePlan((InstancePlan("all", d, (b,) * d, qjl),))
    d_out, d_rest = split_dims(d)
    if b + 1 > MAX_BITS:
        raise ValueError(f"turboquant split: outliers at b + 1 = {b + 1} > {MAX_BITS} bits")
    return SidePlan((InstancePlan("outlier", d_out, (b + 1,) * d_out, qjl),
                     InstancePlan("rest", d_rest, (b,) * d_rest, qjl)))


def _call_bits(plan: SidePlan, rows: int) -> int:
    """Bits one encode call of ``rows`` vectors stores: per instance one code stream padded to a
    whole byte, ceil(d_i / 8) sign bytes per vector, fp16 norms."""
    total = 0
    for inst in plan.instances:
        total += 8 * ((rows * inst.code_bits + 7) // 8)
        total += rows * (8 * ((inst.dim + 7) // 8) * inst.qjl + NORM_BITS * inst.norms)
    return total


def headline_bpd(plan: SidePlan, heads: int, d: int, regime: Regime) -> float:
    """docs/methods.md §0 headline of one side: the mean over the regime's scored positions of the
    bits held / (t H d) (every layer holds the same). Q-all: one call of T tokens; prefill: one
    call of P tokens read by the first scored position, then one call per decoded token."""
    if regime.kind == "qall":
        return _call_bits(plan, heads * regime.tokens) / (regime.tokens * heads * d)
    p, n = regime.tokens, regime.decode
    held = _call_bits(plan, heads * p) + _call_bits(plan, heads) * np.arange(n + 1, dtype=np.float64)
    return float((held / (p + np.arange(n + 1))).mean()) / (heads * d)


def budget_plan(target: float, shape: ModelShape, variant: str, split: bool, regime: Regime) -> SidePlan:
    """The equal-budget mapping: the reachable plan nearest to ``target`` d bits per vector, its
    headline in ``regime`` within 2 % of the target; else :class:`Unsupported` with the range."""
    d = shape.head_dim
    plans = reachable_plans(d, variant, split)
    plan = min(plans, key=lambda p: (abs(p.bits - target * d), p.bits))
    got = headline_bpd(plan, shape.n_kv_heads, d, regime)
    if not in_band(got, target, eps=0.0):
        lo, hi = plans[0].bits / d, plans[-1].bits / d
        raise Unsupported(
            f"turboquant ({variant}{', split' if split else ''}): bpd {target:g} unreachable on head_dim {d}; "
            f"reachable {lo:.4g}..{hi:.4g} in steps of 1/{d} (nearest: {got:.4g})"
        )
    return plan


# ---- rotations, sketches, channel sets ------------------------------------------------------------


def rotation(d: int, seed: int) -> torch.Tensor:
    """Pi: Haar orthogonal d x d (QR of a Gaussian, columns sign-corrected), float64 (§16.1)."""
    return haar_orthogonal(d, seed)


def sketch_matrix(d: int, seed: int, kind: str = "gaussian") -> torch.Tensor:
    """S [m = d, d] float64 (§16.2): i.i.d. N(0, 1), or QJL's ``rot=True`` orthogonalized sketch
    (``init_rot_dir``: S^T = sqrt(d) Q, Q the reduced QR factor of a Gaussian d x d)."""
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    if kind == "gaussian":
        return g
    if kind == "orthogonal":
        q, _ = torch.linalg.qr(g, mode="reduced")
        return (q * math.sqrt(d)).T.contiguous()
    raise ValueError(f"sketch={kind!r} not in {SKETCHES}")


def outlier_channels(energy: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outlier, rest) channel indices [H, n_out], [H, d - n_out] (ascending) from per-channel
    energies [H, d]: the n_out / 2 RoPE pairs (i, i + d/2) with the largest E[x_i^2 + x_{i+d/2}^2]."""
    h, d = energy.shape
    half = d // 2
    pair = energy[:, :half] + energy[:, half:]
    top = torch.topk(pair, n_out // 2, dim=-1).indices
    mask = torch.zeros(h, half, dtype=torch.bool)
    mask.scatter_(1, top, True)
    mask = torch.cat([mask, mask], 1)
    idx = torch.arange(d).expand(h, d)
    return idx[mask].reshape(h, n_out), idx[~mask].reshape(h, d - n_out)


# ---- the codec --------------------------------------------------------------------------------------


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("bhte,hed->bhtd")`` of x [B, H, T, e] or, for stored calls stacked [S, B, H, T, e],
    of each call (:func:`methods.codec_state.head_matmul`: the bits of each call alone)."""
    return torch.einsum("bhte,hed->bhtd", x, w) if x.dim() == 4 else head_matmul(x, w)


@dataclass
class InstancePacked:
    """What one instance stores for a block of vectors [B, H, T]: the code stream (uint8), QJL sign
    bytes [B, H, T, ceil(d_i/8)] or None, nu and gamma (fp16 [B, H, T]; gamma None unless stored)."""

    codes: torch.Tensor
    signs: torch.Tensor | None
    norm: torch.Tensor
    gamma: torch.Tensor | None

    def bits(self) -> int:
        """The bytes held, times 8 (codes and signs uint8, norms fp16)."""
        held = (self.codes, self.signs, self.norm, self.gamma)
        return sum(8 * x.numel() * x.element_size() for x in held if x is not None)


@dataclass
class TurboPacked:
    parts: list
    shape: tuple  # (B, H, T, d)
    dtype: torch.dtype  # arithmetic dtype


class TurboInstance:
    """One instance of one layer and side, all KV heads: plan, Pi [H, d_i, d_i], S [H, d_i, d_i] or
    None, channels [H, d_i] (None: all, in order), and the output scale (debias, else 1)."""

    def __init__(self, plan: InstancePlan, rot: torch.Tensor, sketch: torch.Tensor | None,
                 channels: torch.Tensor | None, scale: float = 1.0):
        self.plan = plan
        self.rot = rot.to(torch.float64)
        self.sketch = None if sketch is None else sketch.to(torch.float64)
        self.channels = channels
        self.scale = float(scale)
        self.blocks = []  # (start, stop, codebook) of runs of equal width
        start = 0
        for b in sorted(set(plan.widths), reverse=True):
            n = plan.widths.count(b)
            self.blocks.append((start, start + n, lloyd_max(b, plan.dim)))
            start += n
        self._cache: dict = {}

    def _params(self, device, dtype):
        """(Pi, S, channels, [(start, stop, boundaries, centroids)]) on ``device``, cached."""
        key = (str(device), dtype)
        if key not in self._cache:
            prepare_layout(self.plan.widths, device)
            blocks = [(s, e, torch.tensor(cb.boundaries, dtype=dtype, device=device),
                       torch.tensor(cb.centroids, dtype=dtype, device=device)) for s, e, cb in self.blocks]
            self._cache[key] = (
                self.rot.to(device, dtype), None if self.sketch is None else self.sketch.to(device, dtype),
                None if self.channels is None else self.channels.to(device), blocks,
            )
        return self._cache[key]

    def _take(self, x, ch):
        if ch is None:
            return x
        b, h, t, _ = x.shape
        return x.gather(-1, ch[None, :, None, :].expand(b, h, t, -1))

    def encode(self, x: torch.Tensor):
        """(packed, decoded subvector [B, H, T, d_i]) of x [B, H, T, d] in the arithmetic dtype."""
        rot, sketch, ch, blocks = self._params(x.device, x.dtype)
        xs = self._take(x, ch)
        nu = torch.linalg.vector_norm(xs, dim=-1)
        u = xs / torch.where(nu > 0, nu, 1.0)[..., None]
        y = torch.einsum("bhtd,hed->bhte", u, rot)
        codes = torch.cat([torch.bucketize(y[..., s:e].contiguous(), bnd) for s, e, bnd, _ in blocks], -1)
        u_hat = self._rotate_back(codes, rot, blocks)
        norm = nu.half()
        signs = gamma = None
        z = None
        if sketch is not None:
            rho = u - u_hat
            proj = torch.einsum("bhtd,hmd->bhtm", rho, sketch)
            z = proj > 0
            signs = pack_bits(z.to(torch.uint8), 1)
            if self.plan.code_bits:
                gamma = torch.linalg.vector_norm(rho, dim=-1).half()
        stream = self._pack(codes)
        packed = InstancePacked(stream, signs, norm, gamma)
        return packed, self._reconstruct(u_hat, z, norm, gamma, sketch)

    def _pack(self, codes):
        if not self.plan.code_bits:
            return torch.zeros(0, dtype=torch.uint8, device=codes.device)
        return pack_codes(codes.reshape(-1, self.plan.dim), self.plan.widths)

    def _rotate_back(self, codes, rot, blocks):
        """u_hat = Pi^T c[code] [B, H, T, d_i]: one gather from the blocks' centroids laid end to
        end, each coordinate's code offset to its block's table (the same values as a gather per
        block and a cat, one launch instead of one per block and the cat)."""
        table, offsets = self._table(rot.device, rot.dtype, blocks)
        c = table[codes if offsets is None else codes + offsets]
        return _per_head(c, rot)

    def _table(self, device, dtype, blocks):
        """(the blocks' centroids concatenated, per-coordinate offsets into it or None for one
        block), cached."""
        key = ("table", str(device), dtype)
        if key not in self._cache:
            table = torch.cat([cent for _, _, _, cent in blocks])
            offsets = None
            if len(blocks) > 1:
                firsts, at = [], 0
                for s, e, _, cent in blocks:
                    firsts.append(torch.full((e - s,), at, dtype=torch.long, device=device))
                    at += cent.numel()
                offsets = torch.cat(firsts)
            self._cache[key] = (table, offsets)
        return self._cache[key]

    def _reconstruct(self, u_hat, z, norm, gamma, sketch):
        """nu (u_hat + gamma sqrt(pi/2)/d_i S^T z) (prod) or scale nu u_hat (mse), from stored values."""
        nu = norm.to(u_hat.dtype)[..., None]
        if z is None:
            return u_hat * (nu * self.scale) if self.scale != 1.0 else u_hat * nu
        zpm = z.to(u_hat.dtype) * 2 - 1
        g = 1.0 if gamma is None else gamma.to(u_hat.dtype)[..., None]
        qjl = _per_head(zpm, sketch) * (QJL_SCALE / self.plan.dim)
        return nu * (u_hat + g * qjl)

    def decode(self, packed: InstancePacked, shape, dtype) -> torch.Tensor:
        """The decoded subvector [B, H, T, d_i] from the stored bytes alone (arithmetic ``dtype``)."""
        b, h, t, _ = shape
        device = packed.norm.device
        rot, sketch, _, blocks = self._params(device, dtype)
        if self.plan.code_bits:
            codes = unpack_codes(packed.codes, self.plan.widths, b * h * t).reshape(b, h, t, self.plan.dim)
        else:
            codes = torch.zeros(b, h, t, self.plan.dim, dtype=torch.long, device=device)
        u_hat = self._rotate_back(codes, rot, blocks)
        z = None if packed.signs is None else unpack_bits(packed.signs, 1, self.plan.dim).bool()
        return self._reconstruct(u_hat, z, packed.norm, packed.gamma, sketch)

    def decode_calls(self, calls: int, parts: dict, shape, dtype) -> torch.Tensor:
        """:meth:`decode` of ``calls`` stored calls at once ([calls, ...] parts -> [calls, B, H, T,
        d_i]), each with the bits decoding it alone gives (:func:`_per_head`)."""
        b, h, t, _ = shape
        norm = parts["norm"]
        rot, sketch, _, blocks = self._params(norm.device, dtype)
        if self.plan.code_bits:
            codes = unpack_calls(parts["codes"], self.plan.widths, b * h * t).reshape(calls, b, h, t, self.plan.dim)
        else:
            codes = torch.zeros(calls, b, h, t, self.plan.dim, dtype=torch.long, device=norm.device)
        u_hat = self._rotate_back(codes, rot, blocks)
        signs = parts.get("signs")
        z = None if signs is None else unpack_bits(signs, 1, self.plan.dim).bool()
        return self._reconstruct(u_hat, z, norm, parts.get("gamma"), sketch)

    def put(self, out: torch.Tensor, xs_hat: torch.Tensor) -> None:
        """Write the decoded subvector into its channels of ``out`` [..., B, H, T, d]."""
        _, _, ch, _ = self._params(out.device, out.dtype)
        if ch is None:
            out.copy_(xs_hat)
            return
        h, n = ch.shape
        index = ch.reshape(*[1] * (out.dim() - 3), h, 1, n).expand(*out.shape[:-1], n)
        out.scatter_(-1, index, xs_hat)


class TurboCodec(Codec):
    """One side of one layer: the instances over disjoint channel sets (:class:`TurboInstance`)."""

    def __init__(self, instances: list[TurboInstance], pre_rope: bool = False):
        self.instances = instances
        self.pre_rope = pre_rope

    def encode(self, x):
        return self.encode_decode(x)[0]

    def encode_decode(self, x):
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(dtype)
        encoded = [inst.encode(x) for inst in self.instances]
        packed = TurboPacked([p for p, _ in encoded], tuple(x.shape), dtype)
        if len(encoded) == 1:
            return packed, encoded[0][1]
        out = torch.empty_like(x)
        for inst, (_, xs_hat) in zip(self.instances, encoded):
            inst.put(out, xs_hat)
        return packed, out

    def decode(self, packed: TurboPacked) -> torch.Tensor:
        decoded = [inst.decode(part, packed.shape, packed.dtype) for inst, part in zip(self.instances, packed.parts)]
        if len(decoded) == 1:
            return decoded[0]
        out = torch.empty(packed.shape, dtype=packed.dtype, device=decoded[0].device)
        for inst, xs_hat in zip(self.instances, decoded):
            inst.put(out, xs_hat)
        return out

    def bits(self, packed: TurboPacked) -> int:
        return sum(p.bits() for p in packed.parts)

    def parts(self, packed: TurboPacked):
        parts = {}
        for i, p in enumerate(packed.parts):
            parts.update({f"{i}.codes": p.codes, f"{i}.signs": p.signs, f"{i}.norm": p.norm, f"{i}.gamma": p.gamma})
        return (packed.shape, packed.dtype), parts, {}

    def decode_stored(self, store):
        """One instance without QJL (the mse stage alone) and calls whose code streams end on
        whole row groups: every stored code looked up in one pass, one product per run and head
        (:func:`methods.codec_state.head_matmul`), the norms applied once; else run by run."""
        runs = store.runs()
        inst = self.instances[0]
        g = rows_per_byte_boundary(inst.plan.widths)
        if (len(self.instances) > 1 or inst.sketch is not None or not inst.plan.code_bits
                or any((s[0] * s[1] * s[2]) % g for (s, _), *_ in runs)):
            return super().decode_stored(store)
        dtype = runs[0][0][1]
        data = store.flat("0.codes")
        rot, _, _, blocks = inst._params(data.device, dtype)
        table, offsets = inst._table(rot.device, rot.dtype, blocks)
        whole = [calls * b * h * t for ((b, h, t, _), _), calls, _, _ in runs]
        codes = unpack_codes(data, inst.plan.widths, sum(whole))
        c = table[codes if offsets is None else codes + offsets]
        u_hat, at = [], 0
        for i, (((b, h, t, _), _), calls, _, _) in enumerate(runs):
            u_hat.append(head_matmul(c[at : at + whole[i]].view(calls, b, h, t, -1), rot))
            at += whole[i]
        norm = join_calls([parts["0.norm"][..., None] for _, _, parts, _ in runs])[..., 0]
        return inst._reconstruct(join_calls(u_hat), None, norm, None, None)

    def decode_calls(self, layout, calls, parts, ragged):
        shape, dtype = layout
        mine = [{k.split(".", 1)[1]: v for k, v in parts.items() if k.startswith(f"{i}.")}
                for i in range(len(self.instances))]
        if calls == 1:
            one = [InstancePacked(p["codes"][0], p["signs"][0] if "signs" in p else None, p["norm"][0],
                                  p["gamma"][0] if "gamma" in p else None) for p in mine]
            return self.decode(TurboPacked(one, shape, dtype))[None]
        decoded = [inst.decode_calls(calls, p, shape, dtype) for inst, p in zip(self.instances, mine)]
        if len(decoded) == 1:
            return decoded[0]
        out = torch.empty((calls, *shape), dtype=dtype, device=decoded[0].device)
        for inst, xs_hat in zip(self.instances, decoded):
            inst.put(out, xs_hat)
        return out


# ---- the method ---------------------------------------------------------------------------------------


def _salt(side: int, instance: int, kind: int) -> int:
    """Seed salt of (side, instance, Pi = 0 | S = 1): distinct from the other codecs' salts."""
    return 16 + 4 * side + 2 * instance + kind


@dataclass
class TurboQuant(KVMethod):
    """TurboQuant (docs/methods.md §16): data-oblivious rotation + Lloyd-Max codebooks of f_d, fp16
    norms, optionally QJL's 1-bit residual stage on keys. See the module docstring for the budget
    map and the decisions.

    Options: ``bits`` / ``v_bits`` (plain-paper rows b + 16/d, run as set; null = the equal-budget
    mapping from bpd / v_bpd), ``k_variant`` "mse" | "prod" (values are always mse, §16.3),
    ``split`` (§16.4), ``pre_rope`` (§16.5: keys coded before RoPE), ``sketch`` "gaussian" |
    "orthogonal", ``debias`` (§16.3 ablation, mse keys)."""

    name: ClassVar[str] = "turboquant"
    needs_calibration: ClassVar[bool] = True  # the harness's seed (and the split's energies)
    seeded: ClassVar[bool] = True

    bits: int | None = None
    v_bits: int | None = None
    k_variant: str = "mse"
    split: bool = False
    pre_rope: bool = False
    sketch: str = "gaussian"
    debias: bool = False

    def __post_init__(self):
        if self.k_variant not in VARIANTS:
            raise ValueError(f"turboquant: k_variant={self.k_variant!r} not in {VARIANTS}")
        if self.sketch not in SKETCHES:
            raise ValueError(f"turboquant: sketch={self.sketch!r} not in {SKETCHES}")
        self._shape: ModelShape | None = None
        self._plans: dict = {}
        self._codecs: dict | None = None
        self._knobs: dict = {}
        self._seed = 0

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        self._plans = {
            "k": self._side_plan(shape, self.bits, bpd_k, self.k_variant),
            "v": self._side_plan(shape, self.v_bits, bpd_v, "mse"),
        }
        self._knobs = {"target_bpd_k": bpd_k, "target_bpd_v": bpd_v, "k_variant": self.k_variant,
                       "split": self.split, "pre_rope": self.pre_rope, "sketch": self.sketch,
                       "debias": self.debias, "regime": asdict(self.regime)}
        d = shape.head_dim
        for side, plan in self._plans.items():
            if plan is None:
                self._knobs[f"{side}_plan"] = "exact16"
                continue
            self._knobs.update({
                f"{side}_plan": plan.label(),
                f"{side}_bits_per_vector": plan.bits,
                f"{side}_widths": [list(i.widths) for i in plan.instances],
                f"{side}_headline_bpd": headline_bpd(plan, shape.n_kv_heads, d, self.regime),
                f"{side}_unit_distortion": [unit_distortion(i.widths, i.dim) for i in plan.instances],
                f"{side}_mode": "plain" if (self.bits if side == "k" else self.v_bits) is not None else "budget",
            })

    def _side_plan(self, shape, bits, target, variant) -> SidePlan | None:
        d = shape.head_dim
        if bits is not None:
            return plain_plan(bits, d, variant, self.split)
        if target is None or float(target) == 16:
            return None
        return budget_plan(float(target), shape, variant, self.split, self.regime)

    def calibrate(self, stats, seed=0):
        """Draws Pi and S from ``seed``; reads the statistics only for the split's pair energies."""
        if self._shape is None:
            raise RuntimeError("turboquant: configure() before calibrate()")
        if stats is not None and len(stats) != self._shape.n_layers:
            raise ValueError(f"turboquant: {len(stats)} layer statistics for {self._shape.n_layers} layers")
        if self.split and stats is None:
            raise ValueError("turboquant split: the outlier channels need calibration statistics")
        self._seed = int(seed)
        self._codecs = {}
        for side_i, side in enumerate(SIDES):
            plan = self._plans.get(side)
            layers = []
            for layer in range(self._shape.n_layers):
                if plan is None:
                    layers.append(ExactCodec())
                    continue
                energy = None if not self.split else _energy(stats[layer], side)
                layers.append(self._codec(plan, layer, side_i, energy))
            self._codecs[side] = layers
        self._knobs.update(seed=self._seed, rotation_bytes_if_stored=self._rotation_bytes())

    def _codec(self, plan: SidePlan, layer: int, side_i: int, energy) -> TurboCodec:
        h = self._shape.n_kv_heads
        channels = [None]
        if self.split:
            channels = list(outlier_channels(energy, plan.instances[0].dim))
        instances = []
        for j, (inst, ch) in enumerate(zip(plan.instances, channels)):
            rot = torch.stack([rotation(inst.dim, sub_seed(self._seed, layer, hh, _salt(side_i, j, 0)))
                               for hh in range(h)])
            sketch = None
            if inst.qjl:
                sketch = torch.stack([sketch_matrix(inst.dim, sub_seed(self._seed, layer, hh, _salt(side_i, j, 1)),
                                                    self.sketch) for hh in range(h)])
            scale = 1.0
            if self.debias and side_i == 0 and not inst.qjl and inst.code_bits:
                scale = 1.0 / (1.0 - unit_distortion(inst.widths, inst.dim))
            instances.append(TurboInstance(inst, rot, sketch, ch, scale))
        return TurboCodec(instances, pre_rope=self.pre_rope and side_i == 0)

    def _rotation_bytes(self) -> int:
        """fp32 bytes Pi and S would take if stored instead of regenerated from the seed."""
        per_layer = sum(4 * i.dim * i.dim * (1 + i.qjl) for p in self._plans.values() if p for i in p.instances)
        return per_layer * self._shape.n_heads_total

    def static_bytes(self) -> int:
        """fp32 centroids of the codebooks in use, the 8-byte seed, and with the split one bit per
        RoPE pair per (layer, KV head, side) marking the outlier set."""
        if self._shape is None:
            return 0
        books = {(b, i.dim) for p in self._plans.values() if p for i in p.instances for b in i.widths}
        total = sum(4 * (1 << b) for b, _ in books) + 8
        if self.split:
            sides = sum(p is not None for p in self._plans.values())
            total += (sides * self._shape.n_heads_total * (self._shape.head_dim // 2) + 7) // 8
        return total

    def new_layer_state(self, layer):
        if self._codecs is None:
            raise RuntimeError("turboquant: calibrate() before new_layer_state()")
        return CodecLayerState(self._codecs["k"][layer], self._codecs["v"][layer])

    def knobs(self):
        return dict(self._knobs)

    def nominal_bpd(self, n_tokens):
        d = self._shape.head_dim
        return tuple(16.0 if self._plans.get(s) is None else self._plans[s].bits / d for s in SIDES)


def _energy(stats, side: str) -> torch.Tensor:
    """Uncentered per-channel energy E[x_i^2] [H, d] (float64) of keys or values (pre-RoPE keys:
    the pair energy is RoPE-invariant, §16.4)."""
    mu = getattr(stats, f"mu_{side}").cpu().to(torch.float64)
    cov = getattr(stats, f"cov_{side}").cpu().to(torch.float64)
    return torch.diagonal(cov, dim1=-2, dim2=-1) + mu * mu
