"""H2O: heavy-hitter oracle token eviction (docs/methods.md §6)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from . import h2o_fused
from .attention import causal_attention
from .base import KVMethod, Unsupported
from .budget import in_band
from .eviction import EvictionLayerState, top_and_recent
from .sparsifier import attention_column_sums, compute_dtype, round_half_up, shared_target

#: official defaults (`--heavy_ratio 0.1 --recent_ratio 0.1`), used when no bpd target is given
DEFAULT_RATIO = 0.1


@dataclass
class H2O(KVMethod):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", NeurIPS 2023, arXiv 2306.14048; code FMInference/H2O), docs/methods.md §6.

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
    :class:`Unsupported`). ``budget="measured"`` (default): a Q-all state (PPL track A,
    zero-shot) uses a ρ fitted so that the measured figure of docs/methods.md §0 — the mean over
    query positions of what each query read, the min_budget floor and the query itself included
    (:func:`qall_mean_bpd`) — is the target at the job's regime length (``knobs.rho_qall``). In a
    prefill regime (PPL track B, LongBench, RULER: P prompt tokens, then D decoded) the kept count
    C = ρP stays fixed while the held positions grow, so the scored positions read
    [C/P + Σ_j (C+1)/(P+j)] / (1 + D) of the cache (:func:`prefill_mean_bpd`; the prompt's own
    prediction at the end-of-prefill figure); the fit takes the C whose figure is closest to the
    target (``knobs.predicted_prefill_bpd``), so the end of prefill sits above it (1.15 at 1 bpd,
    P = 1536, D = 511). ``budget="nominal"``: always ρ = target / (16 + 16/d)
    (the formula of §6.4; in Q-all the cache then holds more than the label: 1.23 at 1.0, T=2048),
    split half/half
    (16 + 16/d = 16.125 at d = 128: an fp32 score per kept token per KV head shared by K and V);
    ``count_indices`` adds a 32-bit position per kept token (another 16/d per element and side).
    Without a target: the official 0.1 / 0.1.

    Decisions where docs/methods.md is silent:

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
    * The sequential recursion (decode and Q-all) runs over row blocks
      of logits, one block alive at a time (:data:`ROW_BLOCK` rows, fewer past
      :data:`BLOCK_ELEMS`); one token is a few ops over all heads at once: mask add, softmax,
      write-back of the probabilities, one GEMM adding the group mean into the negated score,
      and per eviction an argmax and one scatter of -inf into mask and score together (four to
      six ops, 5.6 per token on average at rho = 0.25). The outputs are one GEMM per block.
      (Scattering -inf into the block's later rows instead would drop the mask add and the
      write-back, 3.6 ops per token, but was 1.5x slower on a CPU: strided writes per eviction.)
    * ``fused`` (``auto`` | ``on`` | ``off``): the same recursion as one Triton kernel launch per
      block (:mod:`methods.h2o_fused`): ``auto`` on CUDA where Triton is installed, the torch loop
      above (the reference) elsewhere; ``on`` insists (an error where it cannot run, unless
      Triton's interpreter is active), ``off`` never. Same kept sets, counts and outputs up to
      rounding (tests/test_h2o_fused.py).
    """

    name = "h2o"
    rows_in_one_state = True  # scores and kept sets per row; the kept count by position
    evicts_tokens = True

    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    min_budget: int = 8
    count_indices: bool = False
    budget: str = "measured"
    fused: str = "auto"

    def __post_init__(self):
        h2o_fused.check_choice(self.fused)
        if self.budget not in ("measured", "nominal"):
            raise ValueError(f"h2o: budget must be 'measured' or 'nominal', got {self.budget!r}")
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
        self._predicted, self._qall_scale, self._predicted_prefill = None, 1.0, None
        if self.budget == "measured" and self.regime.kind == "qall":
            self._qall_scale = self._fit_qall(target, per) / rho
        kept = None
        if self.budget == "measured" and self.regime.kind == "prefill":
            kept = self._fit_prefill(target, per)
            rho = kept / self.regime.tokens
        h, r = self.heavy_ratio, self.recent_ratio
        if h is None and r is None and kept is not None:  # halves that round back to C exactly
            h, r = (kept - kept // 2) / self.regime.tokens, (kept // 2) / self.regime.tokens
        elif h is None and r is None:
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

    def _fit_qall(self, target: float, per: float) -> float:
        """ρ whose Q-all mean over positions (:func:`qall_mean_bpd`) is the target: the largest ρ
        at or below it, by bisection (the mean is non-decreasing in ρ)."""
        t = self.regime.tokens
        lo_bpd = qall_mean_bpd(0.0, self.min_budget, t, per)
        if target < lo_bpd - 1e-12:
            raise Unsupported(
                f"h2o: bpd={target} is not reachable in Q-all over {t} positions: with at least "
                f"min_budget={self.min_budget} kept tokens the mean over positions is >= {lo_bpd:.3g} "
                f"(range [{lo_bpd:.3g}, {per:g}]; budget='nominal' maps ρ = bpd/{per:g} instead)"
            )
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if qall_mean_bpd(mid, self.min_budget, t, per) <= target else (lo, mid)
        self._predicted = qall_mean_bpd(lo, self.min_budget, t, per)
        return lo

    def _fit_prefill(self, target: float, per: float) -> int:
        """The kept count C (min_budget <= C <= P) whose :func:`prefill_mean_bpd` in the job's
        prefill regime is closest to the target (the figure is affine in C); :class:`Unsupported`
        when even that is more than 2 % away."""
        p, d = self.regime.tokens, self.regime.decode
        unit = prefill_mean_bpd(1, p, d, per) - prefill_mean_bpd(0, p, d, per)
        exact = (target - prefill_mean_bpd(0, p, d, per)) / unit
        cands = {min(p, max(int(self.min_budget), c)) for c in (math.floor(exact), math.ceil(exact))}
        c = min(sorted(cands), key=lambda n: abs(prefill_mean_bpd(n, p, d, per) - target))
        self._predicted_prefill = prefill_mean_bpd(c, p, d, per)
        if not in_band(self._predicted_prefill, target, eps=1e-12):
            lo, hi = prefill_mean_bpd(int(self.min_budget), p, d, per), prefill_mean_bpd(p, p, d, per)
            raise Unsupported(
                f"h2o: bpd={target} is not reachable after a {p}-token prefill with {d} decoded positions: "
                f"the mean over the scored positions lies in [{lo:.3g}, {hi:.3g}] (min_budget="
                f"{self.min_budget}); budget='nominal' maps ρ = bpd/{per:g} instead")
        return c

    def new_layer_state(self, layer):
        h, r = self._ratios
        scale = getattr(self, "_qall_scale", 1.0)
        return H2OLayerState(h, r, int(self.min_budget), bool(self.count_indices), scale, self.fused)

    def knobs(self):
        h, r = self._ratios
        return {
            "heavy_ratio": h,
            "recent_ratio": r,
            "rho": h + r,
            "min_budget": int(self.min_budget),
            "count_indices": bool(self.count_indices),
            "budget": self.budget,
            "rho_qall": (h + r) * getattr(self, "_qall_scale", 1.0),
            "predicted_qall_bpd": getattr(self, "_predicted", None),
            **({"predicted_prefill_bpd": self._predicted_prefill}
               if getattr(self, "_predicted_prefill", None) is not None else {}),
        }

    def allocation(self):
        """``kept``: the kept fraction of every KV head [L, H_kv], ρ = heavy_ratio + recent_ratio (a
        Q-all state's fitted ``rho_qall``; H2O keeps as many tokens in every head: the map is uniform
        by construction)."""
        if getattr(self, "_shape", None) is None:
            return {}
        kept = float(sum(self._ratios)) * getattr(self, "_qall_scale", 1.0)
        return {"kept": torch.full((self._shape.n_layers, self._shape.n_kv_heads), kept, dtype=torch.float64)}

    def nominal_bpd(self, n_tokens):
        """§6.4: ρ·(16 + 32/(2d)) on each side (floors and rounding not included)."""
        if self._shape is None:
            raise RuntimeError("h2o: call configure() before nominal_bpd()")
        bpd = sum(self._ratios) * self.bits_per_element(self._shape.head_dim)
        return bpd, bpd


def prefill_mean_bpd(kept: int, prompt: int, decode: int, per: float) -> float:
    """docs/methods.md §0 for H2O after an exact ``prompt``-token prefill that keeps ``kept``
    tokens, then ``decode`` decoded positions: the prompt's own prediction reads the stored prompt
    (kept/P), decoded position P+j-1 reads the kept + 1 tokens before its eviction of the P+j held;
    the mean over the 1 + D scored positions, at ``per`` bits per kept element and side."""
    j = torch.arange(1, decode + 1, dtype=torch.float64)
    reads = kept / prompt + float(((kept + 1) / (prompt + j)).sum())
    return reads / (1 + decode) * per


def qall_mean_bpd(rho: float, min_budget: int, tokens: int, per: float) -> float:
    """docs/methods.md §0 for H2O's Q-all cache (§6.3): query p reads min(p, C_{p-1}) + 1 kept
    tokens, C_t = max(min_budget, ceil(ρ (t + 1))), at ``per`` bits per kept element and side;
    the mean over p of that / (p + 1)."""
    p = torch.arange(tokens, dtype=torch.float64)
    cap_before = torch.clamp(torch.ceil(rho * p - 1e-9), min=min_budget)
    kept = torch.minimum(p, cap_before) + 1
    return float((kept / (p + 1)).mean()) * per


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """One intra-op thread on a CPU for the duration: the per-token loop runs four to six tiny ops
    per token, and a second OpenMP thread only adds fork/join and spin-wait time to each of them (2-5x
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


#: query rows per block of the decode-mode logits (at most; fewer when a block would exceed
#: :data:`BLOCK_ELEMS`): only one block of logits is alive at a time, so memory stays bounded at long contexts
ROW_BLOCK = 256
#: logits elements per block (2^26 float32 = 256 MiB): 256 rows up to 8k tokens at 32 query
#: heads, 64 at 32k
BLOCK_ELEMS = 1 << 26


def _block_rows(bh: int, g: int, cols: int) -> int:
    """Query rows per block: ROW_BLOCK, fewer when [B*Hkv, g, rows, cols] exceeds BLOCK_ELEMS."""
    return max(1, min(ROW_BLOCK, BLOCK_ELEMS // max(1, bh * g * cols)))


def _logit_block(qg, kt, m, r0, r1, scaling):
    """Logits of queries r0..r1-1 over the m kept + r1 new keys: [B*Hkv, g, r, m + r1] (compute
    dtype, one GEMM per KV head over its g query heads, the scaling folded in), -inf at the keys
    after each query (their probabilities are then exactly 0)."""
    bh, g, _, d = qg.shape
    r, c = r1 - r0, m + r1
    none = torch.zeros((), dtype=qg.dtype, device=qg.device)
    blk = torch.baddbmm(none, qg[:, :, r0:r1].reshape(bh, g * r, d), kt[:, :, :c], beta=0.0, alpha=scaling)
    blk = blk.view(bh, g, r, c)
    if r > 1:
        later = torch.ones(r, r, dtype=torch.bool, device=qg.device).triu_(1)
        blk[:, :, :, m + r0 :].masked_fill_(later, float("-inf"))
    return blk


def _block_output(blk, vw, out_dtype):
    """Probabilities [B*Hkv, g, r, c] x values [B, Hkv, >= c, d] -> outputs [B, Hkv*g, r, d]."""
    bh, g, r, c = blk.shape
    b, h, _, d = vw.shape
    out = torch.bmm(blk.view(bh, g * r, c), vw[:, :, :c].to(blk.dtype).reshape(bh, c, d))
    return out.view(b, h * g, r, d).to(out_dtype)


@dataclass
class H2OLayerState(EvictionLayerState):
    """One layer's H2O cache: kept K, V [B, Hkv, C, d] (same C for every head), their fp32
    scores [B, Hkv, C] and positions [B, Hkv, C] (bookkeeping for the recent window)."""

    label = "h2o"

    heavy_ratio: float
    recent_ratio: float
    min_budget: int = 8
    count_indices: bool = False
    qall_scale: float = 1.0  # ρ of a Q-all state = (heavy + recent) x this (budget="measured")
    fused: str = "auto"  # the per-token recursion as a Triton kernel (methods/h2o_fused.py)

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
        c = max(self.min_budget, math.ceil(self.rho * self.qall_scale * (t + 1) - 1e-9))
        return c, round_half_up(c * self.recent_ratio / self.rho)

    def budget(self, t: int) -> tuple[int, int]:
        return self._fixed if self._fixed is not None else self.qall_budget(t)

    # -- attention (dispatched by EvictionLayerState.attend) -------------------------------------
    def _prefill(self, q, k, v, scaling):
        if self._seen:
            raise ValueError("h2o: prefill must be the first call on a layer state")
        self._reads = None
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
            idx = top_and_recent(score[..., : p - c_r], c_h, c_r)  # c_r < p here
        self._store(k, v, score, pos, idx)
        self._seen = p
        return out

    def _decode(self, q, k, v, scaling):
        b, h, n, d = k.shape
        dev = k.device
        cdt = compute_dtype(q)
        g = q.shape[1] // h
        bh = b * h
        m = self.n_kept
        new_pos = torch.arange(self._seen, self._seen + n, device=dev).expand(b, h, n)
        # state [2, B*Hkv, m + n]: row 0 the additive mask (0 kept, -inf evicted), row 1 the negated
        # score (-inf evicted); one scatter evicts a token from both
        state = torch.zeros(2, bh, m + n, dtype=cdt, device=dev)
        if m:
            kw = torch.cat([self._k, k.to(self._k.dtype)], dim=2)
            vw = torch.cat([self._v, v.to(self._v.dtype)], dim=2)
            pos = torch.cat([self._pos, new_pos], dim=-1)
            torch.neg(self._score.reshape(bh, m), out=state[1, :, :m])
        else:
            kw, vw, pos = k, v, new_pos
        qg = q.to(cdt).reshape(bh, g, n, d)
        kt = kw.to(cdt).reshape(bh, m + n, d).transpose(1, 2)
        ones = torch.ones(1, g, dtype=cdt, device=dev)
        kept, counts, outs = m, [], []
        rows = _block_rows(bh, g, m + n)
        fused = h2o_fused.use_fused(self.fused, dev, g, m + n)
        with _one_thread(dev):
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                blk = _logit_block(qg, kt, m, r0, r1, scaling)
                live = state[:, :, : m + r1].clone()  # contiguous for the in-place GEMM
                if fused:
                    kept = self._fused_block(blk, live, pos.reshape(bh, m + n), m, r0, kept, counts)
                else:
                    kept = self._evict_loop(blk, live, ones, pos.reshape(bh, m + n), m, r0, kept, counts)
                state[:, :, : m + r1] = live
                outs.append(_block_output(blk, vw, q.dtype))
                del blk  # one block of logits alive at a time
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        neg = state[1]
        keep = torch.isfinite(neg).view(b, h, m + n)
        idx = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :kept]
        self._store(kw, vw, neg.neg_().view(b, h, m + n), pos, idx.sort(dim=-1).values)
        self._seen += n
        per_token = self.token_bits(b, h, d)
        read = torch.tensor(counts, dtype=torch.float64) * per_token  # read before evicting
        self._reads = (read, read.clone())
        return out

    def _evict_loop(self, blk, live, ones, pos, m, r0, kept, counts):
        """The per-token part of :meth:`_decode` over one block ``blk`` [B*Hkv, g, r, c] of
        :func:`_logit_block` and the block's ``live`` state [2, B*Hkv, c] (mask, negated score):
        row i's softmax over the kept keys for all heads at once (mask added, probabilities
        written back into the block for its output), the group-mean score update (one GEMM into
        the negated score), then evictions down to the budget (argmax of the negated score over
        the eligible tokens, one scatter of -inf into mask and score). Returns the number of
        tokens kept; ``counts`` receives the tokens each query read."""
        bh, g, r, c = blk.shape
        pen, neg = live[0], live[1]
        flat = neg.view(1, bh * c)
        x = blk.new_empty(g, bh, c)  # this token's masked logits, group heads outermost
        inv = -1.0 / g
        for li in range(r):
            i = r0 + li
            t = self._seen + i
            kept += 1
            counts.append(kept)
            row = blk[:, :, li]  # [B*Hkv, g, c]: -inf after the query
            torch.add(row.transpose(0, 1), pen, out=x)
            p = torch.softmax(x, dim=-1)  # [g, B*Hkv, c]: 0 after the query and at evicted keys
            row.copy_(p.transpose(0, 1))
            flat.addmm_(ones, p.view(g, bh * c), alpha=inv)  # neg -= mean over the g query heads
            cap, c_r = self.budget(t)
            while kept > cap:
                j = self._victim(neg, pos, m, t, c_r)
                live.scatter_(-1, j.expand(2, *j.shape), float("-inf"))
                kept -= 1
        return kept

    def _fused_block(self, blk, live, pos, m, r0, kept, counts):
        """:meth:`_evict_loop` as one Triton launch (:func:`methods.h2o_fused.evict_block`); the
        evictions per token and the recent-window thresholds come from the budget schedule."""
        n_evict, thresholds, kept = h2o_fused.block_schedule(
            self.budget, self._seen, r0, blk.shape[2], kept, counts)
        h2o_fused.evict_block(blk, live, pos, n_evict, thresholds, nothing_held=m == 0)
        return kept

    def _victim(self, neg, pos, m, t, c_r):
        """[B*Hkv, 1]: the lowest-score token among those at positions <= t - C_r (the largest
        negated score; ties: the oldest, argmax takes the first)."""
        new_old = t - c_r - self._seen + 1  # new tokens (index m..) at positions <= t - C_r
        if m == 0:
            return neg[:, : max(1, new_old)].argmax(dim=-1, keepdim=True)
        if new_old >= 0:  # every kept token is older than the recent window: a prefix
            return neg[:, : m + new_old].argmax(dim=-1, keepdim=True)
        old = pos[:, : neg.shape[1]] <= t - c_r
        return torch.where(old, neg, float("-inf")).argmax(dim=-1, keepdim=True)

    def _store(self, k, v, score, pos, idx):
        self._gather(idx, k, v)
        self._score = score.gather(-1, idx)
        self._pos = pos.gather(-1, idx)

    # -- accounting -----------------------------------------------------------------------------
    def token_bits(self, batch: int, heads: int, head_dim: int) -> int:
        """Bits per kept token and side: 16 d per head + half its fp32 score (+ half a position)."""
        return batch * heads * (16 * head_dim + 16 * (2 if self.count_indices else 1))

    def metadata_bits(self) -> int:
        """An fp32 score per kept token and KV head, half to K and half to V (+ a 32-bit
        position, split the same way, with ``count_indices``)."""
        meta = self._score.numel() * 32 // 2
        if self.count_indices:
            meta += self._pos.numel() * 32 // 2
        return meta

    def kept_positions(self) -> torch.Tensor | None:
        """Positions [B, Hkv, C] of the kept tokens (ascending), for tests and diagnostics."""
        return self._pos
