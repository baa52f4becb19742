"""Op-count section of ``python -m kvbench.bench``: aten ops per layer, a proxy for GPU launch cost.

On a GPU every eager aten op that computes launches (at least) one kernel, at ~5-10 us of host
time each; a method whose attention runs ten times FP16's ops is launch-bound on short requests
whatever its FLOPs. Counting the ops is machine-independent, so it can be done, and gated, on a
CPU.

What is profiled, per method (``torch.profiler``, CPU activities, one thread):

* **decode step** — an exact prefill of ``ops_tokens`` tokens (2048), then ``ops_decode_steps``
  one-token steps (32, so that every flush cycle of a residual window or a token group of up to 32
  is inside); the row is the mean over those steps. Methods: through a :class:`Compressor` session
  (``forward(prefill=True)``, then ``forward(prefill=False)``, as ``CompressedLM.generate`` does);
  FP16: the plain model with its own ``DynamicCache`` (``model(..., cache=...)``), as the harness
  runs FP16.
* **one-pass** — one teacher-forced (Q-all) forward of ``ops_tokens`` tokens, as perplexity track A
  and zero-shot run it (``model(ids, use_cache=False)`` with the method attached; FP16: the plain
  ``sdpa`` model). SnapKV has no one-pass form (docs/methods.md §7.4) and gets no row.

What is counted: the aten ops that run inside each decoder layer's ``self_attn.forward`` **except
those inside its q/k/v/o projections** (the model's own matmuls, identical for every method), i.e.
the RoPE the model applies, the cache update (FP16: ``DynamicCache.update``), the attention function
and everything the method's layer state does, hooks included. The figure is per layer (the sum over
layers / L). The counting rules (:func:`count_events`; docs/performance.md states them once):

* **An op** (a kernel: what a GPU launches) is an aten op that computes. An aten op in
  :data:`NO_KERNEL` (views, reshapes that stay views, allocation, metadata queries) launches
  nothing and is reported beside, as ``views``; an op in :data:`DELEGATING` (``to``, ``matmul``,
  ``softmax``, ``reshape``, ``contiguous``, ``item``, ...) counts as the ops it calls, so
  ``x.to(x.dtype)`` counts nothing, ``aten::to`` -> ``_to_copy`` -> ``copy_`` one copy and
  ``aten::linear`` its ``mm``; any other aten op is **one** op, plus the layout copies it makes
  inside (``_softmax`` of a non-contiguous tensor: 2), but not the other ops it calls (``mean``'s
  ``sum`` and ``div_`` are one reduction on a GPU). A ``copy_`` from a 0-dim tensor (a Python
  scalar wrapped for a CPU kernel) is not counted.
* **Host syncs** (:data:`SYNC_OPS`: ``_local_scalar_dense`` from ``.item()``/``int(t)``/``bool(t)``,
  ``nonzero``, ...) are counted as ops and also reported as ``syncs``.
* **Host ops**: the bits each query read (``LayerState.read_bits``) are float64 CPU tensors on any
  device, computed inside a ``kvbench.host`` profiler range (:func:`methods.bookkeeping.host_ops`). An op
  in that range whose tensor inputs are all float64 (or 0-dim: Python scalars) is a host op: it
  runs on the CPU and launches nothing on a GPU. The model here is float32, so no tensor of the
  model's computation is float64; an op in the range with any other tensor input (or a tensor
  list, whose dtypes the profiler does not record) counts as a device op. Host ops follow the same
  rule as the others and are reported apart.
* **The verdict** is taken on the device ops (kernels without the host ops): that figure counts
  everything the GPU launches and nothing it does not, which is what the target bounds (launch
  cost). The figure with the host ops (each is host time, like a launch's) is reported beside it
  in the note and the JSON (``all_ops_per_layer``).

Decisions where docs/methods.md is silent (it says nothing about performance):

* Device-dependent dispatch follows the GPU: KIVI's and SVDq's long chunks take one SDPA call on a
  GPU but the per-group loop on a CPU (``methods.blocked_attention.CPU_SINGLE_CALL_QUERIES``); the one-pass is
  counted inside :func:`methods.blocked_attention.gpu_dispatch`, i.e. on the GPU's path.
* The CPU's kernels stand in for CUDA's: a few ops decompose differently on the two (an op here
  and there, the same for every method); the hand count of FP16's layer (13 per decode step, 11
  per one-pass forward: tests/test_bench.py) is what transformers' Llama layer calls on any device.
  Host-to-device copies of Python values (``torch.as_tensor(x, device=cuda)``) do not show on a CPU.
* The model: Llama-3.1-8B's attention geometry (32 query / 8 KV heads, d = 128, llama3 RoPE) with a
  narrow residual stream (hidden 512, vocabulary 256, 2 layers), random weights, float32: the
  counted ops do not depend on the width, only on the attention geometry, and the 2048-token
  passes take seconds. Calibrated methods get synthetic statistics of that geometry
  (:func:`kvbench.bench.common.synthetic_stats`). The ``smoke`` preset uses the tests' tiny shape.
* Budgets: those of the overhead section (codecs 2 bpd with 16-bit values, GEAR 4, H2O and SnapKV
  4 bpd on K and V). KVQuant's fit reads a key/value sample: drawn from the synthetic moments
  (:func:`kvbench.bench.common.synthetic_stats`).

* **rows** — the one-pass of :data:`ROWS` unpadded rows of :data:`ROWS_TOKENS` tokens (PPL windows
  at a batch) against one such row, both warm (without the per-pass setup :func:`one_pass` finds):
  what a batch multiplies the attention's launches by. The
  plain model, and a method whose state takes the rows together (``KVMethod.rows_in_one_state``,
  docs/design.md §2.1), launch what one row launches; a method run row by row, B times that.

Targets: the codecs (KIVI, SVDq, KQ-SVD, KV-COBRA, and the published competitors KVQuant, GEAR
and TurboQuant) at most 3x FP16's ops per layer, per decode step and per one-pass forward (GEAR's
decode figure is the mean over whole flush cycles of its n_b-token buffer: :func:`decode_steps`); H2O's one-pass at most 3x FP16's ops per layer **per window** (the whole
2048-token recursion: a bound that does not grow with the window, so an implementation that
launches ops per token misses it at any window longer than a few tokens; the per-token figure is
in the note); rows: a method that declares ``rows_in_one_state`` at most :data:`ROWS_RATIO` x its
ops at one row. Other rows are informational.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from methods import ModelShape
from methods.blocked_attention import gpu_dispatch
from methods.bookkeeping import HOST_RANGE

from ..model.integrate import attached, attention_modules, cache_argument, model_shape, returned_cache

from .codec_speed import CODEC_CASES
from .common import BASELINES, EVAL_CASES, Row, Sizes, make_method, random_model, synthetic_source, tiny_config

log = logging.getLogger(__name__)

#: aten ops that launch no kernel: views, allocation, dtype/layout no-ops, metadata
NO_KERNEL = frozenset(
    "aten::" + n for n in (
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "transpose", "t", "permute",
        "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "narrow", "split",
        "split_with_sizes", "chunk", "unbind", "alias", "detach", "detach_", "view_as", "unflatten",
        "diagonal", "movedim", "unfold", "lift_fresh", "lift", "empty", "empty_strided", "empty_like",
        "new_empty", "new_empty_strided", "resize_", "result_type", "resolve_conj", "resolve_neg",
        "size", "stride", "numel", "dim", "is_same_size", "_has_compatible_shallow_copy_type", "set_",
        "_shape_as_tensor", "broadcast_tensors", "is_floating_point", "is_complex", "real", "conj",
        "_conj", "_neg_view", "unsafe_split", "unsafe_chunk", "align_as", "tensor_split",
    )
)
#: composite ops that only call other ops: they count as what they call (nothing, when they
#: call nothing: ``x.to(x.dtype)``, ``x.contiguous()`` of a contiguous tensor, dropout in eval).
#: One that calls an op of its own name (an ``out=`` overload) counts as a kernel op instead.
DELEGATING = frozenset(
    "aten::" + n for n in (
        "to", "_to_copy", "contiguous", "clone", "reshape", "flatten", "type_as", "matmul", "linear",
        "softmax", "log_softmax", "item", "is_nonzero", "einsum", "scaled_dot_product_attention", "dropout",
    )
)
#: ops whose result size or value the host must wait for (a device->host sync on a GPU)
SYNC_OPS = frozenset(
    "aten::" + n for n in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim")
)
ATTN, PROJ = "kvbench.opcount.attn", "kvbench.opcount.proj"
HOST = HOST_RANGE  # bookkeeping on CPU tensors inside the layer states (counted apart, as host ops)
CODECS = ("kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl")
#: the published competitors at the budgets of the overhead section (GEAR at 4: its buffer keeps 2
#: out of reach)
BASELINE_CASES = [(c[0], c[1], c[3], c[4]) for c in EVAL_CASES if c[1] in BASELINES]
#: (label, registry name, bpd, v_bpd); None = the plain model (FP16 as the harness runs it)
CASES = [("fp16", None, None, None), ("fp16 (kvbench state)", "fp16", None, None), *CODEC_CASES, *BASELINE_CASES]
CODEC_RATIO = 3.0
#: H2O's one-pass: at most this many times FP16's ops per layer for the whole window
H2O_WINDOW_RATIO = 3.0
#: layers of the model whose attention geometry the count uses (Llama-3.1-8B)
TARGET_LAYERS = 32
#: the rows regime: unpadded rows per pass and their length (at most ``ops_tokens``)
ROWS, ROWS_TOKENS = 4, 256
#: a method whose state takes the rows together: at most this many times its ops at one row (a
#: row-by-row pass launches about ROWS times them)
ROWS_RATIO = 1.25


def opcount_config(layers: int = 2):
    """Llama-3.1-8B's attention geometry on a narrow random model (see the module docstring)."""
    from .common import llama3_8b_config

    cfg = llama3_8b_config(layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 512, 512, 256
    return cfg


@dataclass
class OpCount:
    """Counted ops of one profiled region, summed over the layers."""

    kernels: int
    views: int
    syncs: int
    by_name: Counter
    host: int = 0  # host ops: inside :data:`HOST` ranges, on float64 CPU tensors (no launch on a GPU)
    setup_per_pass: int = 0  # one-pass: ops of the first pass only, shared by the layers (:func:`one_pass`)
    steps: int = 0  # decode: the one-token steps profiled (0: the preset's ``ops_decode_steps``)

    def per(self, n: float) -> dict:
        return {"kernels": self.kernels / n, "views": self.views / n, "syncs": self.syncs / n, "host": self.host / n,
                "all": (self.kernels + self.host) / n}


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _host_scalar_copy(event) -> bool:
    """A ``copy_`` from a 0-dim tensor: a Python scalar wrapped for a CPU kernel (no launch on a GPU)."""
    shapes = getattr(event, "input_shapes", None) or []
    return event.name == "aten::copy_" and len(shapes) >= 2 and list(shapes[1]) == []


#: input dtypes (as the profiler records them) that a host op may have: float64 tensors,
#: Python scalars and lists of them, absent arguments
HOST_DTYPES = frozenset(("double", "Scalar", "ScalarList", ""))


def _host_only(event) -> bool:
    """Whether an op inside a :data:`HOST` range runs on host data only: every input a float64
    tensor, a 0-dim tensor (a wrapped Python scalar) or not a tensor. A tensor list (``cat``)
    cannot be checked (the profiler records no dtypes for it) and makes the op a device op."""
    dtypes = getattr(event, "input_dtypes", None)
    if dtypes is None:
        return False
    shapes = list(getattr(event, "input_shapes", None) or [])
    shapes += [[]] * (len(dtypes) - len(shapes))
    return all(d in HOST_DTYPES or (d != "TensorList" and list(s) == []) for d, s in zip(dtypes, shapes))


def count_events(events) -> OpCount:
    """Kernel ops / views / syncs / host ops inside every :data:`ATTN` range, outside the
    :data:`PROJ` ranges nested in it. The rule (module docstring): an aten op in
    :data:`NO_KERNEL` is a view (unless ops it calls compute: ``reshape`` of a non-contiguous
    tensor copies); one in :data:`DELEGATING` counts as the ops it calls; any other aten op is
    **one** op, plus the layout copies it makes inside (``copy_`` of a non-scalar tensor: a GPU
    runs those as separate kernels too), and nothing else it calls (``mean``'s ``sum`` and
    ``div_`` are one reduction). Inside a :data:`HOST` range an op that passes
    :func:`_host_only` is a host op instead of a kernel (and its syncs are not device syncs).
    Ops of :data:`SYNC_OPS` are counted as syncs wherever they occur outside host ops."""
    names: Counter = Counter()
    totals = {"kernels": 0, "views": 0, "syncs": 0, "host": 0}

    def op(e, host: bool) -> bool:
        """Count one computing op; True when it is a host op."""
        if host and _host_only(e):
            totals["host"] += 1
            return True
        totals["kernels"] += 1
        names[e.name] += 1
        return False

    def syncs_below(e):
        for c in e.cpu_children:
            totals["syncs"] += c.name in SYNC_OPS
            syncs_below(c)

    def copies_below(e, host: bool):
        for c in e.cpu_children:
            if c.name == "aten::copy_":
                if not _host_scalar_copy(c):
                    op(c, host)
            else:
                copies_below(c, host)

    def walk(e, host: bool = False):
        for c in e.cpu_children:
            if c.name == PROJ:
                continue
            if c.name == HOST:
                walk(c, True)
                continue
            if not _is_aten(c):
                walk(c, host)
                continue
            delegates = c.name in DELEGATING and all(k.name != c.name for k in c.cpu_children)
            if delegates or (c.name in NO_KERNEL and _computes_below(c)):
                totals["syncs"] += c.name in SYNC_OPS and not (host and _host_only(c))
                walk(c, host)
            elif c.name in NO_KERNEL:
                totals["views"] += 1
            elif not op(c, host):
                totals["syncs"] += c.name in SYNC_OPS
                copies_below(c, host)
                syncs_below(c)
            else:
                copies_below(c, host)

    for e in events:
        if e.name == ATTN:
            walk(e)
    return OpCount(totals["kernels"], totals["views"], totals["syncs"], names, totals["host"])


def _computes_below(e) -> bool:
    """Whether a view-class op called an op that computes (``reshape`` -> ``clone`` -> ``copy_``)."""
    for c in e.cpu_children:
        if _is_aten(c) and c.name not in NO_KERNEL:
            return True
        if _computes_below(c):
            return True
    return False


class _Ranges:
    """record_function ranges around each layer's self_attn and its projections (module hooks)."""

    def __init__(self, model):
        self.handles, self.open = [], {}
        for attn in attention_modules(model):
            self._wrap(attn, ATTN)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                self._wrap(getattr(attn, name), PROJ)

    def _wrap(self, module, label):
        def enter(mod, args):
            rf = torch.autograd.profiler.record_function(label)
            rf.__enter__()
            self.open.setdefault(id(mod), []).append(rf)

        def leave(mod, args, out):
            self.open[id(mod)].pop().__exit__(None, None, None)

        self.handles.append(module.register_forward_pre_hook(enter))
        self.handles.append(module.register_forward_hook(leave))

    def remove(self):
        for h in self.handles:
            h.remove()


def profile_ops(model, fn) -> OpCount:
    """Run ``fn()`` under the profiler with the layer ranges in place; count its ops."""
    from torch.profiler import ProfilerActivity, profile

    ranges = _Ranges(model)
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
    finally:
        ranges.remove()
    return count_events(prof.events())


@torch.no_grad()
def plain_decode(model, prompt: torch.Tensor, nxt: torch.Tensor) -> OpCount:
    """FP16 as the harness runs it: the unpatched model and its own cache; one-token steps of ``nxt``."""
    name = cache_argument(model)
    cache = returned_cache(model(input_ids=prompt, use_cache=True, logits_to_keep=1))

    def go():
        for i in range(nxt.shape[1]):
            model(input_ids=nxt[:, i : i + 1], use_cache=True, logits_to_keep=1, **{name: cache})

    return profile_ops(model, go)


@torch.no_grad()
def method_decode(model, method, prompt: torch.Tensor, nxt: torch.Tensor) -> OpCount:
    """An exact prefill of ``prompt`` through a session, then one-token steps of ``nxt`` (profiled)."""
    with attached(model, method) as comp, comp.session():
        comp.forward(prompt, 0, prefill=True)
        t = prompt.shape[1]

        def go():
            for i in range(nxt.shape[1]):
                comp.forward(nxt[:, i : i + 1], t + i, prefill=False)

        return profile_ops(model, go)


@torch.no_grad()
def one_pass(model, method, ids: torch.Tensor, model_layers: int | None = None) -> OpCount:
    """One teacher-forced forward, counted on the paths a GPU takes (:func:`methods.blocked_attention.gpu_dispatch`:
    a CPU would take KIVI's/SVDq's per-group loop for long chunks, fewer FLOPs but more launches).

    Two passes are profiled: the first (cold) and a second of the same length (warm: what every
    window after the first of an evaluation costs). What the first runs beyond the second is a
    per-pass cost shared by the layers (KIVI/SVDq's union mask, built once per pass length and
    cached), so it is spread over the ``model_layers`` layers of the model whose geometry this is
    (:data:`TARGET_LAYERS`; ``None``: the profiled model's own), not over the 2 profiled ones: the
    result's ``kernels`` are the warm pass's plus that cost x (profiled layers / model_layers)."""
    def go():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)

    with attached(model, method), gpu_dispatch():
        cold, warm = profile_ops(model, go), profile_ops(model, go)
    layers = len(attention_modules(model))
    share = layers / (model_layers or layers)
    setup = max(0, cold.kernels - warm.kernels)
    return OpCount(warm.kernels + setup * share, warm.views, warm.syncs + max(0, cold.syncs - warm.syncs) * share,
                   warm.by_name, warm.host, setup_per_pass=setup)


def _model_for(sizes: Sizes, device):
    cfg = tiny_config() if sizes.name == "smoke" else opcount_config()
    return random_model(cfg, device, torch.float32)


def cases_named(labels: list[str] | None) -> list[tuple]:
    """The :data:`CASES` with these labels and the plain FP16 baseline (None: all); an unknown
    label is an error naming the valid ones."""
    if labels is None:
        return CASES
    unknown = sorted(set(labels) - {c[0] for c in CASES})
    if unknown:
        raise SystemExit(f"--ops-methods: unknown {unknown}; valid choices: {', '.join(c[0] for c in CASES[1:])}")
    return [c for c in CASES if c[1] is None or c[0] in labels]


def run(sizes: Sizes, device: torch.device, cases=CASES) -> list[Row]:
    model = _model_for(sizes, device)
    shape: ModelShape = model_shape(model)
    stats = synthetic_source(shape)  # KVQuant's fit asks for a key/value sample: drawn from the moments
    t, steps, layers = sizes.ops_tokens, sizes.ops_decode_steps, shape.n_layers
    methods = {label: None if name is None else make_method(name, {}, shape, bpd, v_bpd, stats)
               for label, name, bpd, v_bpd in cases}
    longest = max(steps if m is None else decode_steps(m, steps) for m in methods.values())
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, int(model.config.vocab_size), (1, t + longest), generator=g).to(device)
    prompt = ids[:, :t]
    counts: dict[tuple[str, str], OpCount] = {}
    for label, name, bpd, v_bpd in cases:
        method = methods[label]
        n_steps = steps if method is None else decode_steps(method, steps)
        nxt = ids[:, t : t + n_steps]
        log.info("opcount: %s decode step (prefill %d, %d steps)", label, t, n_steps)
        if method is None:
            counts[label, "decode"] = plain_decode(model, prompt, nxt)
        else:
            counts[label, "decode"] = method_decode(model, method, prompt, nxt)
        counts[label, "decode"].steps = n_steps
        if method is None or method.supports_in_pass:
            log.info("opcount: %s one-pass over %d tokens", label, t)
            counts[label, "one-pass"] = one_pass(model, method, prompt, None if sizes.name == "smoke" else TARGET_LAYERS)
            rows = torch.randint(0, int(model.config.vocab_size), (ROWS, min(ROWS_TOKENS, t)), generator=g).to(device)
            log.info("opcount: %s one-pass of %d rows of %d tokens", label, ROWS, rows.shape[1])
            counts[label, "rows"] = (one_pass(model, method, rows[:1]), one_pass(model, method, rows))
    return rows_from(counts, t, steps, layers, shape) + rows_regime(counts, methods, layers)


def rows_regime(counts: dict, methods: dict, layers: int) -> list[Row]:
    """Rows regime: device ops per layer of :data:`ROWS` unpadded rows over one row's, per method
    (``methods``: label -> configured method, None for the plain model)."""
    out = []
    for label, method in methods.items():
        if (label, "rows") not in counts:
            continue
        # warm passes: a per-pass setup (a mask cached per pass length) is not what the rows multiply
        one, many = ((c.kernels - c.setup_per_pass) / layers for c in counts[label, "rows"])
        ratio = many / one
        together = method is None or method.rows_in_one_state
        detail = {"method": "fp16" if method is None else method.name, "plain_model": method is None,
                  "regime": "rows", "rows": ROWS, "kernels_per_layer": many, "kernels_per_layer_one_row": one,
                  "rows_in_one_state": together}
        note = (f"{many:.1f} device ops per layer for {ROWS} rows vs {one:.1f} for one; "
                + ("one state per layer" if together else "one state per row and layer"))
        gated = method is not None and together
        out.append(Row("opcount", f"{label} one-pass, {ROWS} rows", "ops / one row's ops", ratio, "x",
                       "<=" if gated else "info", ROWS_RATIO if gated else 0.0,
                       shown=f"{ratio:.2f}x ({many:.1f})", detail=detail, note=note))
    return out


def decode_steps(method, steps: int) -> int:
    """Decode steps that hold whole flush cycles of ``method``: ``steps`` (32 covers a residual
    window or token group of up to 32), for GEAR the smallest multiple of its block n_b (64 or
    96 at bpd 4) that is at least ``steps``: every n_b-th step compresses the buffered block,
    and a mean over fewer steps would leave that out (or count it too often)."""
    block = int(method.knobs().get("block") or 0) if method.name == "gear" else 0
    return steps if block <= 0 else -(-steps // block) * block


def rows_from(counts: dict, t: int, steps: int, layers: int, shape: ModelShape) -> list[Row]:
    """Rows per (method, regime): device ops per layer (decode: per step too) against FP16's, the
    verdict's figure; the count with the host ops beside it (module docstring)."""
    rows = []
    geometry = f"{shape.n_q_heads}/{shape.n_kv_heads} heads, d={shape.head_dim}"
    for regime in ("decode", "one-pass"):
        base = counts["fp16", regime]
        base_k = base.kernels / (layers * ((base.steps or steps) if regime == "decode" else 1))
        for label, name, bpd, v_bpd in CASES:
            if (label, regime) not in counts:
                continue
            c = counts[label, regime]
            n_steps = (c.steps or steps) if regime == "decode" else None
            n = layers * (n_steps or 1)
            per = c.per(n)
            ratio = per["kernels"] / base_k
            what = "per layer per step" if regime == "decode" else f"per layer per {t}-token pass"
            note = (f"{per['kernels']:.1f} device ops {what} vs fp16 {base_k:.1f}; with host ops "
                    f"{per['all']:.1f} ({per['all'] / base_k:.2f}x); views {per['views']:.1f}, "
                    f"syncs {per['syncs']:.2f}")
            detail = {
                "method": name or "fp16", "plain_model": name is None, "regime": regime, "bpd": bpd,
                "v_bpd": v_bpd, "tokens": t, "decode_steps": n_steps,
                "layers": layers, "kernels_per_layer": per["kernels"], "views_per_layer": per["views"],
                "syncs_per_layer": per["syncs"], "host_ops_per_layer": per["host"],
                "all_ops_per_layer": per["all"], "all_ops_ratio_to_fp16": per["all"] / base_k,
                "fp16_kernels_per_layer": base_k, "ratio_to_fp16": ratio, "verdict_on": "kernels_per_layer",
                "setup_ops_per_pass": c.setup_per_pass if regime == "one-pass" else None,
                "top_ops": dict(Counter({k: v / n for k, v in c.by_name.items()}).most_common(12)),
            }
            row_name = f"{label} {regime}" + ("" if bpd is None else f" (bpd {bpd:g})")
            shown = f"{ratio:.2f}x ({per['kernels']:.1f})"
            if name == "h2o" and regime == "one-pass":
                per_token = per["kernels"] / t
                detail["kernels_per_token_per_layer"] = per_token
                rows.append(Row("opcount", row_name, "window ops / fp16 window ops", ratio, "x", "<=",
                                H2O_WINDOW_RATIO, shown=shown, detail=detail,
                                note=note + f"; {per_token:.2f} per token: the whole window's ops are bounded"))
            elif name in CODECS or name in BASELINES:
                rows.append(Row("opcount", row_name, "ops / fp16 ops", ratio, "x", "<=", CODEC_RATIO,
                                shown=shown, note=note + (f"; mean of {n_steps} steps (whole flush cycles)"
                                                          if n_steps and n_steps != steps else ""), detail=detail))
            else:
                rows.append(Row("opcount", row_name, "ops / fp16 ops", ratio, "x", "info", 0.0,
                                shown=shown, note=note + f"; {geometry}", detail=detail))
    return rows
