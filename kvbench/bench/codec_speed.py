"""§3 of ``python -m kvbench.bench``: encode + decode throughput of each method's key codec.

Keys [1, 8, T, 128] (T = 32768 in the full run) drawn from synthetic calibration moments, stored in
16-bit floats (fp16 on a CPU, the model's bf16 on a GPU). Each method is configured on a random
model of that geometry (:class:`methods.ModelShape` 2 x 32 query / 8 KV heads x d=128, synthetic
:class:`methods.LayerStats`) at 2 bpd (H2O, SnapKV: 4 bpd on K and V), and its layer-0 codec is
timed the way the cache calls it:

* KIVI: ``quantize_groups`` + ``dequantize_groups`` along tokens with the configured (b, G) — the
  key path of its cache state, on post-RoPE keys.
* SVDq: the cache state's attend-free encode path ``SVDqLayerState._encode`` (projection,
  per-latent-group quantization, reconstruction and RoPE of complete token groups: the keys are
  cut to a multiple of the state's token group G_t, which the budget chooses).
* KQ-SVD, KV-COBRA: ``key_codec.decode(key_codec.encode(k_pre))`` of the layer's
  :class:`methods.codec_state.CodecLayerState` (projection, fixed-step quantization, bit packing,
  unpacking, reconstruction; the RoPE the state applies afterwards is not included).
* H2O, SnapKV: no attend-free path (their selection reads the queries), so a **prefill attend**
  is timed (exact attention + scores + selection + gather), with queries [1, 32, T, 128] and values
  like the keys; on a CPU at a shorter T (the scores are O(T^2)). FP16's prefill attend on the same
  inputs is given beside it.

Throughput = fp16 bytes of the keys / (encode + decode time), against a plain copy of the same
tensor into a preallocated buffer (``dst.copy_(x)``: memory bandwidth, without the page faults a
fresh 64 MiB allocation costs on a CPU); the row is the percentage of copy bandwidth (target at
least 25%).
"""

from __future__ import annotations

import logging

import torch

from methods import ModelShape, Rope
from methods.fp16 import Fp16
from methods.groupquant import dequantize_groups, quantize_groups

from .common import Row, Sizes, make_method, median_time, rope_tables, synthetic_stats

log = logging.getLogger(__name__)

SHAPE = ModelShape(n_layers=2, n_q_heads=32, n_kv_heads=8, head_dim=128)
TARGET_PCT = 25.0
CODEC_CASES = [  # (label, name, bpd, v_bpd)
    ("kivi", "kivi", 2.0, None),
    ("svdq", "svdq", 2.0, None),
    ("kqsvd", "kqsvd", 2.0, None),
    ("cobra_mse", "cobra_mse", 2.0, None),
    ("cobra_kl", "cobra_kl", 2.0, None),
    ("h2o", "h2o", 4.0, 4.0),
    ("snapkv", "snapkv", 4.0, 4.0),
]
ATTEND = {"h2o", "snapkv"}


def sample_keys(stats, t: int, device, dtype, seed: int = 0) -> torch.Tensor:
    """[1, H, t, d] keys with layer 0's mean and covariance."""
    st = stats[0]
    g = torch.Generator().manual_seed(seed)
    h, d = st.mu_k.shape
    evals, evecs = torch.linalg.eigh(st.cov_k)
    factor = (evecs * evals.clamp(min=0).sqrt()[:, None, :]).float().to(device)  # [H, d, d]
    z = torch.randn(1, h, t, d, generator=g).to(device)
    return (st.mu_k.float().to(device)[None, :, None, :] + z @ factor.transpose(-1, -2)).to(dtype)


def codec_fn(label: str, method, x, cos, sin, q=None, v=None):
    """A zero-argument callable doing one encode + decode (or one prefill attend) of ``x``."""
    name = method.name
    if name == "kivi":
        knobs = method.knobs()
        return lambda: dequantize_groups(quantize_groups(x, knobs["bits"], knobs["group"], axis=2))
    if name == "svdq":
        state = method.new_layer_state(0)
        n = x.shape[2] // state.group * state.group  # the state encodes complete token groups only
        xs, cs, ss = x[:, :, :n], cos[:, :n], sin[:, :n]
        return lambda: state._encode(xs, cs, ss)
    if name in ATTEND:
        return attend_fn(method, x, cos, sin, q, v)
    codec = method.new_layer_state(0).key_codec
    return lambda: codec.decode(codec.encode(x))


def attend_fn(method, x, cos, sin, q, v):
    """One prefill attend of a fresh layer-0 state (keys double as the pre-RoPE keys)."""
    rope = Rope(cos, sin)
    scaling = x.shape[-1] ** -0.5
    return lambda: method.new_layer_state(0).attend(q, x, v, scaling=scaling, prefill=True, k_pre=x, rope=rope)


def run(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[Row]:
    io_dtype = torch.float16 if device.type == "cpu" else dtype
    stats = synthetic_stats(SHAPE)
    rows = []
    inputs: dict[int, tuple] = {}
    for label, name, bpd, v_bpd in CODEC_CASES:
        t = sizes.codec_tokens
        if name in ATTEND and device.type == "cpu":
            t = min(t, sizes.codec_attn_tokens_cpu)
        if t not in inputs:
            x = sample_keys(stats, t, device, io_dtype)
            cos, sin = rope_tables(t, SHAPE.head_dim, device, io_dtype)
            dst = torch.empty_like(x)
            copy_s, _ = median_time(lambda: dst.copy_(x), device, max(5, sizes.codec_reps))
            inputs[t] = (x, cos, sin, copy_s)
        x, cos, sin, copy_s = inputs[t]
        q = v = None
        extra = {}
        if name in ATTEND:
            g = torch.Generator().manual_seed(7)
            q = torch.randn(1, SHAPE.n_q_heads, t, SHAPE.head_dim, generator=g).to(device, io_dtype)
            v = torch.randn(1, SHAPE.n_kv_heads, t, SHAPE.head_dim, generator=g).to(device, io_dtype)
            fp16 = Fp16()
            fp16.configure(SHAPE, None, None)
            fp16_s, _ = median_time(attend_fn(fp16, x, cos, sin, q, v), device, sizes.codec_reps)
            extra["fp16_prefill_attend_s"] = fp16_s
        method = make_method(name, {}, SHAPE, bpd, v_bpd, stats)
        fn = codec_fn(label, method, x, cos, sin, q, v)
        log.info("codecs: %s on [1, %d, %d, %d]", label, SHAPE.n_kv_heads, t, SHAPE.head_dim)
        med, times = median_time(fn, device, sizes.codec_reps)
        nbytes = x.numel() * 2
        gbps, copy_gbps = nbytes / med / 1e9, nbytes / copy_s / 1e9
        pct = 100.0 * copy_s / med
        path = "prefill attend" if name in ATTEND else "encode+decode"
        note = f"{path}; copy {copy_gbps:.3g} GB/s"
        if extra:
            note += f"; {med / extra['fp16_prefill_attend_s']:.2f}x fp16 prefill attend"
        if t != sizes.codec_tokens:
            note += f"; T={t}"
        rows.append(Row(
            "codecs", f"{label} ({'bpd' if v_bpd is None else 'bpd K=V'} {bpd:g})", "% of copy", pct, "%",
            ">=", TARGET_PCT, shown=f"{gbps:.3g} GB/s = {pct:.3g}%", note=note,
            detail={
                "method": name, "bpd": bpd, "v_bpd": v_bpd, "path": path, "shape": [1, SHAPE.n_kv_heads, t, SHAPE.head_dim],
                "dtype": str(io_dtype).replace("torch.", ""), "seconds": med, "times_s": times, "gb_per_s": gbps,
                "copy_s": copy_s, "copy_gb_per_s": copy_gbps, **extra,
            },
        ))
    rows.append(conversion_bound(inputs[sizes.codec_tokens], device, io_dtype, sizes.codec_reps))
    return rows


def conversion_bound(inp: tuple, device, io_dtype, reps: int) -> Row:
    """The floor under every codec row: converting the keys to float32 and back, nothing else.
    Every codec computes in float32 (or wider) from 16-bit keys, so none can beat this row. On a
    CPU it also shows the allocator: a float32 copy above glibc's mmap threshold (32 MiB) is
    page-faulted in on every call (docs/performance.md)."""
    x, _, _, copy_s = inp
    med, times = median_time(lambda: x.float().to(io_dtype), device, reps)
    nbytes = x.numel() * 2
    pct = 100.0 * copy_s / med
    return Row(
        "codecs", f"bound: {str(io_dtype).replace('torch.', '')} -> fp32 -> back, no codec", "% of copy",
        pct, "%", ">=", TARGET_PCT, shown=f"{nbytes / med / 1e9:.3g} GB/s = {pct:.3g}%",
        note="the least any codec row does (it computes in fp32)",
        detail={"seconds": med, "times_s": times, "copy_s": copy_s, "shape": list(x.shape)},
    )

