"""Growing cache buffers shared by the layer states.

A layer state holds its stored representation and nothing else between calls (docs/design.md §2):
packed codes, their metadata and full-precision tokens, each in a buffer that grows without copying
the cache at every step. Attention decodes them into a transient copy of one layer's K/V.

* :class:`Growing`: a tensor that grows along one axis (amortized O(1) appends, 1/16 spare room)
  and can drop tokens at its front (a full-precision window whose oldest tokens get quantized).
* :class:`CallStore`: the packed parts of successive encode calls end to end, and the runs of
  consecutive calls whose parts have the same shapes: a run reads back as one tensor per part with
  the calls stacked on a new first axis, so a codec decodes it in one batched pass that computes
  every call exactly as decoding that call alone does (:meth:`methods.codec_state.Codec.decode_calls`).
* :class:`SideStore`: one side (K or V) of a cache stored as packed groups followed by a
  full-precision tail (KIVI's keys and values, SVDq's values).
* :class:`RopeLog`: the (cos, sin) of the positions a sequence's cache holds, shared by the layers
  of the sequence (a pre-RoPE codec rotates its decoded keys with them); held once per sequence,
  not once per layer, and reported apart from the layers' bytes (``RopeLog.shared_by_layers``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from .base import Rope, held_bits
from .bookkeeping import decode_ops

#: spare room of a growing buffer: 1/SPARE_FRACTION of what it holds, at least ``min_spare`` units
SPARE_FRACTION = 16
MIN_SPARE = 64


class Growing:
    """A tensor that grows along ``axis`` (tokens of [B, H, n, d] by default) with amortized O(1)
    appends: it reserves 1/16 spare room (at least ``min_spare`` units along the axis), so a decode
    step writes its token instead of copying the buffer. :meth:`drop_front` forgets the oldest
    units (a window of full-precision tokens); their room is reclaimed when the dead front reaches
    a quarter of what is held (a copy of the live part, amortized O(1) per dropped unit).

    The first append adopts its tensor without copying (a one-pass forward stores its keys as
    they are), unless it is a view into a larger storage; the buffer is copied into owned storage
    before anything writes into it."""

    def __init__(self, axis: int = 2, min_spare: int = MIN_SPARE):
        self.axis = axis
        self.min_spare = min_spare
        self._buf: torch.Tensor | None = None
        self._owned = False
        self._start = 0  # dropped units at the front of ``_buf``
        self.n = 0  # units held

    def _span(self, start: int, stop: int) -> torch.Tensor:
        return self._buf.narrow(self.axis, start, stop - start)

    def _reserve(self, need: int, like: torch.Tensor, spare: bool | None = None) -> None:
        """Room for ``need`` units after the live ones start (owned storage); spare room unless
        nothing is held yet (the first append adopts its tensor as it is)."""
        if self._buf is not None and self._owned and self._start + need <= self._buf.shape[self.axis]:
            return
        spare = (self._buf is not None) if spare is None else spare
        spare = max(self.min_spare, need // SPARE_FRACTION) if spare else 0
        shape = list(like.shape)
        shape[self.axis] = need + spare
        buf = like.new_empty(shape)
        if self._buf is not None and self.n:
            buf.narrow(self.axis, 0, self.n).copy_(self._span(self._start, self._start + self.n))
        self._buf, self._owned, self._start = buf, True, 0

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[self.axis]
        if self._buf is None:  # adopt x, unless it is a view into a larger storage it would keep alive
            if x.untyped_storage().nbytes() > x.numel() * x.element_size():
                x = x.clone()
            self._buf, self._owned, self._start, self.n = x, False, 0, t
            return
        self._reserve(self.n + t, x)
        self._span(self._start + self.n, self._start + self.n + t).copy_(x)
        self.n += t

    def write(self, start: int, x: torch.Tensor) -> None:
        """Overwrite units ``start..start + len(x)`` (already appended) in place. A write that
        replaces the whole adopted tensor adopts ``x`` instead (no copy of what it overwrites)."""
        if not self._owned and start == 0 and self._start == 0 and x.shape[self.axis] == self.n:
            self._buf = x
            return
        self._reserve(self.n, x)
        self._span(self._start + start, self._start + start + x.shape[self.axis]).copy_(x)

    def drop_front(self, m: int) -> None:
        """Forget the ``m`` oldest units."""
        if m <= 0:
            return
        if m >= self.n:
            self.__init__(self.axis, self.min_spare)
            return
        self._start += m
        self.n -= m
        if self._start >= max(self.min_spare, self.n // 4) or not self._owned:
            live = self._span(self._start, self._start + self.n)
            self._buf, self._owned, self._start = None, False, 0
            self._reserve(self.n, live, spare=True)
            self._span(0, self.n).copy_(live)

    @property
    def data(self) -> torch.Tensor | None:
        return None if self._buf is None else self._span(self._start, self._start + self.n)


def row_elements(g: Growing) -> int:
    """Elements per token of a growing [B, H, n, d] buffer (B * H * d)."""
    d = g.data
    return 0 if d is None else d.shape[0] * d.shape[1] * d.shape[3]


@dataclass
class _Run:
    key: Hashable  # the calls' layout and part shapes
    layout: Hashable
    offsets: dict  # part -> element offset of the run's first call in its flat buffer
    shapes: dict  # part -> shape of one call's tensor
    ragged: dict  # ragged part -> element offset of the run's first element
    calls: int = 1


class CallStore:
    """What successive encode calls stored, end to end: one flat growing buffer per named part
    (``parts``: tensors of the same shape in every call of a run; ``ragged``: 1-D tensors whose
    length may differ from call to call, e.g. outlier lists) and the runs of consecutive calls with
    the same ``layout`` and part shapes. :meth:`runs` gives each run's parts stacked [calls, ...]
    and its ragged parts concatenated: views of the buffers, no copy."""

    def __init__(self):
        self._flat: dict[str, Growing] = {}
        self._runs: list[_Run] = []
        self.calls = 0

    def _push(self, name: str, x: torch.Tensor) -> int:
        buf = self._flat.get(name)
        if buf is None:
            buf = self._flat[name] = Growing(axis=0)
        start = buf.n
        buf.append(x.reshape(-1))
        return start

    def append(self, layout: Hashable, parts: dict, ragged: dict | None = None) -> None:
        parts = {k: v for k, v in parts.items() if v is not None}
        ragged = {k: v for k, v in (ragged or {}).items() if v is not None}
        key = (layout, tuple((k, tuple(v.shape), v.dtype) for k, v in parts.items()), tuple(sorted(ragged)))
        offsets = {k: self._push(k, v) for k, v in parts.items()}
        starts = {k: self._push(k, v) for k, v in ragged.items()}
        self.calls += 1
        last = self._runs[-1] if self._runs else None
        if last is not None and last.key == key:
            last.calls += 1
            return
        self._runs.append(_Run(key, layout, offsets, {k: tuple(v.shape) for k, v in parts.items()}, starts))

    def flat(self, name: str) -> torch.Tensor:
        """Every call's ``name`` part end to end (1-D, a view)."""
        return self._flat[name].data

    def runs(self) -> list[tuple[Hashable, int, dict, dict]]:
        """(layout, calls, parts [calls, *shape], ragged parts [elements]) per run, in order."""
        out = []
        for i, run in enumerate(self._runs):
            parts = {}
            for k, shape in run.shapes.items():
                size = 1
                for s in shape:
                    size *= s
                flat = self._flat[k].data
                parts[k] = flat[run.offsets[k] : run.offsets[k] + run.calls * size].view(run.calls, *shape)
            ragged = {}
            for k, start in run.ragged.items():
                nxt = self._runs[i + 1].ragged[k] if i + 1 < len(self._runs) and k in self._runs[i + 1].ragged else None
                ragged[k] = self._flat[k].data[start:nxt]
            out.append((run.layout, run.calls, parts, ragged))
        return out


@dataclass
class SideStore:
    """One side (K or V) of the cache: packed quantized groups of positions < ``n_quant``, then the
    full-precision tail (positions ``n_quant..n``).

    The packed groups are :class:`methods.groupquant.GroupPacked` parts grown along their token
    axis (``codes``, ``scale``, ``minimum``: one growing buffer each), so a decode step appends and
    :meth:`decoded` dequantizes all of them at once, elementwise. ``tail`` drops the positions it
    hands to the quantizer."""

    parts: dict = field(default_factory=dict)
    tail: Growing = field(default_factory=lambda: Growing(min_spare=4))
    n_quant: int = 0
    _packed_bits: int = 0
    _meta: tuple | None = None  # (nbits, group, axis, dtype) of the packed groups

    @property
    def n(self) -> int:
        return self.n_quant + self.tail.n

    @property
    def res(self) -> torch.Tensor | None:
        """The full-precision tail [B, H, n - n_quant, d]."""
        return self.tail.data

    def bits(self) -> int:
        tail = 0 if self.res is None else self.res.numel() * 16
        return self._packed_bits + tail

    def packed_bits(self) -> int:
        return self._packed_bits

    def reads(self, n_read, n_quant, row: int):
        """Bits held by this side when a query reads ``n_read`` tokens of which ``n_quant`` are
        quantized (:func:`methods.base.held_bits`, tensors or Python numbers; the per-token cost
        of the quantized prefix is measured from the packed groups)."""
        per_token = self._packed_bits / self.n_quant if self.n_quant else 0.0
        return held_bits(n_read, n_quant, per_token, 16.0 * row)

    def exact_tail(self, x_new: torch.Tensor) -> torch.Tensor:
        """Positions n_quant.. at full precision once ``x_new`` is appended (before :meth:`flush`)."""
        if self.tail.n == 0:
            return x_new
        return torch.cat([self.res, x_new.to(self.res.dtype)], dim=2)

    def append(self, x_new: torch.Tensor) -> None:
        self.tail.append(x_new)

    def _keep(self, gp) -> None:
        """Append the packed groups ``gp`` (:class:`methods.groupquant.GroupPacked`) along the
        token axis of its parts."""
        token_axis = 3 if gp.axis == 2 else 2  # keys: [B, H, d, n/G, .]; values: [B, H, n, d/G, .]
        self._meta = (gp.nbits, gp.group, gp.axis, gp.dtype)
        for name in ("codes", "scale", "minimum"):
            buf = self.parts.get(name)
            if buf is None:
                buf = self.parts[name] = Growing(axis=token_axis, min_spare=16)
            buf.append(getattr(gp, name))
        self._packed_bits += gp.bits()

    def flush(self, n_quant_new: int, quantize: Callable) -> torch.Tensor | None:
        """Quantize positions n_quant..n_quant_new-1 (complete groups) and drop them from the tail
        (``quantize(x)`` -> (pack, decoded x), as :func:`methods.groupquant.quantize_dequantize_groups`).
        Returns their decoded form (None when nothing completed)."""
        m = n_quant_new - self.n_quant
        if m <= 0:
            return None
        gp, hat = quantize(self.res.narrow(2, 0, m))
        self._keep(gp)
        self.tail.drop_front(m)
        self.n_quant = n_quant_new
        return hat

    def append_quantized(self, x_new: torch.Tensor, quantize: Callable) -> torch.Tensor:
        """Quantize ``x_new`` on arrival (no full-precision tail); returns its decoded form."""
        gp, hat = quantize(x_new)
        self._keep(gp)
        self.n_quant += x_new.shape[2]
        return hat

    def decoded(self) -> torch.Tensor | None:
        """The quantized positions [B, H, n_quant, d] dequantized from the stored groups (the
        model's dtype), bit for bit what the quantizer returned for them."""
        with decode_ops():
            return self._decoded()

    def _decoded(self) -> torch.Tensor | None:
        if not self.n_quant:
            return None
        from .groupquant import GroupPacked, dequantize_groups

        nbits, group, axis, dtype = self._meta
        codes, scale, minimum = (self.parts[k].data for k in ("codes", "scale", "minimum"))
        if axis == 2:  # keys: groups of tokens per channel, [B, H, d, n/G, G b/8]
            b, h, d = codes.shape[:3]
            shape = (b, h, self.n_quant, d)
        else:  # values: groups of channels per token, [B, H, n, d/G, G b/8]
            b, h, n, ng = codes.shape[:4]
            shape = (b, h, n, ng * group)
        return dequantize_groups(GroupPacked(codes, scale, minimum, nbits, group, axis, shape, dtype))

    def read(self) -> torch.Tensor | None:
        """Every position as a single query at the next position reads it: the dequantized groups,
        then the full-precision tail [B, H, n, d] (a new tensor, or the tail itself)."""
        with decode_ops():
            hat = self._decoded()
            if hat is None:
                return self.res
            if self.res is None or self.tail.n == 0:
                return hat
            return torch.cat([hat, self.res.to(hat.dtype)], dim=2)


class RopeLog:
    """(cos, sin) [B, n, d] of positions 0..n-1 of one sequence, shared by the layer states of its
    pre-RoPE codecs (:func:`log_rope`): every layer of a forward pass sees the same tensors, so one
    copy serves them all. A fused kernel would compute the rotation from the positions instead;
    the harness passes the tables, so they are kept once per sequence."""

    #: held once per sequence for all layers: :func:`kvbench.bench.memory.resident_bytes` reports
    #: it apart from the layers' own bytes (the "scratch" figure)
    shared_by_layers = True

    def __init__(self):
        self.cos = Growing(axis=1, min_spare=16)
        self.sin = Growing(axis=1, min_spare=16)
        self._first = None  # weak reference to the first call's cos
        self._last: tuple | None = None  # (weak reference to the last appended cos, its start)

    @property
    def n(self) -> int:
        return self.cos.n

    def _append(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        start = self.n
        if self._first is None:
            self._first = weakref.ref(cos)
        self.cos.append(cos)
        self.sin.append(sin)
        self._last = (weakref.ref(cos), start)

    def rope(self, start: int, stop: int) -> Rope:
        """The tables of positions start..stop-1."""
        return Rope(self.cos.data[:, start:stop], self.sin.data[:, start:stop])


_LOGS: "weakref.WeakValueDictionary[int, RopeLog]" = weakref.WeakValueDictionary()


def log_rope(log: RopeLog | None, n0: int, rope: Rope) -> RopeLog:
    """The log a layer state holds after a call with the tables ``rope`` of positions n0.. .

    A first call (n0 = 0) shares the log of the states that got the very same cos tensor (the
    layers of one forward pass); later calls append to it, or find the call already there
    (another layer of the same pass appended the same tensor). A state whose next tables differ
    from what its shared log holds (two sequences that started alike) continues on a copy of the
    log's first n0 positions."""
    cos, sin = rope.cos, rope.sin
    t = cos.shape[1]
    if log is None or n0 == 0:
        if n0:
            raise ValueError("a pre-RoPE layer state lost the tables of its earlier positions")
        log = _LOGS.get(id(cos))
        if log is None or log._first() is not cos:
            log = RopeLog()
            log._append(cos, sin)
            _LOGS[id(cos)] = log
        return log
    if log.n == n0:
        log._append(cos, sin)
        return log
    last, start = log._last
    if log.n >= n0 + t and start == n0 and last() is cos:
        return log
    fork = RopeLog()
    fork._append(log.cos.data[:, :n0].clone(), log.sin.data[:, :n0].clone())
    fork._append(cos, sin)
    return fork
