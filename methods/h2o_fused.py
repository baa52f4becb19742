"""H2O's per-token recursion as one Triton kernel launch per row block (docs/methods.md §6.3).

H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv 2306.14048) evicts, after each token, the lowest-score non-recent
token; the causal-exact Q-all mask of METHODS §6.3 runs that recursion for t = 0..T-1. The
reference (:meth:`methods.h2o.H2OLayerState._evict_loop`) launches four to six torch ops per token
and layer: on a GPU the pass is launch-bound (173x the plain model on an H200, SmolLM2, 2048
tokens). The control flow is static: how many tokens each query evicts depends only on its
position (the budget schedule), only *which* token is data-dependent. So the whole block runs in
one launch: :func:`block_schedule` computes the evictions per token and the recent-window
threshold on the host (and the kept count each query reads), and :func:`evict_block` launches one
program per B*Hkv row that loops over the block's queries holding the row's additive mask and
negated score (length c) in registers:

* softmax of (logits + mask) over the kept keys for the row's g query heads, written back into
  the block (the output GEMM reads them);
* negated score -= the mean over the g heads;
* ``n_evict[i]`` times: the argmax of the negated score over the eligible tokens (position <= t -
  C_r; the first token alone when nothing is held and none is old enough, as the reference does),
  -inf into mask and score.

It is the same arithmetic in the same order as the reference (mask add, max-shifted exp, sum,
divide; -1/g times the head sum; argmax taking the first of equal values, i.e. the older token),
so float64 agrees to rounding (tests/test_h2o_fused.py, under Triton's interpreter) and the kept
sets are the same wherever no two scores are within rounding of each other.

Triton is optional (``pip install triton``, or the ``gpu`` extra): it is imported only when the
kernel is about to run (never in a CPU run of ``fused=auto``), and the kernel is compiled (or
interpreted, ``TRITON_INTERPRET=1``) at first use.
:func:`use_fused` decides for H2O's ``fused`` option.

Decisions where METHODS.md is silent:

* ``auto`` uses the kernel on CUDA tensors when Triton is installed and blocks fit in one tile
  (:data:`MAX_TILE`), the torch loop everywhere else; ``on`` insists (an error naming the choices
  where Triton or a CUDA device is missing, unless Triton's interpreter is active); ``off`` always
  runs the torch loop.
* A row's block of g x c logits is one register tile (g and c rounded up to powers of two): up to
  :data:`MAX_TILE` elements (16k keys at g <= 4); larger blocks run the torch loop. One warp per
  1024 elements (4 to 32): ptxas for sm_90 fits float32 tiles up to 4 x 2048 (SmolLM2's g = 3 over
  a 2048-token window) in registers at 8 warps; larger tiles spill (4 x 16384 at 32 warps: 1.9 KB a
  thread), still correct.
* No FMA contraction (``enable_fp_fusion=False``): the mask add, shift, exp, sum and divide are
  rounded one by one as in torch's softmax. ``tl.exp`` of float32 is an ``ex2.approx`` on NVIDIA
  GPUs (a few ulp), so float32 agrees with torch's CUDA softmax to rounding, not bit for bit;
  float64 goes through libdevice.
"""

from __future__ import annotations

import importlib.util

import torch

#: Triton and its language module once :func:`_load` imported them (optional: only the GPU path and
#: the tests need them, and importing Triton costs about 0.4 s, so a CPU run never does)
triton = tl = None

#: the choices of H2O's ``fused`` option
CHOICES = ("auto", "on", "off")
#: the largest register tile (next_pow2(g) x next_pow2(c) elements) the kernel holds per program
MAX_TILE = 1 << 16


def available() -> bool:
    """Whether Triton is installed (without importing it)."""
    return triton is not None or importlib.util.find_spec("triton") is not None


def _load() -> None:
    """Import Triton into this module's globals (the kernel's ``tl`` resolves there)."""
    global triton, tl
    if triton is None:
        import triton as _triton
        import triton.language as _tl

        triton, tl = _triton, _tl


def interpreting() -> bool:
    """Whether Triton's interpreter (``TRITON_INTERPRET=1``) runs kernels on the CPU with numpy."""
    if not available():
        return False
    _load()
    return bool(triton.knobs.runtime.interpret)


def check_choice(fused: str) -> None:
    """Raise on an unknown ``fused`` value, or on ``on`` where Triton is not installed."""
    if fused not in CHOICES:
        raise ValueError(f"h2o: fused must be one of {', '.join(CHOICES)}; got {fused!r}")
    if fused == "on" and not available():
        raise RuntimeError("h2o: fused='on' needs Triton (pip install triton), which is not importable "
                           "here; use fused='auto' or 'off' (the torch loop)")


def tile(g: int, c: int) -> int:
    """Elements of a row's register tile for g query heads over c keys."""
    return triton.next_power_of_2(g) * triton.next_power_of_2(c)


def use_fused(fused: str, device: torch.device, g: int, c: int) -> bool:
    """Whether a decode call over at most ``c`` keys with ``g`` query heads per KV head runs the
    kernel: ``off`` never; ``auto`` on a CUDA device with Triton (not its interpreter) and a tile
    within :data:`MAX_TILE`; ``on`` wherever the kernel can run (CUDA, or any device under the
    interpreter), an error elsewhere naming the choices."""
    check_choice(fused)
    if fused == "off" or not available() or (fused == "auto" and device.type != "cuda"):
        return False
    _load()
    runs = interpreting() or device.type == "cuda"
    fits = tile(g, c) <= MAX_TILE
    if fused == "auto":
        return device.type == "cuda" and not interpreting() and fits
    if not runs:
        raise RuntimeError(f"h2o: fused='on' needs a CUDA device for Triton (got {device.type}) or "
                           "Triton's interpreter (TRITON_INTERPRET=1); use fused='auto' or 'off'")
    if not fits:
        raise RuntimeError(f"h2o: fused='on' holds a row's {g} x {c} logits in one tile of at most "
                           f"{MAX_TILE} elements; this block needs {tile(g, c)}: use fused='auto' "
                           "(the torch loop for such blocks) or 'off'")
    return True


def block_schedule(budget, seen: int, r0: int, r: int, kept: int, counts: list) -> tuple[list, list, int]:
    """The static part of the recursion for queries r0..r0+r-1 of a decode call that started at
    position ``seen`` with ``kept`` tokens held before query r0: per query, the number of
    evictions (``budget(t)`` = (C_t, C_r,t): down to C_t after appending) and the threshold t -
    C_r,t (tokens at positions up to it may be evicted). Appends to ``counts`` the kept tokens each
    query reads (itself included); returns (evictions, thresholds, kept after the block)."""
    n_evict, thresholds = [], []
    for li in range(r):
        t = seen + r0 + li
        kept += 1
        counts.append(kept)
        cap, c_r = budget(t)
        n = max(0, kept - cap)
        kept -= n
        n_evict.append(n)
        thresholds.append(t - c_r)
    return n_evict, thresholds, kept


def evict_block(blk: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, n_evict, thresholds,
                nothing_held: bool) -> None:
    """Run the recursion over one block in place: ``blk`` [B*Hkv, g, r, c] the logits of
    :func:`methods.h2o._logit_block` (-inf after each query; overwritten by the probabilities),
    ``live`` [2, B*Hkv, c] the additive mask and negated score (updated), ``pos`` [B*Hkv, >= c]
    the tokens' positions, ``n_evict`` and ``thresholds`` per query from :func:`block_schedule`;
    ``nothing_held``: the decode call started from an empty cache (the first token is then the
    fallback victim when no token is old enough, as in the reference)."""
    bh, g, r, c = blk.shape
    if blk.stride(-1) != 1 or live.stride(-1) != 1:
        raise ValueError("h2o fused: the block and its state need contiguous keys")
    _load()
    dev = blk.device
    nev = torch.tensor(n_evict, dtype=torch.int32, device=dev)
    thr = torch.tensor(thresholds, dtype=torch.int64, device=dev)
    kernel = _kernel()
    big, small = triton.next_power_of_2(c), triton.next_power_of_2(g)
    kernel[(bh,)](
        blk, live, pos, nev, thr,
        g, r, c, int(nothing_held),
        blk.stride(0), blk.stride(1), blk.stride(2),
        live.stride(0), live.stride(1),
        pos.stride(0), pos.stride(1),
        G=small, C=big, num_warps=min(32, max(4, small * big // 1024)),
        enable_fp_fusion=False,  # every op rounded by itself, as torch's elementwise ops
    )


_KERNELS: dict[bool, object] = {}


def _kernel():
    """The jitted kernel, built at first use (compiled, or interpreted under TRITON_INTERPRET=1:
    Triton decides which when the function is wrapped, so one of each is kept)."""
    mode = interpreting()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_h2o_block_kernel)
    return _KERNELS[mode]


def _h2o_block_kernel(
    blk_ptr, live_ptr, pos_ptr, nev_ptr, thr_ptr,
    g, r, c, nothing_held,
    s_row, s_head, s_query,
    s_side, s_lrow,
    s_prow, s_pcol,
    G: tl.constexpr, C: tl.constexpr,
):
    """One program per B*Hkv row: the row's r queries in order (see the module docstring)."""
    row = tl.program_id(0)
    heads = tl.arange(0, G)
    keys = tl.arange(0, C)
    head_ok = heads < g
    key_ok = keys < c
    in_tile = head_ok[:, None] & key_ok[None, :]
    logits = blk_ptr + row * s_row + heads[:, None] * s_head + keys[None, :]
    mask_ptrs = live_ptr + row * s_lrow + keys
    neg_ptrs = mask_ptrs + s_side
    ninf = float("-inf")
    mask = tl.load(mask_ptrs, mask=key_ok, other=ninf)
    neg = tl.load(neg_ptrs, mask=key_ok, other=ninf)
    pos = tl.load(pos_ptr + row * s_prow + keys * s_pcol, mask=key_ok, other=0)
    inv = -1.0 / tl.sum(tl.where(head_ok, 1.0, 0.0).to(neg.dtype), axis=0)  # -1/g in the dtype
    first = (keys == 0) & (nothing_held != 0)
    for li in range(0, r):
        x = tl.load(logits + li * s_query, mask=in_tile, other=ninf) + mask[None, :]
        top = tl.where(head_ok, tl.max(x, axis=1), 0.0)
        e = tl.exp(x - top[:, None])
        total = tl.where(head_ok, tl.sum(e, axis=1), 1.0)
        p = e / total[:, None]
        tl.store(logits + li * s_query, p, mask=in_tile)
        neg = neg + tl.sum(p, axis=0) * inv
        old = key_ok & ((pos <= tl.load(thr_ptr + li)) | first)
        for _ in range(0, tl.load(nev_ptr + li)):
            victim = tl.argmax(tl.where(old, neg, ninf), axis=0)
            gone = keys == victim
            neg = tl.where(gone, ninf, neg)
            mask = tl.where(gone, ninf, mask)
    tl.store(mask_ptrs, mask, mask=key_ok)
    tl.store(neg_ptrs, neg, mask=key_ok)
