"""SVDq: SVD latent channels of the keys with importance-aware mixed-precision quantization.

Hong et al., "SVDq: 1.25-bit and 410x Key Cache Compression for LLM Attention", arXiv 2502.15304
(no official code). Specification: docs/methods.md §3 (quantizer §1.1, regimes §1.3, budget map §8).

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

Decisions where docs/methods.md is silent (or inconsistent):

* **Budget convention** (``budget``). ``"measured"`` (default, docs/methods.md §0): the
  target (within 2 %, the tables' band) is the *measured* bpd_K of the regime the job is evaluated in (``set_regime``: Q-all
  over T positions, or a P-token prefill plus D decoded positions), fp16 buffer, metadata and
  per-sequence basis included. Among schedules of S = 1..64 bits (greedy; the paper's at S = 16)
  and G_t in {8, 16, 24, 32, 48, 64, 96, 128} (or the given ``group``), those predicted (§3.3 per read position,
  :func:`predicted_bpd`) within 2 % of the target come first, then those below it; the least
  expected key distortion (share of keys read quantized x relative MSE of the schedule under the §1.1
  Gaussian column) wins. None fits -> :class:`Unsupported` with the reachable range of that
  regime (SmolLM2, Q-all at T = 2048: about 0.80-8; 0.5 is out of reach, since every query below
  position G_t reads a full-precision cache). ``"mean"`` (the paper's convention, labelled as
  such): the target is the schedule mean b_bar, so bpd=2.0 gives the paper's schedule and the
  metadata, basis and buffer shares come on top (2.16 + buffer in calib mode), G_t = 128.
  ``"total"``: the largest S whose asymptotic S/8 + (n_act/d) 32/G_t is <= target (buffer and
  basis shares not mapped), G_t = 128.
* **Knob search** (docs/methods.md §3.3; ``budget="measured"``, no ``schedule`` or ``group``): a job
  scores :meth:`SVDq.knob_candidates` on held-out windows: the paper schedule at G_t = 128 first
  when admissible, then one candidate per G_t whose schedule is the most bits under the ceiling
  (``total_bits=None``); ``use_knobs`` restricts the fit above to that G_t (and S).
* Basis ``"auto"`` (default, §3.1): the prefill basis after an exact prefill (prefill-exact
  regimes; counted in bpd), the calibration basis in Q-all, decided by each layer state's first
  call; ``"calib"`` / ``"prefill"`` force one.
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
* Latents are computed in float32 (float64 for float64 inputs); calibration eigendecomposition in
  float64.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .attention import causal_attention
from .base import KVMethod, LayerState, Rope, Unsupported, apply_rope, held_bits, query_positions
from .blocked_attention import SDPA_MIN_QUERIES, blocked_attention, mixed_attention
from .bookkeeping import decode_ops, host_ops, one_read
from .budget import AT_TARGET, describe, grid_choice, spread, under_ceiling
from .buffers import CallStore, Growing, RopeLog, SideStore, log_rope, row_elements
from .groupquant import GroupPacked, dequantize_groups, fp16_scale_min, quantize_dequantize_groups
from .packing import pack_bits

N_GROUPS = 8
PAPER_SCHEDULE = (8, 4, 2, 1, 1, 0, 0, 0)
GROUP_GRID = (8, 16, 24, 32, 48, 64, 96, 128)  # G_t tried by budget='measured'
DEFAULT_GROUP = 128  # G_t of budget='mean' / 'total' and of explicit schedules [decision, §3.2]
BASES = ("auto", "calib", "prefill")
BUDGETS = ("measured", "mean", "total")
#: e(b) = MSE / sigma^2 of the MSE-optimal uniform quantizer of N(0, 1), b = 0..8 (docs/methods.md §1.1)
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


def _read_positions(regime) -> torch.Tensor:
    """Query positions whose reads the headline averages over (docs/methods.md §0): every position
    of a Q-all pass; after a P-token prefill, the scored ones: P-1 (the prefill's own prediction,
    counted at the end-of-prefill cache) and the D decoded positions P..P+D-1."""
    if regime.kind == "qall":
        return torch.arange(regime.tokens, dtype=torch.float64)
    return torch.arange(regime.tokens - 1, regime.tokens + regime.decode, dtype=torch.float64)


def predicted_bpd(schedule, group: int, head_dim: int, regime, basis: str) -> float:
    """The measured bpd_K of docs/methods.md §0 from §3.3: the mean over the regime's scored
    positions p of the bits read / (n d). Q-all: the query at p reads n = p + 1 keys, of which
    G_t floor(p/G_t) quantized at mean(b_j) + (n_act/d) 32/G_t bits, the rest fp16. After a
    P-token exact prefill the prefill's own prediction reads the stored prompt (n = P, keys below
    G_t floor(P/G_t) quantized) and a decoded query at p >= P reads as in Q-all. Plus
    16 (n_act + 1)/n for a prefill basis."""
    p = _read_positions(regime)
    n, nq = p + 1, group * torch.floor(p / group)
    if regime.kind == "prefill":  # the end-of-prefill read: every complete group quantized
        nq[0] = group * math.floor(regime.tokens / group)
    quant = schedule_nominal(schedule, group)
    bits = nq * quant + (n - nq) * 16.0
    if basis == "prefill":
        bits = bits + 16.0 * (len(active_channels(schedule, head_dim)) + 1)
    return float((bits / n).mean())


def quantized_share(group: int, regime) -> float:
    """Mean over the regime's read positions of the fraction of keys read quantized."""
    p = _read_positions(regime)
    return float((group * torch.floor(p / group) / (p + 1)).mean())


def schedule_mse(schedule, group_var) -> float:
    """Relative key MSE of a schedule, sum_j lambda_j e(b_j) / sum_j lambda_j (§1.1 column)."""
    lam = [max(float(x), 0.0) for x in group_var]
    return sum(l * GAUSS_MSE[b] for l, b in zip(lam, schedule)) / max(sum(lam), 1e-300)


def active_channels(schedule, head_dim: int) -> list[int]:
    m = head_dim // N_GROUPS
    return [j * m + i for j, b in enumerate(schedule) if b > 0 for i in range(m)]


def quantize_latents(c: torch.Tensor, schedule, m: int, group: int) -> tuple[list[GroupPacked], torch.Tensor]:
    """§3.2 for all active latent channels of c [B, H, T, n_act] at once: per channel, groups of
    ``group`` tokens, asymmetric min-max at the channel's b_j with fp16 (s, mn), exactly
    :func:`methods.groupquant.quantize_groups` along the token axis (the same scales, minima and
    codes: every channel is quantized on its own, so one call per width gives what one call per
    latent group gave). Returns one :class:`GroupPacked` per run of equal widths along the schedule
    (codes packed at that width) and c_hat [B, H, T, n_act], dequantized from the codes before they
    are packed (:func:`methods.groupquant.dequantize_groups` of the packs, bit for bit).

    Decisions where docs/methods.md is silent: one batched quantization of every
    width instead of one per latent group, a fixed dozen ops plus a pack per distinct width."""
    b, h, t, n = c.shape
    levels, zero = _levels(tuple(schedule), m, c.dtype, str(c.device))
    xg = c.movedim(2, -1).reshape(b, h, n, t // group, group)
    s16, mn16 = fp16_scale_min(xg, levels[:, None])
    scale, low = s16.to(c.dtype)[..., None], mn16.to(c.dtype)[..., None]
    q = torch.clamp(((xg - low) / scale).round(), zero, levels[:, None, None])
    codes = q.to(torch.uint8)
    packs, start = [], 0
    for bits, width in _runs(schedule):
        sl = slice(start, start + width * m)
        packs.append(GroupPacked(pack_bits(codes[:, :, sl], bits), s16[:, :, sl], mn16[:, :, sl], bits, group, 2,
                                 (b, h, t, width * m), c.dtype))
        start += width * m
    c_hat = (q * scale + low).reshape(b, h, n, t).movedim(-1, 2).contiguous()
    return packs, c_hat


@lru_cache(maxsize=32)
def _levels(schedule: tuple, m: int, dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^b_j - 1 per active latent channel [n_act], 0) in ``dtype`` on ``device``."""
    top = [float((1 << b) - 1) for b in schedule if b > 0 for _ in range(m)]
    return torch.tensor(top, dtype=dtype).to(device), torch.zeros((), dtype=dtype).to(device)


def _runs(schedule) -> list[tuple[int, int]]:
    """(b, number of consecutive latent groups with that b > 0) along the schedule."""
    runs: list[list[int]] = []
    for b in schedule:
        if b == 0:
            continue
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [tuple(r) for r in runs]


def _svd_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, eigenvalues desc, eigenvectors desc as columns) of the rows of x [..., n, d]."""
    x = x.double()
    mu = x.mean(dim=-2)
    xc = x - mu[..., None, :]
    cov = xc.transpose(-1, -2) @ xc / x.shape[-2]
    evals, evecs = torch.linalg.eigh(cov)
    return mu, evals.flip(-1), evecs.flip(-1)


def _flush_products(c_hat: torch.Tensor, basis_t: torch.Tensor) -> torch.Tensor:
    """``c_hat @ basis_t`` of S stacked flushes c_hat [S, B, H, m, n] with basis_t [H, n, d] (or
    [B or 1, H, n, d]: a prefill basis) -> [S, B, H, m, d], each (flush, batch, head) product the one
    :meth:`SVDqLayerState._encode` computed (m rows): one batched product per head, the head's
    basis broadcast over the flushes (not copied S times)."""
    s, b, h, m, n = c_hat.shape
    d = basis_t.shape[-1]
    basis_t = basis_t.reshape(-1, h, n, d)
    out = torch.empty(s, b, h, m, d, dtype=c_hat.dtype, device=c_hat.device)
    for j in range(h):  # heads, not tokens
        w = basis_t[:, j].contiguous().expand(s, b, n, d).reshape(s * b, n, d)
        out[:, :, j] = torch.bmm(c_hat[:, :, j].reshape(s * b, m, n), w).view(s, b, m, d)
    return out


@dataclass
class _Prefix:
    """A view of the quantized key prefix, for tests and diagnostics (``.data``, ``.n``)."""

    data: torch.Tensor | None

    @property
    def n(self) -> int:
        return 0 if self.data is None else self.data.shape[2]


@dataclass
class SVDqLayerState(LayerState):
    schedule: tuple
    group: int
    mode: str
    mu: torch.Tensor | None  # [H, d] (calib) -> broadcast; prefill mode: set on the first call
    basis: torch.Tensor | None  # [H, d, n_act]
    v_bits: int | None
    v_group: int | None
    #: the calibration basis on each device it was used on, shared by the layer's states
    #: (``SVDq.new_layer_state``): moved from the CPU once, not once per state
    on_device: dict | None = None
    #: the packed latent groups of positions < n_quant, one call per flush (the packs of one flush:
    #: one per run of equal widths along the schedule)
    packed: CallStore = field(default_factory=CallStore)
    n_quant: int = 0
    #: the fp16 buffer, positions n_quant..n: the pre-RoPE keys (what is stored and counted, to be
    #: quantized once their group completes) and the exact post-RoPE keys attention reads
    pending: Growing = field(default_factory=lambda: Growing(min_spare=4))
    exact: Growing = field(default_factory=lambda: Growing(min_spare=4))
    v: SideStore = field(default_factory=SideStore)
    v_exact: Growing = field(default_factory=Growing)
    basis_bits: int = 0
    _rope: RopeLog | None = None  # the sequence's (cos, sin): decoded keys are rotated with them
    _dtype: torch.dtype | None = None  # the model's dtype and device: what attention reads
    _device: torch.device | None = None
    _seen: int = 0
    _packed_bits: int = 0

    @property
    def k_hat(self) -> "_Prefix":
        """The decoded quantized keys [B, H, n_quant, d] (``.data``; ``.n``)."""
        return _Prefix(self._decode_prefix())

    def _params(self, device):
        """(mu, basis) on ``device``: the calibration basis is copied from the CPU once per
        layer and device (not on every call); a prefill basis is made on the device."""
        if self.mu.device == device:
            return self.mu, self.basis
        key = str(device)
        shared = self.on_device if self.on_device is not None else {}
        if key not in shared:
            shared[key] = (self.mu.to(device), self.basis.to(device))
        self.mu, self.basis = shared[key]
        return self.mu, self.basis

    def _set_prefill_basis(self, k_pre):
        """The per-sequence basis, kept in fp16 as counted (its arithmetic reads it widened)."""
        mu, _, vecs = _svd_basis(k_pre)
        idx = torch.tensor(active_channels(self.schedule, k_pre.shape[-1]), device=k_pre.device)
        mu16, basis16 = mu.half(), vecs[..., idx].half()
        self.basis_bits = 16 * (mu16.numel() + basis16.numel())
        self.mu, self.basis = mu16[:, :, None, :], basis16

    def _work_params(self):
        dt = torch.float64 if self._dtype == torch.float64 else torch.float32  # work_dtype of the keys
        mu, basis = self._params(self._device)  # calibration statistics live on the CPU
        return dt, mu.to(dt), basis.to(dt)

    def _encode(self, k_pre, cos, sin):
        """Quantize complete token groups of pre-RoPE keys; return the packs and k_hat post-RoPE."""
        if self._dtype is None:
            self._dtype, self._device = k_pre.dtype, k_pre.device
        dt, mu, basis = self._work_params()
        c = (k_pre.to(dt) - mu) @ basis  # [B, H, m, n_act]
        packs, c_hat = quantize_latents(c, self.schedule, k_pre.shape[-1] // N_GROUPS, self.group)
        k_hat_pre = mu + c_hat @ basis.transpose(-1, -2)
        return packs, apply_rope(k_hat_pre, Rope(cos, sin)).to(k_pre.dtype)

    def _decode_prefix(self) -> torch.Tensor | None:
        """The quantized keys [B, H, n_quant, d] decoded from the stored packs, post-RoPE, in the
        model's dtype: each run of equal flushes in one pass (one product per flush, batch and
        head, as :meth:`_encode` computed it), then the rotation of their positions."""
        if not self.n_quant:
            return None
        dt, mu, basis = self._work_params()
        parts = []
        for (m, metas), calls, stacked, _ in self.packed.runs():
            c_hat = []
            for i, (nbits, shape, dtype) in enumerate(metas):
                merged = [stacked[f"{i}.{k}"].reshape(calls * shape[0], *stacked[f"{i}.{k}"].shape[2:])
                          for k in ("codes", "scale", "minimum")]
                gp = GroupPacked(*merged, nbits, self.group, 2, (calls * shape[0], *shape[1:]), dtype)
                c_hat.append(dequantize_groups(gp))
            c_hat = c_hat[0].contiguous() if len(c_hat) == 1 else torch.cat(c_hat, dim=-1)
            b, h = metas[0][1][:2]
            if calls == 1:  # _encode's own product
                parts.append(mu + c_hat @ basis.transpose(-1, -2))
                continue
            k_hat = mu + _flush_products(c_hat.view(calls, b, h, m, -1), basis.transpose(-1, -2))
            parts.append(k_hat.permute(1, 2, 0, 3, 4).reshape(b, h, calls * m, -1))
        k_hat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return apply_rope(k_hat, self._rope.rope(0, self.n_quant)).to(self._dtype)

    def _keys(self) -> torch.Tensor:
        """What a single query at the next position reads, post-RoPE: the decoded quantized keys,
        then the fp16 buffer's exact keys."""
        with decode_ops():
            hat = self._decode_prefix()
            if hat is None:
                return self.exact.data
            return hat if not self.exact.n else torch.cat([hat, self.exact.data], dim=2)

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if k_pre is None or rope is None:
            raise ValueError("svdq is a pre-RoPE codec: attend needs k_pre and rope")
        n0, n = self._seen, self._seen + k.shape[2]
        if prefill and n0:
            raise ValueError("prefill must be the first call on a layer state")
        if self.mode == "auto" and not n0:  # §3.1: the prefill basis where the regime allows it
            self.mode = "prefill" if prefill else "calib"
            if prefill:
                self.mu = self.basis = None
        if self.mode == "prefill" and self.mu is None:
            if not prefill:
                raise ValueError(
                    "svdq basis='prefill' needs the prefill-exact regime: the first call must be "
                    "prefill=True (in Q-all the basis would see future keys); use basis='calib'"
                )
            self._set_prefill_basis(k_pre)
        self._dtype, self._device = k_pre.dtype, k_pre.device
        self._rope = log_rope(self._rope, n0, rope)
        g, t = self.group, k.shape[2]
        pk = self.n_quant  # read quantized by every new query
        m = g * (n // g) - pk  # tokens whose group completes now
        single = t == 1 and not prefill
        kp = exact = None
        if not single and not prefill:
            with decode_ops():
                kp = self._decode_prefix()
            # the positions pk.. at full precision (before the group is replaced)
            exact = k if not self.exact.n else torch.cat([self.exact.data, k], dim=2)
        self.exact.append(k)
        self.pending.append(k_pre)
        if self.v_bits is None:
            self.v_exact.append(v)
        else:  # quantized on arrival, no residual window
            vg = self.v_group or min(32, v.shape[-1])
            self.v.append_quantized(v, lambda x: quantize_dequantize_groups(x, self.v_bits, vg, axis=3))
        v_all = self.v_exact.data if self.v_bits is None else None
        out = None
        if single:  # the query at n0 reads keys < G_t floor(n0/G_t) = pk quantized: the cache as stored
            out = causal_attention(q, self._keys(), v_all if v_all is not None else self.v.read(), scaling)
        new_hat = self._flush(m) if m > 0 else None
        self._seen = n
        if not prefill and t > 1:
            with host_ops():
                self._reads = self._read_bits(n0, t, k)
        else:
            self._reads = None if prefill else self._read_bits(n0, t, k)
        if out is not None:
            return out
        if prefill:
            return causal_attention(q, k, v, scaling)
        if v_all is None:
            v_all = self.v.read()
        hat_tail = exact if new_hat is None else (
            new_hat if new_hat.shape[2] == exact.shape[2] else torch.cat([new_hat, exact[:, :, m:]], dim=2))
        if t >= SDPA_MIN_QUERIES:
            return blocked_attention(q, kp, exact, hat_tail, g, None, v_all, None, None, scaling)
        tpos = torch.arange(n0, n, device=q.device)[:, None]
        key_mask = torch.arange(pk, n, device=q.device)[None, :] < g * torch.div(
            tpos, g, rounding_mode="floor"
        )
        return mixed_attention(q, kp, exact, hat_tail, key_mask, None, v_all, None, None, scaling)

    def _flush(self, m: int) -> torch.Tensor:
        """Quantize the first m buffered keys (complete groups), store their packs and drop them
        from the fp16 buffer; returns their decoded post-RoPE form."""
        rope = self._rope.rope(self.n_quant, self.n_quant + m)
        packs, new_hat = self._encode(self.pending.data[:, :, :m], rope.cos, rope.sin)
        metas = tuple((gp.nbits, gp.shape, gp.dtype) for gp in packs)
        parts = {f"{i}.{k}": getattr(gp, k) for i, gp in enumerate(packs) for k in ("codes", "scale", "minimum")}
        self.packed.append((m, metas), parts)
        self._packed_bits += sum(p.bits() for p in packs)
        self.pending.drop_front(m)
        self.exact.drop_front(m)
        self.n_quant += m
        return new_hat

    def read_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, H, n, d] as a single query at the next position reads them, in the model's
        dtype."""
        return self._keys(), (self.v_exact.data if self.v_bits is None else self.v.read())

    def _read_bits(self, n0, t, k):
        """Per query position p: keys 0..G_t*floor(p/G_t)-1 quantized, the rest in the fp16
        buffer, plus the per-sequence basis; values exact or quantized on arrival."""
        g, row = self.group, k.shape[0] * k.shape[1] * k.shape[3]
        per_token = self._packed_bits / self.n_quant if self.n_quant else 0.0
        if t == 1:  # a decode step: Python numbers
            bits_k = held_bits(n0 + 1, g * (n0 // g), per_token, 16.0 * row, self.basis_bits)
            bits_v = (n0 + 1) * 16.0 * row if self.v_bits is None else self.v.reads(n0 + 1, n0 + 1, row)
            return one_read(bits_k), one_read(bits_v)
        p = query_positions(n0, t)
        bits_k = held_bits(p + 1, g * torch.floor(p / g), per_token, 16.0 * row, self.basis_bits)
        if self.v_bits is None:
            return bits_k, (p + 1) * 16.0 * row
        return bits_k, self.v.reads(p + 1, p + 1, row)

    def stored_bits(self):
        buf = 0 if not self.pending.n else self.pending.data.numel() * 16
        if self.v_bits is None:
            bits_v = self.v_exact.n * row_elements(self.v_exact) * 16
        else:
            bits_v = self.v.bits()
        return self._packed_bits + buf + self.basis_bits, bits_v

    @property
    def n_seen(self):
        return self._seen


@dataclass
class SVDq(KVMethod):
    """SVDq (Hong et al., arXiv 2502.15304), docs/methods.md §3; see the module docstring.

    basis: "calib" | "prefill"; schedule: explicit 8 latent-group bit widths (overrides the
    budget); group: G_t, tokens per quantization group; budget: "mean" | "total" (what the target
    measures); v_bits/v_group: value quantizer (None = values exact unless ``bpd_v`` is given)."""

    name = "svdq"
    rows_in_one_state = True  # per-sequence bases per row (batched SVD); bits by position
    needs_calibration = True

    basis: str = "auto"
    schedule: tuple | None = None
    group: int | None = None
    budget: str = "measured"
    v_bits: int | None = None
    v_group: int | None = None

    def __post_init__(self):
        if self.basis not in BASES:
            raise ValueError(f"svdq: basis must be one of {BASES}, got {self.basis!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"svdq: budget must be one of {BUDGETS}, got {self.budget!r}")
        if self.group is not None and (int(self.group) != self.group or self.group < 1):
            raise ValueError(f"svdq: group must be a positive integer (or null), got {self.group!r}")
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
        self._group = self.group or DEFAULT_GROUP
        self._fit = None
        if self.schedule is not None:
            self._sched = self.schedule
        elif bpd_k is None:
            self._sched = PAPER_SCHEDULE
        elif self.budget == "measured":
            lo = min(predicted_bpd((1,) + (0,) * (N_GROUPS - 1), g, d, self.regime, self._basis_kind())
                     for g in self._groups())
            if not under_ceiling(lo, bpd_k):  # the ceiling of docs/methods.md §0.1
                raise Unsupported(self._unreachable(bpd_k, d))
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
            floor = schedule_nominal((1,) + (0,) * (N_GROUPS - 1), self._group)
            if bpd_k < floor - _EPS:
                raise Unsupported(
                    f"svdq: bpd={bpd_k} is below the reachable range: bpd >= {floor:g} "
                    f"(1 bit in one latent group + {32 / (N_GROUPS * self._group):g} of metadata, "
                    f"G_t={self._group}), plus the basis/buffer shares"
                )
            if bpd_k >= schedule_nominal((8,) * N_GROUPS, self._group) - _EPS:
                self._sched = (8,) * N_GROUPS
        self._v = (None, None)
        if bpd_v is not None or self.v_bits is not None:
            self._v = grid_choice(
                bpd_v, bits=self.v_bits, group=self.v_group, max_group=d, divides=d,
                side="v_bpd", method="svdq",
            )
        self._head_dim = d
        self._maybe_resolve()

    def _groups(self) -> tuple[int, ...]:
        if self.group is not None:
            return (int(self.group),)
        chosen = self.chosen_knobs
        return (int(chosen["group"]),) if chosen else GROUP_GRID

    def _totals(self) -> range | tuple[int, ...]:
        """Schedule sizes S the measured fit tries: 1..64, or the knob search's candidate's."""
        chosen = self.chosen_knobs
        if chosen and chosen.get("total_bits") is not None:
            return (int(chosen["total_bits"]),)
        return range(1, 8 * N_GROUPS + 1)

    def searches(self) -> tuple[str, ...]:
        """``"knobs"``: the measured fit's G_t (and the paper's schedule) chosen on held-out text
        unless ``schedule`` or ``group`` is given (docs/methods.md §3.3)."""
        explicit = self.schedule is not None or self.group is not None
        return ("knobs",) if self.budget == "measured" and not explicit else ()

    def knob_candidates(self, shape, bpd_k, bpd_v, limit=None):
        """The knob search's points (docs/methods.md §3.3): the paper's schedule at G_t = 128 first
        when admissible, then one point per G_t of :data:`GROUP_GRID` whose cheapest schedule
        (one bit in one latent group) is under the ceiling, ``total_bits=None``: the fit then
        gives that G_t the most schedule bits under the ceiling (the greedy schedule, known after
        calibration, so admissible by construction). Ordered by the schedule bits an upper bound
        of the cost allows (S/8 + min(S, 8)/8 32/G_t), the most first (:func:`methods.budget.spread`)."""
        if bpd_k is None or "knobs" not in self.searches() or shape.head_dim % N_GROUPS:
            return []
        if bpd_v is not None or self.v_bits is not None:
            try:
                grid_choice(bpd_v, bits=self.v_bits, group=self.v_group, max_group=shape.head_dim,
                            divides=shape.head_dim, side="v_bpd", method="svdq")
            except Unsupported:
                return []
        d, kind, target = shape.head_dim, self._basis_kind(), float(bpd_k)

        def worst(s, g):  # every bit in its own latent group: the most metadata S bits can cost
            sched = tuple(1 + (s - 1 - j) // N_GROUPS if j < s else 0 for j in range(N_GROUPS))
            return predicted_bpd(sched, g, d, self.regime, kind)

        bound = {}  # G_t -> the most schedule bits the upper bound admits (0: only fewer than 1 fit)
        for g in GROUP_GRID:
            if under_ceiling(predicted_bpd((1,) + (0,) * (N_GROUPS - 1), g, d, self.regime, kind), target):
                bound[g] = max((s for s in range(1, 8 * N_GROUPS + 1) if under_ceiling(worst(s, g), target)),
                               default=0)
        paper = {"group": DEFAULT_GROUP, "total_bits": 16}
        if not under_ceiling(predicted_bpd(PAPER_SCHEDULE, DEFAULT_GROUP, d, self.regime, kind), target):
            paper = None
        points = [{"group": g, "total_bits": None} for g in bound]
        return spread(points, lambda p: (bound[p["group"]], p["group"]), limit, first=paper)

    def _basis_kind(self) -> str:
        """The basis the fitted regime will use: ``auto`` is the prefill basis in prefill-exact
        regimes and the calibration basis in Q-all (§3.1)."""
        if self.basis != "auto":
            return self.basis
        return "prefill" if self.regime.kind == "prefill" else "calib"

    def _unreachable(self, target, d) -> str:
        r = self.regime
        lo = min(predicted_bpd((1,) + (0,) * (N_GROUPS - 1), g, d, r, self._basis_kind()) for g in self._groups())
        hi = max(predicted_bpd((8,) * N_GROUPS, g, d, r, self._basis_kind()) for g in self._groups())
        return (f"svdq: bpd={target} is not reachable in {describe(r)} ({self._basis_kind()} basis): the "
                f"measured bpd_K, fp16 buffer and metadata included, lies in [{lo:.3g}, {hi:.3g}] "
                f"for G_t in {list(self._groups())} (budget='mean' counts the schedule mean only)")

    def _fit_schedule(self, group_var, d):
        """budget='measured': among schedules of S = 1..64 bits (greedy, the paper's at 16) and
        G_t in the grid, those whose predicted measured bpd_K in the regime is at most 2 % above
        the target (the tables' "at target" band); those inside the band come first, then the
        least expected key distortion (fraction of reads quantized x relative MSE of the
        schedule). Sets the group size; Unsupported when none fits."""
        best, band = None, AT_TARGET * self._target
        for s in self._totals():
            sched = PAPER_SCHEDULE if s == 16 else greedy_schedule(s, group_var, d)
            for g in self._groups():
                pred = predicted_bpd(sched, g, d, self.regime, self._basis_kind())
                if not under_ceiling(pred, self._target):
                    continue
                proxy = quantized_share(g, self.regime) * schedule_mse(sched, group_var)
                key = (pred < self._target - band, proxy, -s, -g)  # at the target first
                if best is None or key < best[0]:
                    best = (key, sched, g, pred)
        if best is None:
            raise Unsupported(self._unreachable(self._target, d))
        _, sched, self._group, pred = best
        self._fit = {"regime": dataclasses.asdict(self.regime), "basis": self._basis_kind(),
                     "predicted_bpd_k": pred}
        if self.chosen_knobs is not None:
            self._fit["chosen_by"] = "held-out knob search"
        return sched

    def _resolve_schedule(self, group_var, d):
        if self.budget == "measured":
            return self._fit_schedule(group_var, d)
        if self.budget == "mean":
            s = self._total_bits
            return PAPER_SCHEDULE if s == 16 else greedy_schedule(s, group_var, d)
        for s in range(min(8 * N_GROUPS, math.floor(8 * self._target + _EPS)), 0, -1):
            sched = PAPER_SCHEDULE if s == 16 else greedy_schedule(s, group_var, d)
            if schedule_nominal(sched, self._group) <= self._target + _EPS:
                return sched
        raise Unsupported(f"svdq: no schedule fits bpd={self._target}")  # excluded by configure

    # ---- calibration --------------------------------------------------------------------------
    def calibrate(self, stats, seed=0):
        self._mu, self._basis, lam = [], [], []
        self._layer_cache = {}  # per-layer bases of the previous calibration
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

    def static_bytes(self) -> int:
        """The calibration basis (its active columns) and mean per layer at fp16; 0 with a
        per-sequence prefill basis, which is counted in bpd."""
        if self._basis_kind() != "calib" or not getattr(self, "_basis", None):
            return 0
        n_act = len(active_channels(self._schedule(), self._head_dim))
        bits = sum(16 * (mu.numel() + basis.shape[0] * basis.shape[1] * n_act)
                   for mu, basis in zip(self._mu, self._basis))
        return bits // 8

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
        group = getattr(self, "_group", None) or self.group or DEFAULT_GROUP
        if self.basis == "prefill":
            return SVDqLayerState(sched, group, "prefill", None, None, vb, vg)
        if not hasattr(self, "_basis"):
            raise RuntimeError(f"svdq basis={self.basis!r} needs calibrate(stats) first")
        mu, basis, on_device = self._layer_params(layer, sched)
        return SVDqLayerState(sched, group, self.basis, mu, basis, vb, vg, on_device)

    def _layer_params(self, layer: int, sched) -> tuple:
        """(mu [1, H, 1, d], active basis columns [H, d, n_act], per-device copies) of a layer,
        made once per schedule and shared by every state of the layer (a job makes one state per
        layer per sequence)."""
        cache = self.__dict__.setdefault("_layer_cache", {})
        key = (layer, tuple(sched))
        if key not in cache:
            d = self._basis[layer].shape[-1]
            idx = torch.tensor(active_channels(sched, d))
            cache[key] = (self._mu[layer][None, :, None, :], self._basis[layer][:, :, idx], {})
        return cache[key]

    def knobs(self):
        vb, vg = getattr(self, "_v", (self.v_bits, self.v_group))
        sched = getattr(self, "_sched", None) or self.schedule
        return {
            "basis": self.basis,
            "basis_rule": "prefill basis after an exact prefill, calibration basis in Q-all"
            if self.basis == "auto" else self.basis,
            "schedule": list(sched) if sched else None,
            "group_tokens": getattr(self, "_group", None) or self.group or DEFAULT_GROUP,
            "budget": self.budget,
            "fit": getattr(self, "_fit", None),
            "v_bits": vb,
            "v_group": vg,
            **self._predicted(vb, vg),
        }

    def _predicted(self, vb, vg) -> dict:
        """``{"predicted": {bpd_k, bpd_v}}`` of a knob search's candidate (the fit's prediction),
        else ``{}``."""
        fit = getattr(self, "_fit", None)
        if self.chosen_knobs is None or not fit:
            return {}
        return {"predicted": {"bpd_k": fit["predicted_bpd_k"], "bpd_v": 16.0 if vb is None else vb + 32.0 / vg}}

    def nominal_bpd(self, n_tokens):
        t = n_tokens
        sched = self._schedule()
        d = getattr(self, "_head_dim", None)
        group = getattr(self, "_group", None) or self.group or DEFAULT_GROUP
        n_b = t % group
        bpd_k = ((t - n_b) * schedule_nominal(sched, group) + 16.0 * n_b) / t
        if self._basis_kind() == "prefill":
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
