"""H2O's fused recursion (methods/h2o_fused.py, one Triton launch per row block) against the torch
loop it replaces (``H2OLayerState._evict_loop``, the reference), under Triton's interpreter on a
CPU (``TRITON_INTERPRET=1``: the kernel runs with numpy). Kept sets and counts must be identical;
probabilities, scores and outputs agree to rounding:

* float64: <= 1e-12 (observed: outputs 7e-16, scores 1.2e-15 relative);
* float32: rtol 1e-5, atol 1e-6 (observed: outputs 4.8e-7, scores 4.3e-7 relative) — numpy's
  exp (the interpreter's) and torch's vectorized exp differ by an ulp or two, the g heads are
  summed in another order, and a token's score adds up to 48 such probabilities here, so a score
  may move by tens of ulps of 2^-24; the kept sets are still compared exactly (ties excepted: the
  random inputs below have no two scores that close, and a near-tie would show as a kept-set
  difference, not a tolerance failure).

The interpreter is slow (milliseconds per op): the inputs are small.
"""

import subprocess
import sys

import pytest
import torch

import methods.h2o as h2o
from methods import build_method
from methods import h2o_fused
from methods.h2o import H2OLayerState, _logit_block

pytestmark = [pytest.mark.usefixtures("one_thread")]

needs_triton = pytest.mark.skipif(not h2o_fused.available(), reason="triton is not installed")

DTYPES = [torch.float64, torch.float32]


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter for the test (the kernel is wrapped once per mode)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert h2o_fused.interpreting()


def close(a, b, dtype):
    if dtype == torch.float64:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def qkv(b, hkv, g, t, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, t, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=dtype)
    return q, k, v


def block_inputs(bh, g, m, r, d, dtype, seed=0):
    """A block of logits over m held tokens (scattered positions, random scores) and r new ones."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bh, g, r, d, generator=gen, dtype=dtype)
    k = torch.randn(bh, m + r, d, generator=gen, dtype=dtype)
    blk = _logit_block(q, k.transpose(1, 2), m, 0, r, d ** -0.5)
    seen = 3 * m
    live = torch.zeros(2, bh, m + r, dtype=dtype)
    old = torch.stack([torch.randperm(seen, generator=gen)[:m].sort().values for _ in range(bh)])
    live[1, :, :m] = -torch.rand(bh, m, generator=gen, dtype=dtype) * 4
    new = torch.arange(seen, seen + r).expand(bh, r)
    return blk, live, torch.cat([old, new], dim=1), seen


def run_both(state, blk, live, pos, m):
    """(blk, live, kept, counts) after the reference loop and after the fused block."""
    bh, g, r, c = blk.shape
    ones = torch.ones(1, g, dtype=blk.dtype)
    ref = [blk.clone(), live.clone(), None, []]
    ref[2] = state._evict_loop(ref[0], ref[1], ones, pos, m, 0, m, ref[3])
    fus = [blk.clone(), live.clone(), None, []]
    fus[2] = state._fused_block(fus[0], fus[1], pos, m, 0, m, fus[3])
    return ref, fus


def check_block(ref, fus, dtype):
    assert fus[2] == ref[2] and fus[3] == ref[3]  # kept count and counts: static
    gone_ref, gone_fus = torch.isinf(ref[1][1]), torch.isinf(fus[1][1])
    assert torch.equal(gone_fus, gone_ref)  # the same tokens evicted
    assert torch.equal(torch.isinf(fus[1][0]), gone_ref)  # the mask says the same
    close(fus[0], ref[0], dtype)  # probabilities written back
    close(fus[1][1][~gone_ref], ref[1][1][~gone_ref], dtype)  # negated scores of the kept tokens


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,m", [(1, 0), (3, 0), (3, 10), (2, 7)])
def test_block_matches_the_torch_loop(interpret, dtype, g, m):
    """One block, B*Hkv = 3 rows: from an empty cache (Q-all budget) and after m held tokens (a
    decode after a prefill, fixed budget, held tokens at scattered positions)."""
    r = 14
    blk, live, pos, seen = block_inputs(3, g, m, r, 8, dtype, seed=g + m)
    st = H2OLayerState(0.2, 0.1, min_budget=4, fused="on")
    st._seen = seen if m else 0
    if m:
        st._fixed = (m, 3)  # C = m: one eviction per new token; recent window 3
    else:
        pos = pos - seen
    ref, fus = run_both(st, blk, live, pos, m)
    check_block(ref, fus, dtype)
    assert any(torch.isinf(ref[1][1]).flatten())  # evictions happened


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_with_several_evictions_per_token(interpret, dtype):
    """A budget that shrinks (12 -> 5 -> 8, recent windows 2-4) evicts up to 8 tokens after one
    query; the kernel's in-program loop over evictions follows the schedule (H2O's own schedules
    evict at most one per token, the kernel allows any)."""
    m, r, g = 9, 12, 3
    blk, live, pos, seen = block_inputs(4, g, m, r, 8, dtype, seed=5)
    st = H2OLayerState(0.2, 0.1, min_budget=4, fused="on")
    st._seen = seen
    st.budget = lambda t: (12, 2) if t < seen + 5 else ((5, 4) if t < seen + 9 else (8, 3))
    ref, fus = run_both(st, blk, live, pos, m)
    check_block(ref, fus, dtype)
    n_evict, _, _ = h2o_fused.block_schedule(st.budget, seen, 0, r, m, [])
    assert max(n_evict) > 1


def both_states(monkeypatch, heavy, recent, min_budget, rows):
    """Two layer states (torch loop, fused) with blocks of ``rows`` queries (several per call)."""
    monkeypatch.setattr(h2o, "ROW_BLOCK", rows)
    return (H2OLayerState(heavy, recent, min_budget, fused="off"),
            H2OLayerState(heavy, recent, min_budget, fused="on"))


def check_states(ref, fus, out_ref, out_fus, dtype):
    close(out_fus, out_ref, dtype)
    assert torch.equal(fus.kept_positions(), ref.kept_positions())
    close(fus._score, ref._score, dtype)
    assert torch.equal(fus._k, ref._k) and torch.equal(fus._v, ref._v)  # gathered copies
    if ref._reads is None:  # a prefill
        assert fus._reads is None
    else:
        assert all(torch.equal(a, b) for a, b in zip(fus._reads, ref._reads))
    assert fus.stored_bits() == ref.stored_bits()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [1, 3])
def test_qall_layer_state_matches_the_torch_loop(interpret, monkeypatch, dtype, g):
    """A whole Q-all pass (growing budget from min_budget, §6.3) in blocks of 16 queries, B = 2,
    Hkv = 2: outputs, kept positions, scores and the bits each query read."""
    ref, fus = both_states(monkeypatch, 0.15, 0.1, 5, rows=16)
    q, k, v = qkv(2, 2, g, 40, 8, dtype, seed=g)
    out_ref = ref.attend(q, k, v, scaling=8 ** -0.5, prefill=False)
    out_fus = fus.attend(q, k, v, scaling=8 ** -0.5, prefill=False)
    check_states(ref, fus, out_ref, out_fus, dtype)
    assert ref.n_kept < 40


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_after_prefill_matches_the_torch_loop(interpret, monkeypatch, dtype):
    """A 30-token prefill (real drop, C = 9), a 12-token chunk in blocks of 5 (m = 9 held), then
    two single tokens: the fused path from a non-empty cache at scattered positions."""
    ref, fus = both_states(monkeypatch, 0.2, 0.1, 4, rows=5)
    q, k, v = qkv(1, 2, 2, 44, 8, dtype, seed=7)
    for lo, hi, prefill in ((0, 30, True), (30, 42, False), (42, 43, False), (43, 44, False)):
        args = (q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
        out_ref = ref.attend(*args, scaling=8 ** -0.5, prefill=prefill)
        out_fus = fus.attend(*args, scaling=8 ** -0.5, prefill=prefill)
        check_states(ref, fus, out_ref, out_fus, dtype)


@needs_triton
def test_choices(interpret, monkeypatch):
    """``auto`` stays on the torch loop on a CPU (even under the interpreter); ``on`` runs there
    only under the interpreter and names the choices otherwise; unknown values are refused."""
    cpu = torch.device("cpu")
    assert not h2o_fused.use_fused("auto", cpu, 3, 64)
    assert not h2o_fused.use_fused("off", cpu, 3, 64)
    assert h2o_fused.use_fused("on", cpu, 3, 64)
    with pytest.raises(RuntimeError, match="auto.*off"):
        h2o_fused.use_fused("on", cpu, 4, 1 << 15)  # beyond one tile
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA.*TRITON_INTERPRET=1"):
        h2o_fused.use_fused("on", cpu, 3, 64)


def test_option_values_and_missing_triton(monkeypatch):
    with pytest.raises(ValueError, match="auto, on, off"):
        build_method("h2o", fused="yes")
    assert build_method("h2o").fused == "auto"
    monkeypatch.setattr(h2o_fused, "triton", None)
    monkeypatch.setattr(h2o_fused.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="Triton"):
        build_method("h2o", fused="on")
    assert not h2o_fused.use_fused("auto", torch.device("cuda"), 3, 64)  # no Triton: the torch loop


def test_importing_methods_does_not_import_triton():
    code = "import sys, methods, methods.h2o_fused; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
