"""KVQuant's bit count and budget (Hooper et al., arXiv 2401.18079, App. M; docs/methods.md §14.5,
§14.6, §0.1): an ordinary token's bpd per side, the exact sink tokens' share in a regime, the
predicted measured headline, and the configurations under the budget's ceiling in the fit's order
of preference (the paper's presets first)."""

from __future__ import annotations

import torch

from ..base import Regime
from ..budget import spread, under_ceiling
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



# ---- the configurations a fit chooses among (docs/methods.md §0.1, §14.6) -------------------

#: outlier fractions f per side the fit and the knob search consider (the paper's 1 % among them)
OUTLIER_GRID = (0.0, 0.005, 0.01, 0.02)
#: exact first tokens (attention sink) the fit considers: §14.3's 1 first
SINK_GRID = (1, 0)
#: the paper's settings (Table 18: nuq4/3/2-1 %, §3.5's sink), richest first
PRESETS = {
    "nuq4-1%": {"bits": 4, "outliers": 0.01, "sink": 1},
    "nuq3-1%": {"bits": 3, "outliers": 0.01, "sink": 1},
    "nuq2-1%": {"bits": 2, "outliers": 0.01, "sink": 1},
}
#: the knobs of one configuration (what ``KVQuant.use_knobs`` takes)
KNOBS = ("bits", "outliers", "v_bits", "v_outliers", "sink")


def configurations(targets: dict, grids: dict, sinks: tuple, n: int, regime: Regime, budget: str,
                   target_kv: float | None = None) -> list[dict]:
    """Every configuration over ``grids`` ({side: (bit widths, outlier fractions)} for the quantized
    sides "k", "v") and ``sinks`` whose predicted headline (:func:`headline`) is at most 1.02 x its
    side's target (``targets[side]``; None: run as set, no check), or with ``target_kv`` whose two
    sides' mean is at most 1.02 x ``target_kv`` (the KV-track's ``joint_kv``). Each: the
    :data:`KNOBS` (None for an exact side) and ``predicted_bpd_k``/``predicted_bpd_v``."""
    out = []
    for sink in sinks:
        points = {side: [(b, f, headline(token_cost(side, b, f, n), sink, regime, budget))
                         for b in grids[side][0] for f in grids[side][1]] for side in grids}
        for k in points.get("k", [None]):
            for v in points.get("v", [None]):
                pk, pv = (16.0 if k is None else k[2]), (16.0 if v is None else v[2])
                if target_kv is not None:
                    if not under_ceiling((pk + pv) / 2, target_kv):
                        continue
                elif any(p is not None and targets.get(side) is not None and not under_ceiling(p[2], targets[side])
                         for side, p in (("k", k), ("v", v))):
                    continue
                out.append({"bits": k and k[0], "outliers": k and k[1], "v_bits": v and v[0],
                            "v_outliers": v and v[1], "sink": sink, "predicted_bpd_k": pk, "predicted_bpd_v": pv})
    return out


def knob_options(config: dict) -> dict:
    """The :data:`KNOBS` of a configuration (without its predictions)."""
    return {k: config[k] for k in KNOBS}


def preset_knobs(name: str, values: bool) -> dict:
    """A :data:`PRESETS` entry as :data:`KNOBS` (values alike when ``values``, else exact)."""
    p = PRESETS[name]
    return {"bits": p["bits"], "outliers": p["outliers"], "v_bits": p["bits"] if values else None,
            "v_outliers": p["outliers"] if values else None, "sink": p["sink"]}


def preferred(configs: list[dict], limit: int | None = None) -> list[dict]:
    """``configs`` in the fit's order of preference: the richest paper preset among them first
    (:data:`PRESETS`), then one configuration per (key bits, value bits) in turn, the most bits
    first (:func:`methods.budget.spread`), each family's configurations by predicted bits spent
    (most first), then with the sink first; at most ``limit``."""
    values = any(c["v_bits"] is not None for c in configs)
    options = [knob_options(c) for c in configs]
    first = next((i for name in PRESETS for i, o in enumerate(options) if o == preset_knobs(name, values)), None)
    ranked = sorted(range(len(configs)), reverse=True,
                    key=lambda i: (configs[i]["predicted_bpd_k"] + configs[i]["predicted_bpd_v"], configs[i]["sink"]))
    ordered = spread(ranked, lambda i: (configs[i]["bits"] or 0, configs[i]["v_bits"] or 0), limit, first=first)
    return [configs[i] for i in ordered]
