"""KVQuant's bit count and budget (Hooper et al., arXiv 2401.18079, App. M; docs/methods.md §14.5,
§14.6, §0.1): an ordinary token's bpd per side, the exact sink tokens' share in a regime, the
predicted measured headline."""

from __future__ import annotations

import torch

from ..base import Regime
from .codec import outlier_level, value_outlier_count


def token_cost(side: str, bits: int, f: float, n: int) -> float:
    """bpd of an ordinary token (§14.5): keys b + [f > 0](32 f + 32/n); values b + 32/n
    + [f > 0](32 f_V + 32/n) with f_V the exact per-token count of :func:`value_outlier_count`."""
    if side == "k":
        return bits + ((32 * f + 32 / n) if f > 0 else 0.0)
    cost = bits + 32 / n
    if f > 0:
        cost += 32 * value_outlier_count(n, outlier_level(f)) / n + 32 / n
    return cost


def sink_share(regime: Regime, sink: int) -> float:
    """Mean over the regime's scored positions of the fraction of the cache held by the first
    ``sink`` tokens: Q-all, positions t = 1..T reading t tokens; prefill, the prompt's prediction at
    P tokens and the D decoded ones at P+1..P+D."""
    if sink <= 0:
        return 0.0
    if regime.kind == "qall":
        lengths = torch.arange(1, regime.tokens + 1, dtype=torch.float64)
    else:
        lengths = torch.arange(regime.tokens, regime.tokens + regime.decode + 1, dtype=torch.float64)
    return float((lengths.clamp(max=sink) / lengths).mean())


def headline(cost: float, sink: int, regime: Regime, budget: str = "measured") -> float:
    """Predicted measured bpd of one side: ``cost`` per ordinary token, 16 for the sink tokens."""
    if budget == "nominal":
        return cost
    return cost + (16.0 - cost) * sink_share(regime, sink)

