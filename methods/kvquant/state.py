"""KVQuant's layer state (docs/methods.md §14.4-14.5): the shared codec state whose reads are
counted exactly per token, since outlier counts vary from token to token."""

from __future__ import annotations

import torch

from ..bookkeeping import host_ops
from ..codec_state import CodecLayerState


class KVQuantLayerState(CodecLayerState):
    """:class:`methods.codec_state.CodecLayerState` whose reads are exact per token: with outliers
    the bits differ from token to token, so query i of a chunk reads the bits of the tokens up to
    its own (:attr:`KVQuantPacked.token_bits`), not the chunk's average."""

    def _call_reads(self, prior_k, prior_v, entries_k, entries_v):
        return held_per_token(prior_k, entries_k), held_per_token(prior_v, entries_v)


def held_per_token(prior: float, entries: list) -> torch.Tensor:
    """Bits held after each new token, float64 CPU: ``prior`` plus the cumulative per-token bits of
    the (codec, packed, tokens) entries of one call (exact tokens cost the same each)."""
    with host_ops():
        parts = []
        for codec, packed, n in entries:
            per = getattr(packed, "token_bits", None)
            if per is None:
                per = torch.full((n,), codec.bits(packed) / n, dtype=torch.float64)
            parts.append(per)
        held = parts[0] if len(parts) == 1 else torch.cat(parts)  # a decode step: one part, no cat
        return held.cumsum(0).add_(prior)

