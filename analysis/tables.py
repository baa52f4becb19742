"""The paper's two tables built from the runs frame: the main table and the ablation table.

Both return a format-independent ``cells.Table``; ``render`` turns it into Markdown, LaTeX or CSV.
Without options, the PPL datasets and the long-context metric are the ones the table's runs have
(analysis.defaults); every cell whose measured bpd is more than 2% over its target carries a †, more
than 5% under it a ‡ (analysis.budget), and the notes list the measured figures. The main table
shows beside each headline bpd the end-of-sequence figure and the static bytes
(analysis.accounting, docs/methods.md §0).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import pandas as pd

from analysis.accounting import pair_cell, static_cells, static_note
from analysis.budget import (
    DAGGER, UNDER, bpd_task_of, has_own_figure, mark_note, measured_sides, row_mark, side_label,
)
from analysis.cells import (
    NOT_APPLICABLE, Cell, Column, Table, count_cell, marker_notes, mean_cell, not_applicable,
    stat_cell, status_marker,
)
from analysis.defaults import (
    LONGBENCH_8SET, PplChoice, best_ppl_dataset, bpd_convention_note, choose_long_metric,
    choose_ppl_datasets, left_out_text, long_header, long_note, ppl_protocol, static_bytes_note,
    zeroshot_note,
)
from analysis.derived import add_ppl_summaries
from analysis.load import NoResultsError, warn
from analysis.naming import (
    ABLATION_METHOD_ORDER, FP16_BITS, METHOD_ORDER, MODEL_ORDER, fmt_bpd, fmt_g, method_name,
    model_name, order_key, ppl_dataset_name,
)
from analysis.select import (
    add_variants, describe_options, deviations, distinguishing_options, drop_duplicate_seeds,
    experiment_of, is_split, line_label, options_sort_key, select_ablation, select_main,
)

PARTIAL_MARK = " *"
#: the main table's columns of the two accountings (docs/methods.md §0)
ACCOUNTING_HEADERS = ("bpd_K meas. / end", "bpd_KV meas. / end", "static MiB", "static < 1% from T·B")
TASK_LABELS = {"ppl": "PPL", "zeroshot": "zero-shot", "longbench": "LongBench",
               "longqa_squad": "longqa_squad", "ruler": "RULER", "ruler_wiki": "ruler_wiki"}


def _restrict(frame: pd.DataFrame, experiment: str | None) -> pd.DataFrame:
    """Only the runs with ``config.experiment == experiment`` (all runs when None)."""
    if experiment is None:
        return frame
    chosen = frame[experiment_of(frame) == experiment]
    if chosen.empty:
        raise NoResultsError(f"no runs with config.experiment={experiment}")
    return chosen


def _column(frame: pd.DataFrame, name: str) -> list[float]:
    """A metric column as floats (all NaN when no run has it)."""
    if name not in frame.columns:
        return [math.nan] * len(frame)
    return [float(v) for v in frame[name]]


def _metric_cell(runs: pd.DataFrame, statuses: list[str], column: str, decimals: int,
                 **kwargs) -> Cell:
    """``stat_cell`` of a metric column, or "n/a" when every run is ok and the method cannot run
    the column's task (a status marker such as "fail" takes precedence)."""
    tasks = list(runs["not_applicable"]) if "not_applicable" in runs.columns else [""] * len(runs)
    if status_marker(statuses) is None and not_applicable(statuses, tasks, column):
        return Cell(NOT_APPLICABLE)
    return stat_cell(statuses, _column(runs, column), decimals, **kwargs)


def _check_metric(frame: pd.DataFrame, name: str, hint: str) -> None:
    """Warn when no run reports ``name`` (its column will read "missing")."""
    if name not in frame.columns or frame[name].isna().all():
        warn(f"no run reports metric '{name}' ({hint})")


def _reported(frame: pd.DataFrame, name: str) -> bool:
    """True when some run of the frame reports the metric ``name``."""
    return name in frame.columns and bool(frame[name].notna().any())


def iter_variants(frame: pd.DataFrame, key) -> Iterator[tuple[dict, pd.DataFrame]]:
    """(options, runs) per variant, ordered by ``key(first run, options)``."""
    groups = [(sub.iloc[0]["options"], sub) for _, sub in frame.groupby("variant", sort=False)]
    yield from sorted(groups, key=lambda g: key(g[1].iloc[0], g[0]))


def labelled_variants(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(row label, runs) per variant in the main table's order: model, method (naming.METHOD_ORDER),
    target budget, options; the label names the options that tell apart the variants of one
    (model, method, budget)."""
    def sort_key(run, options):
        return (order_key(run.model, MODEL_ORDER), order_key(run.method, METHOD_ORDER),
                _sortable(run.target_k), _sortable(run.target_v), options_sort_key(options))

    variants = list(iter_variants(frame, sort_key))
    siblings: dict[tuple, list[dict]] = {}
    for options, runs in variants:
        siblings.setdefault(_budget_key(runs.iloc[0]), []).append(options)
    return [(line_label(runs.iloc[0].method, options,
                        distinguishing_options(siblings[_budget_key(runs.iloc[0])])), runs)
            for options, runs in variants]


def _sortable(x: float) -> float:
    """NaN-safe sort value (a missing budget sorts last)."""
    return math.inf if x is None or math.isnan(x) else x


def _budget_key(run: pd.Series) -> tuple:
    """(model, method, target K, target V) of a run: the rows a variant label must tell apart."""
    return (run.model, run.method, _sortable(run.target_k), _sortable(run.target_v))


def _budget_text(target_k: float, target_v: float) -> str:
    """``"1.0"`` for a K-only budget, ``"1.0, 4.0"`` when V has its own budget."""
    if is_split(target_v):
        return f"{fmt_bpd(target_k)}, {fmt_bpd(target_v)}"
    return fmt_bpd(target_k)


# ---------------------------------------------------------------- † and ‡ marks

def _with_mark(cell: Cell, mark: str) -> Cell:
    """The cell with ``mark`` appended to its number (markers such as "—" or "fail" stay as they
    are)."""
    if cell.mean is None or not mark:
        return cell
    return Cell(cell.text + mark, cell.mean, cell.std, cell.n)


@dataclass
class MarkLog:
    """The marked rows of a table and their measured figures, for the † and ‡ notes."""

    entries: dict[str, list[str]] = field(default_factory=lambda: {DAGGER: [], UNDER: []})

    def mark_row(self, row_name: str, runs: pd.DataFrame,
                 cells: dict[str, Cell]) -> tuple[str, dict[str, Cell]]:
        """Mark the row's metric cells (by task) and give the headline figure's mark.

        ``cells`` maps metric column -> its cell; returns (headline mark or "", cells with marks).
        """
        headline, figure = row_mark(runs)
        side = side_label(float(runs.iloc[0].target_v))
        parts: dict[str, list[str]] = {DAGGER: [], UNDER: []}
        if headline:
            parts[headline].append(f"{side} {figure:.2f} (meas.)")
        out, seen = {}, set()
        for column, cell in cells.items():
            task = bpd_task_of(column)
            mark, value = row_mark(runs, task)
            own = has_own_figure(runs, task)
            if mark and cell.mean is not None:
                cell = _with_mark(cell, mark)
                same = headline == mark and f"{value:.2f}" == f"{figure:.2f}"
                if task not in seen and not same:
                    name = TASK_LABELS.get(task, task) if own else side
                    parts[mark].append(f"{name} {value:.2f}")
                seen.add(task)
            out[column] = cell
        for mark, listed in parts.items():
            if listed:
                self.entries[mark].append(f"{row_name}: " + ", ".join(listed))
        return headline, out

    def notes(self) -> list[str]:
        return [mark_note(mark, listed) for mark, listed in self.entries.items() if listed]


def append_budget_notes(table: Table, frame: pd.DataFrame, marks: MarkLog,
                        static_column: bool = False) -> None:
    """The notes every table ends its budget notes with: the measured-bpd convention of the
    runs, the static bytes (a list per method, or what the static columns say when the table has
    them), the † and ‡ lists and what the table's markers ("—", "fail", ...) mean."""
    convention = bpd_convention_note(frame, end_shown=static_column)
    if convention:
        table.notes.append(convention)
    if static_column:
        shown = [i for i, c in enumerate(table.columns) if c.header in ACCOUNTING_HEADERS]
        table.notes.append(static_note(any(row[i].text == "?" or row[i].text.endswith(" / ?")
                                           for row in table.rows for i in shown)))
    else:
        static = static_bytes_note(frame)
        if static:
            table.notes.append(static)
    table.notes.extend(marks.notes())
    table.notes.extend(marker_notes(table))


# ---------------------------------------------------------------- PPL columns

def _resolve_ppl(frame: pd.DataFrame, datasets: Sequence[str] | None,
                 partial: bool) -> tuple[list[str], bool, PplChoice | None]:
    """(datasets, partial, the automatic choice or None when the caller named the datasets)."""
    if datasets is not None:
        return list(datasets), partial, None
    choice = choose_ppl_datasets(frame)
    return choice.datasets, partial or choice.partial, choice


def _ppl_note(datasets: list[str], partial: bool, used: set[str], protocol: str,
              choice: PplChoice | None) -> str:
    names = ", ".join(datasets)
    chosen = ("; the datasets every run with PPL reports, --ppl-datasets overrides"
              if choice is not None and not choice.partial else "")
    if len(datasets) == 1 and not partial:
        note = f"PPL = perplexity on {datasets[0]} ({protocol}{chosen})."
    else:
        note = (f"PPL arith. mean = arithmetic mean of each run's PPL over {names} (the seed's "
                "convention, dominated by the largest PPL); geo. mean = geometric mean over the "
                f"same datasets ({protocol}{chosen}).")
    if choice is not None and choice.partial:
        note += " No dataset is reported by every run that has PPL."
    if partial:
        subsets = sorted(u for u in used if u and u != ",".join(datasets))
        if subsets:
            note += (" * = mean over the datasets present only (--ppl-partial): "
                     + "; ".join(s.replace(",", ", ") for s in subsets) + ".")
    elif choice is None and len(datasets) > 1:
        note += (" A run missing one of them has no PPL mean (see `--ppl-datasets`, "
                 "`--ppl-partial`).")
    if choice is not None:
        note += left_out_text(choice)
    return note


def _ppl_columns(datasets: list[str], partial: bool) -> list[tuple[Column, str]]:
    """(column, metric) of the PPL columns: one for a single dataset, arith. + geo. otherwise."""
    if len(datasets) == 1 and not partial:
        return [(Column(f"{ppl_dataset_name(datasets[0])} PPL ↓", "stat"), "ppl_mean")]
    return [(Column("PPL arith. mean ↓", "stat"), "ppl_mean"),
            (Column("PPL geo. mean ↓", "stat"), "ppl_gmean")]


def _resolve_long(frame: pd.DataFrame, metric: str | None) -> tuple[str | None, list[str], bool]:
    """(long-context column, other candidates seen, chosen automatically)."""
    if metric is not None:
        return metric, [], False
    choice = choose_long_metric(frame)
    return choice.column, choice.others, True


def _long_column_header(metric: str) -> str:
    return f"{long_header(metric)} ↑"


# ---------------------------------------------------------------- main table

def main_table(frame: pd.DataFrame, ppl_datasets: Sequence[str] | None = None,
               ppl_partial: bool = False, longbench_metric: str | None = None,
               experiment: str | None = None) -> Table:
    """The main table: model × method × target bpd -> PPL, zero-shot average, long-context F1.

    Rows are grouped by model, then method (naming.METHOD_ORDER), then target budget; runs that
    differ in other method options become separate rows labelled with those options. Without
    ``experiment`` the ablation runs (tagged or with non-default c2/rotation) are left out.
    ``ppl_datasets`` / ``longbench_metric`` None: the ones the table's runs have
    (analysis.defaults); a task no run reports gets no column (named in a note).
    """
    frame = add_variants(frame)
    if experiment is None:
        frame, excluded = select_main(frame)
    else:
        frame, excluded = _restrict(frame, experiment), 0
    if frame.empty:
        raise NoResultsError("no runs for the main table (all are ablation runs)")
    frame = drop_duplicate_seeds(frame)

    datasets, partial, choice = _resolve_ppl(frame, ppl_datasets, ppl_partial)
    if datasets:
        frame = add_ppl_summaries(frame, datasets, partial)
    long_metric, long_others, long_auto = _resolve_long(frame, longbench_metric)
    if not long_auto:
        _check_metric(frame, long_metric, "choose another with --longbench-metric")
    with_zeroshot = _reported(frame, "zeroshot_avg")

    metrics: list[tuple[Column, str, int, float]] = []  # column, metric, decimals, scale
    metrics += [(c, m, 2, 1.0) for c, m in (_ppl_columns(datasets, partial) if datasets else [])]
    if with_zeroshot:
        metrics.append((Column("Zero-shot avg (%) ↑", "stat"), "zeroshot_avg", 1, 100.0))
    if long_metric is not None:
        metrics.append((Column(_long_column_header(long_metric), "stat"), long_metric, 2, 1.0))
    if long_auto and long_metric == "longbench_avg" and LONGBENCH_8SET in long_others:
        long_others = [c for c in long_others if c != LONGBENCH_8SET]  # §9.3: report it too
        metrics.append((Column(_long_column_header(LONGBENCH_8SET), "stat"), LONGBENCH_8SET, 2,
                        1.0))
    table = Table(columns=[
        Column("Model"), Column("Method"), Column("bpd"),
        *(Column(header, "num") for header in ACCOUNTING_HEADERS),
        *(c for c, *_ in metrics), Column("n", "num"),
    ], group_column=0)

    full = ",".join(datasets)
    marks = MarkLog()
    for label, runs in labelled_variants(frame):
        first = runs.iloc[0]
        statuses = list(runs["status"])
        ok_used = {u for s, u in zip(statuses, runs["ppl_used"]) if s == "ok"} \
            if datasets else set()
        mark = PARTIAL_MARK if partial and any(u != full for u in ok_used) else ""
        cells = {}
        for _, metric, decimals, scale in metrics:
            suffix = mark if metric.startswith("ppl_") else ""
            cells[metric] = _metric_cell(runs, statuses, metric, decimals, scale=scale,
                                         suffix=suffix)
        budget = _budget_text(first.target_k, first.target_v)
        headline, cells = marks.mark_row(
            f"{model_name(first.model)} {label} at {budget}", runs, cells)
        end_k, end_v = (list(s) for s in measured_sides(runs, figure="end"))
        table.rows.append([
            Cell(model_name(first.model)), Cell(label), Cell(budget + headline),
            pair_cell(statuses, _column(runs, "measured_k"), end_k),
            pair_cell(statuses, _column(runs, "bpd_kv"), [(k + v) / 2 for k, v in zip(end_k, end_v)]),
            *static_cells(statuses, first.model, _column(runs, "static_bytes"), end_k, end_v),
            *(cells[m] for _, m, *_ in metrics),
            count_cell(statuses),
        ])

    table.notes.append(
        "Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total "
        "when some are not ok. bpd = target bits per K element with V at 16 (K, V when V has its "
        "own budget); meas. = measured, the mean over the scored positions (the ranking figure, "
        "docs/methods.md §0); end = end of sequence, what the cache holds after the last scored "
        "position (its peak memory); both means over runs; bpd_KV = (bpd_K + bpd_V)/2.")
    if datasets:
        table.notes.append(_ppl_note(datasets, partial, set(frame["ppl_used"]),
                                     ppl_protocol(frame, datasets), choice))
    if with_zeroshot:
        table.notes.append(zeroshot_note(frame))
    if long_metric is not None:
        table.notes.append(long_note(frame, long_metric, long_others))
    if any(m == LONGBENCH_8SET for _, m, *_ in metrics) and long_metric != LONGBENCH_8SET:
        table.notes.append(long_note(frame, LONGBENCH_8SET))
    append_budget_notes(table, frame, marks, static_column=True)
    absent = [name for name, present in (("PPL", bool(datasets)), ("zero-shot", with_zeroshot),
                                         ("long-context", long_metric is not None))
              if not present]
    if absent:
        table.notes.append("No column for " + ", ".join(absent)
                           + ": no run of this table reports it (task not run).")
    if excluded:
        table.notes.append(f"{excluded} ablation run(s) (experiment=ablation, non-default "
                           "c2/rotation, or cobra_plus with method.ablate) are left out; see "
                           "`python -m analysis ablation`.")
    return table


# ---------------------------------------------------------------- ablation table

#: cobra_plus ablations that switch on a part the defaults leave off (methods/cobra_plus.py ABLATIONS)
ADDED_PARTS = {"sensitivity": "sensitivity", "step": "calibrated step"}


def _deviation_words(method: str, devs: dict) -> list[str]:
    """``{"c2": False}`` -> ``["w/o C2"]``; ``{"rotation": "none"}`` -> ``["w/o Hadamard"]``."""
    words = []
    for key, value in devs.items():
        if key == "c2":
            words.append("w/o C2" if value in (False, None, "none") else f"C2={value}")
        elif key == "rotation":
            if value in (None, False, "none"):
                words.append("w/o Hadamard")
            elif value == "hadamard":
                words.append("+ Hadamard")
            else:
                words.append(f"rotation={value}")
        elif key == "ablate":  # cobra_plus: the part removed; the parts off by default are added
            words.append(f"+ {ADDED_PARTS[value]}" if value in ADDED_PARTS else f"w/o {value}")
        else:
            words.append(f"{key}={value}")
    return words


#: (header, column, cached) of the ablation table's cost columns, shown when some run reports
#: them; ``cached``: a 0 means the step's result was found in $KVBENCH_CACHE (the allocation is
#: never cached: every run does it)
TIME_COLUMNS = [("alloc. s", "timings.allocate_s", False), ("calib. s", "timings.calibrate_s", True),
                ("sens. s", "timings.sensitivity_s", True)]


def _time_cell(runs: pd.DataFrame, column: str, cached: bool) -> Cell:
    """Mean wall time over the runs that spent it (with ``cached``, a 0 = found in the cache is
    left out of the mean); "none" where no run of the row has the step (e.g. no
    layer-sensitivity passes)."""
    values = [] if column not in runs.columns else [v for v in _column(runs, column) if not math.isnan(v)]
    if not values:
        return Cell("none")
    if cached:
        if not any(v > 0 for v in values):
            return Cell("cached")
        values = [v for v in values if v > 0]
    mean = statistics.fmean(values)
    return Cell(f"{mean:.2f}" if mean < 10 else f"{mean:.0f}", mean, None, len(values))


def ablation_label(method: str, target_k: float, target_v: float, options: dict) -> str:
    """Row label in the seed's style.

    ``"KV-COBRA-KL (T=5) (1, 4)"``, ``"KQ-SVD (T=5) (1, 4)"``, ``"w/o C2 (1.0 bpd K-only)"``
    (KV-COBRA-KL is the implied method of a bare "w/o"), ``"KV-COBRA-KL (1.0 bpd K-only)"``.
    """
    if method == "fp16":
        return "FP16"
    if is_split(target_v):
        budget = f"(T={fmt_g(target_k + target_v)}) ({fmt_g(target_k)}, {fmt_g(target_v)})"
    else:
        budget = f"({fmt_bpd(target_k)} bpd K-only)"
    words = _deviation_words(method, deviations(method, options))
    if not words:
        head = method_name(method)
    elif method == "cobra_kl":
        head = ", ".join(words)
    else:
        head = f"{method_name(method)} " + ", ".join(words)
    return f"{head} {budget}"


def ablation_table(frame: pd.DataFrame, ppl_dataset: str | None = None,
                   longbench_metric: str | None = None,
                   experiment: str | None = None, times: bool = False) -> Table:
    """The ablation table: K/V splits (KV-COBRA vs KQ-SVD), the w/o C2 / w/o Hadamard rows and
    cobra_plus's part-removed rows (``method.ablate``).

    Rows: per model, first the K/V splits (by method, T, K budget), then the K-only rows (the
    default method as reference, then its ablated variants). Columns: config, model, target
    (K, V) bpd, measured (K, V), PPL on ``ppl_dataset``, long-context metric, n. None: the PPL
    dataset (first of wikitext2, ptb, c4, then alphabetical, among those every run with PPL
    reports) and the long-context metric the runs have (analysis.defaults). ``times``: the
    allocation, calibration and layer-sensitivity wall-time columns (:data:`TIME_COLUMNS`).
    """
    frame = add_variants(frame)
    frame = _restrict(frame, experiment) if experiment else select_ablation(frame)
    if frame.empty:
        raise NoResultsError("no ablation runs (K/V splits of cobra_kl/cobra_mse/kqsvd, "
                             "experiment=ablation, non-default c2/rotation, or cobra_plus with "
                             "method.ablate)")
    frame = drop_duplicate_seeds(frame)
    choice = None
    if ppl_dataset is None:
        ppl_dataset, choice = best_ppl_dataset(frame)
    ppl_col = f"ppl_{ppl_dataset}" if ppl_dataset else None
    if ppl_col and choice is None:
        _check_metric(frame, ppl_col, "choose another with --ppl-dataset")
    long_metric, long_others, long_auto = _resolve_long(frame, longbench_metric)
    if not long_auto:
        _check_metric(frame, long_metric, "choose another with --longbench-metric")

    metrics: list[tuple[Column, str]] = []
    if ppl_col:
        metrics.append((Column(f"{ppl_dataset_name(ppl_dataset)} PPL ↓", "stat"), ppl_col))
    if long_metric is not None:
        metrics.append((Column(_long_column_header(long_metric), "stat"), long_metric))
    timed = [(Column(head, "num"), col, cached) for head, col, cached in TIME_COLUMNS
             if times and _reported(frame, col)]
    table = Table(columns=[
        Column("Config"), Column("Model"), Column("(K_bpd, V_bpd)"), Column("meas. (K, V)", "num"),
        *(c for c, _ in metrics), *(c for c, _, _ in timed), Column("n", "num"),
    ], group_column=1)

    def sort_key(run, options):
        split = is_split(run.target_v)
        return (order_key(run.model, MODEL_ORDER), 0 if split else 1,
                order_key(run.method, ABLATION_METHOD_ORDER),
                _sortable(run.target_k + (run.target_v if split else 0)), _sortable(run.target_k),
                len(deviations(run.method, options)),
                ablation_label(run.method, run.target_k, run.target_v, options))

    variants = list(iter_variants(frame, sort_key))
    labels = [(r.iloc[0].model, ablation_label(r.iloc[0].method, r.iloc[0].target_k,
                                               r.iloc[0].target_v, o)) for o, r in variants]
    marks = MarkLog()
    for (options, runs), (model, label) in zip(variants, labels):
        siblings = [o for (o, _), lab in zip(variants, labels) if lab == (model, label)]
        keys = distinguishing_options(siblings)
        if keys:
            label += f" [{describe_options(options, keys)}]"
        first = runs.iloc[0]
        statuses = list(runs["status"])
        mk, mv = mean_cell(statuses, _column(runs, "measured_k")), \
            mean_cell(statuses, _column(runs, "measured_v"))
        measured = Cell(mk.text if mk.text == mv.text == "—" else f"({mk.text}, {mv.text})")
        target_v = first.target_v if is_split(first.target_v) else FP16_BITS
        cells = {m: _metric_cell(runs, statuses, m, 2) for _, m in metrics}
        headline, cells = marks.mark_row(f"{label} ({model_name(first.model)})", runs, cells)
        table.rows.append([
            Cell(label), Cell(model_name(first.model)),
            Cell(f"({fmt_bpd(first.target_k)}, {fmt_bpd(target_v)})" + headline),
            measured, *(cells[m] for _, m in metrics), *(_time_cell(runs, col, cached) for _, col, cached in timed),
            count_cell(statuses),
        ])

    table.notes.append(
        "Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total "
        "when some are not ok. T = K_bpd + V_bpd (the seed's sum; bpd_KV = T/2); K-only rows "
        "keep V at 16 bits. w/o C2 = uniform per-head budget (method.c2=false); w/o Hadamard = "
        "method.rotation=none.")
    if ppl_col:
        how = ("; the first of the datasets every run with PPL reports, --ppl-dataset overrides"
               if choice is not None else "")
        note = f"PPL = {ppl_col} ({ppl_protocol(frame, [ppl_dataset])}{how})."
        if choice is not None:
            others = [d for d in choice.datasets if d != ppl_dataset]
            if others:
                note += " Also in every run: " + ", ".join(others) + "."
            note += left_out_text(choice)
        table.notes.append(note)
    if long_metric is not None:
        table.notes.append(long_note(frame, long_metric, long_others))
    if timed:
        table.notes.append(
            "alloc. s = the budget allocation's wall time (timings.allocate_s), mean over the runs; "
            "calib. s = the calibration statistics' wall time, mean over the runs that computed "
            "them (a run that found them in $KVBENCH_CACHE took 0 and is left out; 'cached' = "
            "every run did); sens. s = the layer-sensitivity passes (and the K/V exchange-rate "
            "passes of cobra_plus's joint K/V allocation), likewise; none = the row has no such step.")
    append_budget_notes(table, frame, marks)
    absent = [name for name, present in (("PPL", bool(ppl_col)),
                                         ("long-context", long_metric is not None)) if not present]
    if absent:
        table.notes.append("No column for " + ", ".join(absent)
                           + ": no run of this table reports it (task not run).")
    return table
