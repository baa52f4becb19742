"""Shared pieces of ``python -m kvbench.bench``: sizes, rows and verdicts, timing, models, inputs.

Every measurement of the benchmark is a **ratio** against a baseline timed in the same process,
interleaved with it (A B B A ...), so that a machine whose load changes during the run still gives
stable answers; the median over repetitions is reported after a warm-up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from methods import LayerStats, ModelShape, build_method

log = logging.getLogger(__name__)

# ---- sizes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much work each section does. ``full`` is the benchmark; ``quick`` is for a laptop or
    CI; ``smoke`` only checks that every row is produced (tests)."""

    name: str
    eval_seqlen: int  # §1: tokens per PPL track-A window
    eval_windows: int  # §1: windows per timed repetition
    eval_reps: int  # §1: paired repetitions after one warm-up
    alloc_reps: int  # §2: allocation repetitions (median)
    codec_tokens: int  # §3: T of the keys [1, 8, T, 128]
    codec_attn_tokens_cpu: int  # §3: T for the attention-bound rows (H2O, SnapKV) on a CPU
    codec_reps: int  # §3: repetitions (median) after one warm-up
    mem_tokens: int  # §4: prefill length
    calib_windows: int  # §5 (and the statistics of §1): windows per calibration pass
    calib_seqlen: int
    calib_reps: int  # §5: paired repetitions after one warm-up
    ops_tokens: int = 2048  # opcount: prefill / one-pass length
    ops_decode_steps: int = 32  # opcount: profiled one-token steps after the prefill
    zs_requests: int = 100  # zeroshot: lm-eval requests timed
    zs_reps: int = 3  # zeroshot: paired repetitions after one warm-up
    e2e_lengths: tuple = (4096, 8192, 16384, 32768)  # e2e: prompt lengths
    e2e_new_tokens: int = 64  # e2e: greedy tokens generated after each prompt
    e2e_layers_cpu: int | None = None  # e2e: llama3_8b_random layers on a CPU (None: all 32)
    #: e2e on a CPU in float32 (no native bf16, :func:`cpu_dtype`): (layers, lengths, new tokens)
    #: that replace the three above, or None to keep them
    e2e_cpu_float32: tuple | None = None


PRESETS = {
    "full": Sizes("full", 2048, 1, 3, 21, 32768, 2048, 3, 8192, 2, 1024, 3),
    "quick": Sizes("quick", 512, 1, 5, 9, 8192, 1024, 3, 2048, 1, 512, 2, zs_reps=2,
                   e2e_lengths=(4096, 8192), e2e_new_tokens=16, e2e_layers_cpu=2,
                   e2e_cpu_float32=(1, (2048,), 16)),
    "smoke": Sizes("smoke", 48, 1, 1, 2, 256, 128, 1, 96, 2, 32, 1, ops_tokens=64, ops_decode_steps=4,
                   zs_requests=6, zs_reps=1, e2e_lengths=(64,), e2e_new_tokens=4, e2e_layers_cpu=1),
}


def e2e_sizes(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> Sizes:
    """``sizes`` with the e2e fields of :attr:`Sizes.e2e_cpu_float32` when the e2e model runs in
    float32 on a CPU (where a bf16 run would have been native, float32 is 2-3x slower; where it
    would not, bf16 does not finish at all)."""
    if device.type != "cpu" or dtype != torch.float32 or sizes.e2e_cpu_float32 is None:
        return sizes
    layers, lengths, new_tokens = sizes.e2e_cpu_float32
    return replace(sizes, e2e_layers_cpu=layers, e2e_lengths=tuple(lengths), e2e_new_tokens=new_tokens)


# ---- the dtype on a CPU ---------------------------------------------------------------------------

#: set to 1 to take the no-native-bf16 branch of :func:`native_bf16` on any CPU (tests, and
#: measuring the float32 presets on a machine that has native bf16)
FORCE_NO_NATIVE_BF16 = "KVBENCH_FORCE_NO_NATIVE_BF16"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively, as PyTorch's oneDNN decides
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BW/VL/DQ on x86, BF16 on Arm),
    and ATen's attention kernel runs in bf16 here (:func:`bf16_attention_runs`); False when
    ``KVBENCH_FORCE_NO_NATIVE_BF16=1``. Where oneDNN says no, a bf16 matmul takes a
    fallback path hundreds of times slower than float32 (a 1024x4096x4096 product: minutes
    against about a second; ``ONEDNN_MAX_CPU_ISA=AVX2`` reproduces it on an AVX-512 machine)."""
    if _forced_no_bf16():
        return False
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False
    return onednn and bf16_attention_runs()


@functools.cache
def bf16_attention_runs() -> bool:
    """Whether ATen's CPU attention kernel runs in bf16 at the kernel set it dispatches to here.
    It does not everywhere: on a CPU with AMX, with ``ATEN_CPU_CAPABILITY=avx2`` or ``default``,
    PyTorch 2.x's flash-attention kernel packs its bf16 blocks with an AVX-512-only routine and
    raises ("pack_vnni2 is only supported when avx512 is supported") once a sequence reaches
    64 tokens. One 128-token call answers it (asked once a process)."""
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        log.info("bf16 attention does not run with ATen's %s kernels here: %s",
                 torch.backends.cpu.get_cpu_capability(), e)
        return False
    return True


def _forced_no_bf16() -> bool:
    return os.environ.get(FORCE_NO_NATIVE_BF16, "").strip() not in ("", "0")


def cpu_dtype() -> torch.dtype:
    """The dtype a CPU run uses where a GPU run uses bf16: bf16 where the CPU computes it
    natively (:func:`native_bf16`), else float32."""
    return torch.bfloat16 if native_bf16() else torch.float32


def bench_dtype(name: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype of a bench model and why: ``auto`` (or None) is bf16 on CUDA and
    :func:`cpu_dtype` on a CPU; an explicit name is taken as given (with a warning for bf16 on a
    CPU without native bf16)."""
    if name in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16, "bfloat16 (CUDA)"
        if native_bf16():
            return torch.bfloat16, "bfloat16 (native on this CPU)"
        if _forced_no_bf16():
            why = f"{FORCE_NO_NATIVE_BF16}=1"
        elif not bf16_attention_runs():
            why = f"ATen's {torch.backends.cpu.get_cpu_capability()} kernels here run no bf16 attention"
        else:
            why = "this CPU has no native bf16"
        return torch.float32, f"float32 ({why})"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid choices: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
        log.warning("bfloat16 on a CPU without native bf16: matmuls take a slow fallback path (auto: float32)")
    return dtype, f"{name} (asked for)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- the methods and budgets benchmarked --------------------------------------------------------

#: (label, registry name, options, bpd, v_bpd, kind). K-track (values 16-bit) as the main table;
#: H2O spends its budget on K and V alike. ``kind``: "codec" (target <= 1.15x) or "evict" (<= 2x).
EVAL_CASES = [
    ("kivi", "kivi", {}, 2.0, None, "codec"),
    ("svdq", "svdq", {}, 2.0, None, "codec"),
    ("kqsvd", "kqsvd", {}, 2.0, None, "codec"),
    ("cobra_mse", "cobra_mse", {}, 2.0, None, "codec"),
    ("cobra_kl", "cobra_kl", {}, 2.0, None, "codec"),
    ("h2o", "h2o", {}, 4.0, 4.0, "evict"),
    ("kvquant", "kvquant", {}, 2.0, None, "baseline"),
    ("gear", "gear", {}, 4.0, None, "baseline"),
    ("turboquant", "turboquant", {}, 2.0, None, "baseline"),
]
#: the published per-token competitors (docs/methods.md §14-16: KVQuant, GEAR, TurboQuant), judged
#: by their own targets (overhead and zero-shot <= 1.2x FP16, op counts <= 3x FP16's). GEAR's
#: fp16 buffer keeps bpd 2 out of its reach in Q-all: it runs at 4, its fitted point at d = 64 and 128
BASELINES = ("kvquant", "gear", "turboquant")

#: §4 uses value budgets too, so both sides of each formula are checked.
MEMORY_CASES = [
    ("kivi", "kivi", {}, 2.0, 2.0),
    ("svdq", "svdq", {}, 2.0, 2.0),
    ("kqsvd", "kqsvd", {}, 2.0, 4.0),
    ("cobra_mse", "cobra_mse", {}, 2.0, 4.0),
    ("cobra_kl", "cobra_kl", {}, 1.0, 4.0),
    ("h2o", "h2o", {}, 4.0, 4.0),
    ("snapkv", "snapkv", {}, 4.0, 4.0),
]


def budget_label(bpd, v_bpd) -> str:
    if v_bpd is None:
        return f"bpd {bpd:g}"
    if v_bpd == bpd:
        return f"bpd {bpd:g} (K and V)"
    return f"bpd {bpd:g}, v_bpd {v_bpd:g}"


def make_method(name: str, options: dict, shape: ModelShape, bpd, v_bpd, stats=None, seed: int = 0):
    """A configured (and, when needed, calibrated) method. KIVI maps its budget nominally here
    (b + 32/G <= bpd, R = 128): the bench times and checks the codec at a fixed point, and its
    measured-budget fit would refuse bpd 2 in the default Q-all regime. ``stats``: a list of
    :class:`LayerStats`, or a :class:`StatsSource` that gives each method the key/value sample it
    asks for (``calibration_sample_tokens()``: KVQuant fits on it) and the others the plain moments.
    ``seed``: the calibration's, and GEAR's Omega (unless its options set one)."""
    method = build_method(name, **bench_options(name, options, seed))
    method.configure(shape, bpd, v_bpd)
    if method.needs_calibration:
        if stats is None:
            raise ValueError(f"{name} needs calibration statistics")
        if isinstance(stats, StatsSource):
            stats = stats(method.calibration_sample_tokens())
        method.calibrate(stats, seed=seed)
    return method


#: KV-COBRA's knobs in the seed (η, b_min, rank step), where its knob search starts
COBRA_SEED_KNOBS = {"eta": 0.3, "b_min": 2, "rank_step": 2}
#: the setting the bench runs a method at besides its case's options: the bench has no Fisher pass
#: and no knob search, so a method that searches runs one fixed point, the one the stored
#: references hold (KIVI at its nominal budget, KV-COBRA at the seed's knobs, TurboQuant at its
#: unsplit mse plan, KVQuant at its §14.6 point nuq-b-0 % with F = 1)
BENCH_SETTING = {
    "kivi": {"budget": "nominal"},
    "cobra_mse": COBRA_SEED_KNOBS,
    "cobra_kl": COBRA_SEED_KNOBS,
    "turboquant": {"k_variant": "mse", "split": False},
    "kvquant": {"fisher": False, "fisher_scale": "code", "outliers": 0.0},
}


def bench_options(name: str, options: dict, seed: int = 0) -> dict:
    """The options :func:`make_method` builds ``name`` with: :data:`BENCH_SETTING` under the case's
    own options, GEAR's Omega drawn from ``seed`` (else the torch seed at configure: whatever ran
    before)."""
    out = {**BENCH_SETTING.get(name, {}), **options}
    if name == "gear":
        out = {"seed": seed, **out}
    return out


class StatsSource:
    """Calibration statistics of one set of windows, collected once per sample size and kept:
    ``source(n)`` is the list of :class:`LayerStats` with a key/value sample of ``n`` tokens per
    head (0: none, the moments every method reads). ``collect(n)`` makes them; ``plain`` (the
    statistics of a pass already made, e.g. the calibration section's) stands for ``n = 0``. A
    sample adds to the moments and changes none of them, so the methods that take none are
    calibrated exactly as before."""

    def __init__(self, collect: Callable[[int], list], plain: list | None = None):
        self._collect = collect
        self._cache: dict[int, list] = {} if plain is None else {0: plain}
        self.seconds: dict[int, float] = {}

    def __call__(self, sample_tokens: int = 0) -> list:
        n = int(sample_tokens)
        if n not in self._cache:
            t0 = time.perf_counter()
            self._cache[n] = self._collect(n)
            self.seconds[n] = time.perf_counter() - t0
        return self._cache[n]


def model_stats(model, windows: torch.Tensor, plain: list | None = None, seed: int = 0) -> StatsSource:
    """:class:`StatsSource` of :func:`kvbench.fit.statistics.collect_stats` over ``windows`` (the sample's
    positions from ``seed``, as ``kvbench.run`` draws them)."""
    from ..fit.statistics import collect_stats

    return StatsSource(lambda n: collect_stats(model, windows, n, seed), plain)


def synthetic_source(shape: ModelShape, seed: int = 0) -> StatsSource:
    """:class:`StatsSource` of :func:`synthetic_stats` (the sample drawn from the same moments)."""
    return StatsSource(lambda n: synthetic_stats(shape, seed, sample_tokens=n))


# ---- rows and verdicts ----------------------------------------------------------------------------

_OPS = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b}
#: ``op`` of a row without a target: verdict INFO
INFO = "info"
#: ``op`` of a row whose only check is that the value is a number: MISS when it is NaN or
#: infinite, INFO otherwise (a finite number is no evidence that a method works: never a PASS)
FINITE = "finite"


@dataclass
class Row:
    """One line of the table: a number, its target and the verdict. PASS only against a target
    that a broken method would miss (``<=``, ``<``, ``>=``); ``op="info"``: no target, verdict
    INFO; ``op="finite"``: MISS for NaN or infinity, else INFO; a non-finite value of a targeted
    row is a MISS, and so is a row whose measurement is not what its target is about
    (``invalid``: the reason, e.g. a method that compressed nothing), whatever its value."""

    section: str
    name: str
    metric: str
    value: float
    unit: str
    op: str
    target: float
    verdict: str = ""
    shown: str = ""
    note: str = ""
    detail: dict = field(default_factory=dict)
    invalid: str = ""

    def __post_init__(self):
        value = float(self.value)
        self.value = value
        if self.op not in _OPS and self.op not in (INFO, FINITE):
            raise ValueError(f"unknown row op {self.op!r}; valid choices: {', '.join([*_OPS, INFO, FINITE])}")
        if self.op == INFO:
            self.verdict = "INFO"
        elif self.invalid:
            self.verdict = "MISS"
            self.note = f"{self.invalid}; {self.note}" if self.note else self.invalid
        elif not math.isfinite(value):
            self.verdict = "MISS"
        elif self.op == FINITE:
            self.verdict = "INFO"
        else:
            self.verdict = "PASS" if _OPS[self.op](value, self.target) else "MISS"
        if not self.shown:
            self.shown = f"{value:.3g}{self.unit}" if self.unit != "x" else f"{value:.2f}x"

    @property
    def target_text(self) -> str:
        if self.op == INFO:
            return "-"
        if self.op == FINITE:
            return "finite (else INFO)"
        unit = "" if self.unit in ("x",) else self.unit
        suffix = "x" if self.unit == "x" else unit
        return f"{self.op} {self.target:g}{suffix}"

    def as_dict(self) -> dict:
        out = asdict(self)
        out["target_text"] = self.target_text
        return out


# ---- timing ---------------------------------------------------------------------------------------


def attached_around(lm, method) -> tuple[Callable[[], None], Callable[[], None]]:
    """(setup, teardown) that attach ``method`` to ``lm``'s model around a timed pass and detach it
    afterwards, so the FP16 baseline runs on the unpatched model."""
    from ..model.integrate import attached

    stack = contextlib.ExitStack()

    def setup():
        lm.compressor = stack.enter_context(attached(lm.model, method))

    def teardown():
        stack.close()
        lm.compressor = None

    return setup, teardown


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_time(fn, device, reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = [clock(fn, device) for _ in range(max(1, reps))]
    return statistics.median(times), times


def clock_around(fn, device, setup=None, teardown=None) -> float:
    """:func:`clock` of ``fn`` with ``setup``/``teardown`` run, untimed, just before and after it
    (e.g. attaching a method to the model that the baseline must see unpatched)."""
    if setup is not None:
        setup()
    try:
        return clock(fn, device)
    finally:
        if teardown is not None:
            teardown()


def paired_ratio(base, fn, device, reps: int, warmup: int = 1, base_warmup: bool = True,
                 setup=None, teardown=None) -> dict:
    """Median of t(fn)/t(base) over ``reps`` interleaved pairs (order alternates: A B, B A, ...),
    after ``warmup`` untimed calls of each (of ``fn`` only with ``base_warmup=False``, when the
    baseline is already warm). ``setup``/``teardown`` run, untimed, around every call of ``fn``
    (e.g. attaching a method to the model that ``base`` must see unpatched)."""

    def timed_fn():
        return clock_around(fn, device, setup, teardown)

    for _ in range(warmup):
        if base_warmup:
            base()
        timed_fn()
    tb, tf = [], []
    for i in range(max(1, reps)):
        if i % 2 == 0:
            tb.append(clock(base, device))
            tf.append(timed_fn())
        else:
            tf.append(timed_fn())
            tb.append(clock(base, device))
    ratios = [f / b for f, b in zip(tf, tb)]
    return {
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "base_s": statistics.median(tb),
        "method_s": statistics.median(tf),
        "base_times_s": tb,
        "method_times_s": tf,
    }


# ---- models ---------------------------------------------------------------------------------------


@dataclass
class BenchModel:
    model: torch.nn.Module
    tokenizer: object | None
    name: str
    device: torch.device
    dtype: torch.dtype
    note: str = ""

    @property
    def vocab(self) -> int:
        return int(self.model.config.vocab_size)


def llama3_8b_config(layers: int | None = None):
    """Llama-3.1-8B's shape (32 layers, 32 query / 8 KV heads, d=128, GQA, llama3 RoPE scaling)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers or 32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def tiny_config():
    """A tiny random Llama (2 layers, 4 query / 2 KV heads, d=32): smoke runs only."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_theta=10000.0, attn_implementation="sdpa",
    )


def random_model(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A randomly initialized LlamaForCausalLM built directly on ``device`` in ``dtype``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_bench_model(name: str, device: str, layers: int | None = None) -> BenchModel:
    from ..model.loading import load_model, resolve_device, resolve_dtype

    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    if name == "smollm2_135m":
        if layers:
            raise ValueError("--layers applies to llama3_8b_random only")
        loaded = load_model("smollm2_135m", embedded=True, device=str(dev))
        return BenchModel(loaded.model, loaded.tokenizer, name, dev, dtype, loaded.source)
    if name == "llama3_8b_random":
        cfg = llama3_8b_config(layers)
        note = "random init, Llama-3.1-8B shape" + (f", {cfg.num_hidden_layers} of 32 layers" if layers else "")
        return BenchModel(random_model(cfg, dev, dtype), None, name, dev, dtype, note)
    if name == "tiny":
        return BenchModel(random_model(tiny_config(), dev, dtype), None, name, dev, dtype, "tiny random Llama")
    raise ValueError(f"unknown model {name!r}; valid choices: smollm2_135m, llama3_8b_random, tiny")


# ---- token windows --------------------------------------------------------------------------------


def eval_windows(bm: BenchModel, seqlen: int, n: int) -> torch.Tensor:
    """[n, seqlen] evaluation windows: PTB test for a real tokenizer, random ids otherwise."""
    if bm.tokenizer is not None:
        from ..data.windows import ppl_windows

        return ppl_windows(bm.tokenizer, "ptb", seqlen, n)
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, bm.vocab, (n, seqlen), generator=g)


def calib_windows(bm: BenchModel, seqlen: int, n: int, seed: int = 0) -> torch.Tensor:
    """[n, seqlen] calibration windows: PTB train at GPTQ-style random offsets, or random ids."""
    if bm.tokenizer is not None:
        from ..fit.statistics import CalibrationSpec, calibration_windows

        spec = CalibrationSpec(dataset="ptb", split="train", n_windows=n, seqlen=seqlen, seed=seed)
        return calibration_windows(bm.tokenizer, spec)
    g = torch.Generator().manual_seed(4321 + seed)
    return torch.randint(0, bm.vocab, (n, seqlen), generator=g)


# ---- synthetic inputs (no model) ----------------------------------------------------------------


def decaying_spectra(n_heads: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n_heads, d] descending positive spectra: lambda_i = s_h exp(-i / tau_h), with per-head
    scale s_h log-uniform in [0.1, 10] and decay tau_h uniform in [d/32, d/4]."""
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** (2 * torch.rand(n_heads, 1, generator=g, dtype=torch.float64) - 1)
    tau = d / 32 + (d / 4 - d / 32) * torch.rand(n_heads, 1, generator=g, dtype=torch.float64)
    i = torch.arange(d, dtype=torch.float64)[None]
    return scale * torch.exp(-i / tau)


def _random_orthogonal(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def synthetic_stats(shape: ModelShape, seed: int = 0, n_tokens: int = 4096,
                    sample_tokens: int = 0) -> list[LayerStats]:
    """Calibration moments of a random model of ``shape``: per KV head a random eigenbasis with a
    decaying spectrum for keys, values and queries (float64, like :func:`kvbench.fit.statistics.collect_stats`);
    with ``sample_tokens`` > 0 also a centered float16 key/value sample [H, n, d] of Gaussian
    vectors with those covariances (what ``collect_stats`` stores for KVQuant's fit). The moments
    do not depend on ``sample_tokens``."""
    g = torch.Generator().manual_seed(seed)
    h, d = shape.n_kv_heads, shape.head_dim
    out = []
    for layer in range(shape.n_layers):
        mats = []
        for salt in range(3):
            lam = decaying_spectra(h, d, seed=seed * 1000 + layer * 10 + salt)
            u = _random_orthogonal(h, d, g)
            mats.append(u @ torch.diag_embed(lam) @ u.transpose(-1, -2))
        out.append(LayerStats(
            mu_k=0.1 * torch.randn(h, d, generator=g, dtype=torch.float64), cov_k=mats[0],
            mu_v=0.1 * torch.randn(h, d, generator=g, dtype=torch.float64), cov_v=mats[1],
            m_q=mats[2], n_tokens=n_tokens,
        ))
    if sample_tokens > 0:  # its own generator: the moments above stay those of sample_tokens=0
        gs = torch.Generator().manual_seed(10_000 + seed)
        for st in out:
            st.k_sample, st.v_sample = (_gaussian_sample(c, sample_tokens, gs) for c in (st.cov_k, st.cov_v))
    return out


def _gaussian_sample(cov: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """[H, n, d] float16 draws of N(0, cov[h]) per head."""
    evals, evecs = torch.linalg.eigh(cov)
    factor = evecs * evals.clamp(min=0).sqrt()[:, None, :]  # [H, d, d]
    z = torch.randn(cov.shape[0], n, cov.shape[-1], generator=g, dtype=torch.float64)
    return (z @ factor.transpose(-1, -2)).half()


def rope_tables(t: int, d: int, device, dtype, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-convention (cos, sin) [1, t, d] for positions 0..t-1."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    freqs = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
