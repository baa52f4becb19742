"""e2e section of ``python -m kvbench.bench``: generation with each method against plain transformers.

Per prompt length (full: 4k, 8k, 16k, 32k; ``--quick``: 4k, 8k) and per method at a budget, one
greedy generation of ``e2e_new_tokens`` tokens from a random prompt on ``llama3_8b_random`` (a
randomly initialized model of Llama-3.1-8B's shape; bf16 on a GPU and on a CPU that computes bf16
natively, else float32 (:func:`kvbench.bench.common.cpu_dtype`; the dtype is in every row's detail
and in the e2e table); all 32 layers on a GPU, 2 on a CPU (float32: the sizes of
``Sizes.e2e_cpu_float32``, 1 layer at 2048 tokens for ``--quick``) unless ``--layers`` says otherwise):

* **the methods**: :meth:`kvbench.model.compressed_lm.CompressedLM.generate` with the method attached
  (exact prefill, compression, decoding from the compressed cache), exactly as LongBench runs it;
* **the baseline**: plain transformers with ``sdpa`` attention and its own ``DynamicCache``: one
  prefill forward (``logits_to_keep=1``, as ``model.generate`` does), then one-token forwards with
  the cache, greedy, the same number of tokens (the loop inside ``model.generate``, without its
  logits processors). It runs before and after the methods of each length; its times are the
  faster of the two runs (load on a shared machine only adds time), its memory the first run's. Anchors: KIVI's ``mem_spd_test.py`` and KVCache-Factory's
  ``scripts/benchmark_latency_memory.py`` (prefill and decode timed apart, peak CUDA memory).

Measured per case: prefill seconds (the first forward, synchronized), decode tokens/s (the
remaining ``n - 1`` tokens over their wall time), peak memory (CUDA: ``max_memory_allocated``
after ``reset_peak_memory_stats``; CPU: peak RSS, ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, weights included), the cache's **stored** bytes (the methods:
``stored_bits() / 8`` summed over layers, the formula's bits; the baseline: the bytes of its
``DynamicCache`` tensors), **resident** bytes (the distinct tensor storages the layer states
hold at the end; the method's static parameters excluded), also as a ratio to the stored bytes
(docs/design.md §2: at most 1.15x), and the **scratch** apart: what the layers of the sequence share
(the RoPE tables of a pre-RoPE codec, :class:`methods.buffers.RopeLog`), counted once. Every
figure is also given as its ratio to the baseline's at the same length, in the same run.

The row of each (method, length) is the peak-memory ratio, target at most 1.1x (a compressed
run must not need much more memory than the model it compresses; on a GPU the difference is an
OOM). Above the target the row is a MISS. Within it, it is a PASS only where the target can fail a
broken method (:func:`discriminates`): where plain transformers' **growth** (its peak minus the
memory held when the case starts: prefill activations and the cache, on top of the weights) is at
least 10% of its peak, so that a method needing twice that growth would miss. Elsewhere the row is
INFO: with 1-2 layers of the 8B shape on a CPU the weights are 90-95% of the peak, and a method
holding many times plain's cache would stay under 1.1x. The growth ratio, prefill, decode and
bytes ratios are in the note and in the e2e table that ``python -m kvbench.bench`` prints after
the main one.

Decisions where docs/methods.md is silent:

* Prompts are random token ids (seeded; the model is random too): lengths and shapes are what
  cost time and memory, not the text. No stop tokens: every case generates exactly ``n`` tokens.
* Budgets: those of the overhead section (codecs 2 bpd, 16-bit values; H2O and SnapKV 4 bpd on K
  and V). Calibrated methods get statistics from ``collect_stats`` over random windows of the
  same model (outside the timed region).
* A case that runs out of memory is recorded (``status: oom``, the error text) and the run goes
  on after freeing what it held. On a CPU each case runs under a soft address-space limit
  (``RLIMIT_AS``: the process's size plus 85% of ``MemAvailable`` at the start of the case), so
  that an allocation too big for the machine fails inside this process instead of waking the
  kernel's OOM killer on a shared machine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from ..model.compressed_lm import CompressedLM
from ..model.integrate import attached, cache_argument, model_shape, returned_cache
from .common import (EVAL_CASES, INFO, BenchModel, Row, Sizes, bench_dtype, budget_label, calib_windows, dtype_name,
                     fmt_bytes, make_method, model_stats, sync)
from .memory import resident_bytes, shared_bytes

log = logging.getLogger(__name__)

#: (label, registry name, options, bpd, v_bpd): the overhead section's budgets, SnapKV beside H2O
CASES = [(label, name, opts, bpd, v_bpd) for label, name, opts, bpd, v_bpd, _ in EVAL_CASES] + [
    ("snapkv", "snapkv", {}, 4.0, 4.0)
]
PEAK_TARGET = 1.1
GUARD_FRACTION = 0.85


# ---- memory probes ---------------------------------------------------------------------------------


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a /proc file (None where /proc is absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_kib(field: str) -> int | None:
    return _proc_kib("/proc/self/status", field)


def _meminfo_kib(field: str) -> int | None:
    return _proc_kib("/proc/meminfo", field)


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim(0)``), so that the RSS
    before a case holds only live memory: otherwise pages an earlier case freed stay resident,
    count in the "before" figure and are reused silently, and a case's growth reads low by up to
    what the case before it left behind. False where there is no glibc."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


class MemoryProbe:
    """Peak memory of one case: CUDA's allocator counters, or the process's peak RSS on a CPU
    (after :func:`release_free_heap`, so that the growth above the start is the case's own)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rss_reset = True

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            return
        release_free_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self.rss_reset = False
        self.before = (_status_kib("VmRSS") or 0) * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return (_status_kib("VmHWM") or 0) * 1024

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "cuda max_memory_allocated"
        return "peak RSS" + ("" if self.rss_reset else " since process start (clear_refs refused)")


@contextlib.contextmanager
def address_space_guard(device: torch.device, fraction: float = GUARD_FRACTION):
    """On a CPU (Linux), a soft RLIMIT_AS of the current size + ``fraction`` x MemAvailable for
    the block; restored afterwards. Elsewhere a no-op."""
    if device.type != "cpu":
        yield None
        return
    try:
        import resource
    except ImportError:  # not POSIX
        yield None
        return
    size, avail = _status_kib("VmSize"), _meminfo_kib("MemAvailable")
    if size is None or avail is None:
        yield None
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = (size + int(fraction * avail)) * 1024
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def is_oom(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("out of memory", "can't allocate", "not enough memory", "cannot allocate")
    )


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the two generators ----------------------------------------------------------------------------


@torch.no_grad()
def plain_generate(model, ids: torch.Tensor, n: int, device) -> dict:
    """Plain transformers: prefill with ``logits_to_keep=1``, then greedy one-token steps with the
    model's own cache."""
    name = cache_argument(model)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    sync(device)
    t1 = time.perf_counter()
    cache = returned_cache(out)
    tok = out.logits[:, -1:].argmax(-1)
    new = [int(tok)]
    del out
    while len(new) < n:
        out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{name: cache})
        cache = returned_cache(out)
        tok = out.logits[:, -1:].argmax(-1)
        new.append(int(tok))
        del out
    sync(device)
    t2 = time.perf_counter()
    nbytes = resident_bytes(cache)
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": new, "stored_bytes": nbytes,
            "resident_bytes": nbytes, "scratch_bytes": 0}


@torch.no_grad()
def method_generate(model, method, ids: torch.Tensor, n: int, device) -> dict:
    """``CompressedLM.generate`` with ``method`` attached; the prefill is timed by wrapping the
    compressor's first ``forward``, and the layer states are kept for the byte counts."""
    with attached(model, method) as comp:
        lm = CompressedLM(model, None, comp)
        marks: dict = {}
        inner = comp.forward

        def timed(*args, **kwargs):  # Compressor.forward(input_ids, start, prefill, ...)
            out = inner(*args, **kwargs)
            if kwargs.get("prefill", args[2] if len(args) > 2 else False):
                sync(device)
                marks["prefill_end"] = time.perf_counter()
            marks["states"] = comp.states
            return out

        comp.forward = timed
        sync(device)
        t0 = time.perf_counter()
        new = lm.generate(ids, n, stop_ids=())
        sync(device)
        t2 = time.perf_counter()
        static: set = set()
        resident_bytes(method, static)  # per-model constants (projections, steps): not the cache
        shared: list = []
        resident = resident_bytes(marks.get("states"), static, shared=shared)
        scratch = shared_bytes(shared, static)
        stored = sum(b[0] + b[1] for b in comp.last_bits[0]) / 8  # the one row
        return {"prefill_s": marks["prefill_end"] - t0, "decode_s": t2 - marks["prefill_end"], "tokens": new,
                "stored_bytes": stored, "resident_bytes": resident, "scratch_bytes": scratch,
                "measured_bpd": list(lm.measured_bpd)}


def run_case(fn, probe: MemoryProbe, device) -> dict:
    """One generation under the memory probe (and, on a CPU, the address-space guard)."""
    probe.start()
    try:
        with address_space_guard(device) as limit:
            res = fn()
        res["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - only OOMs are caught; others re-raised
        if not is_oom(err):
            raise
        res = {"status": "oom", "error": f"{type(err).__name__}: {str(err)[:300]}"}
        limit = None
        free(device)
    res["peak_bytes"] = probe.peak()
    res["before_bytes"] = probe.before
    res["guard_bytes"] = limit
    if res["status"] == "ok":
        res["decode_tok_s"] = (len(res["tokens"]) - 1) / res["decode_s"] if res["decode_s"] > 0 else float("nan")
        res["tokens"] = len(res["tokens"])
    free(device)
    return res


# ---- the section -----------------------------------------------------------------------------------


def e2e_model(sizes: Sizes, device: str, layers: int | None, dtype: torch.dtype | str | None = None,
              tiny: bool = False) -> BenchModel:
    """``llama3_8b_random`` for the section: all 32 layers on a GPU, ``e2e_layers_cpu`` on a CPU,
    ``layers`` when given; ``dtype`` a torch dtype or a name (None or ``auto``:
    :func:`kvbench.bench.common.bench_dtype`). ``tiny``: the tests' tiny Llama (smoke runs)."""
    from ..model.loading import resolve_device
    from .common import llama3_8b_config, random_model, tiny_config

    dev = resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else bench_dtype(dtype, dev)[0]
    if tiny:
        return BenchModel(random_model(tiny_config(), dev, dt), None, "tiny", dev, dt, "tiny random Llama")
    if layers is None and dev.type == "cpu":
        layers = sizes.e2e_layers_cpu or 2
    cfg = llama3_8b_config(layers)
    note = "random init, Llama-3.1-8B shape" + (f", {cfg.num_hidden_layers} of 32 layers" if cfg.num_hidden_layers != 32 else "")
    return BenchModel(random_model(cfg, dev, dt), None, "llama3_8b_random", dev, dt, note)


def run(bm: BenchModel, sizes: Sizes, lengths=None, methods=None, new_tokens=None) -> list[Row]:
    lengths = list(lengths or sizes.e2e_lengths)
    n = int(new_tokens or sizes.e2e_new_tokens)
    cases = [c for c in CASES if methods is None or c[0] in methods]
    unknown = sorted(set(methods or ()) - {c[0] for c in CASES})
    if unknown:
        raise ValueError(f"e2e: unknown method(s) {unknown}; valid choices: {', '.join(c[0] for c in CASES)}")
    shape = model_shape(bm.model)
    # collected when a calibrated method is first built, with the sample it asks for (KVQuant's)
    stats = model_stats(bm.model, calib_windows(bm, sizes.calib_seqlen, sizes.calib_windows).to(bm.device))
    probe = MemoryProbe(bm.device)
    weights = sum(p.numel() * p.element_size() for p in bm.model.parameters())
    warm(bm, cases, shape, stats)
    rows = []
    kind = probe.kind + f", {dtype_name(bm.dtype)}"
    for t in lengths:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(0, bm.vocab, (1, t), generator=g).to(bm.device)
        log.info("e2e: plain transformers, %d-token prompt, %d new tokens", t, n)
        first = run_case(lambda: plain_generate(bm.model, ids, n, bm.device), probe, bm.device)
        results = []
        for label, name, options, bpd, v_bpd in cases:
            method = make_method(name, options, shape, bpd, v_bpd, stats)
            log.info("e2e: %s (%s), %d-token prompt", label, budget_label(bpd, v_bpd), t)
            res = run_case(lambda: method_generate(bm.model, method, ids, n, bm.device), probe, bm.device)
            results.append(((label, name, bpd, v_bpd), res))
            del method
            free(bm.device)
        last = None
        if cases and first["status"] == "ok":
            log.info("e2e: plain transformers again, %d-token prompt", t)
            last = run_case(lambda: plain_generate(bm.model, ids, n, bm.device), probe, bm.device)
        base = bracketed(first, last)
        rows.append(base_row(t, n, base, weights, kind, bm.dtype))
        for (label, name, bpd, v_bpd), res in results:
            rows.append(method_row(label, name, bpd, v_bpd, t, n, res, base, weights, kind, bm.dtype))
    return rows


def bracketed(first: dict, last: dict | None) -> dict:
    """The baseline of one length from its runs before and after the methods: the faster prefill
    and decode of the two (a shared machine's load only ever adds time), the first run's memory
    figures; both runs' times kept."""
    if last is None or last.get("status") != "ok":
        return first
    out = dict(first)
    out["prefill_s"] = min(first["prefill_s"], last["prefill_s"])
    out["decode_tok_s"] = max(first["decode_tok_s"], last["decode_tok_s"])
    out["decode_s"] = min(first["decode_s"], last["decode_s"])
    out["runs"] = [{k: r[k] for k in ("prefill_s", "decode_s", "decode_tok_s", "peak_bytes")} for r in (first, last)]
    return out


def warm(bm: BenchModel, cases, shape, stats, tokens: int = 64) -> None:
    """One short untimed generation of the baseline and of each method (kernel selection, lazy
    buffers), so that the first timed case is not the one that pays for them."""
    ids = torch.randint(0, bm.vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).to(bm.device)
    plain_generate(bm.model, ids, 2, bm.device)
    for label, name, options, bpd, v_bpd in cases:
        method_generate(bm.model, make_method(name, options, shape, bpd, v_bpd, stats), ids, 2, bm.device)
    free(bm.device)


def _ratio(a, b) -> float:
    try:
        return float(a) / float(b)
    except (TypeError, ZeroDivisionError, ValueError):
        return float("nan")


def base_row(t: int, n: int, res: dict, weights: int, kind: str, dtype: torch.dtype) -> Row:
    ok = res["status"] == "ok"
    note = (f"prefill {res['prefill_s']:.3g} s, decode {res['decode_tok_s']:.3g} tok/s, "
            f"peak {fmt_bytes(res['peak_bytes'])} ({kind}), growth {fmt_bytes(res['peak_bytes'] - res['before_bytes'])}, "
            f"cache {fmt_bytes(res['stored_bytes'])}" if ok else res["error"])
    return Row("e2e", f"plain transformers, {t} tokens", "peak memory", res["peak_bytes"] / 2**30, " GiB", INFO, 0.0,
               shown=fmt_bytes(res["peak_bytes"]) if ok else "oom", note=note,
               detail={"method": "plain", "tokens_prompt": t, "new_tokens": n, "weights_bytes": weights,
                       "memory_kind": kind, "dtype": dtype_name(dtype), **_clean(res)})


def discriminates(base: dict) -> bool:
    """Whether the peak target can fail a method that needs twice the memory plain transformers'
    generation adds above what was held before it (its growth): only where that growth is at
    least ``PEAK_TARGET - 1`` (10%) of plain's peak; below, the weights hide any cache."""
    growth = base["peak_bytes"] - base["before_bytes"]
    return growth >= (PEAK_TARGET - 1.0) * base["peak_bytes"]


def method_row(label, name, bpd, v_bpd, t, n, res, base, weights, kind, dtype: torch.dtype) -> Row:
    """The row of one method at one length: peak / plain's peak (module docstring). Above the
    target it is a MISS; within it a PASS only where the target :func:`discriminates`, else INFO."""
    ok, base_ok = res["status"] == "ok", base["status"] == "ok"
    ratios = {}
    if ok and base_ok:
        ratios = {
            "prefill": _ratio(res["prefill_s"], base["prefill_s"]),
            "decode_tok_s": _ratio(res["decode_tok_s"], base["decode_tok_s"]),
            "peak": _ratio(res["peak_bytes"], base["peak_bytes"]),
            "peak_growth": _ratio(res["peak_bytes"] - res["before_bytes"], base["peak_bytes"] - base["before_bytes"]),
            "stored": _ratio(res["stored_bytes"], base["stored_bytes"]),
            "resident": _ratio(res["resident_bytes"], base["resident_bytes"]),
        }
    op = "<="
    if ok:
        nan = float("nan")
        note = (f"peak {fmt_bytes(res['peak_bytes'])}; growth {fmt_bytes(res['peak_bytes'] - res['before_bytes'])} "
                f"({ratios.get('peak_growth', nan):.2f}x); "
                f"prefill {res['prefill_s']:.3g} s ({ratios.get('prefill', nan):.2f}x), "
                f"decode {res['decode_tok_s']:.3g} tok/s ({ratios.get('decode_tok_s', nan):.2f}x), "
                f"stored {fmt_bytes(res['stored_bytes'])} ({ratios.get('stored', nan):.2f}x), "
                f"resident {fmt_bytes(res['resident_bytes'])} ({ratios.get('resident', nan):.2f}x, "
                f"{_ratio(res['resident_bytes'], res['stored_bytes']):.2f}x stored), "
                f"scratch {fmt_bytes(res.get('scratch_bytes', 0))}")
        value = ratios.get("peak", nan)
        shown = f"{value:.2f}x peak"
        if base_ok and value <= PEAK_TARGET and not discriminates(base):
            share = 1.0 - (base["peak_bytes"] - base["before_bytes"]) / base["peak_bytes"]
            op = INFO
            note = (f"no verdict: {100 * share:.0f}% of plain's peak was held before the case (weights), so a "
                    f"method needing twice plain's growth would pass; " + note)
    else:
        note, value, shown = res["error"], float("inf"), "oom"
    return Row("e2e", f"{label} ({budget_label(bpd, v_bpd)}), {t} tokens", "peak / plain peak", value, "x", op,
               PEAK_TARGET, shown=shown, note=note,
               detail={"method": name, "bpd": bpd, "v_bpd": v_bpd, "tokens_prompt": t, "new_tokens": n,
                       "weights_bytes": weights, "memory_kind": kind, "dtype": dtype_name(dtype), "ratios": ratios,
                       "discriminates": bool(base_ok and discriminates(base)), **_clean(res)})


def _clean(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "states"}


def format_e2e(rows: list[Row]) -> str:
    """The e2e rows as one wide table: absolute figures and ratios to plain transformers."""
    head = ("case", "dtype", "status", "prefill s", "x", "decode tok/s", "x", "peak", "x", "growth x", "stored", "x",
            "resident", "x", "/stored", "scratch")
    body = []
    for r in rows:
        d, q = r.detail, r.detail.get("ratios", {})
        if d.get("status") != "ok":
            body.append((r.name, d.get("dtype", ""), d.get("status", "?")) + ("",) * 13)
            continue

        def x(key):
            return f"{q[key]:.2f}" if key in q else "1" if d["method"] == "plain" else ""

        body.append((r.name, d.get("dtype", ""), "ok", f"{d['prefill_s']:.3g}", x("prefill"), f"{d['decode_tok_s']:.3g}",
                     x("decode_tok_s"), fmt_bytes(d["peak_bytes"]), x("peak"), x("peak_growth"),
                     fmt_bytes(d["stored_bytes"]), x("stored"), fmt_bytes(d["resident_bytes"]), x("resident"),
                     f"{_ratio(d['resident_bytes'], d['stored_bytes']):.2f}", fmt_bytes(d.get("scratch_bytes", 0))))
    widths = [max(len(str(c[i])) for c in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
