"""§4 of ``python -m kvbench.bench``: bytes the compressed cache holds after a prefill, and the
measured bpd against each method's formula (docs/methods.md §8, ``method.nominal_bpd(T)``).

One exact prefill of ``mem_tokens`` tokens runs through the model with a recording layer state
attached (:func:`kvbench.model.integrate.attached`, ``session()``, ``prefill=True``), keeping what every
layer's attention receives: queries, post-RoPE keys, values, pre-RoPE keys, RoPE tables. A
prefill attends exactly, so these are exactly the inputs each method's layer states get in a real
compressed prefill; every method's states are then fed them layer by layer (``attend(...,
prefill=True)``) and their ``stored_bits()`` summed. This runs the model once instead of once per
method. Methods whose stored cache does not depend on the queries (all but H2O and SnapKV) get only
the last query row, so the discarded prefill output costs nothing; H2O and SnapKV get all queries.

Per method: bytes held (stored bits / 8, K + V), the ratio to the FP16 cache (16 bits per element),
measured bpd_K / bpd_V against ``nominal_bpd(T)``, the resident bytes of the states' tensors
(per-sequence storages only, any storage a kept view holds alive included; the method's static
parameters are excluded; informational) and, apart, the scratch: what the layers of a sequence
share (the RoPE tables of a pre-RoPE codec, :class:`methods.buffers.RopeLog`), counted once. The
row is the largest relative deviation |measured / nominal - 1| over K and V; target at most 2%.
"""

from __future__ import annotations

import logging

import torch

from methods import KVMethod, LayerState
from methods.attention import causal_attention

from .common import MEMORY_CASES, BenchModel, Row, Sizes, budget_label, eval_windows, fmt_bytes, make_method
from ..model.integrate import attached, model_shape

log = logging.getLogger(__name__)

QUERY_DEPENDENT = {"h2o", "snapkv"}
TARGET_PCT = 2.0


class _Recording(LayerState):
    def __init__(self, sink: dict, layer: int):
        self.sink, self.layer, self._seen = sink, layer, 0

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        self.sink[self.layer] = (q, k, v, k_pre, rope, scaling)
        self._seen += k.shape[2]
        return causal_attention(q, k, v, scaling)

    def stored_bits(self):
        return 0, 0

    @property
    def n_seen(self):
        return self._seen


class _Recorder(KVMethod):
    name = "recorder"

    def __init__(self):
        self.sink: dict = {}

    def configure(self, shape, bpd_k, bpd_v):
        pass

    def new_layer_state(self, layer):
        return _Recording(self.sink, layer)


@torch.no_grad()
def capture(bm: BenchModel, ids: torch.Tensor) -> list[tuple]:
    """Per layer (q, k, v, k_pre, rope, scaling) of an exact prefill of ``ids`` [1, T]."""
    rec = _Recorder()
    with attached(bm.model, rec) as comp, comp.session():
        comp.prefill = True
        ids = ids.to(bm.device)
        pos = torch.arange(ids.shape[1], device=bm.device)[None]
        bm.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
    return [rec.sink[i] for i in range(len(rec.sink))]


def resident_bytes(obj, seen: set | None = None, depth: int = 0, shared: list | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj``'s attributes (lists, tuples,
    dicts and objects with ``__dict__`` followed; callables and modules not).

    An object whose class sets ``shared_by_layers`` (the per-sequence tables every layer of a
    sequence reads, :class:`methods.buffers.RopeLog`) is not followed: it is appended to ``shared``
    and counted once by :func:`shared_bytes`, the "scratch" figure beside the layers' own bytes."""
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen:
        return 0
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = ("storage", st.data_ptr(), obj.device.type)
        if key in seen or st.nbytes() == 0:
            return 0
        seen.add(key)
        return st.nbytes()
    seen.add(id(obj))
    if getattr(type(obj), "shared_by_layers", False):
        if shared is not None:
            shared.append(obj)
        return 0
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not callable(obj):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(resident_bytes(x, seen, depth + 1, shared) for x in items)


def shared_bytes(objs: list, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages of the shared objects :func:`resident_bytes` set
    apart (each counted once, however many layers hold it)."""
    seen = set() if seen is None else seen
    return sum(resident_bytes(vars(o), seen) for o in objs)


@torch.no_grad()
def run(bm: BenchModel, sizes: Sizes, stats, cases=MEMORY_CASES) -> list[Row]:
    shape = model_shape(bm.model)
    t = sizes.mem_tokens
    ids = eval_windows(bm, t, 1)
    log.info("memory: recording a %d-token prefill", t)
    layers = capture(bm, ids)
    elements = t * shape.n_heads_total * shape.head_dim  # per side, batch 1
    fp16_bytes = 2 * elements * 2
    rows = []
    for label, name, options, bpd, v_bpd in cases:
        method = make_method(name, options, shape, bpd, v_bpd, stats)
        log.info("memory: %s (%s)", label, budget_label(bpd, v_bpd))
        bits_k = bits_v = resident = 0
        states, shared = [], []
        for layer, (q, k, v, k_pre, rope, scaling) in enumerate(layers):
            qq = q if name in QUERY_DEPENDENT else q[:, :, -1:]
            state = method.new_layer_state(layer)
            state.attend(qq, k, v, scaling=scaling, prefill=True, k_pre=k_pre, rope=rope)
            bk, bv = state.stored_bits()
            bits_k, bits_v = bits_k + bk, bits_v + bv
            states.append(state)
        static: set = set()
        resident_bytes(method, static)  # per-model constants (projections, steps, their caches)
        for state in states:
            resident += resident_bytes(state, static, shared=shared)
        scratch = shared_bytes(shared, static)
        del states, shared
        measured = (bits_k / elements, bits_v / elements)
        nominal = method.nominal_bpd(t)
        dev = [abs(m / n - 1.0) * 100 for m, n in zip(measured, nominal)]
        held = (bits_k + bits_v) / 8
        rows.append(Row(
            "memory", f"{label} ({budget_label(bpd, v_bpd)})", "|measured/formula - 1|", max(dev), "%", "<=",
            TARGET_PCT, shown=f"{max(dev):.3g}%",
            note=(f"{fmt_bytes(held)} = {held / fp16_bytes:.3f} of fp16 {fmt_bytes(fp16_bytes)}; "
                  f"bpd K {measured[0]:.3f}/{nominal[0]:.3f}, V {measured[1]:.3f}/{nominal[1]:.3f}; "
                  f"resident {resident / fp16_bytes:.2f}x fp16, scratch {fmt_bytes(scratch)}"),
            detail={
                "method": name, "options": options, "bpd": bpd, "v_bpd": v_bpd, "tokens": t,
                "bytes_held": held, "bytes_fp16": fp16_bytes, "ratio_to_fp16": held / fp16_bytes,
                "measured_bpd": list(measured), "nominal_bpd": list(nominal), "deviation_pct": dev,
                "resident_bytes": resident, "resident_to_fp16": resident / fp16_bytes, "scratch_bytes": scratch,
                "queries": "all" if name in QUERY_DEPENDENT else "last row",
            },
        ))
    return rows
