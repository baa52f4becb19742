"""Bookkeeping on host tensors: the bits each query read are float64 CPU tensors whatever
the model's device (``LayerState.read_bits``), so their arithmetic launches no kernel on a GPU.
And the profiler range around a layer state's decoding of its stored cache, so that an op count
can tell the fixed cost of reading the codes from the work of the new tokens.
"""

from __future__ import annotations

import contextlib

import torch


#: the profiler range around bookkeeping on host tensors; ``kvbench.bench.opcount`` counts the ops
#: inside it apart, as host ops
HOST_RANGE = "kvbench.host"


def host_ops():
    """``with host_ops():`` marks bookkeeping on CPU tensors for the op count (:data:`HOST_RANGE`);
    a no-op outside a profiler (a range costs tens of microseconds, twice per layer per pass)."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(HOST_RANGE)


def one_read(x: float) -> torch.Tensor:
    """The bits one query read as a float64 CPU tensor [1] (a decode step: no tensor arithmetic)."""
    return torch.tensor([x], dtype=torch.float64)


#: the profiler range around a layer state's decode of its whole stored cache (what attention
#: reads after the first call, docs/design.md §2): a fixed number of ops per layer and step, whatever
#: the cache length
DECODE_RANGE = "kvbench.decode"


def decode_ops():
    """``with decode_ops():`` marks the decoding of a stored cache for an op count
    (:data:`DECODE_RANGE`); a no-op outside a profiler."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(DECODE_RANGE)
