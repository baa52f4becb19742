"""The hot paths: what a GPU would pay per token, checked on the CPU.

* H2O's one-pass recursion: a handful of fused ops per token for all heads (<= 20 is the target;
  six when a token is evicted, four otherwise), one block of logits alive at a time, the same
  result for every block size.
* Decode steps write their token into preallocated buffers (no copy of the cache), read grouped
  query heads without expanding K and V, and never synchronize with the host. A codec's state
  decodes its stored cache for the step (docs/design.md §2): a fixed number of ops per layer and
  step, whatever the cache length, and nothing of it kept after the step.
* The prefill asks the model for the last row of logits only; SVDq's calibration basis is moved to
  a device once per layer, not once per layer state.

Op counts come from ``torch.profiler``: an op is an aten op that launches work (views, reshapes,
allocation and dtype no-ops are not counted) with no counted op beneath it.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import methods.h2o as h2o_mod
from conftest import configured_method, tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.compressed_lm import CompressedLM
from kvbench.model.integrate import attach, logits_argument, model_shape
from methods.attention import causal_attention, expand_kv
from methods.base import ModelShape, Regime
from methods.h2o import H2O, H2OLayerState
from methods.buffers import Growing
from methods.sparsifier import attention_column_sums
from test_h2o import h2o_reference, kept_lists, make_qkv

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]

NO_WORK = {
    "aten::" + n for n in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "transpose", "t", "permute",
        "expand", "unsqueeze", "squeeze", "slice", "select", "unbind", "alias", "detach", "empty",
        "empty_strided", "empty_like", "new_empty", "resize_", "to", "contiguous", "lift_fresh",
        "result_type", "resolve_conj", "resolve_neg", "split", "narrow", "chunk", "unfold",
    )
}
COPIES = {"aten::cat", "aten::copy_", "aten::clone", "aten::_to_copy", "aten::index_select",
          "aten::gather", "aten::repeat", "aten::repeat_interleave"}


def _counted(events):
    """Leaf work ops (see the module docstring) of a profile."""
    memo = {}

    def has_work_below(e):
        if id(e) not in memo:
            memo[id(e)] = any(_is_work(c) or has_work_below(c) for c in e.cpu_children)
        return memo[id(e)]

    def _is_work(e):
        return e.name.startswith("aten::") and e.name not in NO_WORK and not has_work_below(e)

    return [e for e in events if _is_work(e)]


def profiled(fn, shapes=False):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        fn()
    return prof.events()


# ------------------------------------------------------------------------------------------------
# H2O's one-pass recursion (findings 1, 7)


def test_h2o_one_pass_costs_a_few_ops_per_token():
    t, d = 512, 32
    q, k, v = make_qkv(1, 4, 4, t, d, seed=1)
    m = H2O()
    m.set_regime(Regime("qall", t))
    m.configure(ModelShape(2, 16, 4, d), 4.0, 4.0)
    state = m.new_layer_state(0)
    with torch.no_grad():
        ops = _counted(profiled(lambda: state.attend(q, k, v, scaling=d**-0.5, prefill=False)))
    evicted = t - state.n_kept
    per_token = len(ops) / t
    names = [e.name for e in ops]
    assert per_token <= 20  # the per-token op target
    # per token: mask add, softmax, write-back, score GEMM; per eviction: argmax, one scatter;
    # a few ops per row block
    assert names.count("aten::_softmax") == names.count("aten::addmm_") == t
    assert names.count("aten::argmax") == names.count("aten::scatter_") == evicted
    assert len(ops) <= 4 * t + 2 * evicted + 60


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_h2o_one_block_of_logits_at_a_time_and_any_block_size_is_exact(monkeypatch, rows):
    """Only one block of logits is alive at a time (not T^2/2 Hq 4 bytes): each block is freed
    before the next is made, and the result does not depend on the block size (float64, against
    the naive reference of tests/test_h2o.py)."""
    q, k, v = make_qkv(2, 2, 3, 90, 16, torch.float64, seed=5)
    ref, ref_kept = h2o_reference(q, k, v, 0.4, 0.1, 0.1, 8)
    made = []
    real = h2o_mod._logit_block

    def tracked(*args):
        assert all(w() is None for w in made), "an earlier logit block is still alive"
        blk = real(*args)
        made.append(weakref.ref(blk))
        return blk

    monkeypatch.setattr(h2o_mod, "_logit_block", tracked)
    monkeypatch.setattr(h2o_mod, "ROW_BLOCK", rows)
    state = H2OLayerState(0.1, 0.1, 8)
    out = state.attend(q, k, v, scaling=0.4, prefill=False)
    assert len(made) == math.ceil(90 / rows)
    assert (out - ref).abs().max() < 1e-10
    assert kept_lists(state) == ref_kept


def test_h2o_block_rows_shrink_with_the_element_budget(monkeypatch):
    monkeypatch.setattr(h2o_mod, "BLOCK_ELEMS", 4 * 3 * 100 * 10)  # [B*H, g, rows, cols] <= this
    assert h2o_mod._block_rows(4, 3, 100) == 10
    assert h2o_mod._block_rows(4, 3, 10**9) == 1
    assert h2o_mod._block_rows(1, 1, 1) == h2o_mod.ROW_BLOCK


def test_h2o_prefill_column_sums_take_five_ops_per_block():
    """The keys are cast once, not per block; blocks are taller where they read fewer keys."""
    g, t, d = 2, 300, 16
    q, k, _ = make_qkv(1, 2, g, t, d, seed=2)
    block = 4 * 7200  # B * Hq = 4 query heads: 7200 logits per head and block
    ops = _counted(profiled(lambda: attention_column_sums(q, k, 0.3, block_elems=block)))
    blocks = sum(e.name == "aten::_softmax" for e in ops)
    fixed = math.ceil(t / (7200 // t))  # rows sized for all T keys: 24 rows, 13 blocks
    assert 1 < blocks <= 0.7 * fixed
    assert len(ops) <= 5 * blocks + 8
    logits = (q.double() @ expand_kv(k.double(), g).transpose(-1, -2)) * 0.3
    p = torch.softmax(logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")), -1)
    ref = p.sum(-2).reshape(1, 2, g, t)
    assert (attention_column_sums(q, k, 0.3, block_elems=block).double() - ref).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------
# Attention without expanding grouped heads


@pytest.mark.parametrize("tq,tk", [(40, 40), (1, 40), (7, 40)])
def test_causal_attention_matches_the_expanded_reference(tq, tk):
    """Native GQA (no mask), the single query without a mask, and the folded bottom-right
    causal chunk all equal naive attention with expanded K and V (float64)."""
    gen = torch.Generator().manual_seed(tq)
    g = 3
    q = torch.randn(2, 2 * g, tq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, tk, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, tk, 16, generator=gen, dtype=torch.float64)
    logits = q @ expand_kv(k, g).transpose(-1, -2) * 0.3
    qpos = torch.arange(tk - tq, tk)[:, None]
    mask = torch.arange(tk)[None, :] <= qpos
    ref = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ expand_kv(v, g)
    assert (causal_attention(q, k, v, 0.3) - ref).abs().max() < 1e-12


def test_single_query_attention_builds_no_mask_and_copies_no_cache():
    q = torch.randn(1, 8, 1, 32)
    k, v = torch.randn(1, 2, 500, 32), torch.randn(1, 2, 500, 32)
    ops = _counted(profiled(lambda: causal_attention(q, k, v, 0.2), shapes=True))
    assert [e.name for e in ops if e.name not in ("aten::fill_", "aten::zero_")] == [
        "aten::_scaled_dot_product_flash_attention_for_cpu"
    ]


# ------------------------------------------------------------------------------------------------
# Decode steps: buffers, no whole-cache copies, no host syncs (findings 4, 5)

P, STEPS = 300, 6
STATE_CASES = [
    ("fp16", {}, None, None),
    ("kivi", {"residual": 32, "group": 16, "v_group": 16}, 4.0, 3.0),
    ("kivi", {"residual": 32, "group": 16}, 3.0, None),
    ("svdq", {"group": 16}, 2.0, None),
    ("svdq", {"group": 16, "v_group": 16}, 1.5, 3.0),
    ("kqsvd", {}, 1.0, 4.0),
    ("cobra_kl", {}, 0.5, 4.0),
    ("snapkv", {"window": 8, "kernel": 3}, 4.0, None),
]


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1)
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (4, 64), generator=g))


#: the states that hold their tokens as they came (no codes): attention reads their buffers as held
AS_HELD = ("fp16", "snapkv")


@pytest.mark.parametrize("name,options,bpd,v_bpd", STATE_CASES, ids=lambda x: str(x))
def test_decode_steps_copy_no_cache_and_sync_nothing(model_and_stats, name, options, bpd, v_bpd):
    """After a P-token prefill (and one step, which moves the prefill's tensors into a buffer with
    spare room), no decode step reads a value back to the host (``_local_scalar_dense``;
    transformers' own mask preparation included). A state that holds its tokens as they came
    (FP16, SnapKV) copies nothing of its cache: no op of a step allocates as much as 64 tokens of
    one layer's K or V (a copy of the cache: ``torch.cat``, clones, casts, gathers; the profiler
    does not record the shapes of cat's inputs, so the allocations are checked), none copies a
    [B, H, >= 64, d] input. A codec's state decodes its stored cache into a transient copy for the
    step instead (what it keeps: tests/test_resident_memory.py). H2O's decode step still gathers
    its kept set (not checked)."""
    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, P + STEPS + 1), generator=torch.Generator().manual_seed(3))
    comp = attach(model, method)
    try:
        with torch.no_grad(), comp.session():
            comp.forward(ids[:, :P], 0, prefill=True)
            comp.forward(ids[:, P : P + 1], P, prefill=False)

            def steps():
                for t in range(P + 1, P + 1 + STEPS):
                    comp.forward(ids[:, t : t + 1], t, prefill=False)

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
                steps()
            events = prof.events()
    finally:
        comp.detach()
    syncs = [e for e in events if e.name in ("aten::_local_scalar_dense", "aten::item")]
    assert not syncs
    if name not in AS_HELD:
        return
    shape = model_shape(model)
    big = shape.n_kv_heads * 64 * shape.head_dim * 4  # bytes of 64 float32 tokens of one layer's K
    allocs = [(e.name, e.self_cpu_memory_usage) for e in events
              if e.name.startswith("aten::") and e.self_cpu_memory_usage >= big]
    assert not allocs, allocs
    copies = []
    for e in _counted(events):
        if e.name in COPIES and any(len(s) == 4 and s[2] >= 64 for s in e.input_shapes):
            copies.append((e.name, e.input_shapes))
    assert not copies, copies


def test_growing_buffer_adopts_without_copying_and_never_writes_the_adopted_tensor():
    x = torch.randn(1, 2, 5, 4)
    keep = x.clone()
    buf = Growing()
    buf.append(x)
    assert buf.data.data_ptr() == x.data_ptr()  # a one-pass stores its keys as they are
    buf.write(1, torch.zeros(1, 2, 2, 4))
    assert torch.equal(x, keep)  # the adopted tensor was copied before the write
    assert torch.equal(buf.data[:, :, 1:3], torch.zeros(1, 2, 2, 4))
    ptrs = set()
    for _ in range(40):  # decode-like appends: amortized, at least 64 tokens of spare room
        buf.append(torch.randn(1, 2, 1, 4))
        ptrs.add(buf._buf.data_ptr())
    assert len(ptrs) == 1 and buf.n == 45


def test_svdq_basis_moves_to_a_device_once_per_layer(model_and_stats):
    """No layer state copies the calibration basis from the CPU."""
    model, stats = model_and_stats
    m = configured_method(model, "svdq", {"group": 16, "basis": "calib"}, 2.0, None, stats)
    a, b = m.new_layer_state(1), m.new_layer_state(1)
    assert a.basis is b.basis and a.mu is b.mu  # the active columns are selected once per layer
    meta = torch.device("meta")
    pa, pb = a._params(meta), b._params(meta)
    assert pa[1].device == meta and pa[1] is pb[1] and pa[0] is pb[0]
    assert m.new_layer_state(0).basis is not a.basis


# ------------------------------------------------------------------------------------------------
# The prefill computes one row of logits


def test_prefill_asks_the_model_for_the_last_row_only(model_and_stats):
    model, stats = model_and_stats
    assert logits_argument(model) == "logits_to_keep"  # transformers 5.x; 4.45-4.49: num_logits_to_keep
    rows = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(out.shape[1]))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        plain = CompressedLM(model, None)
        plain.generate(ids, 3)
        assert rows == [1, 1, 1]
        rows.clear()
        plain.score(ids[:, :30], ids[:, 30:])
        assert rows == [11]  # the 10 targets' predictions + the last position, not 40 rows
        # the values: 11 rows against 40 are differently shaped GEMMs, so compared in float64
        model64 = tiny_llama(seed=1).to(torch.float64)
        logprobs = CompressedLM(model64, None).score(ids[:, :30], ids[:, 30:])
        with torch.no_grad():
            full = model64(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
        expect = full[:, 29:-1].gather(-1, ids[:, 30:, None])[..., 0]
        assert (logprobs - expect).abs().max() < 1e-5
        for name, options, bpd, v_bpd in (("kivi", {"residual": 32, "group": 16}, 3.0, None),
                                          ("snapkv", {"window": 8, "kernel": 3}, 4.0, None)):
            comp = attach(model, configured_method(model, name, options, bpd, v_bpd, stats))
            try:
                lm = CompressedLM(model, None, comp)
                rows.clear()
                lm.generate(ids, 3)
                assert rows == [1, 1, 1]
                rows.clear()
                lm.score(ids[:, :30], ids[:, 30:])
                assert rows == [1, 9]  # the prefill's last row, then the 9 decoded targets
            finally:
                comp.detach()
    finally:
        hook.remove()


def test_logits_argument_names_either_version_or_none():
    from kvbench.model.integrate import last_logits

    class New(torch.nn.Module):
        def forward(self, input_ids, logits_to_keep=0):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, num_logits_to_keep=0):
            return input_ids

    class Plain(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    assert last_logits(New()) == {"logits_to_keep": 1}
    assert last_logits(Old(), 5) == {"num_logits_to_keep": 5}
    assert last_logits(Plain()) == {}


# ------------------------------------------------------------------------------------------------
# Host syncs: the Gaussian quantizer with one integer width


def test_integer_width_quantizer_equals_the_tensor_path_and_makes_no_width_tensor():
    """``torch.as_tensor(int, device=cuda)`` was a host->device copy per layer and step; an integer
    width now stays a Python number, with the same codes and reconstructions bit for bit."""
    from methods.gaussquant import dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        c = torch.randn(40, 32, generator=gen, dtype=dtype) * 3
        c[0, :3] = torch.tensor([1e30, -1e30, 0.0], dtype=dtype)  # clamped in float
        step = torch.rand(32, generator=gen, dtype=dtype) + 0.1
        for b in range(0, 9):
            codes = quantize(c, step, b)
            assert torch.equal(codes, quantize(c, step, torch.tensor(b)))
            assert torch.equal(dequantize(codes, step, b), dequantize(codes, step, torch.tensor(b)))
    names = {e.name for e in profiled(lambda: dequantize(quantize(c, step, 3), step, 3))}
    assert not names & {"aten::lift_fresh", "aten::scalar_tensor", "aten::where"}


# ------------------------------------------------------------------------------------------------
# Launch counts of the codecs: a fixed handful of ops per call


def _naive_stream(codes: torch.Tensor, widths: list[int]) -> list[int]:
    """The little-endian bit stream of rows of codes (row-major, each code LSB first), as bytes."""
    bits = []
    for row in codes.tolist():
        for c, b in zip(row, widths):
            bits += [(int(c) >> k) & 1 for k in range(b)]
    bits += [0] * (-len(bits) % 8)
    return [sum(bits[8 * i + k] << k for k in range(8)) for i in range(len(bits) // 8)]


@pytest.mark.parametrize("widths", [[3, 0, 2, 7, 1, 8, 0, 5], [2] * 12, [4] * 6, [1] * 9, [8] * 3, [3] * 5, [0, 2, 2, 0]])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 21])
def test_pack_codes_paths_write_the_naive_stream(widths, m):
    """The bit-gather path (mixed widths, zero-width slots, a partial last super-row: a decode
    step packs one row) and the whole-codes-per-byte path (one width of 1, 2, 4 or 8) against a
    naive bit string; float codes (a quantizer's output before its cast) pack like integers."""
    from methods.gaussquant import pack_codes, unpack_codes

    g = torch.Generator().manual_seed(m)
    codes = torch.stack([torch.randint(0, 2**b, (m,), generator=g) for b in widths], 1)
    expect = _naive_stream(codes, widths)
    w = torch.tensor(widths)
    for c in (codes, codes.float(), codes.to(torch.uint8)):
        assert pack_codes(c, w).tolist() == expect
        assert pack_codes(c, tuple(widths)).tolist() == expect
    assert torch.equal(unpack_codes(pack_codes(codes, w), w, m), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_rows_write_the_naive_stream(bits):
    """Per row of n codes of ``bits`` bits, ceil(n bits / 8) bytes (the word path: 3, 5, 6, 7)."""
    from methods.packing import pack_bits, unpack_bits

    g = torch.Generator().manual_seed(bits)
    for n in (1, 5, 8, 13, 32):
        codes = torch.randint(0, 2**bits, (3, n), generator=g)
        packed = pack_bits(codes, bits)
        assert packed.tolist() == [_naive_stream(row[None], [bits] * n) for row in codes]
        assert torch.equal(unpack_bits(packed, bits, n), codes)


CODEC_CASES = [("kqsvd", {}, 2.0), ("kqsvd", {"step": "gauss"}, 1.0), ("cobra_kl", {}, 0.5), ("cobra_mse", {}, 2.0)]


@pytest.mark.parametrize("name,options,bpd", CODEC_CASES, ids=lambda x: str(x))
def test_latent_codec_reads_what_it_stores(model_and_stats, name, options, bpd):
    """What a cache layer reads on arrival (``encode_decode``: dequantized from the codes it
    packs, without unpacking them) is what decoding the stored bytes gives, bit for bit; and both
    equal a per-head reference of §1.1 over the active coordinates only (no padding slots), with
    the stream of the reference's codes in that order."""
    from methods.gaussquant import dequantize, quantize

    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, None, stats)
    gen = torch.Generator().manual_seed(1)
    for codec in method._k_codecs:
        h, d = codec.mu.shape
        for t in (1, 3, 40):
            x = torch.randn(2, h, t, d, generator=gen, dtype=torch.float64) * 2
            packed, k_hat = codec.encode_decode(x)
            assert torch.equal(codec.decode(packed), k_hat)
            assert torch.equal(codec.encode(x).data, packed.data)
            ref, codes, widths = torch.zeros_like(x), [], []
            for j in range(h):
                w = codec.width[j]
                on = w > 0
                c = torch.einsum("btd,rd->btr", x[:, j] - codec.mu[j], codec.enc[j])[..., on]
                q = quantize(c, codec.step[j][on], w[on])
                ref[:, j] = codec.mu[j] + dequantize(q, codec.step[j][on], w[on]) @ codec.dec[j][on]
                codes.append(q)
                widths += w[on].tolist()
            assert (k_hat - ref).abs().max() < 1e-9
            rows = torch.cat(codes, -1).reshape(2 * t, -1)  # tokens (batch, position), heads, coordinates
            assert packed.data.tolist() == _naive_stream(rows, widths)


OPS_CASES = [
    ("kqsvd", {}, 2.0, None), ("cobra_kl", {}, 0.5, None), ("cobra_mse", {}, 2.0, None),
    ("kivi", {"residual": 32, "group": 16}, 3.0, None), ("svdq", {"group": 16}, 2.0, None),
]


def _decode_step_ops(model, method, prompt, nxt):
    """(all counted ops, those inside the states' decode of their stored cache) of one-token steps
    of ``nxt`` after an exact prefill of ``prompt``, by ``kvbench.bench.opcount``'s rule."""
    from kvbench.bench import opcount
    from methods.bookkeeping import DECODE_RANGE

    with attach_session(model, method) as comp:
        comp.forward(prompt, 0, prefill=True)
        ranges = opcount._Ranges(model)
        try:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for i in range(nxt.shape[1]):
                    comp.forward(nxt[:, i : i + 1], prompt.shape[1] + i, prefill=False)
        finally:
            ranges.remove()
    events = prof.events()
    total = opcount.count_events(events)
    attn = opcount.ATTN
    try:
        opcount.ATTN = DECODE_RANGE  # the same rule, inside the decode ranges only
        decoding = opcount.count_events(events)
    finally:
        opcount.ATTN = attn
    return total, decoding


@contextlib.contextmanager
def attach_session(model, method):
    comp = attach(model, method)
    try:
        with torch.no_grad(), comp.session():
            yield comp
    finally:
        comp.detach()


@pytest.mark.parametrize("name,options,bpd,v_bpd", OPS_CASES, ids=lambda x: str(x))
def test_codec_decode_steps_stay_within_three_times_fp16s_ops(model_and_stats, name, options, bpd, v_bpd):
    """The per-token op target with the bench's own counting rule (``kvbench.bench.opcount``) on the
    tiny model: per layer and decode step at most 3x the plain model's 13 ops for the step's own
    work (encoding and storing the token, RoPE, attention); the decode of the stored cache the step
    attends over is a fixed number of ops, the same after a prompt of 100 tokens and of 196 (no op
    per cached token); no host sync. The latent codecs' one-pass forward at most 3x its 11 (the
    host-side bookkeeping of the bits read is apart)."""
    from kvbench.bench import opcount

    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, 216), generator=torch.Generator().manual_seed(2))
    layers = model.config.num_hidden_layers
    counts = []
    for p in (100, 196):  # the same position in the token groups (multiples of 32 apart)
        total, decoding = _decode_step_ops(model, method, ids[:, :p], ids[:, p : p + 20])
        assert (total.kernels - decoding.kernels) / (layers * 20) <= 3 * 13
        assert total.syncs == 0
        counts.append(decoding.kernels)
    assert counts[0] == counts[1]
    if name in ("kqsvd", "cobra_kl", "cobra_mse"):
        one = opcount.one_pass(model, method, ids[:, :120])
        assert one.kernels / layers <= 3 * 11
        assert one.host > 0  # the bits each query read: counted apart


def _blocked_case(n0, tq, kb, with_prefix, two_values, dtype=torch.float64):
    g = torch.Generator().manual_seed(n0 + tq)
    n = n0 + tq
    pk = kb * (n0 // kb) if with_prefix else 0
    pv = max(0, n0 - kb) if (with_prefix and two_values) else 0
    q = torch.randn(1, 4, tq, 8, generator=g, dtype=dtype)
    k_hat, k_ex = (torch.randn(1, 2, n - pk, 8, generator=g, dtype=dtype) for _ in range(2))
    kp = torch.randn(1, 2, pk, 8, generator=g, dtype=dtype) if pk else None
    if two_values:
        v_hat, v_ex = (torch.randn(1, 2, n - pv, 8, generator=g, dtype=dtype) for _ in range(2))
        vp = torch.randn(1, 2, pv, 8, generator=g, dtype=dtype) if pv else None
        return q, kp, k_ex, k_hat, kb, vp, v_ex, v_hat, kb, 0.3
    return q, kp, k_ex, k_hat, kb, None, torch.randn(1, 2, n, 8, generator=g, dtype=dtype), None, None, 0.3


@pytest.mark.parametrize("n0,tq,kb,with_prefix,two_values", [
    (0, 200, 32, False, False), (0, 200, 32, False, True), (70, 90, 32, True, False),
    (70, 90, 32, True, True), (64, 17, 16, True, True), (40, 100, 16, False, True),
])
def test_blocked_attention_is_one_sdpa_call_equal_to_the_eager_mix(n0, tq, kb, with_prefix, two_values):
    """KIVI/SVDq's chunk attention: one fused call with one mask for all key groups, equal in
    float64 to the eager per-(query, key) mix of §2.3 and to the per-group loop."""
    from methods.blocked_attention import blocked_attention, grouped_attention, mixed_attention

    args = _blocked_case(n0, tq, kb, with_prefix, two_values)
    q, kp, k_ex, k_hat, _, vp, v_ex, v_hat, window, scaling = args
    n = n0 + tq
    pk = 0 if kp is None else kp.shape[2]
    pv = 0 if vp is None else vp.shape[2]
    t = torch.arange(n0, n)[:, None]
    key_mask = torch.arange(pk, n)[None, :] < kb * torch.div(t, kb, rounding_mode="floor")
    val_mask = None if v_hat is None else torch.arange(pv, n)[None, :] < t - window
    ref = mixed_attention(q, kp, k_ex, k_hat, key_mask, vp, v_ex, v_hat, val_mask, scaling)
    out = blocked_attention(*args)
    assert (out - ref).abs().max() < 1e-12
    assert (grouped_attention(*args) - ref).abs().max() < 1e-12
    names = [e.name for e in profiled(lambda: blocked_attention(*args))]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1


@pytest.mark.parametrize("n0,tq,kb", [(0, 200, 32), (64, 90, 32), (70, 90, 32), (0, 600, 64)])
def test_blocked_attention_with_values_by_the_key_rule_is_the_eager_mix(n0, tq, kb):
    """GEAR's chunk attention (``value_window=None``): value s read in its key's version (s below
    the query's block start: compressed), equal in float64 to the eager mix with the key mask as
    the value mask, as one SDPA call (``gpu_dispatch``) and as the per-group loop."""
    from methods.blocked_attention import blocked_attention, gpu_dispatch, grouped_attention, mixed_attention

    g = torch.Generator().manual_seed(n0 + tq)
    n, pk = n0 + tq, kb * (n0 // kb)
    q = torch.randn(1, 4, tq, 8, generator=g, dtype=torch.float64)
    kp, vp = (torch.randn(1, 2, pk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k_hat, k_ex, v_hat, v_ex = (torch.randn(1, 2, n - pk, 8, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.arange(n0, n)[:, None]
    mask = torch.arange(pk, n)[None, :] < kb * torch.div(t, kb, rounding_mode="floor")
    ref = mixed_attention(q, kp, k_ex, k_hat, mask, vp, v_ex, v_hat, mask, 0.3)
    args = (q, kp, k_ex, k_hat, kb, vp, v_ex, v_hat, None, 0.3)
    with gpu_dispatch():
        one = blocked_attention(*args)
        names = [e.name for e in profiled(lambda: blocked_attention(*args))]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1
    assert (one - ref).abs().max() < 1e-12
    assert (grouped_attention(*args) - ref).abs().max() < 1e-12
    assert (blocked_attention(*args) - ref).abs().max() < 1e-12


def test_blocked_attention_ops_do_not_grow_with_the_key_groups():
    from kvbench.bench import opcount
    from methods.blocked_attention import blocked_attention

    counts = []
    for tq in (64, 512):
        args = _blocked_case(0, tq, 16, False, False, dtype=torch.float32)
        blocked_attention(*args)  # the mask of this shape is cached: the layers of a pass share it
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with torch.autograd.profiler.record_function(opcount.ATTN):
                blocked_attention(*args)
        counts.append(opcount.count_events(prof.events()).kernels)
    assert counts[0] == counts[1] <= 4  # cat keys, cat values, SDPA


def test_growing_buffer_adopts_a_write_that_replaces_everything():
    x = torch.randn(1, 2, 5, 4)
    keep = x.clone()
    buf = Growing()
    buf.append(x)
    y = torch.zeros(1, 2, 5, 4)
    buf.write(0, y)
    assert buf.data.data_ptr() == y.data_ptr() and torch.equal(x, keep)
    buf.append(torch.ones(1, 2, 1, 4))
    assert torch.equal(y, torch.zeros(1, 2, 5, 4)) and buf.n == 6
    assert torch.equal(buf.data[:, :, 5], torch.ones(1, 2, 4))


@pytest.mark.parametrize("schedule", [(8, 4, 2, 1, 1, 0, 0, 0), (3, 3, 2, 0, 2, 0, 0, 0), (5, 0, 0, 0, 0, 0, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_svdq_batched_latent_quantizer_is_the_per_group_quantizer(schedule, dtype):
    """SVDq's one-call quantization of every active latent channel gives, per run of one width,
    exactly the pack of :func:`quantize_groups` along the token axis (codes, fp16 scales and
    minima, bits), and c_hat is their :func:`dequantize_groups`, bit for bit."""
    from methods.groupquant import dequantize_groups, quantize_groups
    from methods.svdq import _runs, quantize_latents

    m, group, t = 4, 8, 24
    n = m * sum(1 for b in schedule if b)
    c = torch.randn(2, 3, t, n, generator=torch.Generator().manual_seed(len(schedule)), dtype=dtype) * 2
    packs, c_hat = quantize_latents(c, schedule, m, group)
    start, parts = 0, []
    assert [p.nbits for p in packs] == [b for b, _ in _runs(schedule)]
    for gp, (b, width) in zip(packs, _runs(schedule)):
        ref = quantize_groups(c[..., start : start + width * m].contiguous(), b, group, axis=2)
        assert torch.equal(gp.codes, ref.codes) and torch.equal(gp.scale, ref.scale)
        assert torch.equal(gp.minimum, ref.minimum) and gp.bits() == ref.bits()
        parts.append(dequantize_groups(ref))
        assert torch.equal(dequantize_groups(gp), parts[-1])
        start += width * m
    assert torch.equal(c_hat, torch.cat(parts, -1))


@pytest.mark.parametrize("v_bpd", [3.0, 4.0])
def test_rotated_value_codec_reads_what_it_stores(model_and_stats, v_bpd):
    """The values a cache layer reads on arrival are the decoded stored bytes, bit for bit."""
    model, stats = model_and_stats
    method = configured_method(model, "kqsvd", {}, 1.0, v_bpd, stats)
    gen = torch.Generator().manual_seed(4)
    for codec in method._v_codecs:
        h, d = codec.mu.shape
        for t in (1, 9):
            x = torch.randn(1, h, t, d, generator=gen, dtype=torch.float64)
            packed, v_hat = codec.encode_decode(x)
            assert torch.equal(codec.decode(packed), v_hat)
            assert packed.data.numel() == (h * t * d * int(v_bpd) + 7) // 8


def test_long_cpu_chunks_take_the_group_loop_unless_counted_as_a_gpu():
    """On the CPU a chunk longer than CPU_SINGLE_CALL_QUERIES takes the per-group loop (fewer
    FLOPs); the op count (``gpu_dispatch``) counts the single call a GPU makes. Same result."""
    from methods.blocked_attention import CPU_SINGLE_CALL_QUERIES, blocked_attention, gpu_dispatch

    args = _blocked_case(0, CPU_SINGLE_CALL_QUERIES + 64, 64, False, True)
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    out_loop = blocked_attention(*args)
    assert [e.name for e in profiled(lambda: blocked_attention(*args))].count(sdpa) > 1
    with gpu_dispatch():
        out_one = blocked_attention(*args)
        assert [e.name for e in profiled(lambda: blocked_attention(*args))].count(sdpa) == 1
    assert (out_loop - out_one).abs().max() < 1e-12
