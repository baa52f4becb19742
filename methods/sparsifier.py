"""Token-selection primitives shared by H2O (docs/methods.md §6) and SnapKV (§7).

The first four functions are the seed's ``sparsifier.py`` (seeds/000, §3-§4) with the seed's names
and semantics; they accept numpy arrays and torch tensors alike and return the input's kind
(numpy index arrays are ``int32`` as in the seed, torch ones ``int64``).

Tie-breaking, used everywhere in this package: **among equal scores the later token is kept**
(the older one is evicted). A stable ascending sort puts ties in position order, so the top-k are
the last k entries; ``argmin`` returns the first (oldest) minimum, which is the same rule for
H2O's one-at-a-time eviction. Max pooling (SnapKV) makes exact ties common, so this matters.

The rest are helpers for the layer states: blocked attention column sums (H2O's prefill score),
the last rows of the causal attention matrix (SnapKV's observation window), and grouped-query
attention by broadcasting (no ``repeat_kv`` copy). They compute in float32 (float64 when the
inputs are float64, so tests can compare with float64 references). The prefill *outputs* come
from ``attention.causal_attention``, the FP16 baseline's own path.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .attention import causal_mask
from .base import Unsupported

# ------------------------------------------------------------------------------------------------
# The seed's functions


def _to_torch(x) -> tuple[torch.Tensor, bool]:
    """(tensor, came_from_numpy). Lists and scalars count as numpy input."""
    if isinstance(x, torch.Tensor):
        return x, False
    return torch.from_numpy(np.array(x)), True


def _float(x: torch.Tensor) -> torch.Tensor:
    """float32 like the seed (``astype(np.float32)``), but float64 input stays float64."""
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def top_k_latest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] (ascending) of the k largest scores along the last axis; ties keep the
    later position. ``k`` is clipped to [0, length]."""
    n = scores.shape[-1]
    k = max(0, min(int(k), n))
    order = torch.sort(scores, dim=-1, stable=True).indices
    return order[..., n - k :].sort(dim=-1).values


def recent_plus_top(scores: torch.Tensor, budget: int, recent_window: int) -> torch.Tensor:
    """The last ``recent_window`` positions plus the ``budget - recent_window`` best-scored older
    ones, per row of ``scores`` [..., T] -> sorted indices [..., n]. The recent window is kept
    whole even if it exceeds the budget (seed semantics)."""
    t = scores.shape[-1]
    n_recent = min(recent_window, t)
    start = t - n_recent
    heavy = top_k_latest(scores[..., :start], max(0, budget - n_recent))
    recent = torch.arange(start, t, device=scores.device).expand(*scores.shape[:-1], n_recent)
    return torch.cat([heavy, recent], dim=-1)


def _indices_out(idx: torch.Tensor, as_numpy: bool):
    return idx.numpy().astype(np.int32) if as_numpy else idx


def cumulative_attention_scores(attention_history):
    """H2O score: sum over observation steps of ``attention_history`` [steps, tokens]."""
    hist, as_numpy = _to_torch(attention_history)
    if hist.ndim != 2:
        raise ValueError("attention_history must be rank-2 [num_steps, num_tokens]")
    out = _float(hist).sum(dim=0)
    return out.numpy() if as_numpy else out


def keep_recent_and_heavy_hitters(attention_history, budget: int, recent_window: int):
    """Sorted unique indices: the last ``recent_window`` tokens plus the ``budget - recent_window``
    older tokens with the largest cumulative attention (ties: the later token)."""
    budget = _check_count("budget", budget)
    recent_window = _check_count("recent_window", recent_window)
    hist, as_numpy = _to_torch(attention_history)
    scores = cumulative_attention_scores(hist)
    return _indices_out(recent_plus_top(scores, budget, recent_window), as_numpy)


def snapkv_select(observation_scores, budget: int, recent_window: int):
    """Sorted unique indices: the last ``recent_window`` tokens plus the ``budget - recent_window``
    older tokens with the largest observation score (ties: the later token). The seed takes a
    vector [tokens]; a batch [..., tokens] gives one row of indices per leading index."""
    budget = _check_count("budget", budget)
    recent_window = _check_count("recent_window", recent_window)
    scores, as_numpy = _to_torch(observation_scores)
    if scores.ndim < 1:
        raise ValueError("observation_scores must have a token axis [..., num_tokens]")
    return _indices_out(recent_plus_top(_float(scores), budget, recent_window), as_numpy)


def compression_ratio(total_tokens: int, kept_tokens: int) -> float:
    """Token compression ratio T / K."""
    if total_tokens <= 0 or kept_tokens <= 0 or kept_tokens > total_tokens:
        raise ValueError("require 0 < kept_tokens <= total_tokens")
    return total_tokens / kept_tokens


# ------------------------------------------------------------------------------------------------
# Budget helpers


def round_half_up(x: float) -> int:
    """Rounding used for every token count derived from a ratio (documented, platform-free)."""
    return int(math.floor(x + 0.5))


def shared_target(name: str, bpd_k: float | None, bpd_v: float | None) -> float | None:
    """Eviction keeps whole tokens, so one budget is spent on K and V alike (docs/design.md §3)."""
    if bpd_k is not None and bpd_v is not None and abs(bpd_k - bpd_v) > 1e-12:
        raise Unsupported(
            f"{name} evicts whole tokens, so keys and values share one budget; got bpd={bpd_k} "
            f"and v_bpd={bpd_v}: give one target (or equal targets)"
        )
    return bpd_k if bpd_k is not None else bpd_v


# ------------------------------------------------------------------------------------------------
# Attention helpers (vectorized over batch and heads)

#: logits elements per block of the blocked prefill (2^26 float32 = 256 MiB)
PREFILL_BLOCK_ELEMS = 1 << 26


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def grouped_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, Hq, n, d], k [B, H, m, d] with Hq = g*H -> logits [B, H, g, n, m] (compute dtype)."""
    b, hq, n, d = q.shape
    h, m = k.shape[1], k.shape[2]
    cdt = compute_dtype(q)
    # one GEMM per KV head over its g stacked query heads, the scaling folded in (no extra pass)
    qg = q.to(cdt).reshape(b * h, (hq // h) * n, d)
    kt = k.to(cdt).reshape(b * h, m, d).transpose(1, 2)
    out = torch.baddbmm(torch.zeros((), dtype=cdt, device=q.device), qg, kt, beta=0.0, alpha=scaling)
    return out.view(b, h, hq // h, n, m)


def _rows_from(s: int, per_head: int) -> int:
    """Query rows r of the block starting at row s with r (s + r) <= per_head logits (at least 1)."""
    return max(1, int((math.sqrt(s * s + 4.0 * per_head) - s) / 2))


def attention_column_sums(
    q: torch.Tensor, k: torch.Tensor, scaling: float, *, block_elems: int = PREFILL_BLOCK_ELEMS
) -> torch.Tensor:
    """Σ over the T queries of their causal attention probabilities -> [B, H, g, T] (H2O's
    prefill score), computed in query blocks so the [T, T] matrix never exists at once
    (LongBench prompts are 31.5k tokens).

    Each block of rows [s, s + r) reads only keys < s + r, so its row count is chosen for a block
    of at most ``block_elems`` logits over those keys (early blocks are taller: about half the
    blocks of a fixed row count). Queries and keys are cast to the compute dtype and laid out
    once (rows major over (position, group head), so a block is a contiguous slice), not per
    block; a block costs five ops."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    cdt = compute_dtype(q)
    qr = q.to(cdt).view(b, h, g, t, d).transpose(2, 3).reshape(b * h, t * g, d)
    kt = k.to(cdt).reshape(b * h, t, d).transpose(1, 2)
    none = torch.zeros((), dtype=cdt, device=q.device)
    col = torch.zeros(b, h, g, t, dtype=cdt, device=q.device)
    per_head = max(1, block_elems // max(1, b * hq))
    r_max = _rows_from(0, per_head)
    later = torch.ones(min(r_max, t), min(r_max, t), dtype=torch.bool, device=q.device).triu_(1)
    s = 0
    while s < t:
        e = min(t, s + _rows_from(s, per_head))
        r = e - s
        logits = torch.baddbmm(none, qr[:, s * g : e * g], kt[:, :, :e], beta=0.0, alpha=scaling)
        logits = logits.view(b, h, r, g, e)
        # only the block's diagonal part has keys after a query
        logits[..., s:].masked_fill_(later[:r, None, :r], float("-inf"))
        col[..., :e].add_(torch.softmax(logits, dim=-1).sum(dim=2))
        s = e
    return col


def window_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """Causal attention probabilities of the last ``window`` queries over all T keys
    -> [B, H, g, window, T] (SnapKV's observation window)."""
    t = k.shape[2]
    window = min(window, t)
    logits = grouped_logits(q[:, :, t - window :], k, scaling)
    mask = causal_mask(window, t, device=q.device)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
