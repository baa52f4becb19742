"""Measured bpd per task and the marks of a cell against its target: † over, ‡ well under.

docs/methods.md §0: every task reports one headline, the mean over its scored positions of the
bits the cache held when that prediction was made (PPL track A: every position; zero-shot: the
continuation; track B: the targets; generation: the generated tokens), and stores the
end-of-prefill and end-of-sequence figures beside it. The result's ``bpd`` block holds the convention figure as ``measured_k``/``measured_v``
and the end-of-sequence figure as ``end_k``/``end_v``, and per task ``by_task.<task>.measured_k``,
``end_k``, ...; tables and plots use those.

The marks (docs/methods.md §0: the budget is a ceiling): a cell is marked † when its measured bpd
of the side(s) the budget is about — bpd_K in the K-track (V kept at 16 bits), bpd_KV =
(bpd_K + bpd_V)/2 in the KV-track (V has its own budget, or the method evicts tokens) — is more than
2% over the target (not admissible), and ‡ when it is more than 5% under it (admissible, but the
row spends fewer bits than its column says).

Decisions where docs/methods.md is silent:

- the measured figure of a row is the mean over its ok runs (seeds) that report one;
- a task without its own ``by_task`` entry (result files older than v2, or a task the writer did
  not break out) uses the result's top-level ``measured_k``/``measured_v`` (``end_k``/``end_v``);
- FP16 rows (method ``fp16``, or target 16/16) are never marked; rows without a measured figure
  (unsupported, failed) are never marked;
- "2% over" and "5% under" are relative: ``measured - target > 0.02 * target``, ``target -
  measured > 0.05 * target`` (exactly 2% or 5% is not marked; a 1e-9 relative slack keeps float
  rounding of e.g. 1.02 from deciding it).
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from analysis.naming import FP16_BITS

TOLERANCE = 0.02  # over the target by more: †
UNDER_TOLERANCE = 0.05  # under the target by more: ‡
DAGGER = "†"
UNDER = "‡"
#: the top-level ``bpd`` columns of each figure (``by_task`` uses the same names)
FIGURES = {"measured": "measured", "end": "bpd.end"}


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


def _per_run(runs: pd.DataFrame, task: str | None, side: str, figure: str) -> list[float]:
    """One figure (``measured``/``end``) of one side (``k``/``v``) per run: the task's figure,
    else the top level (NaN where neither is recorded)."""
    top = f"{FIGURES[figure]}_{side}"
    values = [_as_float(v) for v in runs[top]] if top in runs.columns else [math.nan] * len(runs)
    for key in reversed(task_keys(task)):  # the preferred key is applied last, so it wins
        col = f"bpd.by_task.{key}.{figure}_{side}"
        if col in runs.columns:
            own = [_as_float(v) for v in runs[col]]
            values = [t if math.isnan(o) else o for o, t in zip(own, values)]
    return values


def measured_sides(runs: pd.DataFrame, task: str | None = None, figure: str = "measured"
                   ) -> tuple[pd.Series, pd.Series]:
    """Per-run (bpd_K, bpd_V) for ``task`` (top-level figure when None or absent): the headline
    (``figure="measured"``) or the end-of-sequence figure (``"end"``)."""
    k, v = _per_run(runs, task, "k", figure), _per_run(runs, task, "v", figure)
    return (pd.Series(k, index=runs.index, dtype=float),
            pd.Series(v, index=runs.index, dtype=float))


def budget_figure(mk: float, mv: float, target_v: float) -> float:
    """The measured figure the budget is about: bpd_K (K-track) or bpd_KV (KV-track)."""
    return (mk + mv) / 2 if is_kv_track(target_v) else mk


def budget_target(target_k: float, target_v: float) -> float:
    """The target of that figure: the K budget, or (K + V)/2 in the KV-track."""
    return (target_k + target_v) / 2 if is_kv_track(target_v) else target_k


def over_target(measured: float, target: float, tolerance: float = TOLERANCE) -> bool:
    """True when ``measured`` is more than ``tolerance`` (relative) over ``target``: not
    admissible (the budget is a ceiling)."""
    if not (math.isfinite(measured) and math.isfinite(target)) or target <= 0:
        return False
    return measured - target > tolerance * target * (1 + 1e-9)  # exactly 2% is within


def under_target(measured: float, target: float, tolerance: float = UNDER_TOLERANCE) -> bool:
    """True when ``measured`` is more than ``tolerance`` (relative) under ``target``."""
    if not (math.isfinite(measured) and math.isfinite(target)) or target <= 0:
        return False
    return target - measured > tolerance * target * (1 + 1e-9)  # exactly 5% is not marked


def budget_mark(measured: float, target: float) -> str:
    """``"†"`` (over the target by more than 2%), ``"‡"`` (under it by more than 5%) or ``""``."""
    if over_target(measured, target):
        return DAGGER
    return UNDER if under_target(measured, target) else ""


def row_measured(runs: pd.DataFrame, task: str | None = None, figure: str = "measured") -> float:
    """Mean over the ok runs of the budget's figure, the headline or the end-of-sequence one
    (NaN when none reports one)."""
    mk, mv = measured_sides(runs, task, figure)
    ok = runs["status"] == "ok"
    target_v = float(runs.iloc[0]["target_v"])
    values = [budget_figure(k, v, target_v) for k, v in zip(mk[ok], mv[ok])]
    values = [x for x in values if not math.isnan(x)]
    return statistics.fmean(values) if values else math.nan


def row_mark(runs: pd.DataFrame, task: str | None = None) -> tuple[str, float]:
    """(mark, measured figure) of one table row (the runs of a variant) for ``task``: the mark is
    :func:`budget_mark`'s, ``""`` for FP16."""
    first = runs.iloc[0]
    measured = row_measured(runs, task)
    if is_fp16(first.method, float(first.target_k), float(first.target_v)):
        return "", measured
    target = budget_target(float(first.target_k), float(first.target_v))
    return budget_mark(measured, target), measured


def side_label(target_v: float) -> str:
    """``"bpd_K"`` (K-track) or ``"bpd_KV"`` (KV-track)."""
    return "bpd_KV" if is_kv_track(target_v) else "bpd_K"


MARK_WORDS = {
    DAGGER: f"more than {TOLERANCE:.0%} over the target (the budget is a ceiling: the cell is not "
            "at its budget)",
    UNDER: f"more than {UNDER_TOLERANCE:.0%} under the target (within the budget, but the cell "
           "spends fewer bits than its column says)",
}


def mark_note(mark: str, marked: list[str]) -> str:
    """The table note explaining ``mark`` (†, ‡) and listing the measured figures of its cells."""
    return (f"{mark} = the measured bpd (headline figure, docs/methods.md §0) is "
            f"{MARK_WORDS[mark]}: bpd_K in the K-track (V at 16 bits), bpd_KV = "
            "(bpd_K + bpd_V)/2 in the KV-track. On the bpd column it concerns the meas. columns "
            "(the result's headline figure); on a metric it concerns the figure of that task. "
            "Measured (mean over seeds): " + "; ".join(marked) + ".")
