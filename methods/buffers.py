"""Growing cache buffers shared by the layer states.

:class:`Growing` is an append-only working tensor (a decode step does not copy the cache);
:class:`SideStore` is one side (K or V) of a cache stored as a packed quantized prefix followed by a
full-precision tail (KIVI's keys and values, SVDq's values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import held_bits


class Growing:
    """Append-only [B, H, n, d] working tensor with amortized O(1) appends along the token axis
    (12.5 % spare capacity, at least 64 tokens), so a decode step does not copy the whole cache.

    The first append adopts its tensor without copying (a one-pass forward stores its keys as
    they are); the buffer is copied into owned storage before anything writes into it."""

    def __init__(self):
        self._buf: torch.Tensor | None = None
        self._owned = False
        self.n = 0

    def _reserve(self, need: int, like: torch.Tensor) -> None:
        if self._buf is not None and self._owned and need <= self._buf.shape[2]:
            return
        spare = 0 if self._buf is None else max(64, need // 8)
        buf = like.new_empty(like.shape[0], like.shape[1], need + spare, like.shape[3])
        if self._buf is not None:
            buf[:, :, : self.n] = self._buf[:, :, : self.n]
        self._buf, self._owned = buf, True

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[2]
        if self._buf is None:
            self._buf, self._owned, self.n = x, False, t
            return
        self._reserve(self.n + t, x)
        self._buf[:, :, self.n : self.n + t] = x
        self.n += t

    def write(self, start: int, x: torch.Tensor) -> None:
        """Overwrite tokens ``start..start + len(x)`` (already appended) in place. A write that
        replaces the whole adopted tensor adopts ``x`` instead (no copy of what it overwrites)."""
        if not self._owned and start == 0 and x.shape[2] == self.n:
            self._buf = x
            return
        self._reserve(self.n, x)
        self._buf[:, :, start : start + x.shape[2]] = x

    @property
    def data(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[:, :, : self.n]


def row_elements(g: Growing) -> int:
    """Elements per token of a growing buffer (B * H * d)."""
    d = g.data
    return 0 if d is None else d.shape[0] * d.shape[1] * d.shape[3]


@dataclass
class SideStore:
    """One side (K or V) of the cache: packed quantized prefix + full-precision tail.

    ``buf`` holds what a single query at the next position reads, contiguously: the decoded
    quantized prefix (positions < ``n_quant``, a working copy of the packed codes) followed by the
    full-precision tail. A decode step appends its token and, when a group completes, overwrites
    that group with its decoded form: no copy of the cache."""

    packed: list = field(default_factory=list)
    buf: Growing = field(default_factory=Growing)
    n_quant: int = 0
    _packed_bits: int = 0

    @property
    def n(self) -> int:
        return self.buf.n

    @property
    def hat(self) -> torch.Tensor | None:
        """The decoded quantized prefix [B, H, n_quant, d] (a view), None when empty."""
        return None if not self.n_quant else self.buf.data[:, :, : self.n_quant]

    @property
    def res(self) -> torch.Tensor | None:
        """The full-precision tail [B, H, n - n_quant, d] (a view)."""
        return None if self.buf.data is None else self.buf.data[:, :, self.n_quant :]

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
        if self.n == self.n_quant:
            return x_new
        return torch.cat([self.res, x_new.to(self.res.dtype)], dim=2)

    def append(self, x_new: torch.Tensor) -> None:
        self.buf.append(x_new)

    def flush(self, n_quant_new: int, quantize) -> None:
        """Quantize positions n_quant..n_quant_new-1 (complete groups), replacing them in ``buf``
        by their decoded form (``quantize(x)`` -> (pack, decoded x), as
        :func:`methods.groupquant.quantize_dequantize_groups`)."""
        m = n_quant_new - self.n_quant
        if m <= 0:
            return
        x = self.buf.data[:, :, self.n_quant : n_quant_new]
        gp, hat = quantize(x)
        self.packed.append(gp)
        self._packed_bits += gp.bits()
        self.buf.write(self.n_quant, hat)
        self.n_quant = n_quant_new

    def append_quantized(self, x_new: torch.Tensor, quantize) -> None:
        """Quantize ``x_new`` on arrival (no full-precision tail) and append its decoded form."""
        gp, hat = quantize(x_new)
        self.packed.append(gp)
        self._packed_bits += gp.bits()
        self.buf.append(hat)
        self.n_quant += x_new.shape[2]
