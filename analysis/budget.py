"""Measured bpd per task and the † rule: a cell whose measured budget is off its target.

docs/methods.md §0: every task reports one headline, the mean over its scored positions of the
bits the cache held when that prediction was made (PPL track A: every position; zero-shot: the
continuation; track B: the targets; generation: the generated tokens), and stores the
end-of-prefill and end-of-sequence figures beside it. The result's ``bpd`` block holds the convention figure as ``measured_k``/``measured_v``
and, per task, ``by_task.<task>.measured_k``/``measured_v``; tables and plots use those.

The † rule: a cell is marked when its measured bpd of the side(s) the budget is about — bpd_K in
the K-track (V kept at 16 bits), bpd_KV = (bpd_K + bpd_V)/2 in the KV-track (V has its own budget,
or the method evicts tokens) — is more than 2% off the target.

Decisions where docs/methods.md is silent:

- the measured figure of a row is the mean over its ok runs (seeds) that report one;
- a task without its own ``by_task`` entry (result files older than v2, or a task the writer did
  not break out) uses the result's top-level ``measured_k``/``measured_v``;
- FP16 rows (method ``fp16``, or target 16/16) are never marked; rows without a measured figure
  (unsupported, failed) are never marked;
- "2% off" is relative: ``|measured - target| > 0.02 * target`` (exactly 2% is not marked; a
  1e-9 relative slack keeps float rounding of e.g. 0.98 from deciding it).
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from analysis.naming import FP16_BITS

TOLERANCE = 0.02
DAGGER = "†"


def bpd_task_of(column: str) -> str:
    """The ``bpd.by_task`` key of a metric column (``ppl_mean`` -> ``ppl``, ``longqa_squad_f1``
    -> ``longqa_squad``, ``longbench_avg`` -> ``longbench``, ``ruler_wiki_avg`` ->
    ``ruler_wiki``)."""
    for task in ("longqa_squad", "ruler_wiki", "ruler", "longbench", "zeroshot", "ppl"):
        if column == task or column.startswith(task + "_"):
            return task
    return column.split("_", 1)[0]


def is_kv_track(target_v: float) -> bool:
    """True when the budget is about K and V together (V has its own budget, not 16 bits)."""
    return not (target_v is None or math.isnan(target_v) or target_v == FP16_BITS)


def is_fp16(method: str, target_k: float, target_v: float) -> bool:
    """FP16 rows are the baseline: never marked."""
    return method == "fp16" or (target_k == FP16_BITS and target_v == FP16_BITS)


# by_task keys to try per metric task: kvbench runs longqa_squad inside its `longbench` task, and
# files RULER's figure under the task `ruler` whether the metric block is `ruler` or `ruler_wiki`,
# so a writer may file a figure under either name.
TASK_FALLBACKS = {"longqa_squad": ("longqa_squad", "longbench"), "ruler_wiki": ("ruler_wiki", "ruler")}


def task_keys(task: str | None) -> tuple[str, ...]:
    """The ``bpd.by_task`` keys that hold ``task``'s figure, in order of preference."""
    if task is None:
        return ()
    return TASK_FALLBACKS.get(task, (task,))


def has_own_figure(runs: pd.DataFrame, task: str | None) -> bool:
    """True when some run breaks ``task``'s measured bpd out in ``bpd.by_task``."""
    return any(f"bpd.by_task.{key}.measured_k" in runs.columns
               and runs[f"bpd.by_task.{key}.measured_k"].notna().any() for key in task_keys(task))


def _as_float(value) -> float:
    """A number as float; anything else (None, text) as NaN."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _per_run(runs: pd.DataFrame, task: str | None, side: str) -> list[float]:
    """Measured bpd of one side (``k``/``v``) per run: the task's figure, else the top level."""
    values = [_as_float(v) for v in runs[f"measured_{side}"]]
    for key in reversed(task_keys(task)):  # the preferred key is applied last, so it wins
        col = f"bpd.by_task.{key}.measured_{side}"
        if col in runs.columns:
            own = [_as_float(v) for v in runs[col]]
            values = [t if math.isnan(o) else o for o, t in zip(own, values)]
    return values


def measured_sides(runs: pd.DataFrame, task: str | None = None) -> tuple[pd.Series, pd.Series]:
    """Per-run measured (bpd_K, bpd_V) for ``task`` (top-level figure when None or absent)."""
    k, v = _per_run(runs, task, "k"), _per_run(runs, task, "v")
    return (pd.Series(k, index=runs.index, dtype=float),
            pd.Series(v, index=runs.index, dtype=float))


def budget_figure(mk: float, mv: float, target_v: float) -> float:
    """The measured figure the budget is about: bpd_K (K-track) or bpd_KV (KV-track)."""
    return (mk + mv) / 2 if is_kv_track(target_v) else mk


def budget_target(target_k: float, target_v: float) -> float:
    """The target of that figure: the K budget, or (K + V)/2 in the KV-track."""
    return (target_k + target_v) / 2 if is_kv_track(target_v) else target_k


def off_target(measured: float, target: float, tolerance: float = TOLERANCE) -> bool:
    """True when ``measured`` is more than ``tolerance`` (relative) away from ``target``."""
    if not (math.isfinite(measured) and math.isfinite(target)) or target <= 0:
        return False
    return abs(measured - target) > tolerance * target * (1 + 1e-9)  # exactly 2% is within


def row_measured(runs: pd.DataFrame, task: str | None = None) -> float:
    """Mean over the ok runs of the budget's measured figure (NaN when none reports one)."""
    mk, mv = measured_sides(runs, task)
    ok = runs["status"] == "ok"
    target_v = float(runs.iloc[0]["target_v"])
    values = [budget_figure(k, v, target_v) for k, v in zip(mk[ok], mv[ok])]
    values = [x for x in values if not math.isnan(x)]
    return statistics.fmean(values) if values else math.nan


def row_mark(runs: pd.DataFrame, task: str | None = None) -> tuple[bool, float]:
    """(marked, measured figure) of one table row (the runs of a variant) for ``task``."""
    first = runs.iloc[0]
    measured = row_measured(runs, task)
    if is_fp16(first.method, float(first.target_k), float(first.target_v)):
        return False, measured
    target = budget_target(float(first.target_k), float(first.target_v))
    return off_target(measured, target), measured


def side_label(target_v: float) -> str:
    """``"bpd_K"`` (K-track) or ``"bpd_KV"`` (KV-track)."""
    return "bpd_KV" if is_kv_track(target_v) else "bpd_K"


def dagger_note(marked: list[str]) -> str:
    """The table note explaining † and listing the measured figures of the marked cells."""
    return (f"{DAGGER} = the measured bpd (headline figure, docs/methods.md §0) is more than "
            f"{TOLERANCE:.0%} off the target: bpd_K in the K-track (V at 16 bits), bpd_KV = "
            "(bpd_K + bpd_V)/2 in the KV-track. On the bpd column it concerns the meas. columns "
            "(the result's headline figure); on a metric it concerns the figure of that task. "
            "Measured (mean over seeds): " + "; ".join(marked) + ".")
