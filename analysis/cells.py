"""Table cells: the Table/Column/Cell data model and how one row's runs become a cell.

A stat cell summarizes one metric over the runs (seeds) of a variant: mean ± sample standard
deviation over the ``ok`` runs, the std only when at least two runs have the metric. Run status
overrides the numbers (every run unsupported -> "—", any diverged -> "div.", any failed ->
"fail"); a metric that no run reports is "missing" and is never filled in.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

UNSUPPORTED = "—"
DIVERGED = "div."
FAILED = "fail"
MIXED = "mixed"
MISSING = "missing"
NOT_APPLICABLE = "n/a"

NOTES = {
    UNSUPPORTED: "— = unsupported: the method cannot reach this budget (every run reported "
                 "status `unsupported`).",
    DIVERGED: "div. = diverged: at least one seed diverged (k/n = diverged of all runs); no mean "
              "is shown, since dropping the diverged seeds would flatter the method.",
    FAILED: "fail = at least one run failed (k/n = failed of all runs; see `error` in its "
            "result.json); rerun it before reporting.",
    MIXED: "mixed = some runs ok and some `unsupported` at the same budget (k/n = unsupported of "
           "all runs).",
    NOT_APPLICABLE: "n/a = not applicable: the method does not run this task (listed in "
                    "`unsupported_tasks` of its result.json; SnapKV has no track-A perplexity, "
                    "docs/methods.md §7.4).",
    MISSING: "missing = the metric is not in the result files (task not run); never filled in.",
    "(n=": "(n=k) = only k of the ok runs report this metric; mean ± std over those k.",
}


@dataclass(frozen=True)
class Cell:
    """One table cell: its display text and, for statistics, the numbers behind it."""

    text: str
    mean: float | None = None
    std: float | None = None
    n: int | None = None  # how many runs the mean is over


@dataclass(frozen=True)
class Column:
    """A column: header and kind ("text", "num" right-aligned, "stat" = mean ± std)."""

    header: str
    kind: str = "text"


@dataclass
class Table:
    """A rendered-format-independent table: columns, rows of cells, footnotes."""

    columns: list[Column]
    rows: list[list[Cell]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    group_column: int | None = None  # rows change group when this column's text changes


def _partial(marker: str, k: int, total: int) -> str:
    return marker if k == total else f"{marker} ({k}/{total})"


def status_marker(statuses: list[str]) -> str | None:
    """The marker that replaces a row's numbers, or None when every run is ok."""
    counts = Counter(statuses)
    total = len(statuses)
    if counts["unsupported"] == total:
        return UNSUPPORTED
    if counts["diverged"]:
        return _partial(DIVERGED, counts["diverged"], total)
    if counts["failed"]:
        return _partial(FAILED, counts["failed"], total)
    if counts["ok"] < total:
        return _partial(MIXED, counts["unsupported"], total)
    return None


def format_stat(mean: float, std: float | None, decimals: int) -> str:
    """``"31.17 ± 2.21"``, ``"31.17"`` (no std) or ``"inf"``."""
    if not math.isfinite(mean):
        return str(mean)
    if std is None:
        return f"{mean:.{decimals}f}"
    return f"{mean:.{decimals}f} ± {std:.{decimals}f}"


def stat_cell(statuses: list[str], values: list[float], decimals: int, scale: float = 1.0,
              suffix: str = "") -> Cell:
    """Mean ± sample std of ``values`` (one per run, NaN = metric missing) unless a marker applies.

    ``scale`` multiplies the values (100 for fractions shown as %); ``suffix`` is appended to a
    numeric text (e.g. a footnote mark).
    """
    marker = status_marker(statuses)
    if marker:
        return Cell(marker)
    present = [v * scale for v in values if not math.isnan(v)]
    if not present:
        return Cell(MISSING)
    if all(math.isfinite(v) for v in present):
        mean = statistics.fmean(present)
        std = statistics.stdev(present) if len(present) >= 2 else None
    else:
        mean, std = math.fsum(present) / len(present), None  # inf (or nan) propagates
    text = format_stat(mean, std, decimals)
    if len(present) < len(values):
        text += f" (n={len(present)})"
    return Cell(text + suffix, mean, std, len(present))


def task_of(column: str) -> str:
    """The kvbench task (``tasks=`` entry) a metric column comes from."""
    head = column.split("_", 1)[0]
    # longbench_*, longqa_* (longqa_squad runs inside the longbench task); ruler_*, ruler_wiki_*
    return {"ppl": "ppl", "zeroshot": "zeroshot", "ruler": "ruler"}.get(head, "longbench")


def not_applicable(statuses: list[str], tasks_lists: list[str], column: str) -> bool:
    """True when every ok run lists the column's task as one the method cannot run."""
    task = task_of(column)
    ok = [t for s, t in zip(statuses, tasks_lists) if s == "ok"]
    return bool(ok) and all(task in (t or "").split(",") for t in ok)


def mean_cell(statuses: list[str], values: list[float], decimals: int = 2) -> Cell:
    """Plain mean of a measured quantity over the runs that report it ("—" if all unsupported)."""
    present = [v for v in values if not math.isnan(v)]
    if status_marker(statuses) == UNSUPPORTED:
        return Cell(UNSUPPORTED)
    if not present:
        return Cell(MISSING)
    mean = statistics.fmean(present)
    return Cell(f"{mean:.{decimals}f}", mean, None, len(present))


def count_cell(statuses: list[str]) -> Cell:
    """Number of runs; ``ok/total`` when some runs are not ok."""
    total = len(statuses)
    ok = sum(s == "ok" for s in statuses)
    return Cell(str(total) if ok == total else f"{ok}/{total}", float(ok))


def marker_notes(table: Table) -> list[str]:
    """Footnotes for the markers that occur in the table's cells, in NOTES order."""
    texts = [cell.text for row in table.rows for cell in row]
    return [note for marker, note in NOTES.items()
            if any(t == marker or t.startswith(marker + " ") or
                   (marker == "(n=" and "(n=" in t) for t in texts)]
