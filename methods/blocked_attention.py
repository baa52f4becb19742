"""Attention over a cache whose positions are read in two versions, quantized or exact.

KIVI (docs/methods.md §2.3) and SVDq (§3) keep a packed prefix and a full-precision tail per side:
query t reads key s quantized iff ``s < key_block * floor(t / key_block)`` and, with two value
versions, value s quantized iff ``s < t - value_window``; GEAR (§15.5) reads the value of s by the
key's rule (``value_window=None``). :func:`mixed_attention` is the eager
reference (blocks of queries, any masks); :func:`blocked_attention` does the same with torch's
fused SDPA in a fixed number of ops, falling back to one call per key group
(:func:`grouped_attention`) for chunks whose single mask would be too large, or long CPU chunks.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import torch
import torch.nn.functional as F

from .attention import causal_attention, causal_mask, folded_attention, work_dtype


#: largest [B, Hq, Tq, N] logit block materialized at once (float32 elements)
MAX_LOGIT_ELEMENTS = 1 << 26


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Tq, d] (float32) x k [B, Hkv, n, d] -> [B, Hq, Tq, n], GQA without copying k
    (query head h reads KV head h // g, as :func:`methods.attention.expand_kv`)."""
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    out = q.reshape(b, hkv, (hq // hkv) * tq, d) @ k.to(q.dtype).transpose(-1, -2)
    return out.reshape(b, hq, tq, k.shape[2])


def _weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [B, Hq, Tq, n] x v [B, Hkv, n, d] -> [B, Hq, Tq, d]."""
    b, hq, tq, n = p.shape
    hkv = v.shape[1]
    out = p.reshape(b, hkv, (hq // hkv) * tq, n) @ v.to(p.dtype)
    return out.reshape(b, hq, tq, v.shape[3])


def _tail(q, prefix, ex, hat, mask, fn):
    """[fn(prefix) | where(mask, fn(hat), fn(ex))] along the key axis."""
    parts = [] if prefix is None or prefix.shape[2] == 0 else [fn(q, prefix)]
    if hat is None:
        parts.append(fn(q, ex))
    else:
        parts.append(torch.where(mask, fn(q, hat), fn(q, ex)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def mixed_attention(q, kp, k_ex, k_hat, key_mask, vp, v_ex, v_hat, val_mask, scaling):
    """Causal attention of the last Tq positions over N keys where each (query, key) pair reads
    the quantized or the exact version (docs/methods.md §2.3).

    Keys: ``kp`` [B, Hkv, pk, d] a prefix every query reads quantized (or None), then the tail
    positions pk..N-1 in both versions ``k_ex``/``k_hat`` with ``key_mask`` [Tq, N-pk], True =
    read ``k_hat`` (``k_hat=None``: tail exact). Values alike with their own prefix length.
    Query i sits at position N - Tq + i. Long chunks are processed in blocks of queries so that no
    logit block exceeds ``MAX_LOGIT_ELEMENTS`` (exact; blocks, not a loop over tokens)."""
    tq = q.shape[2]
    pk = 0 if kp is None else kp.shape[2]
    pv = 0 if vp is None else vp.shape[2]
    n = pk + k_ex.shape[2]
    blk = max(1, MAX_LOGIT_ELEMENTS // max(1, q.shape[0] * q.shape[1] * n))
    qf = q.to(work_dtype(q))
    outs = []
    for i in range(0, tq, blk):
        j = min(i + blk, tq)
        m = n - tq + j  # keys visible to the block's last query (m > pk, pv)
        logits = _tail(
            qf[:, :, i:j], kp, k_ex[:, :, : m - pk],
            None if k_hat is None else k_hat[:, :, : m - pk],
            None if key_mask is None else key_mask[i:j, : m - pk], _logits,
        )
        qpos = torch.arange(n - tq + i, n - tq + j, device=q.device)[:, None]
        causal = torch.arange(m, device=q.device)[None, :] <= qpos
        probs = torch.softmax((logits * scaling).masked_fill(~causal, float("-inf")), dim=-1)
        pieces = [] if pv == 0 else [_weighted(probs[..., :pv], vp)]
        pt = probs[..., pv:]
        if v_hat is None:
            pieces.append(_weighted(pt, v_ex[:, :, : m - pv]))
        else:
            vm = val_mask[i:j, : m - pv].to(pt.dtype)
            pieces.append(_weighted(pt * (1 - vm), v_ex[:, :, : m - pv]))
            pieces.append(_weighted(pt * vm, v_hat[:, :, : m - pv]))
        outs.append(sum(pieces))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(q.dtype)


#: chunks of at least this many queries take :func:`blocked_attention` (fused SDPA); shorter ones
#: the eager :func:`mixed_attention` (single decode steps: ``KiviLayerState._step``, fused SDPA)
SDPA_MIN_QUERIES = 16


#: largest [Tq, keys] mask of :func:`blocked_attention`'s single call (2^27 elements); longer
#: chunks take the per-group loop (:func:`grouped_attention`)
MAX_UNION_MASK = 1 << 27
#: on the CPU, launches are cheap and FLOPs are not: chunks of more queries than this take the
#: per-group loop there (a GPU takes the single call up to :data:`MAX_UNION_MASK`)
CPU_SINGLE_CALL_QUERIES = 512


@contextlib.contextmanager
def gpu_dispatch():
    """Within it, a CPU takes the paths a GPU takes (the single call at any length): what
    ``kvbench.bench.opcount`` counts, as the launches of a GPU."""
    global CPU_SINGLE_CALL_QUERIES
    saved, CPU_SINGLE_CALL_QUERIES = CPU_SINGLE_CALL_QUERIES, 1 << 62
    try:
        yield
    finally:
        CPU_SINGLE_CALL_QUERIES = saved


def blocked_attention(q, kp, k_ex, k_hat, key_block, vp, v_ex, v_hat, value_window, scaling):
    """:func:`mixed_attention` for the masks KIVI and SVDq use, with torch's fused SDPA kernel.

    Key s is read quantized by query t iff ``s < key_block * floor(t / key_block)``; with ``v_hat``
    given, value s iff ``s < t - value_window``, or by the key's rule with ``value_window=None``
    (then ``vp`` ends where ``kp`` does; ``v_hat=None``: one version of the values, ``v_ex``, after
    the prefix ``vp``). Arguments as in :func:`mixed_attention`; the tails start where the
    prefixes end, and the key prefix must end on a key block boundary at or below the first query's.

    One SDPA call (a fixed number of ops however many key groups the chunk
    spans): each (key version, value version) pair a query may read is a segment of one key
    sequence, every position of the tail entering once per version pair, and one boolean mask
    [Tq, keys] keeps, per query, exactly the version of each position it reads (segments:
    :func:`_union_mask`). The softmax runs over the same logits as the eager path, so the result
    is equal up to rounding. Decisions where docs/methods.md is silent: the work is that of attention
    over 2-3 times the keys without causal skipping (cheap on a GPU next to the launches it saves;
    about 3x the per-group loop's time on this CPU at 2048 tokens); a chunk whose mask would
    exceed :data:`MAX_UNION_MASK` elements, or a CPU chunk of more than
    :data:`CPU_SINGLE_CALL_QUERIES` queries, takes the per-group loop :func:`grouped_attention`
    instead (the work of causal attention)."""
    tq = q.shape[2]
    pk = 0 if kp is None else kp.shape[2]
    pv = 0 if vp is None else vp.shape[2]
    n = pk + k_ex.shape[2]
    if pk > key_block * ((n - tq) // key_block):
        raise ValueError("blocked_attention: the key prefix ends inside a query's key block")
    paired = v_hat is not None and value_window is None  # each value read in its key's version
    if paired and pv != pk:
        raise ValueError("blocked_attention: values read by the key's rule need vp to end where kp does")
    two_values = v_hat is not None and not paired
    if two_values and (value_window < key_block or pv > pk):
        return grouped_attention(q, kp, k_ex, k_hat, key_block, vp, v_ex, v_hat, value_window, scaling)
    width = 3 * n - pk - pv if two_values else 2 * n - pk
    cpu_long = q.device.type == "cpu" and tq > CPU_SINGLE_CALL_QUERIES
    if tq * width > MAX_UNION_MASK or cpu_long:
        return grouped_attention(q, kp, k_ex, k_hat, key_block, vp, v_ex, v_hat, value_window, scaling)
    hat_keys = [k_hat] if kp is None else [kp, k_hat.to(kp.dtype)]  # positions 0..n-1
    if two_values:  # segments: (hat, hat) 0..n, (hat, exact) pv..n, (exact, exact) pk..n
        hat_keys = hat_keys[0] if len(hat_keys) == 1 else torch.cat(hat_keys, dim=2)
        keys = torch.cat([hat_keys, hat_keys[:, :, pv:], k_ex.to(hat_keys.dtype)], dim=2)
        v_hat_all = v_hat if vp is None else torch.cat([vp, v_hat.to(vp.dtype)], dim=2)
        vals = torch.cat([v_hat_all, v_ex, v_ex[:, :, pk - pv :]], dim=2)
    else:  # segments: hat keys 0..n, exact keys pk..n; values v_ex (after vp), or hat then exact
        keys = torch.cat([*hat_keys, k_ex.to(hat_keys[0].dtype)], dim=2)
        if paired:
            vals = torch.cat([v.to(v_ex.dtype) for v in (vp, v_hat, v_ex) if v is not None], dim=2)
        else:
            v_all = v_ex if vp is None else torch.cat([vp, v_ex.to(vp.dtype)], dim=2)
            vals = torch.cat([v_all, v_all[:, :, pk:]], dim=2)
    mask = _union_mask(n - tq, tq, pk, pv if two_values else None, key_block, value_window, q.dtype, str(q.device))
    return _masked_sdpa(q, keys.to(q.dtype), vals.to(q.dtype), mask, scaling)


@lru_cache(maxsize=2)
def _union_mask(n0: int, tq: int, pk: int, pv: int | None, key_block: int, window, dtype, device: str) -> torch.Tensor:
    """The additive mask [tq, keys] (0 = read, -inf = not; in ``dtype``, as the fused kernel
    wants it) of :func:`blocked_attention` for queries at n0..n0+tq-1 over n = n0 + tq
    positions. With one value version (``pv=None``): hat keys of
    positions 0..n-1 (read iff s < B(t) = key_block floor(t / key_block)), then exact keys of
    pk..n-1 (iff B(t) <= s <= t). With two: (hat key, hat value) of 0..n-1 (iff s < t - window),
    (hat key, exact value) of pv..n-1 (iff t - window <= s < B(t)), (exact, exact) of pk..n-1
    (iff B(t) <= s <= t; exact values there, since t - window <= t - key_block < B(t)). Cached: the
    layers of one pass (and passes of one length) share it."""
    keep = _union_keep(n0, tq, pk, pv, key_block, window, torch.device(device))
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def _union_keep(n0, tq, pk, pv, key_block, window, dev) -> torch.Tensor:
    """The boolean form of :func:`_union_mask` (True = read)."""
    n = n0 + tq
    t = torch.arange(n0, n, device=dev)[:, None]
    s = torch.arange(n, device=dev)[None, :]
    start = key_block * torch.div(t, key_block, rounding_mode="floor")
    own = (s[:, pk:] >= start) & (s[:, pk:] <= t)
    if pv is None:
        return torch.cat([s < start, own], dim=1)
    hat_value = s < t - window
    return torch.cat([hat_value, ~hat_value[:, pv:] & (s[:, pv:] < start), own], dim=1)


def _masked_sdpa(q, k, v, mask, scaling):
    """SDPA with a mask [Tq, Tk] shared by all heads, grouped-query heads read natively:
    on the CPU ``enable_gqa`` (the fused kernel takes it with a mask), elsewhere the g query heads
    of each KV head folded into the query axis (:func:`methods.attention.folded_attention`; a masked
    ``enable_gqa`` call falls back to the unfused kernel on CUDA)."""
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return folded_attention(q, k, v, mask, scaling)


def grouped_attention(q, kp, k_ex, k_hat, key_block, vp, v_ex, v_hat, value_window, scaling):
    """:func:`blocked_attention` as one SDPA call per key group, for chunks too long for one mask.

    The queries are split at key-block boundaries. Every query of a group shares the block start
    B, so it reads hat keys before B and exact keys from B on: one causal SDPA call over that key
    sequence (written into a working copy of the hat keys and restored afterwards). A value rule
    splits at most one block of positions (t - value_window falls inside it for the group's
    queries); those positions enter twice, with hat and with exact values, under complementary
    masks; values read by the key's rule (``value_window=None``) swap versions with their keys.
    Same softmax over the same logits as the eager path, so equal up to rounding; the work is that
    of exact causal attention, without the [Tq, N] logits in memory."""
    tq = q.shape[2]
    pk = 0 if kp is None else kp.shape[2]
    pv = 0 if vp is None else vp.shape[2]
    n = pk + k_ex.shape[2]
    n0 = n - tq
    keys = k_hat.clone() if kp is None else torch.cat([kp, k_hat.to(kp.dtype)], dim=2)
    keys = keys.to(q.dtype)
    paired = v_hat is not None and value_window is None
    if paired:  # values swap versions with their keys, group by group
        vals = (v_hat.clone() if vp is None else torch.cat([vp, v_hat.to(vp.dtype)], dim=2)).to(q.dtype)
        v_ex = v_ex.to(q.dtype)
    elif v_hat is None:
        vals = v_ex if vp is None else torch.cat([vp, v_ex.to(vp.dtype)], dim=2)
        vals = vals.to(q.dtype)
    else:
        v_hat_all = (v_hat if vp is None else torch.cat([vp, v_hat.to(vp.dtype)], dim=2)).to(q.dtype)
        v_ex = v_ex.to(q.dtype)
    k_ex = k_ex.to(q.dtype)
    outs = []
    t0 = n0
    while t0 < n:
        start = key_block * (t0 // key_block)
        t1 = min(n, start + key_block)
        if start < pk:
            raise ValueError("blocked_attention: the key prefix ends inside a query's key block")
        saved = keys[:, :, start:t1].clone()
        keys[:, :, start:t1] = k_ex[:, :, start - pk : t1 - pk]
        if paired:
            saved_v = vals[:, :, start:t1].clone()
            vals[:, :, start:t1] = v_ex[:, :, start - pv : t1 - pv]
        qg = q[:, :, t0 - n0 : t1 - n0]
        one_version = v_hat is None or paired
        if one_version and t0 == 0:  # from position 0: plain causal attention
            outs.append(causal_attention(qg, keys[:, :, :t1], vals[:, :, :t1], scaling))
        elif one_version:  # queries t0..t1-1 over keys 0..t1-1, as an additive mask
            keep = causal_mask(t1 - t0, t1, q.device)
            mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
            outs.append(folded_attention(qg, keys[:, :, :t1], vals[:, :, :t1], mask, scaling))
        else:
            outs.append(_two_value_group(qg, keys, v_hat_all, v_ex, pv, t0, t1, value_window, scaling))
        keys[:, :, start:t1] = saved
        if paired:
            vals[:, :, start:t1] = saved_v
        t0 = t1
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _two_value_group(qg, keys, v_hat_all, v_ex, pv, t0, t1, window, scaling):
    """One query group [t0, t1) of :func:`blocked_attention` when values have two versions."""
    lo, hi = max(0, t0 - window), t1 - 1 - window  # positions whose version depends on the query
    cut = max(hi + 1, 0)
    k_main, v_main = keys[:, :, :t1], torch.cat([v_hat_all[:, :, :cut], v_ex[:, :, cut - pv : t1 - pv]], dim=2)
    dev = qg.device
    tpos = torch.arange(t0, t1, device=dev)[:, None]
    spos = torch.arange(t1, device=dev)[None, :]
    mask = (spos <= tpos) & ~((spos >= lo) & (spos <= hi) & (spos >= tpos - window))
    if hi >= lo:  # the zone again, with exact values, visible where the hat copy is not
        zpos = torch.arange(lo, hi + 1, device=dev)[None, :]
        k_main = torch.cat([k_main, keys[:, :, lo : hi + 1]], dim=2)
        v_main = torch.cat([v_main, v_ex[:, :, lo - pv : hi + 1 - pv]], dim=2)
        mask = torch.cat([mask, zpos >= tpos - window], dim=1)
    return folded_attention(qg, k_main, v_main, mask, scaling)
