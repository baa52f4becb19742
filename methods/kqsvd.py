"""KQ-SVD harness baseline: logit-optimal low-rank keys + fixed-step quantization.

KQ-SVD: Lesens, Rakhshan, Rabusseau, arXiv 2512.05916, AISTATS 2026 (DamienLesens/KQ-SVD,
``process_cache.py::compute_proj_KQT_mem``). docs/methods.md §4.1 (objective), §4.2 (harness
baseline: the calibrated step of §1.1b), §4.3 (budget); values as KV-COBRA (§5.8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KVMethod, ModelShape, Unsupported
from .budget import AT_TARGET, EPS, under_ceiling
from .cobra import key_moments, key_spectra
from .cobra_alloc import Q_MODELS, prefix_terms
from .codec_state import CodecLayerState, ExactCodec, codecs_static_bytes
from .gaussquant import optimal_step
from .latent_codec import (
    LatentKeyCodec,
    build_value_codecs,
    centered_samples,
    check_step,
    sample_tokens_for,
    step_multipliers,
    value_plan,
    values_reachable,
)

RIDGE_START = 1e-12  # relative to mean(diag): first ridge tried when a Cholesky factorization fails


def cholesky_ridge(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factors of SPD matrices [..., d, d] (float64). A matrix that is not numerically
    positive definite gets a ridge eps * mean(diag) * I, eps = 1e-12, 1e-11, ... until it factors.
    Returns (L, ridge / mean(diag) per matrix)."""
    m = m.to(torch.float64)
    scale = torch.diagonal(m, dim1=-2, dim2=-1).mean(-1).clamp(min=1e-300)
    ridge = torch.zeros_like(scale)
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    chol, info = torch.linalg.cholesky_ex(m)
    eps = RIDGE_START
    while bool((info != 0).any()):
        bad = info != 0
        ridge = torch.where(bad, eps * scale, ridge)
        chol, info = torch.linalg.cholesky_ex(m + ridge[..., None, None] * eye)
        eps *= 10.0
        if eps > 1.0:
            raise ValueError("matrix too far from positive definite for a Cholesky factorization")
    return chol, ridge / scale


def kq_factors(key_gram: torch.Tensor, query_gram: torch.Tensor, rank: int):
    """§4.1 from Gram matrices K^T K and Q^T Q [..., d, d]: R_K = L_K^T, R_Q = L_Q^T (Cholesky, so
    K = Q_K R_K without T x d storage); SVD R_K R_Q^T = U S V; A = R_Q^T V^T S^-1 [:, :r] (down),
    B = R_K^T U[:, :r] (up). Returns (A, B, S) with A, B [..., d, r], S [..., d] (all singular
    values) and the relative ridge [...] that either factorization needed: B^T A = I_r and
    (Q B)(K A)^T is the best rank-r approximation of Q K^T."""
    lk, ridge_k = cholesky_ridge(key_gram)
    lq, ridge_q = cholesky_ridge(query_gram)
    u, s, vh = torch.linalg.svd(lk.transpose(-1, -2) @ lq)
    a = lq @ vh[..., :rank, :].transpose(-1, -2) / s[..., None, :rank]
    b = lk @ u[..., :, :rank]
    return a, b, s, torch.maximum(ridge_k, ridge_q)


BITS = tuple(range(2, 9))  # b of §4.3


def candidates(target: float, d: int) -> list[tuple[int, int]]:
    """(r, b) with r * b = target * d, r even in [2, d], b in 2..8 (§4.3), r ascending."""
    out = []
    for b in BITS:
        r = target * d / b
        if abs(r - round(r)) < 1e-9 and round(r) % 2 == 0 and 2 <= round(r) <= d:
            out.append((int(round(r)), b))
    return sorted(out)


def admissible(target: float, d: int) -> list[tuple[int, int]]:
    """The knob search's (r, b) (docs/methods.md §4.3, §0.1): for each b in 2..8 the largest even
    r <= d with r b <= 1.02 target d (:func:`methods.budget.under_ceiling`); the §4.3 pairs
    (r b = target d exactly, among which the proxy chooses) first in r ascending (the proxy's tie
    order), then the others, the most bits per token r b first (the least under the target)."""
    exact = candidates(target, d)
    rest = []
    for b in BITS:
        r = min(d, int((1 + AT_TARGET) * target * d / b + EPS)) // 2 * 2
        if r >= 2 and (r, b) not in exact and under_ceiling(r * b / d, target):
            rest.append((r, b))
    return exact + sorted(rest, key=lambda rb: (-rb[0] * rb[1], rb[0]))


@dataclass
class KQSVD(KVMethod):
    """KQ-SVD (Lesens, Rakhshan, Rabusseau, arXiv 2512.05916, AISTATS 2026) as the harness
    baseline of docs/methods.md §4.2: pre-RoPE keys only, queries untouched.

    Per KV head (§4.1, GQA: the group's queries stacked, i.e. Q^T Q = n g M_Q): A, B from Cholesky
    factors of n Sigma_K (centered keys) and n M_Q; online c = A^T (k - mu_K), quantized with the
    fixed-step quantizer (§1.1) at b bits, k_hat = mu_K + B c_hat, then RoPE. Steps (§4.2):
    ``step="calibrated"`` (default, §1.1b) Delta_j = m_h s*(b) sqrt(var_j), the one multiplier m_h
    per head minimizing the empirical MSE of the head's calibration latents c_j / sqrt(var_j)
    (all r coordinates pooled; they are decorrelated, var_j their variance); ``step="gauss"``
    Delta_j = s*(b) sqrt(var_j) (§1.1, the Gaussian rule). One global (r, b),
    r even, b in 2..8, r b = bpd_K d (§4.3), chosen by the minimum summed proxy
    sum_h D(r, b) = sum_h [sum_{i>r} w_i + q(b) sum_{i<=r} w_i] (§5.3 with KL weights). Values as
    KV-COBRA (§5.8). Unsupported when no (r, b) matches the target.

    Decisions where docs/methods.md is silent:

    * Knob search (docs/methods.md §4.3): with neither ``rank`` nor ``bits`` given, a job scores
      :func:`admissible` (the largest even r per b with r b <= 1.02 bpd_K d, the §4.3 pairs first)
      on held-out windows and runs its choice (``use_knobs``); without a search the proxy chooses
      among the §4.3 pairs as above. ``rank`` and ``bits`` together run as set.
    * Ridge: a Gram matrix that fails Cholesky gets eps * mean(diag) * I, eps = 1e-12, 1e-11, ...
      (logged per run as the largest relative ridge).
    * Latent variance: diag(A^T Sigma_K A) = 1/n exactly without ridge (R_K A = U_r, so the latents
      K A are decorrelated and equal-variance); the steps use this per-coordinate variance computed
      from Sigma_K itself, which stays exact when a ridge was needed.
    * ``proxy="eig"`` (default, literal §4.3): KL weights sigma_Q,i^2 lambda_i in the key eigenbasis;
      ``proxy="kq"``: w_i = S_i^2 / n^2, the exact logit-error weights in KQ-SVD's own basis.
      ``q_model`` "seed" | "gauss" as in KV-COBRA. Ties go to the smaller r.
    * ``centered=False``: Sigma = E[k k^T], mu = 0 (as KV-COBRA's ``--uncentered``).
    * ``quantize=False`` stores float32 latents (test mode).
    * ``first_fp16=True``: docs/methods.md §5.9's first-token protection — the sequence's first token (the
      attention sink, an outlier the fixed steps clip) is stored at 16 bits on both sides
      (:class:`methods.codec_state.CodecLayerState` ``exact_first``), counted in the measured bpd
      (about 16 (ln T + 0.58)/T over positions in track A: 0.06 at T = 2048). Off by default.
    * ``step`` also sets the value step (§5.8 rotated codec, one multiplier per head from the value
      sample), so the KV-track baseline is calibrated on both sides. Statistics without a sample
      (collected without :meth:`calibration_sample_tokens`) fall back to the Gaussian step; the
      knobs then carry ``step_fallback``.
    """

    name: ClassVar[str] = "kqsvd"
    # rows_in_one_state stays False: a call's codes are one byte-rounded stream, so B rows in one
    # call store a few bits fewer than B calls (SmolLM2, rows of 37 tokens: 7.5e-4 bpd)
    needs_calibration: ClassVar[bool] = True
    seeded: ClassVar[bool] = True  # random signs of the value rotation

    q_model: str = "seed"
    proxy: str = "eig"
    centered: bool = True
    v_quant: str = "hadamard"
    v_group: int = 32
    v_centered: bool = False
    quantize: bool = True
    step: str = "calibrated"
    first_fp16: bool = False
    rank: int | None = None
    bits: int | None = None

    def __post_init__(self):
        if self.q_model not in Q_MODELS or self.proxy not in ("eig", "kq"):
            raise ValueError(f"kqsvd: q_model in {tuple(Q_MODELS)}, proxy in ('eig', 'kq')")
        if (self.rank is None) != (self.bits is None):
            raise ValueError(f"kqsvd: give rank and bits together (or neither), got {self.rank}, {self.bits}")
        if self.rank is not None and not (self.rank == int(self.rank) and self.rank >= 1 and self.bits in BITS):
            raise ValueError(f"kqsvd: rank must be a positive integer and bits in {BITS}, got {self.rank}, {self.bits}")
        check_step("kqsvd", self.step)
        self._shape: ModelShape | None = None
        self._cands: list | None = None
        self._rb: tuple[int, int] | None = None
        self._v_bits: int | None = None
        self._v_nominal = 16.0
        self._k_codecs: list | None = None
        self._v_codecs: list | None = None
        self._knobs: dict = {}

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: (r, b) chosen on held-out text among :func:`admissible` unless given."""
        return () if self.rank is not None else ("knobs",)

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """:func:`admissible` as ``{"rank", "bits"}``, the §4.3 pairs (the proxy's choice among
        them: the harness baseline's setting) first; ``[]`` with keys exact or values out of reach."""
        if (bpd_k is None or bpd_k == 16 or "knobs" not in self.searches()
                or not values_reachable(bpd_v, self.v_quant, self.v_group, shape.head_dim)):
            return []
        out = [{"rank": r, "bits": b} for r, b in admissible(float(bpd_k), shape.head_dim)]
        return out if limit is None else out[:limit]

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        d = shape.head_dim
        chosen = self.chosen_knobs
        if self.rank is not None:  # explicit: run as set, reported at its bpd
            if not (self.rank <= d and self.rank * self.bits <= 8 * d):
                raise ValueError(f"kqsvd: rank {self.rank} must be <= head_dim {d}")
            self._cands = [(int(self.rank), int(self.bits))]
        elif bpd_k is None or bpd_k == 16:
            self._cands = None
        elif chosen is not None:
            rb = (int(chosen["rank"]), int(chosen["bits"]))
            if rb not in admissible(float(bpd_k), d):
                raise Unsupported(f"kqsvd: knobs {chosen} are not admissible at bpd={bpd_k:g} (r b <= "
                                  f"{1 + AT_TARGET:g} x {bpd_k:g} x {d}, r even, b in 2..8)")
            self._cands = [rb]
        else:
            self._cands = candidates(float(bpd_k), d)
            if not self._cands:
                raise Unsupported(f"kqsvd: no (r even <= {d}, b in 2..8) with r*b = {bpd_k}*{d}")
        self._v_bits, self._v_nominal = value_plan(bpd_v, self.v_quant, self.v_group, d)
        self._knobs = {"target_bpd_k": bpd_k, "target_bpd_v": bpd_v, "candidates": self._cands}
        if self._cands is not None and (chosen is not None or self.rank is not None):
            r, b = self._cands[0]
            self._knobs.update(
                fit={"chosen_by": "explicit" if self.rank is not None else "held-out knob search"},
                predicted={"bpd_k": r * b / d, "bpd_v": self._v_nominal})

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head whose keys/values :meth:`calibrate` wants (§1.1b), 0 if none
        (:func:`methods.latent_codec.sample_tokens_for`)."""
        return sample_tokens_for(self.step, self._shape is not None, self._cands is not None, self._v_bits, self.v_quant)

    def calibrate(self, stats, seed=0):
        if self._shape is None:
            raise RuntimeError("kqsvd: configure() before calibrate()")
        self._v_codecs, vknobs = build_value_codecs(
            stats, self._v_bits, self.v_quant, self.v_group, seed, self.v_centered, self.step
        )
        self._knobs.update(vknobs, seed=seed)
        if self._cands is None:
            self._k_codecs = [ExactCodec() for _ in stats]
            return
        hkv, d = self._shape.n_kv_heads, self._shape.head_dim
        mu, cov, mq = key_moments(stats, self.centered)
        n_tok = torch.tensor([float(s.n_tokens) for s in stats for _ in range(hkv)], dtype=torch.float64)
        a, b, s, ridge = kq_factors(cov * n_tok[:, None, None], mq * n_tok[:, None, None], d)

        if self.proxy == "kq":
            w = s**2 / n_tok[:, None] ** 2
        else:
            w = key_spectra(stats, "kl", self.centered, "plain")[4]
        tail, head = prefix_terms(w)
        q = Q_MODELS[self.q_model]
        scores = [float((tail[:, r] + q(torch.tensor(float(bb), dtype=torch.float64)) * head[:, r]).sum())
                  for r, bb in self._cands]
        r, bits = self._cands[scores.index(min(scores))]  # first minimum: candidates ascend in r
        self._rb = (r, bits)

        a, b = a[..., :r], b[..., :r]
        var = torch.einsum("ndr,nde,ner->nr", a, cov, a)
        sd = torch.sqrt(var.clamp(min=1e-300))
        step = optimal_step(bits) * sd
        mult, step_knobs = self.step_multipliers(stats, mu, a, sd, bits)
        if mult is not None:
            step = step * mult[:, None]
        self._k_codecs = []
        for layer in range(self._shape.n_layers):
            sl = slice(layer * hkv, (layer + 1) * hkv)
            self._k_codecs.append(LatentKeyCodec(
                mu[sl], a[sl].transpose(-1, -2), b[sl].transpose(-1, -2), step[sl],
                torch.full((hkv, r), bits, dtype=torch.long), quantize=self.quantize,
            ))
        spread = var * n_tok[:, None]
        self._knobs.update({
            "rank": r, "bits": bits, "proxy": self.proxy, "proxy_scores": dict(zip(map(str, self._cands), scores)),
            "max_relative_ridge": float(ridge.max()),
            "latent_var_times_n_range": [float(spread.min()), float(spread.max())],
            "padding": "< 8 bits per layer per encode call (0 when T * H_kv * r * b % 8 == 0)",
            **step_knobs,
        })

    def step_multipliers(self, stats, mu, a, sd, bits):
        """(m [N] or None, knobs): the §1.1b multiplier of each head from its sample latents
        A^T (k - mu) / sqrt(var) [n, r] (one group per head: one global b)."""
        samples = None if self.step == "gauss" else centered_samples(stats, "k", mu)
        groups = None if samples is None else [((x @ a_n) / sd_n).float() for x, a_n, sd_n in zip(samples, a, sd)]
        n = samples[0].shape[0] if samples else 0
        return step_multipliers(self.step, groups, [bits] * (len(groups) if groups else 0), n)

    def static_bytes(self) -> int:
        return codecs_static_bytes(self._k_codecs, self._v_codecs)

    def new_layer_state(self, layer):
        if self._k_codecs is None or self._v_codecs is None:
            raise RuntimeError("kqsvd: calibrate() before new_layer_state()")
        return CodecLayerState(self._k_codecs[layer], self._v_codecs[layer], exact_first=int(self.first_fp16))

    def knobs(self):
        return dict(self._knobs)

    def allocation(self):
        """The chosen (r, b) for every KV head [L, H_kv] (KQ-SVD spreads its budget uniformly):
        ``k_rank`` r, ``k_bits`` b, ``k_bpd`` r b / d; ``{}`` before calibration or at 16 bits."""
        if self._rb is None or self._cands is None:
            return {}
        r, b = self._rb
        full = torch.ones(self._shape.n_layers, self._shape.n_kv_heads, dtype=torch.float64)
        return {"k_rank": full * r, "k_bits": full * b, "k_bpd": full * (r * b / self._shape.head_dim)}

    def nominal_bpd(self, n_tokens):
        if self._cands is None:
            return 16.0, self._v_nominal
        r, b = self._rb if self._rb else self._cands[0]
        return r * b / self._shape.head_dim, self._v_nominal
