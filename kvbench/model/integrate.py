"""Putting a method into a transformers model (docs/design.md §2; docs/methods.md §1.3).

``with attached(model, method) as comp:`` is how the harness puts a method in a model: it
registers one attention function, ``"kvbench"``, with transformers'
``AttentionInterface`` (and a matching entry in ``AttentionMaskInterface``: the function builds its
own causal rule, so the mask is not needed; forgetting to register it would make transformers fall
back to a bidirectional mask for an unknown implementation). Every attention layer then routes its
post-RoPE queries, keys and values to the method's :class:`methods.LayerState`:

* With no session open, each forward pass is the **Q-all** simulation: a fresh state per layer
  in decode semantics, so every token's K/V is compressed before any query (its own included)
  reads it. Perplexity track A and zero-shot log-likelihoods run this way.
* Inside ``session()`` the states persist across forward passes: the first call can be an exact
  prefill followed by compression, later calls decode from the compressed cache (generation,
  track B). The model runs with ``use_cache=False`` and explicit ``position_ids``; the compressed
  cache lives here, not in a transformers ``Cache``, so the code is the same for transformers
  5.17 (``past_key_values=``) and 5.24 (``cache=``).

Pre-RoPE codecs need the keys before rotation: a forward hook on ``k_proj`` passes its output
(bias included) and a pre-hook on the attention module passes the ``(cos, sin)`` it receives.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from methods import KVMethod, ModelShape, Rope
from methods.bookkeeping import host_ops

from .batching import Padded

ATTN_IMPLEMENTATION = "kvbench"


def model_shape(model) -> ModelShape:
    cfg = model.config
    n_q = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return ModelShape(
        n_layers=cfg.num_hidden_layers,
        n_q_heads=n_q,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_q,
        head_dim=head_dim,
    )


def cache_argument(model) -> str:
    """The name of the cache argument: ``cache`` (transformers 5.24+) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_LOGITS_ARGUMENT: dict = {}


def logits_argument(model) -> str | None:
    """The argument that limits the logits to the last positions: ``logits_to_keep`` (transformers
    4.50 and every 5.x, 5.17 and 5.24 included), ``num_logits_to_keep`` (4.45-4.49), or None when
    ``forward`` takes neither (then every position's logits are computed)."""
    kind = type(model)
    if kind not in _LOGITS_ARGUMENT:
        params = inspect.signature(model.forward).parameters
        _LOGITS_ARGUMENT[kind] = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    return _LOGITS_ARGUMENT[kind]


def last_logits(model, n: int = 1) -> dict:
    """Keyword arguments for a forward pass that needs the logits of its last ``n`` positions only
    (a prefill keeps one row: at 31.5k tokens the full logits are 8-10 GB in bf16). The logits keep their shape [B, n, V]."""
    name = logits_argument(model)
    return {} if name is None else {name: n}


def returned_cache(output):
    """The cache a forward pass returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer (Llama, Mistral, Qwen2 layout)."""
    try:
        layers = model.model.layers
    except AttributeError as err:
        raise TypeError(
            f"{type(model).__name__} has no model.layers: only decoder-only models laid out like "
            "Llama, Mistral and Qwen2 are supported"
        ) from err
    return [layer.self_attn for layer in layers]


def _kvbench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    compressor: Compressor = module._kvbench
    out = compressor.attend(module.layer_idx, query, key, value, scaling or module.scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _kvbench_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    _registered = True


@dataclass
class Compressor:
    """A method attached to a model: what :func:`attached` yields.

    Rows: a forward pass may carry B token rows, padded (:mod:`kvbench.model.batching`). Each row
    has its own layer states (inside a session: ``states[row][layer]``; in a Q-all pass: fresh
    ones), and :meth:`attend` hands each row only its real tokens, so padding never reaches a
    method and every row computes and measures what it would alone. For a method whose state
    takes rows together (``KVMethod.rows_in_one_state``) one state per layer serves all the rows,
    B rows per kernel launch, where that changes nothing (docs/design.md §2.1): a Q-all pass of
    unpadded rows, or of right-padded rows when the cache holds what its last query read
    (``holds_last_read``), and a session opened with ``together``. The bookkeeping is per row:
    :meth:`read_bpd` and :meth:`measured_bpd` take the row."""

    model: torch.nn.Module
    method: KVMethod
    shape: ModelShape
    #: inside a session: per row, one layer state per layer (rows together: one list, shared)
    states: list | None = None
    #: whether the open session runs its rows in one state per layer (:meth:`session`)
    together: bool = False
    prefill: bool = False
    #: per row, per layer (bits_k, bits_v, tokens) after the row's last forward pass
    last_bits: list = field(default_factory=list)
    #: per row, per layer what each query of the row's last forward pass read (``LayerState.read_bits``)
    last_reads: list = field(default_factory=list)
    _k_pre: dict = field(default_factory=dict)
    _rope: dict = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    _previous_impl: str | None = None
    #: the layout of the pass under way: its padding (None: every column is real) and the session
    #: row of each input row (None: input row i is row i)
    _padded: Padded | None = None
    _rows: list | None = None

    def _row_lists(self, n: int) -> None:
        empty = [(0, 0, 0)] * self.shape.n_layers
        while len(self.last_bits) < n:
            self.last_bits.append(list(empty))
            self.last_reads.append([None] * self.shape.n_layers)

    def attend(self, layer: int, q, k, v, scaling: float) -> torch.Tensor:
        cos, sin = self._rope.pop(layer)
        k_pre = self._k_pre.pop(layer, None)
        b, t = q.shape[0], q.shape[2]
        rows = self._rows or list(range(b))
        self._row_lists(max(rows) + 1)
        ragged = self._padded is not None and self._padded.ragged
        if b == 1 and not ragged:
            return self._attend_row(rows[0], layer, q, k, v, k_pre, Rope(cos, sin), scaling)
        if self.together:
            if ragged or rows != list(range(len(self.last_bits))):
                raise RuntimeError("a session of rows in one state takes all its rows, unpadded, in every pass")
            return self._attend_rows(rows, layer, q, k, v, k_pre, Rope(cos, sin), scaling, self.states[0][layer])
        right = ragged and self._padded.side == "right" and self.method.holds_last_read
        if self.states is None and self.method.rows_in_one_state and (not ragged or right):
            lengths = self._padded.lengths if ragged else None
            return self._attend_rows(rows, layer, q, k, v, k_pre, Rope(cos, sin), scaling, lengths=lengths)
        out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
        for i, row in enumerate(rows):
            cols = self._padded.valid(i) if self._padded is not None else slice(0, t)
            if cols.start == cols.stop:
                continue
            ci = slice(i, i + 1) if cos.shape[0] > 1 else slice(0, 1)
            out[i:i + 1, :, cols] = self._attend_row(
                row, layer, q[i:i + 1, :, cols], k[i:i + 1, :, cols], v[i:i + 1, :, cols],
                None if k_pre is None else k_pre[i:i + 1, :, cols], Rope(cos[ci, cols], sin[ci, cols]), scaling,
            )
        return out

    def _attend_row(self, row: int, layer: int, q, k, v, k_pre, rope: Rope, scaling: float) -> torch.Tensor:
        state = self.states[row][layer] if self.states is not None else self.method.new_layer_state(layer)
        out = state.attend(q, k, v, scaling=scaling, prefill=self.prefill, k_pre=k_pre, rope=rope)
        bits_k, bits_v = state.stored_bits()
        self.last_bits[row][layer] = (bits_k, bits_v, state.n_seen)
        self.last_reads[row][layer] = state.read_bits()
        return out

    def _attend_rows(self, rows: list, layer: int, q, k, v, k_pre, rope: Rope, scaling: float,
                     state=None, lengths: list | None = None) -> torch.Tensor:
        """Rows through one state (the method's ``rows_in_one_state``): a fresh one in a Q-all
        pass, the session's in a session of rows together; each row's bits held and read are the
        state's / B. ``lengths``: right-padded rows of a Q-all pass (a method that
        ``holds_last_read``). A Q-all pass is decoding, so no real position reads a later column:
        padding at a row's end changes none of its outputs or reads, and what the row holds at its
        end is what its last real query read."""
        state = self.method.new_layer_state(layer) if state is None else state
        out = state.attend(q, k, v, scaling=scaling, prefill=self.prefill, k_pre=k_pre, rope=rope)
        (bits_k, bits_v), reads, b = state.stored_bits(), state.read_bits(), len(rows)
        with host_ops():  # float64 CPU bookkeeping
            share = None if reads is None else (reads[0] / b, reads[1] / b)
            for i, row in enumerate(rows):
                if lengths is None:
                    self.last_bits[row][layer] = (bits_k / b, bits_v / b, state.n_seen)
                    self.last_reads[row][layer] = share
                elif lengths[i]:
                    n = lengths[i]
                    self.last_reads[row][layer] = (share[0][:n], share[1][:n])
                    self.last_bits[row][layer] = (float(share[0][n - 1]), float(share[1][n - 1]), n)
        return out

    def read_bpd(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """bpd_K, bpd_V [T] that each query of ``row``'s last forward pass read (docs/methods.md
        §0 v2): the bits all layers held when query i read them / ((n0 + i + 1) N d); None when
        that pass was an exact prefill."""
        reads = self.last_reads[row] if row < len(self.last_reads) else None
        if not reads or any(r is None for r in reads):
            return None
        bits_k = sum(r[0] for r in reads)
        bits_v = sum(r[1] for r in reads)
        t, seen = bits_k.shape[0], self.last_bits[row][0][2]
        tokens = torch.arange(seen - t + 1, seen + 1, dtype=torch.float64)
        elements = tokens * (self.shape.n_heads_total * self.shape.head_dim)
        return bits_k / elements, bits_v / elements

    def measured_bpd(self, row: int = 0) -> tuple[float, float]:
        """bpd_K, bpd_V of ``row``'s cache after its last pass: stored bits / (T * N * d),
        docs/methods.md §0."""
        bits = self.last_bits[row] if row < len(self.last_bits) else []
        tokens = bits[0][2] if bits else 0
        elements = tokens * self.shape.n_heads_total * self.shape.head_dim
        if elements == 0:
            return float("nan"), float("nan")
        return sum(b[0] for b in bits) / elements, sum(b[1] for b in bits) / elements

    @contextlib.contextmanager
    def layout(self, padded: Padded | None, rows: list | None = None):
        """The block's forward passes carry ``padded``'s rows (None: unpadded), input row i being
        session row ``rows[i]`` (default i)."""
        self._padded, self._rows = padded, rows
        try:
            yield
        finally:
            self._padded = self._rows = None

    @contextlib.contextmanager
    def session(self, rows: int = 1, together: bool = False):
        """A persistent compressed cache of ``rows`` sequences for the forward passes inside the
        block. ``together`` (a method whose state takes rows together, every pass carrying all the
        rows unpadded: equal-length contexts, then equal-length continuations): one state per
        layer holds them all."""
        if together and not self.method.rows_in_one_state:
            raise ValueError(f"{self.method.name}: its layer state does not take rows together")
        self.together = together and rows > 1
        count = 1 if self.together else rows
        self.states = [[self.method.new_layer_state(i) for i in range(self.shape.n_layers)]
                       for _ in range(count)]
        self.last_bits, self.last_reads = [], []
        self._row_lists(rows)
        try:
            yield self
        finally:
            self.states = None
            self.prefill = False
            self.together = False

    def forward(self, input_ids: torch.Tensor, start, prefill: bool, last: int = 0,
                padded: Padded | None = None, rows: list | None = None) -> torch.Tensor:
        """Run new tokens through the open session; returns logits [B, T, V], or those of the
        last ``last`` columns only ([B, last, V]; 0 = all). ``start``: the position of each row's
        first new token (an int for every row alike, or one per row); ``padded``: the rows'
        padding (None: every column is real; its ``ids`` are ``input_ids``); ``rows``: the
        session row of each input row (default: input row i is row i)."""
        if self.states is None:
            raise RuntimeError("forward() needs an open session(); plain model(...) is Q-all")
        self.prefill = prefill
        b, t = input_ids.shape
        starts = [start] * b if isinstance(start, int) else list(start)
        if padded is not None and padded.ragged:
            positions = padded.positions(starts)
        elif len(set(starts)) == 1:
            positions = torch.arange(starts[0], starts[0] + t, device=input_ids.device)[None].expand(b, t)
        else:
            positions = torch.tensor(starts, device=input_ids.device)[:, None] + torch.arange(t, device=input_ids.device)
        extra = last_logits(self.model, last) if last else {}
        # An explicit (all-true) 2D padding mask: given position_ids, no mask and no cache,
        # transformers (5.17, 5.24) checks the positions for packed sequences, a device->host sync
        # per forward pass, i.e. per decode step. The mask function registered for "kvbench"
        # returns None either way: each row's states see only its real tokens.
        mask = torch.ones(b, max(starts) + t, dtype=torch.bool, device=input_ids.device)
        try:
            with self.layout(padded if padded is not None and padded.ragged else None, rows):
                logits = self.model(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra
                ).logits
        finally:
            self.prefill = False
        return logits[:, -last:] if last else logits

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in attention_modules(self.model):
            if getattr(module, "_kvbench", None) is self:
                del module._kvbench
        if self._previous_impl is not None:
            self.model.config._attn_implementation = self._previous_impl


def attach(model, method: KVMethod) -> Compressor:
    """Route every attention layer of ``model`` through ``method`` (configured and calibrated)."""
    _register()
    shape = model_shape(model)
    comp = Compressor(model=model, method=method, shape=shape)
    comp._previous_impl = model.config._attn_implementation
    for idx, module in enumerate(attention_modules(model)):
        if getattr(module, "_kvbench", None) is not None:
            raise RuntimeError("a method is already attached to this model; detach() it first")
        module._kvbench = comp

        def keep_k_pre(mod, args, output, idx=idx):
            b, t = output.shape[:2]
            comp._k_pre[idx] = output.view(b, t, -1, shape.head_dim).transpose(1, 2)

        def keep_rope(mod, args, kwargs, idx=idx):
            pe = kwargs.get("position_embeddings")
            if pe is None and len(args) > 1:
                pe = args[1]
            comp._rope[idx] = pe

        comp._handles.append(module.k_proj.register_forward_hook(keep_k_pre))
        comp._handles.append(module.register_forward_pre_hook(keep_rope, with_kwargs=True))
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return comp


@contextlib.contextmanager
def attached(model, method: KVMethod | None):
    """The block runs ``model`` with ``method`` attached (configured and calibrated) and yields its
    :class:`Compressor`; on the way out, however it is left, the model is as before. ``method``
    None (the FP16 baseline) yields None and leaves the model untouched: the plain model is the
    reference, not the kvbench attention function at 16 bits."""
    if method is None:
        yield None
        return
    comp = attach(model, method)
    try:
        yield comp
    finally:
        comp.detach()
