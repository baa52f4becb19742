"""SVDq: SVD latent channels of the keys with importance-aware mixed-precision quantization.

Hong et al., "SVDq: 1.25-bit and 410x Key Cache Compression for LLM Attention", arXiv 2502.15304
(no official code). Specification: METHODS.md §3 (quantizer §1.1, regimes §1.3, budget map §8).

* Basis (§3.1), per layer and KV head, pre-RoPE, centred: ``basis="calib"`` = eigenvectors of the
  calibration covariance Sigma_K (``LayerStats.cov_k``, descending eigenvalues) and mean mu_K;
  ``basis="prefill"`` = right singular vectors of this sequence's centred prefill keys (eigenvectors
  of their covariance), stored per sequence in fp16 and counted in bpd.
* Quantization (§3.2): c = V^T (k - mu); latent group j = channels [j d/8, (j+1) d/8) gets b_j bits
  (b_j = 0 drops it); per latent channel, asymmetric min-max (:mod:`methods.groupquant`) over token
  groups of G_t tokens aligned at 0. New tokens wait in full precision until their group completes:
  at query t, **key s is read quantized iff s < G_t*floor(t/G_t)** (the KIVI key rule, R = G_t).
  k_hat = mu + V c_hat, then RoPE with the token's own (cos, sin).
* bpd_K (§3.3) = (T-n_b)/T * [(1/8) sum b_j + (n_act/d) 32/G_t] + 16 n_b/T
  + [prefill basis] 16 (n_act+1)/T, n_b = T mod G_t, n_act = (d/8) #{b_j > 0}. Measured by
  ``stored_bits`` from the stored tensors. (8,4,2,1,1,0,0,0), d=128, T=2048: 2 + 0.156 (+ 0.633).
* Schedule (§3.3): the paper's (8,4,2,1,1,0,0,0) verbatim at schedule mean 2.0; otherwise
  S = round(8 b_bar) bits given greedily, one at a time, to the group maximising
  (d/8) lambda_j [e(b_j) - e(b_j + 1)] (lambda_j: mean calibration eigenvalue of group j over all
  layers and KV heads; e: the Gaussian MSE column of §1.1, e(0) = 1; b_j <= 8), then sorted
  non-increasing.

Decisions where METHODS.md is silent (or inconsistent):

* **Budget convention** (``budget``). ``"mean"`` (default, §3.3 literally and the paper's
  convention): the target is the schedule mean b_bar, so bpd=2.0 gives the paper's schedule; the
  metadata, basis and buffer shares are on top and are reported as measured bpd (2.16 in calib
  mode). Reachable: 1/16 <= target <= 8 (S in 1..64). ``"total"``: the largest S whose asymptotic
  nominal bpd S/8 + (n_act/d) 32/G_t is <= target (like KIVI's mapping; the T-dependent basis and
  buffer shares are reported, not mapped); floor 1/8 + 4/G_t (0.156 at G_t=128). §8's "0.5: calib
  only" is a quality remark, not reachability: in prefill mode 0.5 costs 0.5 + 0.031 + 0.133 = 0.66
  measured at T=2048 (d=128), in calib mode 0.53.
* One global schedule for all layers and heads (the paper's form); the greedy rule needs
  calibration eigenvalues, so a non-paper schedule is resolved in ``calibrate`` (also in prefill
  mode, where only the schedule uses the statistics). An explicit ``schedule`` overrides everything.
* The fp16 buffer holds the full pre-RoPE key (16 d bits per token, counted); attention reads the
  exact post-RoPE key for buffered tokens.
* ``basis="prefill"`` needs the prefill-exact regime (the first call must be ``prefill=True``);
  otherwise ``ValueError`` (the basis would see future keys). Its mean and the active basis columns
  are rounded to fp16 (as counted) and that copy is used to encode and decode.
* Values: 16-bit (kept exactly) unless ``bpd_v`` or ``v_bits`` is given; then KIVI's per-token
  group quantizer at (b_V, G_V) chosen like KIVI's (largest b + 32/G <= target, G <= d), applied on
  arrival with **no** residual window (§5.8 ablation form), so bpd_V = b_V + 32/G_V exactly.
* Latents are computed in float32; calibration eigendecomposition in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .attention import causal_attention
from .base import KVMethod, LayerState, Rope, Unsupported, apply_rope
from .groupquant import dequantize_groups, quantize_groups
from .kivi import (
    SDPA_MIN_QUERIES,
    Growing,
    _advance,
    _cat,
    _row,
    _SideStore,
    blocked_attention,
    grid_choice,
    mixed_attention,
)

N_GROUPS = 8
PAPER_SCHEDULE = (8, 4, 2, 1, 1, 0, 0, 0)
#: e(b) = MSE / sigma^2 of the MSE-optimal uniform quantizer of N(0, 1), b = 0..8 (METHODS.md §1.1)
GAUSS_MSE = (1.0, 0.363, 0.119, 0.0374, 0.0115, 0.00350, 0.00104, 3.04e-4, 8.77e-5)
_EPS = 1e-9


def greedy_schedule(total_bits: int, group_var, head_dim: int) -> tuple[int, ...]:
    """§3.3 greedy: ``total_bits`` bits, one at a time, to the group with the largest MSE gain."""
    lam = [float(x) for x in group_var]
    if len(lam) != N_GROUPS:
        raise ValueError(f"need {N_GROUPS} group variances, got {len(lam)}")
    bits = [0] * N_GROUPS
    for _ in range(min(total_bits, 8 * N_GROUPS)):
        gains = [
            (head_dim / N_GROUPS) * lam[j] * (GAUSS_MSE[bits[j]] - GAUSS_MSE[bits[j] + 1])
            if bits[j] < 8
            else -math.inf
            for j in range(N_GROUPS)
        ]
        j = max(range(N_GROUPS), key=lambda i: (gains[i], -i))
        bits[j] += 1
    return tuple(sorted(bits, reverse=True))


def schedule_nominal(schedule, group_tokens: int) -> float:
    """Asymptotic bpd_K of a schedule: mean bits + (n_act/d) 32/G_t (T -> infinity)."""
    active = sum(1 for b in schedule if b > 0)
    return sum(schedule) / N_GROUPS + active / N_GROUPS * 32.0 / group_tokens


def active_channels(schedule, head_dim: int) -> list[int]:
    m = head_dim // N_GROUPS
    return [j * m + i for j, b in enumerate(schedule) if b > 0 for i in range(m)]


def _svd_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, eigenvalues desc, eigenvectors desc as columns) of the rows of x [..., n, d]."""
    x = x.double()
    mu = x.mean(dim=-2)
    xc = x - mu[..., None, :]
    cov = xc.transpose(-1, -2) @ xc / x.shape[-2]
    evals, evecs = torch.linalg.eigh(cov)
    return mu, evals.flip(-1), evecs.flip(-1)


@dataclass
class SVDqLayerState(LayerState):
    schedule: tuple
    group: int
    mode: str
    mu: torch.Tensor | None  # [H, d] (calib) -> broadcast; prefill mode: set on the first call
    basis: torch.Tensor | None  # [H, d, n_act]
    v_bits: int | None
    v_group: int | None
    packed: list = field(default_factory=list)
    k_hat: Growing = field(default_factory=Growing)  # decoded quantized keys, post-RoPE
    buf_pre: torch.Tensor | None = None
    buf_post: torch.Tensor | None = None
    buf_cos: torch.Tensor | None = None
    buf_sin: torch.Tensor | None = None
    v: _SideStore = field(default_factory=_SideStore)
    v_exact: Growing = field(default_factory=Growing)
    basis_bits: int = 0
    _seen: int = 0

    def _set_prefill_basis(self, k_pre):
        mu, _, vecs = _svd_basis(k_pre)
        idx = torch.tensor(active_channels(self.schedule, k_pre.shape[-1]), device=k_pre.device)
        mu16, basis16 = mu.half(), vecs[..., idx].half()
        self.basis_bits = 16 * (mu16.numel() + basis16.numel())
        self.mu, self.basis = mu16.float()[:, :, None, :], basis16.float()

    def _encode(self, k_pre, cos, sin):
        """Quantize complete token groups of pre-RoPE keys; return packed and k_hat post-RoPE."""
        if self.mu.device != k_pre.device:  # calibration statistics live on the CPU
            self.mu, self.basis = self.mu.to(k_pre.device), self.basis.to(k_pre.device)
        mu, basis = self.mu, self.basis
        c = (k_pre.float() - mu) @ basis  # [B, H, m, n_act]
        m = k_pre.shape[-1] // N_GROUPS
        packs, parts, start = [], [], 0
        for b in self.schedule:
            if b == 0:
                continue
            gp = quantize_groups(c[..., start : start + m].contiguous(), b, self.group, axis=2)
            packs.append(gp)
            parts.append(dequantize_groups(gp))
            start += m
        c_hat = torch.cat(parts, dim=-1)
        k_hat_pre = mu + c_hat @ basis.transpose(-1, -2)
        return packs, apply_rope(k_hat_pre, Rope(cos, sin)).to(k_pre.dtype)

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if k_pre is None or rope is None:
            raise ValueError("svdq is a pre-RoPE codec: attend needs k_pre and rope")
        n0, n = self._seen, self._seen + k.shape[2]
        if prefill and n0:
            raise ValueError("prefill must be the first call on a layer state")
        if self.mode == "prefill" and self.mu is None:
            if not prefill:
                raise ValueError(
                    "svdq basis='prefill' needs the prefill-exact regime: the first call must be "
                    "prefill=True (in Q-all the basis would see future keys); use basis='calib'"
                )
            self._set_prefill_basis(k_pre)
        g = self.group
        kp = self.k_hat.data  # read quantized by every new query
        pre, post = _cat(self.buf_pre, k_pre), _cat(self.buf_post, k)
        cos = rope.cos if self.buf_cos is None else torch.cat([self.buf_cos, rope.cos], dim=1)
        sin = rope.sin if self.buf_sin is None else torch.cat([self.buf_sin, rope.sin], dim=1)
        m = g * (n // g) - g * (n0 // g)
        hat_tail = post
        if m > 0:
            packs, new_hat = self._encode(pre[:, :, :m], cos[:, :m], sin[:, :m])
            self.packed.extend(packs)
            self.k_hat.append(new_hat)
            hat_tail = torch.cat([new_hat, post[:, :, m:]], dim=2)
        # the buffers are copies when m > 0: slices would keep the whole chunk's storage alive
        keep = (lambda x: x[:, :, m:].clone()) if m > 0 else (lambda x: x)
        keep_rope = (lambda x: x[:, m:].clone()) if m > 0 else (lambda x: x)
        self.buf_pre, self.buf_post = keep(pre), keep(post)
        self.buf_cos, self.buf_sin = keep_rope(cos), keep_rope(sin)
        if self.v_bits is None:
            self.v_exact.append(v)
            v_all = self.v_exact.data
        else:  # quantized on arrival, no residual window
            vg = self.v_group or min(32, v.shape[-1])
            _advance(self.v, v, n, lambda x: quantize_groups(x, self.v_bits, vg, axis=3))
            v_all = self.v.hat.data
        self._seen = n
        if prefill:
            return causal_attention(q, k, v, scaling)
        if k.shape[2] >= SDPA_MIN_QUERIES:
            return blocked_attention(q, kp, post, hat_tail, g, None, v_all, None, None, scaling)
        tpos = torch.arange(n0, n, device=q.device)[:, None]
        pk = 0 if kp is None else kp.shape[2]
        key_mask = torch.arange(pk, n, device=q.device)[None, :] < g * torch.div(
            tpos, g, rounding_mode="floor"
        )
        return mixed_attention(q, kp, post, hat_tail, key_mask, None, v_all, None, None, scaling)

    def stored_bits(self):
        buf = 0 if self.buf_pre is None else self.buf_pre.numel() * 16
        if self.v_bits is None:
            bits_v = self.v_exact.n * _row(self.v_exact) * 16
        else:
            bits_v = self.v.bits()
        return sum(p.bits() for p in self.packed) + buf + self.basis_bits, bits_v

    @property
    def n_seen(self):
        return self._seen


@dataclass
class SVDq(KVMethod):
    """SVDq (Hong et al., arXiv 2502.15304), METHODS.md §3; see the module docstring.

    basis: "calib" | "prefill"; schedule: explicit 8 latent-group bit widths (overrides the
    budget); group: G_t, tokens per quantization group; budget: "mean" | "total" (what the target
    measures); v_bits/v_group: value quantizer (None = values exact unless ``bpd_v`` is given)."""

    name = "svdq"
    needs_calibration = True

    basis: str = "calib"
    schedule: tuple | None = None
    group: int = 128
    budget: str = "mean"
    v_bits: int | None = None
    v_group: int | None = None

    def __post_init__(self):
        if self.basis not in ("calib", "prefill"):
            raise ValueError(f"svdq: basis must be 'calib' or 'prefill', got {self.basis!r}")
        if self.budget not in ("mean", "total"):
            raise ValueError(f"svdq: budget must be 'mean' or 'total', got {self.budget!r}")
        if self.schedule is not None:
            self.schedule = tuple(int(b) for b in self.schedule)
            if len(self.schedule) != N_GROUPS or not all(0 <= b <= 8 for b in self.schedule):
                raise ValueError(f"svdq: schedule needs {N_GROUPS} widths in 0..8: {self.schedule}")
            if not any(self.schedule):
                raise ValueError("svdq: schedule keeps no latent group")

    # ---- budget -------------------------------------------------------------------------------
    def configure(self, shape, bpd_k, bpd_v):
        d = shape.head_dim
        if d % N_GROUPS:
            raise Unsupported(f"svdq: head_dim {d} is not a multiple of {N_GROUPS}")
        self._target, self._sched = bpd_k, None
        if self.schedule is not None:
            self._sched = self.schedule
        elif bpd_k is None:
            self._sched = PAPER_SCHEDULE
        elif self.budget == "mean":
            s = math.floor(8 * bpd_k + 0.5)
            if not 1 <= s <= 8 * N_GROUPS:
                raise Unsupported(
                    f"svdq: bpd={bpd_k} (schedule mean) is outside the reachable range "
                    f"1/16 <= bpd <= 8 (budget='mean': the target is the mean latent bit width)"
                )
            self._sched = PAPER_SCHEDULE if s == 16 else None
            self._total_bits = s
        else:
            floor = schedule_nominal((1,) + (0,) * (N_GROUPS - 1), self.group)
            if bpd_k < floor - _EPS:
                raise Unsupported(
                    f"svdq: bpd={bpd_k} is below the reachable range: bpd >= {floor:g} "
                    f"(1 bit in one latent group + {32 / (N_GROUPS * self.group):g} of metadata, "
                    f"G_t={self.group}), plus the basis/buffer shares"
                )
            if bpd_k >= schedule_nominal((8,) * N_GROUPS, self.group) - _EPS:
                self._sched = (8,) * N_GROUPS
        self._v = (None, None)
        if bpd_v is not None or self.v_bits is not None:
            self._v = grid_choice(
                bpd_v, bits=self.v_bits, group=self.v_group, max_group=d, divides=d,
                side="v_bpd", method="svdq",
            )
        self._head_dim = d
        self._maybe_resolve()

    def _resolve_schedule(self, group_var, d):
        if self.budget == "mean":
            s = self._total_bits
            return PAPER_SCHEDULE if s == 16 else greedy_schedule(s, group_var, d)
        for s in range(min(8 * N_GROUPS, math.floor(8 * self._target + _EPS)), 0, -1):
            sched = PAPER_SCHEDULE if s == 16 else greedy_schedule(s, group_var, d)
            if schedule_nominal(sched, self.group) <= self._target + _EPS:
                return sched
        raise Unsupported(f"svdq: no schedule fits bpd={self._target}")  # excluded by configure

    # ---- calibration --------------------------------------------------------------------------
    def calibrate(self, stats, seed=0):
        self._mu, self._basis, lam = [], [], []
        for st in stats:
            _, evals, evecs = _svd_basis_from_cov(st.cov_k)
            self._mu.append(st.mu_k.float())
            self._basis.append(evecs.float())
            lam.append(evals)
        d = self._basis[0].shape[-1]
        all_l = torch.cat(lam, dim=0).clamp_min(0)  # [L*H, d]
        self._group_var = all_l.reshape(-1, N_GROUPS, d // N_GROUPS).mean(dim=(0, 2)).tolist()
        self._maybe_resolve()

    def _maybe_resolve(self):
        """Resolve a pending greedy schedule once both the target and the eigenvalues are known
        (``configure`` and ``calibrate`` may come in either order)."""
        pending = getattr(self, "_sched", None) is None and hasattr(self, "_target")
        if pending and hasattr(self, "_group_var"):
            self._sched = self._resolve_schedule(self._group_var, self._head_dim)

    # ---- cache --------------------------------------------------------------------------------
    def _schedule(self):
        sched = getattr(self, "_sched", None)
        if sched is None:
            if self.schedule is not None:
                return self.schedule
            if not hasattr(self, "_target"):
                return PAPER_SCHEDULE
            raise RuntimeError(
                "svdq: the greedy schedule for this target needs calibration eigenvalues; "
                "call calibrate() before new_layer_state() (or pass an explicit schedule)"
            )
        return sched

    def new_layer_state(self, layer):
        sched = self._schedule()
        vb, vg = getattr(self, "_v", (self.v_bits, self.v_group))
        if self.basis == "prefill":
            return SVDqLayerState(sched, self.group, "prefill", None, None, vb, vg)
        if not hasattr(self, "_basis"):
            raise RuntimeError("svdq basis='calib' needs calibrate(stats) first")
        d = self._basis[layer].shape[-1]
        idx = torch.tensor(active_channels(sched, d))
        mu = self._mu[layer][None, :, None, :]
        return SVDqLayerState(sched, self.group, "calib", mu, self._basis[layer][:, :, idx], vb, vg)

    def knobs(self):
        vb, vg = getattr(self, "_v", (self.v_bits, self.v_group))
        sched = getattr(self, "_sched", None) or self.schedule
        return {
            "basis": self.basis,
            "schedule": list(sched) if sched else None,
            "group_tokens": self.group,
            "budget": self.budget,
            "v_bits": vb,
            "v_group": vg,
        }

    def nominal_bpd(self, n_tokens):
        t = n_tokens
        sched = self._schedule()
        d = getattr(self, "_head_dim", None)
        n_b = t % self.group
        bpd_k = ((t - n_b) * schedule_nominal(sched, self.group) + 16.0 * n_b) / t
        if self.basis == "prefill":
            if d is None:
                raise RuntimeError("svdq: nominal_bpd in prefill mode needs configure() (head_dim)")
            n_act = len(active_channels(sched, d))
            bpd_k += 16.0 * (n_act + 1) / t
        vb, vg = getattr(self, "_v", (self.v_bits, self.v_group))
        if vb is None:
            return bpd_k, 16.0
        return bpd_k, vb + 32.0 / (vg or min(32, d or 32))


def _svd_basis_from_cov(cov: torch.Tensor):
    """(None, eigenvalues desc, eigenvectors desc as columns) of covariances [H, d, d]."""
    evals, evecs = torch.linalg.eigh(cov.double())
    return None, evals.flip(-1), evecs.flip(-1)
