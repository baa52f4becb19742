"""H2O: heavy-hitter oracle token eviction (METHODS.md §6)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .attention import causal_attention
from .base import KVMethod, LayerState, Unsupported
from .sparsifier import (
    attention_column_sums,
    compute_dtype,
    recent_plus_top,
    round_half_up,
    shared_target,
)

#: official defaults (`--heavy_ratio 0.1 --recent_ratio 0.1`), used when no bpd target is given
DEFAULT_RATIO = 0.1


@dataclass
class H2O(KVMethod):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", NeurIPS 2023, arXiv 2306.14048; code FMInference/H2O), METHODS.md §6.

    Keeps the tokens with the largest accumulated attention ("heavy hitters") plus a recent
    window; K and V are evicted together (post-RoPE, whole tokens).

    * ``prefill=True`` (real-drop, §6.2): exact causal attention over the prompt; score = column
      sums of the causal prefill attention; keep the top-C_h older tokens and the last C_r, with
      C_h = round(heavy_ratio·P), C_r = round(recent_ratio·P) fixed for the rest of the sequence.
    * ``prefill=False`` (decode, §6.2/§6.3): per token, append, attend over the kept set, add the
      attention row to the scores, evict the lowest-score non-recent token while |cache| > C. From
      an empty state this is the causal-exact Q-all mask of §6.3 with the growing budget
      C_t = max(min_budget, ⌈ρ(t+1)⌉), recent share C_r,t = round(C_t·recent_ratio/ρ).

    Budget (§6.4): ``bpd`` and ``v_bpd`` are one budget spent on K and V (different values raise
    :class:`Unsupported`); ρ = heavy_ratio + recent_ratio = target / (16 + 16/d), split half/half
    (16 + 16/d = 16.125 at d = 128: an fp32 score per kept token per KV head shared by K and V);
    ``count_indices`` adds a 32-bit position per kept token (another 16/d per element and side).
    Without a target: the official 0.1 / 0.1.

    Decisions where METHODS.md is silent:

    * GQA: one kept set per KV head, score = mean over its g query heads (§6.2 [decision]).
    * Batch elements are independent sequences (the official code sums scores over the batch).
    * Rounding of every token count: half up. Prefill budgets below ``min_budget`` are raised to
      C = min_budget, C_r = round(C·recent_ratio/ρ); odd C_t gives the recent window the extra
      token. The prefill keeps everything when P ≤ C_h + C_r.
    * Ties: the older token is evicted (top-k keeps the later one; argmin takes the oldest).
    * With a target and one explicit ratio, the other ratio is ρ minus it; two explicit ratios
      must sum to ρ. Scores accumulate in float32 (float64 for float64 inputs) and are counted as
      fp32.
    * Prefill outputs come from ``attention.causal_attention`` (the FP16 baseline's kernel); the
      scores and every decode step are eager float32 softmax (the probabilities are needed).
    """

    name = "h2o"
    evicts_tokens = True

    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    min_budget: int = 8
    count_indices: bool = False

    def __post_init__(self):
        for label, r in (("heavy_ratio", self.heavy_ratio), ("recent_ratio", self.recent_ratio)):
            if r is not None and not 0.0 <= r <= 1.0:
                raise ValueError(f"h2o: {label} must be in [0, 1], got {r}")
        if isinstance(self.min_budget, bool) or int(self.min_budget) != self.min_budget:
            raise ValueError(f"h2o: min_budget must be an integer, got {self.min_budget!r}")
        if self.min_budget < 1:
            raise ValueError(f"h2o: min_budget must be >= 1, got {self.min_budget}")
        self._shape = None
        self._target = None
        self._ratios = self._default_ratios()
        self._check_ratios(*self._ratios)

    def _default_ratios(self) -> tuple[float, float]:
        h = DEFAULT_RATIO if self.heavy_ratio is None else self.heavy_ratio
        r = DEFAULT_RATIO if self.recent_ratio is None else self.recent_ratio
        return h, r

    @staticmethod
    def _check_ratios(h: float, r: float) -> None:
        if not 0.0 < h + r <= 1.0 + 1e-12:
            raise ValueError(f"h2o: heavy_ratio + recent_ratio must be in (0, 1], got {h + r}")

    def bits_per_element(self, head_dim: int) -> float:
        """Bits per kept element and side: 16 + fp32 score / (2d) (+ int32 position / (2d))."""
        return 16.0 + (16.0 / head_dim) * (2 if self.count_indices else 1)

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        target = shared_target("h2o", bpd_k, bpd_v)
        self._target = target
        if target is None:
            self._ratios = self._default_ratios()
            self._check_ratios(*self._ratios)
            return
        per = self.bits_per_element(shape.head_dim)
        if not 0.0 < target <= per:
            raise Unsupported(
                f"h2o: bpd={target} unreachable; eviction spends {per:g} bits per kept element, "
                f"so targets lie in (0, {per:g}]"
            )
        rho = target / per
        h, r = self.heavy_ratio, self.recent_ratio
        if h is None and r is None:
            h = r = rho / 2
        elif h is None:
            h = rho - r
        elif r is None:
            r = rho - h
        elif abs(h + r - rho) > 1e-9:
            raise ValueError(
                f"h2o: heavy_ratio + recent_ratio = {h + r:g} but bpd={target} needs ρ = {rho:g}; "
                "give at most one ratio together with a bpd target"
            )
        if h < 0 or r < 0:
            raise Unsupported(f"h2o: bpd={target} gives ρ = {rho:g}, below the fixed ratio")
        self._ratios = (h, r)

    def new_layer_state(self, layer):
        h, r = self._ratios
        return H2OLayerState(h, r, int(self.min_budget), bool(self.count_indices))

    def knobs(self):
        h, r = self._ratios
        return {
            "heavy_ratio": h,
            "recent_ratio": r,
            "rho": h + r,
            "min_budget": int(self.min_budget),
            "count_indices": bool(self.count_indices),
        }

    def nominal_bpd(self, n_tokens):
        """§6.4: ρ·(16 + 32/(2d)) on each side (floors and rounding not included)."""
        if self._shape is None:
            raise RuntimeError("h2o: call configure() before nominal_bpd()")
        bpd = sum(self._ratios) * self.bits_per_element(self._shape.head_dim)
        return bpd, bpd


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """One intra-op thread on a CPU for the duration: the per-token loop runs a dozen tiny ops per
    token, and a second OpenMP thread only adds fork/join and spin-wait time to each of them (2-5x
    slower on a 2-core machine, far worse when it is shared). Restored afterwards."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


#: query rows per block of the decode-mode logits and outputs: only the columns a block's queries
#: can see are computed (about half of the [n, m + n] matrix for a long chunk)
ROW_BLOCK = 256


def _causal_logits(q: torch.Tensor, kw: torch.Tensor, m: int, scaling: float) -> list[torch.Tensor]:
    """Logits of the n new queries over the m kept + n new keys, in row blocks: block [r0, r1) is
    [B, Hkv, g, r1 - r0, m + r1] (compute dtype), one GEMM per KV head with the scaling folded in.
    The strict upper triangle of each block's diagonal part (keys after the query) is zeroed: those
    logits are never read and the probabilities there are 0."""
    b, hq, n, d = q.shape
    h = kw.shape[1]
    g = hq // h
    cdt = compute_dtype(q)
    qg = q.to(cdt).reshape(b * h, g, n, d)
    kt = kw.to(cdt).reshape(b * h, m + n, d).transpose(1, 2)
    none = torch.zeros((), dtype=cdt, device=q.device)
    blocks = []
    for r0 in range(0, n, ROW_BLOCK):
        r1 = min(n, r0 + ROW_BLOCK)
        qb = qg[:, :, r0:r1].reshape(b * h, g * (r1 - r0), d)
        blk = torch.baddbmm(none, qb, kt[:, :, : m + r1], beta=0.0, alpha=scaling)
        blk = blk.view(b, h, g, r1 - r0, m + r1)
        upper = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=q.device).triu(1)
        blk[..., m + r0 :].masked_fill_(upper, 0.0)
        blocks.append(blk)
    return blocks


def _block_output(blk: torch.Tensor, vw: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Probabilities [B, Hkv, g, r, c] x values [B, Hkv, >= c, d] -> outputs [B, Hkv*g, r, d]."""
    b, h, g, r, c = blk.shape
    out = torch.bmm(blk.reshape(b * h, g * r, c), vw[:, :, :c].to(blk.dtype).reshape(b * h, c, -1))
    return out.view(b, h, g, r, -1).reshape(b, h * g, r, -1).to(out_dtype)


@dataclass
class H2OLayerState(LayerState):
    """One layer's H2O cache: kept K, V [B, Hkv, C, d] (same C for every head), their fp32
    scores [B, Hkv, C] and positions [B, Hkv, C] (bookkeeping for the recent window)."""

    heavy_ratio: float
    recent_ratio: float
    min_budget: int = 8
    count_indices: bool = False

    def __post_init__(self):
        self._k = self._v = self._score = self._pos = None
        self._seen = 0
        self._fixed: tuple[int, int] | None = None  # (C, C_r) after a prefill

    # -- budgets --------------------------------------------------------------------------------
    @property
    def rho(self) -> float:
        return self.heavy_ratio + self.recent_ratio

    def prefill_budget(self, p: int) -> tuple[int, int]:
        """(C_h, C_r) for a P-token prompt (§6.2), at least ``min_budget`` in total."""
        c_h, c_r = round_half_up(self.heavy_ratio * p), round_half_up(self.recent_ratio * p)
        if c_h + c_r < self.min_budget:
            c = self.min_budget
            c_r = round_half_up(c * self.recent_ratio / self.rho)
            c_h = c - c_r
        return c_h, c_r

    def qall_budget(self, t: int) -> tuple[int, int]:
        """(C_t, C_r,t) at query position t from an empty state (§6.3)."""
        c = max(self.min_budget, math.ceil(self.rho * (t + 1) - 1e-9))
        return c, round_half_up(c * self.recent_ratio / self.rho)

    def budget(self, t: int) -> tuple[int, int]:
        return self._fixed if self._fixed is not None else self.qall_budget(t)

    # -- attention ------------------------------------------------------------------------------
    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"h2o: {q.shape[1]} query heads for {k.shape[1]} KV heads")
        if prefill:
            return self._prefill(q, k, v, scaling)
        return self._decode(q, k, v, scaling)

    def _prefill(self, q, k, v, scaling):
        if self._seen:
            raise ValueError("h2o: prefill must be the first call on a layer state")
        b, h, p, _ = k.shape
        out = causal_attention(q, k, v, scaling)
        # column sums of the causal prefill attention, group mean over g query heads: [B, Hkv, P]
        score = attention_column_sums(q, k, scaling).mean(dim=2)
        c_h, c_r = self.prefill_budget(p)
        self._fixed = (c_h + c_r, c_r)
        pos = torch.arange(p, device=k.device).expand(b, h, p)
        if p <= c_h + c_r:
            idx = pos
        else:
            idx = recent_plus_top(score, c_h + c_r, c_r)
        self._store(k, v, score, pos, idx)
        self._seen = p
        return out

    def _decode(self, q, k, v, scaling):
        b, h, n, _ = k.shape
        dev = k.device
        cdt = compute_dtype(q)
        m = 0 if self._k is None else self._k.shape[2]
        new_pos = torch.arange(self._seen, self._seen + n, device=dev).expand(b, h, n)
        if m:
            kw = torch.cat([self._k, k.to(self._k.dtype)], dim=2)
            vw = torch.cat([self._v, v.to(self._v.dtype)], dim=2)
            pos = torch.cat([self._pos, new_pos], dim=-1)
            score = torch.cat([self._score, self._score.new_zeros(b, h, n)], dim=-1)
        else:
            kw, vw, pos = k, v, new_pos
            score = torch.zeros(b, h, n, dtype=cdt, device=dev)
        # pen: 0 for a kept token, +inf once evicted. Row i reads only its m + i + 1 visible
        # columns (later tokens are simply not in the slice), so a step costs a handful of ops.
        pen = torch.zeros(b, h, m + n, dtype=score.dtype, device=dev)
        g = q.shape[1] // h
        # logits in row blocks; row i is overwritten by its probabilities at step i
        blocks = _causal_logits(q, kw, m, scaling)
        rows = [r for blk in blocks for r in blk.unbind(dim=3)]  # views, made once
        pens = pen[:, :, None, :]
        kept = m
        with _one_thread(q.device):
            kept = self._evict_loop(rows, pens, pen, score, pos, m, n, g, kept)
        keep = pen == 0
        out = torch.cat([_block_output(blk, vw, q.dtype) for blk in blocks], dim=2)
        idx = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :kept]
        self._store(kw, vw, score, pos, idx.sort(dim=-1).values)
        self._seen += n
        return out

    def _evict_loop(self, rows, pens, pen, score, pos, m, n, g, kept):
        """The per-token part of :meth:`_decode`: row i's softmax over the kept tokens, the score
        update, then evictions down to the budget. Returns the number of tokens kept."""
        inf = float("inf")
        for i in range(n):
            t = self._seen + i
            w = m + i + 1
            kept += 1
            row = rows[i][..., :w]
            p_i = torch.softmax(row - pens[..., :w], dim=-1)
            row.copy_(p_i)
            score[..., :w].add_(p_i.sum(dim=2), alpha=1.0 / g)  # the group mean
            cap, c_r = self.budget(t)
            if kept > cap:
                if m == 0:  # positions are seen + index: the eligible (old) tokens are a prefix
                    lim = max(1, t - c_r - self._seen + 1)
                    cand_s, cand_p = score[..., :lim], pen[..., :lim]
                else:
                    old = pos <= t - c_r
                while kept > cap:
                    if m == 0:
                        j = (cand_s + cand_p).argmin(dim=-1, keepdim=True)
                    else:
                        j = torch.where(old, score + pen, inf).argmin(dim=-1, keepdim=True)
                    pen.scatter_(-1, j, inf)
                    kept -= 1
        return kept

    def _store(self, k, v, score, pos, idx):
        d_idx = idx[..., None].expand(*idx.shape, k.shape[-1])
        self._k = k.gather(2, d_idx)
        self._v = v.gather(2, idx[..., None].expand(*idx.shape, v.shape[-1]))
        self._score = score.gather(-1, idx)
        self._pos = pos.gather(-1, idx)

    # -- accounting -----------------------------------------------------------------------------
    def stored_bits(self):
        """16 bits per kept element + an fp32 score per kept token and KV head, half to K and
        half to V (+ a 32-bit position, split the same way, with ``count_indices``)."""
        if self._k is None:
            return 0, 0
        meta = self._score.numel() * 32 // 2
        if self.count_indices:
            meta += self._pos.numel() * 32 // 2
        return self._k.numel() * 16 + meta, self._v.numel() * 16 + meta

    @property
    def n_seen(self):
        return self._seen

    @property
    def n_kept(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def kept_positions(self) -> torch.Tensor | None:
        """Positions [B, Hkv, C] of the kept tokens (ascending), for tests and diagnostics."""
        return self._pos
