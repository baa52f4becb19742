"""KV-COBRA-MSE / KV-COBRA-KL: co-optimized bit/rank allocation for pre-RoPE keys.

KV-COBRA: "KV Cache Compression via Co-Optimized Bit-Rank Allocation", arXiv 2609.24298,
NeurIPS 2026, known here only through the project's seed summary (``seeds/003_*.txt``; the paper
itself was not found). Specification: docs/methods.md §5 (§5.1-§5.11), with §1.1 (fixed-step
quantizer), §1.1b (the calibrated step, switch ``step="calibrated"``) and §1.2 (calibration
statistics). The allocation lives in :mod:`methods.cobra_alloc`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .base import KVMethod, LayerStats, ModelShape, Unsupported
from .cobra_alloc import (
    Q_MODELS,
    budget_range,
    c1_batch,
    c2_allocate,
    exact_allocate,
    kkt_allocate,
    prefix_terms,
    q_gauss,
    split_bits,
    uniform_allocate,
)
from .codec_state import CodecLayerState, ExactCodec, codecs_static_bytes
from .gaussquant import step_table
from .hadamard import equalizing_rotation
from .latent_codec import (
    LatentKeyCodec,
    build_value_codecs,
    centered_samples,
    check_step,
    sample_tokens_for,
    step_multipliers,
    sub_seed,
    value_plan,
    values_reachable,
)

#: the seed's allocation knobs (§5.3, §5.4): C2's damping eta, the least bits per kept coordinate
#: b_min and the rank step of C1's grid
PAPER_KNOBS = {"eta": 0.3, "b_min": 2, "rank_step": 2}
#: what the held-out knob search tries for each (docs/methods.md §5.12), the seed's value first
KNOB_GRID = {"eta": (0.3, 0.1, 0.6), "b_min": (2, 1, 3), "rank_step": (2, 1, 4)}

C2_MODES = {True: "seed", False: "uniform", "seed": "seed", "uniform": "uniform", "exact": "exact",
            "kkt": "kkt"}  # "kkt" = C2 with KKT slope equalization (§5.11c)


def rope_average(m: torch.Tensor) -> torch.Tensor:
    """§5.11e: average R_D^T M R_D over RoPE offsets D. Cross-pair terms vanish and each (i, i+d/2)
    block becomes half its trace times I_2, so the result is diagonal."""
    d = m.shape[-1]
    diag = torch.diagonal(m, dim1=-2, dim2=-1)
    pair = 0.5 * (diag[..., : d // 2] + diag[..., d // 2 :])
    return torch.diag_embed(torch.cat([pair, pair], -1))


def key_moments(stats: list[LayerStats], centered: bool):
    """(mu_K [N, d], Sigma_K [N, d, d], M_Q [N, d, d]) of all KV heads, layer-major, float64 on the
    CPU; ``centered=False`` gives Sigma = E[k k^T] and mu = 0 (§5.7 ``--uncentered``)."""
    mu, cov, mq = (torch.cat([getattr(s, key).cpu() for s in stats]).to(torch.float64) for key in ("mu_k", "cov_k", "m_q"))
    if not centered:
        cov = cov + mu[:, :, None] * mu[:, None, :]
        mu = torch.zeros_like(mu)
    return mu, cov, mq


def key_spectra(stats: list[LayerStats], variant: str, centered: bool, q_stat: str):
    """Per KV head (all layers stacked, N = L H): mu [N, d] and, reordered by w descending,
    eigenvalues lam [N, d], eigenvectors U [N, d, d] (columns), sigma_Q^2 [N, d] and w [N, d] (§5.2)."""
    mu, cov, mq = key_moments(stats, centered)
    lam, u = torch.linalg.eigh(cov)
    lam = lam.clamp(min=0)
    if q_stat == "rope_avg":
        mq = rope_average(mq)
    sq = (u * (mq @ u)).sum(-2)  # u_i^T M_Q u_i
    w = lam if variant == "mse" else sq * lam
    order = torch.sort(w, dim=-1, descending=True, stable=True).indices
    lam, sq, w = (torch.gather(x, -1, order) for x in (lam, sq, w))
    u = torch.gather(u, -1, order[:, None, :].expand_as(u))
    return mu, lam, u, sq, w


def quant_factor(lam, sq, w, variant: str, kl_term: str, rotation: str) -> torch.Tensor:
    """qsum[h, r], the factor of q(b) in D (§5.3); §5.11b after an exact equalization."""
    head = prefix_terms(w)[1]
    if variant == "kl" and kl_term == "rotated" and rotation == "hadamard":
        cl, cs = prefix_terms(lam)[1], prefix_terms(sq)[1]
        r = torch.arange(lam.shape[-1] + 1, dtype=torch.float64)
        return cl / r.clamp(min=1) * cs
    return head


@dataclass
class Cobra(KVMethod):
    """KV-COBRA (arXiv 2609.24298, NeurIPS 2026, via the seed summary) — docs/methods.md §5.

    Keys, pre-RoPE, per KV head: Sigma_K = U Lambda U^T (float64 eigh), weights w_i = lambda_i (mse)
    or sigma_Q,i^2 lambda_i with sigma_Q,i^2 = u_i^T M_Q u_i (kl) (§5.2), reorder by w. C1 (§5.3)
    picks (r, B/r) per head; C2 (§5.4) spreads B_tot = bpd_K d N over all N = L H_kv heads. Bits per
    coordinate per §5.5. Fused operator P = R U_r^T (§5.7; R = H_r D_s / sqrt(r) or Haar +
    Givens, ``rotation="none"`` -> identity), steps s*(b_j) sigma_bar with
    sigma_bar^2 = mean_{i<=r} lambda_i. Online c = P (k - mu_K), fixed-step quantization (§1.1),
    k_hat = mu_K + P^T c_hat, then RoPE. Values (§5.8): 16-bit exact, or v' = H_d D_s v with one
    integer b_V and step s*(b_V) sigma_V (``v_quant="kivi"``: KIVI per-token groups).

    Options (defaults seed-literal; §5.11 fixes are switches): ``c2`` True (seed C2) | False
    (uniform split, "w/o C2") | "exact" (§5.4 reference solver); ``q_model`` "seed" (2^-2b/12) |
    "gauss" (§1.1 MSE, §5.11a); ``kl_term`` "seed" | "rotated" (§5.11b); ``q_stat`` "plain" |
    "rope_avg" (§5.11e); ``centered`` (§5.7 ``--uncentered``); ``rotation`` "hadamard" | "none";
    ``step`` "gauss" (§5.7, seed-literal) | "calibrated" (§1.1b: Delta = m s*(b) sigma_bar with one
    multiplier m per head and bit width, minimizing the empirical MSE of the sample latents
    P (k - mu_K) / sigma_bar of the coordinates that get that width; values likewise, one per head).
    §5.11c (C2 equalizes D*, KKT equalizes -dD*/dB) is addressed by ``c2="exact"``.

    Decisions where docs/methods.md is silent:

    * ``eta``, ``b_min``, ``rank_step`` (docs/methods.md §5.12): null = chosen by the job's held-out
      knob search (``searches()``, :meth:`knob_candidates`, kvbench/fit/knob_search.py) over
      :data:`KNOB_GRID`, the seed's (0.3, 2, 2) first; without a search, or for the ones not
      given when one is, the seed's values. ``knobs()`` carries them, ``fit`` and ``predicted``
      only for a searched configuration.
    * B_tot = floor(bpd_K d N) (never above the target); targets with B_tot outside
      [N B_min, N B_max] = [4N, 8dN] are Unsupported (no head then needs the r = 0 path, which is
      kept for completeness: key = mu_K, 0 bits). ``bpd=None`` or 16 keeps keys exact.
    * C1 at a real-valued budget (inside C2) uses the same feasible ranks as at integer budgets;
      "gauss" q at fractional b interpolates the integer MSEs linearly (= the realized §5.5 mean).
    * ``kl_term="rotated"`` only applies with ``rotation="hadamard"`` (without rotation the seed
      term is the exact one). The equalization is exact for every r: Hadamard when the order exists
      (2^a, K 2^a with K tabulated), else Haar + Bendel-Mickey Givens; the branch is logged.
    * ``rotation="none"``: steps still use sigma_bar (one step scale per head, the seed's
      "w/o Hadamard" ablation); ``step_scale="coord"`` uses the static per-coordinate RMS instead.
    * ``clip_scale`` multiplies every key step (wider range, fewer clipped outliers); default 1.
      With ``step="calibrated"`` it multiplies the calibrated step.
    * ``step="calibrated"`` with ``step_scale="coord"`` normalizes each coordinate by its own RMS
      before pooling a (head, width) group. Statistics without a sample fall back to the Gaussian
      step (knobs: ``step_fallback``).
    * Per-head random signs / Haar matrices come from ``seed`` via a fixed (seed, layer, head) hash.
    * Values: sigma_V^2 = E||v||^2 / d uncentered as §5.8 writes it (``v_centered`` subtracts mu_V).
    * Packing: see :mod:`methods.latent_codec` (one bit stream per encode call, each code exactly
      b_j bits, < 8 padding bits per layer and call, counted in the measured bits).
    * ``quantize=False`` stores float32 latents (test mode: exact keys at full rank).
    * ``first_fp16=True``: docs/methods.md §5.9's first-token protection — the sequence's first token (the
      attention sink, an outlier the fixed steps clip) is stored at 16 bits on both sides
      (:class:`methods.codec_state.CodecLayerState` ``exact_first``), counted in the measured bpd
      (about 16 (ln T + 0.58)/T over positions in track A: 0.06 at T = 2048). Off by default.
    """

    name: ClassVar[str] = "cobra"
    # rows_in_one_state stays False: a call's codes are one byte-rounded stream, so B rows in one
    # call store a few bits fewer than B calls (SmolLM2, rows of 37 tokens: 3e-4 bpd)
    needs_calibration: ClassVar[bool] = True
    seeded: ClassVar[bool] = True

    variant: str = "mse"
    c2: bool | str = True
    rotation: str = "hadamard"
    q_model: str = "seed"
    kl_term: str = "seed"
    q_stat: str = "plain"
    centered: bool = True
    v_quant: str = "hadamard"
    v_group: int = 32
    v_centered: bool = False
    step_scale: str = "mean"
    step: str = "gauss"
    first_fp16: bool = False
    clip_scale: float = 1.0
    quantize: bool = True
    eta: float | None = None
    c2_iters: int = 5
    b_min: int | None = None
    b_max: int = 8
    rank_step: int | None = None

    def __post_init__(self):
        choices = {
            "variant": ("mse", "kl"), "rotation": ("hadamard", "none"), "q_model": tuple(Q_MODELS),
            "kl_term": ("seed", "rotated"), "q_stat": ("plain", "rope_avg"), "v_quant": ("hadamard", "kivi"),
            "step_scale": ("mean", "coord"),
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ValueError(f"{self.name}: {key}={getattr(self, key)!r} not in {valid}")
        check_step(self.name, self.step)
        if self.c2 not in C2_MODES:
            raise ValueError(f"{self.name}: c2={self.c2!r} must be true, false, 'exact' or 'kkt'")
        if not self.b_max <= 8:
            raise ValueError("b_max must be <= 8 (bit packing)")
        for key in ("b_min", "rank_step"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise ValueError(f"{self.name}: {key} must be a positive integer (or null), got {value!r}")
        if self.eta is not None and not self.eta > 0:
            raise ValueError(f"{self.name}: eta must be positive (or null), got {self.eta!r}")
        self._alloc = self._resolve_alloc()
        self._shape: ModelShape | None = None
        self._total_bits: int | None = None
        self._v_bits: int | None = None
        self._v_nominal = 16.0
        self._k_codecs: list | None = None
        self._v_codecs: list | None = None
        self._budgets: torch.Tensor | None = None
        self._ranks: torch.Tensor | None = None
        self._knobs: dict = {}

    # ---- budget ---------------------------------------------------------------------------------

    def _explicit(self) -> list[str]:
        return [f"{k}={getattr(self, k)}" for k in PAPER_KNOBS if getattr(self, k) is not None]

    def _resolve_alloc(self) -> dict:
        """eta, b_min, rank_step in force: the explicit options, else the knob search's choice
        (``use_knobs``), else the seed's (:data:`PAPER_KNOBS`)."""
        chosen = self.chosen_knobs or {}
        return {k: (getattr(self, k) if getattr(self, k) is not None else chosen.get(k, v))
                for k, v in PAPER_KNOBS.items()}

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: eta, b_min and the rank step are chosen on held-out text (docs/methods.md
        §5.12) unless one of them is given."""
        return () if self._explicit() else ("knobs",)

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The :data:`KNOB_GRID` points whose per-head budget range holds the target (the predicted
        bpd_K is floor(bpd_K d N)/(d N), never over it; the value side is the same for all), the
        seed's setting first, then the points one knob away from it, then two, then three (each
        distance in grid order), so that a shorter list keeps the seed's neighbourhood; eta only
        where C2 is the seed's (it moves nothing else)."""
        if (bpd_k is None or bpd_k == 16 or "knobs" not in self.searches()
                or not values_reachable(bpd_v, self.v_quant, self.v_group, shape.head_dim)):
            return []
        etas = KNOB_GRID["eta"] if C2_MODES[self.c2] == "seed" else KNOB_GRID["eta"][:1]
        points = [{"eta": e, "b_min": b, "rank_step": r}
                  for e in etas for b in KNOB_GRID["b_min"] for r in KNOB_GRID["rank_step"]]
        n, d = shape.n_heads_total, shape.head_dim
        total = int(math.floor(float(bpd_k) * d * n + 1e-9))

        def fits(p):
            lo, hi = budget_range(d, p["b_min"], self.b_max, p["rank_step"])
            return p["b_min"] <= self.b_max and n * lo <= total <= n * hi

        def away(p):
            return sum(p[k] != PAPER_KNOBS[k] for k in PAPER_KNOBS)

        out = sorted((p for p in points if fits(p)), key=away)  # stable: grid order within a distance
        return out if limit is None else out[:limit]

    def use_knobs(self, knobs):
        super().use_knobs(knobs)
        self._alloc = self._resolve_alloc()

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        self._alloc = self._resolve_alloc()
        a = self._alloc
        n, d = shape.n_heads_total, shape.head_dim
        if bpd_k is None or bpd_k == 16:
            self._total_bits = None
        else:
            lo, hi = budget_range(d, a["b_min"], self.b_max, a["rank_step"])
            total = int(math.floor(float(bpd_k) * d * n + 1e-9))
            if not n * lo <= total <= n * hi:
                raise Unsupported(
                    f"{self.name}: bpd={bpd_k} outside the reachable range [{lo / d:g}, {hi / d:g}] "
                    f"(per-head budgets in [{lo}, {hi}] bits, d={d})"
                )
            self._total_bits = total
        self._v_bits, self._v_nominal = value_plan(bpd_v, self.v_quant, self.v_group, d)
        self._knobs = {"target_bpd_k": bpd_k, "target_bpd_v": bpd_v, "total_bits": self._total_bits}
        if self.chosen_knobs is not None:  # a knob search's candidate, or its choice
            self._knobs.update(a, fit={"chosen_by": "held-out knob search"}, predicted={
                "bpd_k": 16.0 if self._total_bits is None else self._total_bits / (n * d), "bpd_v": self._v_nominal})

    # ---- calibration ----------------------------------------------------------------------------

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head whose keys/values :meth:`calibrate` wants (§1.1b), 0 if none
        (:func:`methods.latent_codec.sample_tokens_for`)."""
        return sample_tokens_for(self.step, self._shape is not None, self._total_bits is not None, self._v_bits, self.v_quant)

    def allocate(self, w: torch.Tensor, qsum: torch.Tensor) -> torch.Tensor:
        """Per-head integer budgets for weights w [N, d] (C2 / uniform / exact)."""
        a = self._alloc
        kw = dict(b_min=a["b_min"], b_max=self.b_max, rank_step=a["rank_step"], q_model=self.q_model, qsum=qsum)
        mode = C2_MODES[self.c2]
        if mode == "uniform":
            return uniform_allocate(w.shape[0], self._total_bits)
        if mode == "exact":
            return exact_allocate(w, self._total_bits, **kw)
        if mode == "kkt":  # §5.11c
            return kkt_allocate(w, self._total_bits, **kw)
        return c2_allocate(w, self._total_bits, eta=a["eta"], iters=self.c2_iters, **kw)

    def calibrate(self, stats, seed=0):
        if self._shape is None:
            raise RuntimeError(f"{self.name}: configure() before calibrate()")
        shape = self._shape
        if len(stats) != shape.n_layers:
            raise ValueError(f"{self.name}: {len(stats)} LayerStats for {shape.n_layers} layers")
        self._v_codecs, vknobs = build_value_codecs(
            stats, self._v_bits, self.v_quant, self.v_group, seed, self.v_centered, self.step
        )
        self._knobs.update(vknobs, seed=seed)
        if self._total_bits is None:
            self._k_codecs = [ExactCodec() for _ in stats]
            return
        self._calibrate_keys(stats, seed)

    def _calibrate_keys(self, stats, seed):
        shape = self._shape
        hkv, d = shape.n_kv_heads, shape.head_dim
        mu, lam, u, sq, w = key_spectra(stats, self.variant, self.centered, self.q_stat)
        tail = prefix_terms(w)[0]
        qsum = quant_factor(lam, sq, w, self.variant, self.kl_term, self.rotation)
        t0 = time.perf_counter()
        budgets = self.allocate(w, qsum)
        rank, mean_bits, dist = c1_batch(
            tail, qsum, budgets.to(torch.float64),
            b_min=self._alloc["b_min"], b_max=self.b_max, rank_step=self._alloc["rank_step"], q_model=self.q_model,
        )
        alloc_ms = 1e3 * (time.perf_counter() - t0)
        self._budgets, self._ranks = budgets, rank
        heads, branches = [], {}
        for n in range(budgets.numel()):
            r = int(rank[n])
            widths = torch.tensor(split_bits(int(budgets[n]), r), dtype=torch.long)
            p, sigma, branch = self.head_operator(u[n, :, :r], lam[n, :r], sub_seed(seed, *divmod(n, hkv), 0))
            branches[branch] = branches.get(branch, 0) + 1
            heads.append((p, sigma, widths))
        mults, step_knobs = self.step_multipliers(stats, mu, heads)
        heads = [(p, step_table(w) * sigma * m * self.clip_scale, w) for (p, sigma, w), m in zip(heads, mults)]
        self._k_codecs = [
            LatentKeyCodec.from_heads(mu[l * hkv : (l + 1) * hkv], heads[l * hkv : (l + 1) * hkv], self.quantize)
            for l in range(shape.n_layers)
        ]

        # §5.5: the realized mean_j q(b_j) >= q(b_bar) (convexity), under the active q model
        q = Q_MODELS[self.q_model]
        used = [(n, h[2].double()) for n, h in enumerate(heads) if h[2].numel()]
        layer_bits = budgets.reshape(shape.n_layers, hkv).sum(1)
        self._knobs.update(
            {
                "n_heads": budgets.numel(),
                "bpd_k_nominal": float(budgets.sum()) / (budgets.numel() * d),
                "alloc": C2_MODES[self.c2],
                "alloc_ms": round(alloc_ms, 3),
                "budgets": budgets.tolist(),
                "ranks": rank.tolist(),
                "rank_mean": float(rank.double().mean()),
                "distortion_total": float(dist.sum()),
                "distortion_cv": float(dist.std() / dist.mean()) if dist.numel() > 1 and dist.mean() > 0 else 0.0,
                "distortion_max_over_min": float(dist.max() / dist.min()) if dist.min() > 0 else None,
                "rotation_branches": branches,
                "q_at_mean_bits": float(q(mean_bits[[n for n, _ in used]]).mean()) if used else 0.0,
                "q_realized": sum(float(q(wd).mean()) for _, wd in used) / max(len(used), 1),
                "gauss_mse_realized": sum(float(q_gauss(wd).mean()) for _, wd in used) / max(len(used), 1),
                "layer_bits_per_token": layer_bits.tolist(),
                # one stream per encode call, padded to a byte: a one-token call of layer l pads
                # (-sum_h B_h) mod 8 bits, so decoding token by token can exceed the nominal bpd_K by
                "decode_padding_bpd_max": float((-layer_bits % 8).sum()) / (budgets.numel() * d),
                **step_knobs,
            }
        )

    def step_multipliers(self, stats, mu, heads):
        """(per head a multiplier per coordinate [r_h] (ones for the Gaussian step), knobs): §1.1b
        with one group per (head, width), the sample latents P (k - mu) / sigma of the coordinates
        that get that width."""
        per_coord = [torch.ones(w.numel(), dtype=torch.float64) for _, _, w in heads]
        samples = None if self.step == "gauss" else centered_samples(stats, "k", mu)
        groups, bits, where = [], [], []
        for n, ((p, sigma, w), x) in enumerate(zip(heads, samples or [])):
            if not w.numel():
                continue
            z = ((x @ p.T) / sigma).float()  # the search runs in float32
            for b in torch.unique(w).tolist():
                sel = w == b
                groups.append(z[:, sel])
                bits.append(b)
                where.append((n, sel))
        n_tok = samples[0].shape[0] if samples else 0
        mult, knobs = step_multipliers(self.step, None if samples is None else groups, bits, n_tok)
        if mult is not None:
            for (n, sel), m in zip(where, mult):
                per_coord[n][sel] = m
        return per_coord, knobs

    def head_operator(self, u_r: torch.Tensor, lam_r: torch.Tensor, seed: int):
        """(P [r, d], sigma per coordinate [r], branch) for one head (§5.7): P = R U_r^T with R the
        equalizing rotation (identity for ``rotation="none"``); sigma = sigma_bar, or the static
        per-coordinate RMS for ``step_scale="coord"``."""
        r = lam_r.numel()
        if self.rotation == "hadamard":
            rot, branch = equalizing_rotation(lam_r, seed)
        else:
            rot, branch = torch.eye(r, dtype=torch.float64), "none"
        p = rot @ u_r.T
        if self.step_scale == "coord":
            sigma = torch.sqrt((rot**2 * lam_r).sum(-1))  # diag(R Lambda_r R^T) = diag(P Sigma P^T)
        else:
            sigma = torch.sqrt(lam_r.mean()).expand(r) if r else lam_r
        return p, sigma.clamp(min=1e-30), branch

    # ---- cache ----------------------------------------------------------------------------------

    def static_bytes(self) -> int:
        return codecs_static_bytes(self._k_codecs, self._v_codecs)

    def new_layer_state(self, layer):
        if self._k_codecs is None or self._v_codecs is None:
            raise RuntimeError(f"{self.name}: calibrate() before new_layer_state()")
        return CodecLayerState(self._k_codecs[layer], self._v_codecs[layer], exact_first=int(self.first_fp16))

    def knobs(self):
        return dict(self._knobs)

    def allocation(self):
        """C1/C2's choice per KV head [L, H_kv]: ``k_rank`` r_h, ``k_bits`` B_h / r_h (the mean
        bits per kept latent coordinate; 0 where r_h = 0) and ``k_bpd`` B_h / d; ``{}`` before
        calibration or with keys at 16 bits."""
        if self._budgets is None or self._ranks is None or self._total_bits is None:
            return {}
        shape = (self._shape.n_layers, self._shape.n_kv_heads)
        b = self._budgets.to(torch.float64).reshape(shape)
        r = self._ranks.to(torch.float64).reshape(shape)
        return {"k_rank": r, "k_bits": torch.where(r > 0, b / r.clamp(min=1), torch.zeros_like(b)),
                "k_bpd": b / self._shape.head_dim}

    def nominal_bpd(self, n_tokens):
        if self._total_bits is None:
            bpd_k = 16.0
        else:
            d, n = self._shape.head_dim, self._shape.n_heads_total
            bpd_k = (float(self._budgets.sum()) if self._budgets is not None else self._total_bits) / (n * d)
        return bpd_k, self._v_nominal


@dataclass
class CobraMSE(Cobra):
    """KV-COBRA-MSE: w_i = lambda_i (docs/methods.md §5.2). See :class:`Cobra`."""

    name: ClassVar[str] = "cobra_mse"
    variant: str = field(default="mse", init=False)


@dataclass
class CobraKL(Cobra):
    """KV-COBRA-KL: w_i = sigma_Q,i^2 lambda_i (docs/methods.md §5.2). See :class:`Cobra`."""

    name: ClassVar[str] = "cobra_kl"
    variant: str = field(default="kl", init=False)
