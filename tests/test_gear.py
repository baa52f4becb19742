"""GEAR (methods/gear.py, docs/methods.md §15) against the official code and a naive reference.

The official functions are transcribed below from opengear-project/GEAR at commit efe0bfe,
``GenerationBench/GenerationTest/GEARLM/Simulated/compress_function.py`` (line numbers of that
file), in float64, with two hooks where the harness stores less than the simulator computes: the
scale and minimum of a group are rounded to fp16 as the cache stores them (inserted after the
official ``scale = ...`` line), and the final ``.half()`` casts are left out (exactness in float64).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import configured_method, tiny_llama
from methods import Unsupported, build_method
from methods.attention import causal_attention
from methods.base import ModelShape, Regime
from methods.gear import (
    SideCodec,
    decode_blocks,
    draw_omegas,
    encode_blocks,
    headline,
    power_iteration,
    sparse_backbone,
)

pytestmark = pytest.mark.numerics

B, HKV, HQ, D = 1, 2, 4, 16
SCALING = 1 / math.sqrt(D)
SMOLLM2 = ModelShape(30, 9, 3, 64)


def fp16_meta(scale, mn):
    """The cache's metadata: fp16 scale (floored at 2^-24) and fp16 minimum."""
    return scale.half().clamp_min(2.0**-24).double(), mn.half().double()


# ---- official code, transcribed ----------------------------------------------------------------

def official_channel_quant(x, levels, group, meta=fp16_meta):
    """L39-67 ``fake_groupwise_channel_asymmetric_quantization_new`` (levels 2^b - 1) = L100-130
    ``..._cluster`` (levels ``cluster_num``) on whole groups: per (head, channel), groups of
    ``group`` consecutive tokens; scale = (mx - mn)/levels; relu((x - mn)/scale).round_()."""
    batch, num_head, seq_len, sep_dim = x.shape
    inp = x.permute(0, 2, 1, 3).contiguous().view(batch, seq_len, sep_dim * num_head).double()
    group_num = inp.shape[1] // group
    fixed = inp.view(batch, group_num, group, num_head * sep_dim)
    mx, mn = fixed.max(dim=-2)[0].unsqueeze(-2), fixed.min(dim=-2)[0].unsqueeze(-2)
    scale = (mx - mn) / levels
    scale, mn = meta(scale, mn)
    q = F.relu((fixed - mn) / scale).round_()
    out = (q * scale + mn).view(batch, group_num * group, num_head, sep_dim)
    return out.permute(0, 2, 1, 3)


def official_token_quant(x, levels, group, meta=fp16_meta):
    """L7-37 ``fake_groupwise_token_asymmetric_quantization`` = L132-160 ``..._cluster``: per token,
    groups of ``group`` consecutive entries of the concatenated heads."""
    batch, num_head, seq_len, sep_dim = x.shape
    inp = x.permute(0, 2, 1, 3).contiguous().view(batch, seq_len, sep_dim * num_head).double()
    groups = inp.view(batch, seq_len, (sep_dim * num_head) // group, group)
    mx, mn = groups.max(dim=-1)[0].unsqueeze(-1), groups.min(dim=-1)[0].unsqueeze(-1)
    scale = (mx - mn) / levels
    scale, mn = meta(scale, mn)
    q = F.relu((groups - mn) / scale).round_()
    out = (q * scale + mn).view(batch, seq_len, num_head, sep_dim)
    return out.permute(0, 2, 1, 3)


def official_gears_channelQ(x, bit, group, sparsity):
    """L261-296 ``gears_channelQ``: k = int(int(B H n d s)/B/n/2) largest and smallest per channel
    along the tokens set to the channel mean, b^2 - 1 levels, then the exact values scattered back
    (smallest first)."""
    out = x.double().clone()
    batch, num_head, seq_len, sep_dim = out.shape
    k = int(int(batch * num_head * seq_len * sep_dim * sparsity) / batch / seq_len / 2)
    out = out.permute(0, 1, 3, 2).contiguous().view(batch, sep_dim * num_head, seq_len)
    sv, si = torch.topk(out, k, dim=-1, largest=False)
    lv, li = torch.topk(out, k, dim=-1, largest=True)
    avg = out.mean(dim=-1, keepdim=True).expand_as(out)
    out.scatter_(-1, si, avg.gather(-1, si))
    out.scatter_(-1, li, avg.gather(-1, li))
    out = out.view(batch, num_head, sep_dim, seq_len).permute(0, 1, 3, 2)
    out = official_channel_quant(out, bit**2 - 1, group)
    out = out.permute(0, 1, 3, 2).contiguous().view(batch, sep_dim * num_head, seq_len)
    out.scatter_(-1, si, sv)
    out.scatter_(-1, li, lv)
    return out.view(batch, num_head, sep_dim, seq_len).permute(0, 1, 3, 2)


def official_gears_tokenQ(x, bit, group, sparsity):
    """L297-333 ``gears_tokenQ``: the same per token over the concatenated heads."""
    out = x.double().clone()
    batch, num_head, seq_len, sep_dim = out.shape
    k = int(int(batch * num_head * seq_len * sep_dim * sparsity) / batch / seq_len / 2)
    out = out.permute(0, 2, 1, 3).contiguous().view(batch, seq_len, sep_dim * num_head)
    sv, si = torch.topk(out, k, dim=-1, largest=False)
    lv, li = torch.topk(out, k, dim=-1, largest=True)
    avg = out.mean(dim=-1, keepdim=True).expand_as(out)
    out.scatter_(-1, si, avg.gather(-1, si))
    out.scatter_(-1, li, avg.gather(-1, li))
    out = out.view(batch, seq_len, num_head, sep_dim).permute(0, 2, 1, 3)
    out = official_token_quant(out, bit**2 - 1, group)
    out = out.permute(0, 2, 1, 3).contiguous().view(batch, seq_len, sep_dim * num_head)
    out.scatter_(-1, si, sv)
    out.scatter_(-1, li, lv)
    return out.view(batch, seq_len, num_head, sep_dim).permute(0, 2, 1, 3)


def official_power_iteration(inp, loop, p0, factors=lambda q, p: (q, p)):
    """L69-98 ``fake_poweriteration_group`` with ``p_base`` given (Omega): QR only in the last
    round, of p and then of q; returns q p^T. ``factors`` rounds (q, p) as the cache stores them."""
    p_base, q_base = [p0.clone()], [None]
    for i in range(loop):
        if i == loop - 1:
            p_base[0] = torch.linalg.qr(p_base[0]).Q
        q_base[0] = inp @ p_base[0]
        if i == loop - 1:
            q_base[0] = torch.linalg.qr(q_base[0]).Q
        p_base[0] = torch.transpose(inp, 2, 3) @ q_base[0]
    q, p = factors(q_base[0], p_base[0])
    return q @ torch.transpose(p, 2, 3)


def official_gearslkivi_new(x, bit, group, sparsity, omega, loop, side):
    """L204-220 ``gearslkivi_{token,channel}Q_new``: error = input - gears_*Q(input); output +
    power iteration of the error (factors rounded to fp16 as stored)."""
    sparse = official_gears_channelQ if side == "k" else official_gears_tokenQ
    out = sparse(x, bit, group, sparsity)
    half = lambda q, p: (q.half().double(), p.half().double())  # noqa: E731
    return out + official_power_iteration(x.double() - out, loop, omega, half)


# ---- helpers ------------------------------------------------------------------------------------

def _x(shape, seed=0, outlier_scale=6.0):
    """float64 random data with a few heavy outlier channels and tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x[..., 1] *= outlier_scale
    x = x + 0.3 * torch.randn(shape[:-1] + (1,), generator=g, dtype=torch.float64)
    return x


def _blocks(x):
    """[B, H, n, d] -> one block [B, H, 1, n, d]."""
    return x.unsqueeze(2)


# ---- backbone, outliers, low rank: parity with the official code -------------------------------

@pytest.mark.parametrize("bits,group", [(2, 16), (3, 32), (4, 8), (8, 16)])
def test_backbone_equals_official_quantizers(bits, group):
    """Keys: L39-67 (per channel, token groups); values: L7-37 (per token, entry groups). With the
    stored fp16 metadata, bitwise equal; against the literal float scale, within one step."""
    x = _x((1, 4, 64, 16), seed=bits)
    for side, official in (("k", official_channel_quant), ("v", official_token_quant)):
        ds = sparse_backbone(_blocks(x), SideCodec(side, bits, group, 0.0, 0))[0][:, :, 0]
        ref = official(x, 2**bits - 1, group)
        assert torch.equal(ds, ref)
        literal = official(x, 2**bits - 1, group, meta=lambda s, mn: (s, mn))
        step = (x.amax() - x.amin()) / (2**bits - 1)
        assert (ds - literal).abs().max() <= 1.01 * step


@pytest.mark.parametrize("bits,sparsity", [(2, 0.05), (3, 0.1), (4, 0.08)])
def test_sparse_path_equals_gears_channelQ_and_tokenQ(bits, sparsity):
    """``levels=official, kcount=official``: D + S equals L261-296 / L297-333 (b^2 - 1 levels: b = 3
    has 9, stored in 4 bits)."""
    x = _x((1, 3, 64, 16), seed=10 + bits)
    for side, official in (("k", official_gears_channelQ), ("v", official_gears_tokenQ)):
        codec = SideCodec(side, bits, 16, sparsity, 0, levels_rule="official", kcount="official")
        assert codec.levels == bits**2 - 1 and codec.code_bits == math.ceil(math.log2(bits**2))
        ds = sparse_backbone(_blocks(x), codec)[0][:, :, 0]
        assert torch.equal(ds, official(x, bits, 16, sparsity))


def test_harness_outlier_counts_and_exact_outliers():
    """Harness mode: keys keep 2 floor(s n / 2) entries per channel (a fraction of exactly
    2 floor(s n/2)/n), values 2 floor(s H d / 2) per token; those entries are reconstructed
    exactly (the residual is 0 there) and they are the extremes of their vector."""
    x = _x((1, 3, 96, 16), seed=3)
    n, h, d, s = 96, 3, 16, 0.07
    kc = SideCodec("k", 2, 32, s, 0)
    packed, hat = encode_blocks(x, kc, n, None)
    k = math.floor(s * n / 2)
    assert k == 3 and packed.out_idx.shape == (1, h, 1, d, 2 * k)
    assert packed.out_idx.shape[-1] / n == 2 * math.floor(s * n / 2) / n
    idx = packed.out_idx[:, :, 0].long()  # [B, H, d, 2k] token indices
    xt = x.transpose(-1, -2)
    assert torch.equal(hat.transpose(-1, -2).gather(-1, idx), xt.gather(-1, idx))
    assert torch.equal(idx[..., :k].sort(-1).values, xt.topk(k, -1, largest=False).indices.sort(-1).values)
    vc = SideCodec("v", 2, 16, s, 0)
    packed, hat = encode_blocks(x, vc, n, None)
    assert packed.out_idx.shape == (1, 1, n, 2 * math.floor(s * h * d / 2))
    flat = lambda t: t.permute(0, 2, 1, 3).reshape(1, n, h * d)  # noqa: E731
    vi = packed.out_idx[:, 0].long()
    assert torch.equal(flat(hat).gather(-1, vi), flat(x).gather(-1, vi))


def test_power_iteration_equals_official_and_approaches_truncated_svd():
    """L69-98 with the same Omega: equal to rounding; on decaying spectra with a gap after r,
    within 5 % of the best rank-r error (a randomized range finder from U[0,1) starts, loop = 3;
    without the gap a U[0,1) start can miss by 20-70 % at ratios 0.5-0.7)."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 3, 64, 16, generator=g, dtype=torch.float64)
    omega = torch.rand(2, 3, 16, 4, generator=g, dtype=torch.float64)
    q, p = power_iteration(r, omega, 3)
    ref = official_power_iteration(r, 3, omega)
    assert torch.allclose(q @ p.transpose(-1, -2), ref, rtol=1e-12, atol=1e-12)
    u = torch.linalg.qr(torch.randn(64, 16, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64)).Q
    i = torch.arange(16, dtype=torch.float64)
    for rank in (1, 2, 4):
        m = (u * torch.where(i < rank, 0.8**i, 0.3 * 0.8**i)) @ v.T  # decaying, a gap after r
        best = torch.sqrt((torch.linalg.svdvals(m)[rank:] ** 2).sum())
        for _ in range(10):
            q, p = power_iteration(m[None, None], torch.rand(1, 1, 16, rank, generator=g, dtype=torch.float64), 3)
            assert torch.linalg.norm(m - (q @ p.transpose(-1, -2))[0, 0]) <= 1.05 * best


@pytest.mark.parametrize("side", ["k", "v"])
def test_whole_block_equals_official_gearslkivi(side):
    """D + S + L of one block equals L204-220 (``gearslkivi_*Q_new``) with the same Omega and the
    factors rounded to fp16 as stored."""
    x = _x((1, 3, 64, 16), seed=21)
    codec = SideCodec(side, 4, 16, 0.05, 3, levels_rule="official", kcount="official")
    omega = draw_omegas(5, 2, side, 1, 64, (1, 3, 16, 3), x)
    _, hat = encode_blocks(x, codec, 64, omega)
    ref = official_gearslkivi_new(x, 4, 16, 0.05, omega[:, :, 0], 3, side)
    assert torch.allclose(hat, ref, rtol=0, atol=1e-12)


def test_each_component_reduces_the_error():
    """On data with outlier channels: ||X - (D+S+L)|| < ||X - (D+S)|| < ||X - D||."""
    x = _x((1, 3, 128, 16), seed=4, outlier_scale=20.0)
    errs = []
    for s, r in ((0.0, 0), (0.05, 0), (0.05, 4)):
        codec = SideCodec("k", 2, 32, s, r)
        omega = draw_omegas(0, 0, "k", 1, 128, (1, 3, 16, r), x) if r else None
        errs.append(float(torch.linalg.norm(x - encode_blocks(x, codec, 128, omega)[1])))
    assert errs[2] < errs[1] < errs[0]


# ---- the stored representation ----------------------------------------------------------------

@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("bits,group,sparsity,rank,index_bits,levels", [
    (2, 16, 0.02, 2, 16, "harness"), (1, 32, 0.0, 1, 16, "harness"), (3, 16, 0.1, 4, 32, "official"),
    (4, 32, 0.1, 0, 16, "harness"),
])
def test_stored_bits_equal_section_15_7_and_decode_from_them(side, bits, group, sparsity, rank, index_bits, levels):
    """Per block of n tokens and head: n d b + 32 n d/G + outliers (16 + iota) + 16 r (n + d)
    (§15.7), J blocks at once; decoding the stored tensors gives the working copy bit for bit."""
    n, j, h, d = 64, 3, 4, 16
    x = _x((1, h, j * n, d), seed=7)
    codec = SideCodec(side, bits, group, sparsity, rank, levels_rule=levels, index_bits=index_bits)
    omega = draw_omegas(0, 1, side, j, n, (1, h, d, rank), x) if rank else None
    packed, hat = encode_blocks(x, codec, n, omega)
    cb = bits if levels == "harness" or sparsity == 0 else math.ceil(math.log2(bits**2))
    k = math.floor(sparsity * (n if side == "k" else h * d) / 2 + 1e-9)
    outliers = 2 * k * (h * d if side == "k" else n)
    per_block = h * n * d * cb + 32 * h * n * d // group + outliers * (16 + index_bits) + h * 16 * rank * (n + d)
    assert packed.bits() == j * per_block == j * codec.block_bits(n, h, d)
    assert torch.equal(decode_blocks(packed), hat)
    assert packed.codes.dtype == torch.uint8 and packed.scale.dtype == torch.float16
    if rank:
        assert packed.q.dtype == torch.float16 and packed.q.shape == (1, h, j, n, rank)


# ---- the layer state: streaming buffer, regimes ------------------------------------------------

KNOBS = dict(bits=2, group=8, sparsity=0.25, rank=2, block=16, v_bits=3, v_group=8, v_sparsity=0.1, v_rank=1,
             seed=3)


def _method(**over):
    m = build_method("gear", **{**KNOBS, **over})
    m.configure(ModelShape(2, HQ, HKV, D), None, None)
    return m


def _qkv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, t, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, t, D, generator=g, dtype=torch.float64) * 2 + 0.5
    v = torch.randn(B, HKV, t, D, generator=g, dtype=torch.float64)
    return q, k, v


def _run(method, q, k, v, chunks, prefill_first=False, layer=0):
    state = method.new_layer_state(layer)
    outs, start = [], 0
    for i, c in enumerate(chunks):
        sl = slice(start, start + c)
        outs.append(state.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=SCALING,
                                 prefill=prefill_first and i == 0))
        start += c
    assert start == k.shape[2]
    return torch.cat(outs, dim=2), state


def reference(method, q, k, v, prefill_len=0, layer=0):
    """Naive §15.5: every complete n_b-block compressed on its own (with the layer's Omega); query t reads
    K and V of s from the compressed block iff s < n_b floor(t / n_b), else exact; queries of an
    exact prefill read everything exact. Loops over positions and heads, float64 softmax."""
    kn = method.knobs()
    nb, n = kn["block"], k.shape[2]
    kc = SideCodec("k", **{x: kn["k"][x] for x in ("bits", "group", "sparsity", "rank")})
    vc = SideCodec("v", **{x: kn["v"][x] for x in ("bits", "group", "sparsity", "rank")})
    k_hat, v_hat = k.clone(), v.clone()
    seed = kn["seed"]
    for j in range(n // nb):
        sl = slice(j * nb, (j + 1) * nb)
        k_hat[:, :, sl] = encode_blocks(k[:, :, sl], kc, nb, draw_omegas(seed, layer, "k", 1, nb,
                                                                          (B, HKV, D, kc.rank), k))[1]
        v_hat[:, :, sl] = encode_blocks(v[:, :, sl], vc, nb, draw_omegas(seed, layer, "v", 1, nb,
                                                                          (B, HKV, D, vc.rank), v))[1]
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(n):
        for h in range(q.shape[1]):
            comp = 0 if t < prefill_len else nb * (t // nb)
            keys = torch.cat([k_hat[0, h // g, :comp], k[0, h // g, comp:t + 1]])
            vals = torch.cat([v_hat[0, h // g, :comp], v[0, h // g, comp:t + 1]])
            p = torch.softmax(keys @ q[0, h, t] * SCALING, dim=0)
            out[0, h, t] = p @ vals
    return out


def test_one_pass_equals_token_by_token_and_the_reference():
    t = 70
    q, k, v = _qkv(t)
    m = _method()
    full, st_full = _run(m, q, k, v, [t])
    steps, st_steps = _run(m, q, k, v, [1] * t)
    mixed, st_mixed = _run(m, q, k, v, [23, 1, 30, 16])
    assert (full - steps).abs().max() < 1e-12
    assert (full - mixed).abs().max() < 1e-12
    assert st_full.stored_bits() == st_steps.stored_bits() == st_mixed.stored_bits()
    assert (full - reference(m, q, k, v)).abs().max() < 1e-12
    assert (full - causal_attention(q, k, v, SCALING)).abs().max() > 1e-2  # compression acts


def test_without_s_and_l_the_keys_are_kivi_with_the_residual_n_b():
    """GEAR's buffer rule for keys is KIVI's key rule with R = n_b (docs/methods.md §2.3, §15.5): with
    s = 0 and r = 0 (values exact) both caches give the same attention and store the same bits, in
    one pass, token by token and after a prefill."""
    t = 90
    q, k, v = _qkv(t, seed=8)
    shape = ModelShape(2, HQ, HKV, D)
    gear = build_method("gear", bits=3, group=8, sparsity=0.0, rank=0, block=32)
    kivi = build_method("kivi", bits=3, group=8, residual=32)
    gear.configure(shape, None, None)
    kivi.configure(shape, None, None)
    for chunks, prefill in (([t], False), ([1] * t, False), ([45, 1, 44], True)):
        a, sa = _run(gear, q, k, v, chunks, prefill)
        b, sb = _run(kivi, q, k, v, chunks, prefill)
        assert (a - b).abs().max() < 1e-12
        assert sa.stored_bits() == sb.stored_bits()


def test_prefill_is_exact_then_decodes_by_the_buffer_rule():
    t, p = 75, 37
    q, k, v = _qkv(t, seed=2)
    m = _method()
    out, st = _run(m, q, k, v, [p, 1, 1, 20, t - p - 22], prefill_first=True)
    assert torch.equal(out[:, :, :p], causal_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], SCALING))
    assert (out - reference(m, q, k, v, prefill_len=p)).abs().max() < 1e-12
    steps, _ = _run(m, q, k, v, [p] + [1] * (t - p), prefill_first=True)
    assert (out - steps).abs().max() < 1e-12
    _, st = _run(m, q[:, :, :p], k[:, :, :p], v[:, :, :p], [p], prefill_first=True)
    assert st.k.n_comp == st.v.n_comp == 32 and st.read_bits() is None  # 2 blocks, 5 tokens buffered


def test_one_block_prompt_stores_the_prefill_at_rank_r_p():
    """``prompt=one_block`` (§15.5, the paper): floor(P/n_b) n_b prompt tokens as one block at r_p,
    decode blocks after it aligned at n_b; a chunk after it equals single steps."""
    t, p = 80, 40
    q, k, v = _qkv(t, seed=4)
    m = _method(prompt="one_block", prompt_rank=3)
    _, st = _run(m, q[:, :, :p], k[:, :, :p], v[:, :, :p], [p], prefill_first=True)
    kc = SideCodec("k", 2, 8, 0.25, 3)
    assert st.k.ends == [32] and st.k.cum == [kc.block_bits(32, HKV, D)]
    assert st.stored_bits()[0] == kc.block_bits(32, HKV, D) + 8 * HKV * D * 16
    chunk, _ = _run(m, q, k, v, [p, t - p], prefill_first=True)
    steps, st2 = _run(m, q, k, v, [p] + [1] * (t - p), prefill_first=True)
    assert (chunk - steps).abs().max() < 1e-12
    assert st2.k.ends == [32, 48, 64, 80]


def _direct_reads(method, t0, t, row, prefill=None):
    """bits_K per query position from §15.5/§15.7: compressed blocks below n_b floor(p/n_b) at their
    block bits, the rest 16 bits per element."""
    kn = method.knobs()
    nb = kn["block"]
    kc = SideCodec("k", **{x: kn["k"][x] for x in ("bits", "group", "sparsity", "rank")})
    out = []
    for p in range(t0, t0 + t):
        blocks = p // nb
        out.append(blocks * kc.block_bits(nb, HKV, D) + (p + 1 - blocks * nb) * 16 * row)
    return out


def test_read_bits_follow_the_buffer_rule_and_the_headline_formula():
    t = 70
    q, k, v = _qkv(t, seed=5)
    m = _method()
    row = B * HKV * D
    _, st = _run(m, q, k, v, [t])
    bits_k, bits_v = st.read_bits()
    assert bits_k.tolist() == pytest.approx(_direct_reads(m, 0, t, row))
    steps = []
    state = m.new_layer_state(0)
    for i in range(t):
        state.attend(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], scaling=SCALING, prefill=False)
        steps.append(state.read_bits())
    assert torch.cat([s[0] for s in steps]).tolist() == pytest.approx(bits_k.tolist())
    assert torch.cat([s[1] for s in steps]).tolist() == pytest.approx(bits_v.tolist())
    cost = m.knobs()["k"]["block_bpd"]
    measured = float((bits_k / (torch.arange(1, t + 1) * row)).mean())
    assert measured == pytest.approx(headline(cost, 16, Regime("qall", t)), rel=1e-12)


def _measured_headline(method, shape, regime, seed=0, dtype=torch.float64):
    """The headline bpd_K of one layer state fed random tensors in ``regime`` (docs/methods.md §0 v3)."""
    h, d = shape.n_kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(seed)
    n = regime.tokens + regime.decode
    q = torch.randn(1, shape.n_q_heads, n, d, generator=g, dtype=dtype)
    k = torch.randn(1, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(1, h, n, d, generator=g, dtype=dtype)
    st = method.new_layer_state(0)
    row = h * d
    if regime.kind == "qall":
        st.attend(q, k, v, scaling=0.125, prefill=False)
        return float((st.read_bits()[0] / (torch.arange(1, n + 1) * row)).mean())
    p = regime.tokens
    st.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.125, prefill=True)
    first = st.stored_bits()[0] / (p * row)
    st.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.125, prefill=False)
    reads = st.read_bits()[0] / (torch.arange(p + 1, n + 1) * row)
    return float((first + reads.sum()) / (1 + regime.decode))


@pytest.mark.parametrize("target", [0.5, 1.0, 2.0, 3.0])
def test_low_targets_are_unsupported_on_smollm2_in_q_all(target):
    m = build_method("gear")
    with pytest.raises(Unsupported, match=r"reachable range \[3\.17, "):
        m.configure(SMOLLM2, target, None)


def test_fit_lands_within_two_percent_of_the_measured_headline():
    """bpd=4 on SmolLM2 (d = 64) in Q-all over 2048 positions, and bpd=3 after a 1536-token prefill
    with 511 decoded positions (PPL track B): the knobs' measured headline is what the fit predicts
    and lies within 2 % of the target."""
    for target, regime in ((4.0, Regime("qall", 2048)), (3.0, Regime("prefill", 1536, 511))):
        m = build_method("gear")
        m.set_regime(regime)
        m.configure(SMOLLM2, target, None)
        kn = m.knobs()
        assert kn["fitted"] and kn["k"]["rank"] >= 1
        measured = _measured_headline(m, SMOLLM2, regime, dtype=torch.float32)
        assert measured == pytest.approx(kn["fit"]["predicted_bpd_k"], rel=1e-9)
        assert abs(measured - target) <= 0.02 * target
    json.dumps(kn)


def test_value_track_and_nominal_budget_and_explicit_knobs():
    m = build_method("gear")
    m.configure(SMOLLM2, 4.0, 4.0)
    kn = m.knobs()
    assert abs(kn["predicted"]["bpd_v"] - 4.0) <= 0.08 and (3 * 64) % kn["v"]["group"] == 0
    m = build_method("gear", budget="nominal")
    m.configure(SMOLLM2, 2.0, None)
    assert m.knobs()["k"]["block_bpd"] == pytest.approx(2.0, rel=0.02)
    m = build_method("gear", bits=2)
    m.configure(SMOLLM2, 4.0, None)
    kn = m.knobs()
    assert not kn["fitted"] and "explicit" in kn["not_fitted"]
    assert (kn["block"], kn["k"]["group"], kn["k"]["sparsity"], kn["k"]["rank"]) == (64, 64, 0.02, 2)
    assert kn["v"] is None and m.nominal_bpd(128)[1] == 16.0


def test_bad_options_name_the_choices():
    with pytest.raises(ValueError, match="harness"):
        build_method("gear", levels="paper")
    with pytest.raises(ValueError, match="chunked"):
        build_method("gear", prompt="all")
    with pytest.raises(ValueError, match="0 levels"):
        SideCodec("k", 1, 8, 0.1, 0, levels_rule="official")
    m = build_method("gear", group=48, block=64)
    with pytest.raises(ValueError, match="must divide"):
        m.configure(SMOLLM2, None, None)


# ---- inside a model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model64():
    return tiny_llama(seed=1).to(torch.float64)


def test_in_a_model_one_pass_equals_decoding_and_prefill_chunk_equals_steps(model64):
    from kvbench.model.integrate import attach

    method = configured_method(model64, "gear", KNOBS, 4.0, 3.0, None)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model64(input_ids=ids, use_cache=False).logits
        comp = attach(model64, method)
        try:
            in_pass = model64(input_ids=ids, use_cache=False).logits
            bpd_in_pass = comp.measured_bpd()
            with comp.session():
                stepped = torch.cat([comp.forward(ids[:, t:t + 1], t, prefill=False) for t in range(80)], 1)
            bpd_stepped = comp.measured_bpd()
            with comp.session():
                comp.forward(ids[:, :50], 0, prefill=True)
                chunk = comp.forward(ids[:, 50:], 50, prefill=False)
            with comp.session():
                comp.forward(ids[:, :50], 0, prefill=True)
                steps = torch.cat([comp.forward(ids[:, t:t + 1], t, prefill=False) for t in range(50, 80)], 1)
        finally:
            comp.detach()
    assert (in_pass - stepped).abs().max() < 1e-9
    assert (in_pass - ref).abs().max() > 1e-3
    assert bpd_in_pass == pytest.approx(bpd_stepped)
    assert (chunk - steps).abs().max() < 1e-9


@pytest.mark.parametrize("bpd,v_bpd,regime", [(4.0, None, Regime("qall", 2048)), (6.0, None, Regime("qall", 2048)),
                                              (8.0, 8.0, Regime("qall", 2048)),
                                              (3.0, None, Regime("prefill", 1536, 511))], ids=str)
def test_knob_candidates_are_admissible_and_lead_with_the_paper_setting(bpd, v_bpd, regime):
    """docs/methods.md §0.1: every candidate, run as chosen (``use_knobs``), predicts at most 1.02 x
    each target, as its explicit knobs measure; at most 27; the §15.6 setting first when admissible."""
    m = build_method("gear")
    m.set_regime(regime)
    every = m.knob_candidates(SMOLLM2, bpd, v_bpd)
    cands = m.knob_candidates(SMOLLM2, bpd, v_bpd, 27)
    assert cands == every[:27] and 0 < len(cands) <= 27
    side = {"bits": 2, "group": 64, "sparsity": 0.02, "rank": 2}
    explicit = build_method("gear", **side, block=64, **({} if v_bpd is None else {f"v_{k}": x for k, x in side.items()}))
    explicit.set_regime(regime)
    explicit.configure(SMOLLM2, bpd, v_bpd)
    pred = explicit.knobs()["predicted"]
    paper_ok = pred["bpd_k"] <= 1.02 * bpd and (v_bpd is None or pred["bpd_v"] <= 1.02 * v_bpd)
    assert (cands[0] == {"block": 64, "k": side, "v": None if v_bpd is None else side}) == paper_ok
    for knobs in cands:
        m.use_knobs(knobs)
        m.configure(SMOLLM2, bpd, v_bpd)
        kn = m.knobs()
        assert kn["block"] == knobs["block"] and kn["fit"]["chosen_by"] == "held-out knob search"
        assert {k: kn["k"][k] for k in side} == knobs["k"]
        assert kn["predicted"]["bpd_k"] <= 1.02 * bpd
        assert v_bpd is None or kn["predicted"]["bpd_v"] <= 1.02 * v_bpd
    m.use_knobs({"block": 64, "k": {"bits": 8, "group": 32, "sparsity": 0.0, "rank": 4}, "v": None})
    with pytest.raises(Unsupported, match="not admissible"):
        m.configure(SMOLLM2, bpd, v_bpd)
    assert build_method("gear", bits=2).knob_candidates(SMOLLM2, bpd, v_bpd) == []
