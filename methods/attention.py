"""Plain softmax attention with grouped-query heads, used by every :class:`LayerState`.

Queries are the last ``Tq`` positions of a sequence whose keys are ``k`` (``Tk >= Tq``); query i
sits at position ``Tk - Tq + i`` and may read keys ``0..Tk - Tq + i`` (causal). ``keys_pos`` gives
the original positions of the stored keys when a cache has evicted some (order-free caches), and
``query_pos`` those of the queries; with both given the causal rule is ``keys_pos <= query_pos``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """Arithmetic precision for attention and quantizers: float32, or float64 for float64 inputs
    (so a float64 model can check exactness without float32 noise flipping a rounding)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, T, d] -> [B, Hkv*group, T, d] (query head h reads KV head h // group)."""
    if group == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, group, t, d).reshape(b, h * group, t, d)


def causal_mask(tq: int, tk: int, device=None) -> torch.Tensor:
    """Boolean [tq, tk], True where query i (at position tk - tq + i) may read key j."""
    qpos = torch.arange(tk - tq, tk, device=device)[:, None]
    kpos = torch.arange(tk, device=device)[None, :]
    return kpos <= qpos


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Exact causal attention of the last ``Tq`` positions over all ``Tk`` keys.

    Uses torch's fused ``scaled_dot_product_attention`` (the kernel of transformers' ``sdpa``
    path), so a 32k-token prefill never materializes the [Tq, Tk] probability matrix.

    Decisions where docs/methods.md is silent: grouped-query heads are never
    expanded. Without a mask SDPA reads them natively (``enable_gqa``, as transformers' ``sdpa``
    path does: same kernel, same numbers); a single query reads every key, so a decode step needs
    no mask at all; a chunk of ``1 < Tq < Tk`` queries after a prefix (bottom-right causal mask)
    folds the g query heads of each KV head into its query axis (:func:`folded_attention`), since
    a masked ``enable_gqa`` call falls back to the unfused kernel on CUDA."""
    tq, tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    if tq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
    return folded_attention(q, k, v, causal_mask(tq, tk, device=q.device), scaling)


def folded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """SDPA with a mask [Tq, Tk] shared by all heads (boolean, True = keep, or additive) for
    grouped-query heads without repeating K and V: the g query heads of each KV head are stacked
    along the query axis and the mask tiled to match."""
    b, hq, tq, d = q.shape
    h = k.shape[1]
    g = hq // h
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    out = F.scaled_dot_product_attention(
        q.reshape(b, h, g * tq, d), k, v, attn_mask=mask.repeat(g, 1), scale=scaling
    )
    return out.view(b, h, g, tq, -1).reshape(b, hq, tq, -1)
