"""The paper's two tables built from the runs frame: the main table and the ablation table.

Both return a format-independent ``cells.Table``; ``render`` turns it into Markdown, LaTeX or CSV.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import pandas as pd

from analysis.cells import (
    NOT_APPLICABLE, Cell, Column, Table, count_cell, marker_notes, mean_cell, not_applicable, stat_cell,
    status_marker,
)
from analysis.derived import DEFAULT_PPL_DATASETS, add_ppl_summaries
from analysis.load import NoResultsError, warn
from analysis.naming import (
    ABLATION_METHOD_ORDER, FP16_BITS, METHOD_ORDER, MODEL_ORDER, fmt_bpd, fmt_g, method_name,
    model_name, order_key, ppl_dataset_name,
)
from analysis.select import (
    add_variants, describe_options, deviations, distinguishing_options, drop_duplicate_seeds,
    experiment_of, is_split, options_sort_key, select_ablation, select_main,
)

DEFAULT_LONGBENCH_METRIC = "longbench_avg"
PARTIAL_MARK = " *"


def _prepare(frame: pd.DataFrame, datasets: list[str], partial: bool) -> pd.DataFrame:
    return add_variants(add_ppl_summaries(frame, datasets, partial))


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


def iter_variants(frame: pd.DataFrame, key) -> Iterator[tuple[dict, pd.DataFrame]]:
    """(options, runs) per variant, ordered by ``key(first run, options)``."""
    groups = [(sub.iloc[0]["options"], sub) for _, sub in frame.groupby("variant", sort=False)]
    yield from sorted(groups, key=lambda g: key(g[1].iloc[0], g[0]))


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


def _ppl_note(datasets: list[str], partial: bool, used: set[str]) -> str:
    names = ", ".join(datasets)
    note = (f"PPL arith. mean = arithmetic mean of each run's PPL over {names} (the seed's "
            "convention, dominated by the largest PPL); geo. mean = geometric mean over the same "
            "datasets.")
    if partial:
        subsets = sorted(u for u in used if u and u != ",".join(datasets))
        if subsets:
            note += (" * = mean over the datasets present only (--ppl-partial): "
                     + "; ".join(s.replace(",", ", ") for s in subsets) + ".")
    else:
        note += (" A run missing one of them has no PPL mean (see `--ppl-datasets`, "
                 "`--ppl-partial`).")
    return note


def _longbench_note(metric: str) -> str:
    if metric == DEFAULT_LONGBENCH_METRIC:
        return "LongBench F1 = longbench_avg."
    return f"the {metric} column stands in for LongBench F1 (it is not LongBench)."


def main_table(frame: pd.DataFrame, ppl_datasets: Sequence[str] = DEFAULT_PPL_DATASETS,
               ppl_partial: bool = False, longbench_metric: str = DEFAULT_LONGBENCH_METRIC,
               experiment: str | None = None) -> Table:
    """The main table: model × method × target bpd -> PPL, zero-shot average, LongBench F1.

    Rows are grouped by model, then method (naming.METHOD_ORDER), then target budget; runs that
    differ in other method options become separate rows labelled with those options. Without
    ``experiment`` the ablation runs (tagged or with non-default c2/rotation) are left out.
    """
    ppl_datasets = list(ppl_datasets)
    frame = _prepare(frame, ppl_datasets, ppl_partial)
    if experiment is None:
        frame, excluded = select_main(frame)
    else:
        frame, excluded = _restrict(frame, experiment), 0
    if frame.empty:
        raise NoResultsError("no runs for the main table (all are ablation runs)")
    frame = drop_duplicate_seeds(frame)
    _check_metric(frame, "zeroshot_avg", "no run had tasks=zeroshot")
    _check_metric(frame, longbench_metric, "choose another with --longbench-metric")

    lb_header = "LongBench F1 ↑" if longbench_metric == DEFAULT_LONGBENCH_METRIC \
        else f"{longbench_metric} ↑"
    table = Table(columns=[
        Column("Model"), Column("Method"), Column("bpd"), Column("bpd_K meas.", "num"),
        Column("bpd_KV meas.", "num"), Column("PPL arith. mean ↓", "stat"),
        Column("PPL geo. mean ↓", "stat"), Column("Zero-shot avg (%) ↑", "stat"),
        Column(lb_header, "stat"), Column("n", "num"),
    ], group_column=0)

    def sort_key(run, options):
        return (order_key(run.model, MODEL_ORDER), order_key(run.method, METHOD_ORDER),
                _sortable(run.target_k), _sortable(run.target_v), options_sort_key(options))

    variants = list(iter_variants(frame, sort_key))
    siblings: dict[tuple, list[dict]] = {}
    for options, runs in variants:
        siblings.setdefault(_budget_key(runs.iloc[0]), []).append(options)
    full = ",".join(ppl_datasets)
    for options, runs in variants:
        first = runs.iloc[0]
        keys = distinguishing_options(siblings[_budget_key(first)])
        label = method_name(first.method) + (f" ({describe_options(options, keys)})"
                                             if keys else "")
        statuses = list(runs["status"])
        ok_used = {u for s, u in zip(statuses, runs["ppl_used"]) if s == "ok"}
        mark = PARTIAL_MARK if ppl_partial and any(u != full for u in ok_used) else ""
        table.rows.append([
            Cell(model_name(first.model)), Cell(label),
            Cell(_budget_text(first.target_k, first.target_v)),
            mean_cell(statuses, _column(runs, "measured_k")),
            mean_cell(statuses, _column(runs, "bpd_kv")),
            _metric_cell(runs, statuses, "ppl_mean", 2, suffix=mark),
            _metric_cell(runs, statuses, "ppl_gmean", 2, suffix=mark),
            _metric_cell(runs, statuses, "zeroshot_avg", 1, scale=100.0),
            _metric_cell(runs, statuses, longbench_metric, 2),
            count_cell(statuses),
        ])

    table.notes.append(
        "Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total "
        "when some are not ok. bpd = target bits per K element with V at 16 (K, V when V has its "
        "own budget); meas. = measured, mean over runs; bpd_KV = (bpd_K + bpd_V)/2.")
    table.notes.append(_ppl_note(ppl_datasets, ppl_partial, set(frame["ppl_used"])))
    table.notes.append("Zero-shot avg = zeroshot_avg × 100; " + _longbench_note(longbench_metric))
    table.notes.extend(marker_notes(table))
    if excluded:
        table.notes.append(f"{excluded} ablation run(s) (experiment=ablation, or non-default "
                           "c2/rotation) are left out; see `python -m analysis ablation`.")
    return table


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
        else:
            words.append(f"{key}={value}")
    return words


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


def ablation_table(frame: pd.DataFrame, ppl_dataset: str = "wikitext2",
                   longbench_metric: str = DEFAULT_LONGBENCH_METRIC,
                   experiment: str | None = None) -> Table:
    """The ablation table: K/V splits (KV-COBRA vs KQ-SVD) and the w/o C2 / w/o Hadamard rows.

    Rows: per model, first the K/V splits (by method, T, K budget), then the K-only rows (the
    default method as reference, then its ablated variants). Columns: config, model, target
    (K, V) bpd, measured (K, V), PPL on ``ppl_dataset``, LongBench F1, n.
    """
    frame = add_variants(frame)
    frame = _restrict(frame, experiment) if experiment else select_ablation(frame)
    if frame.empty:
        raise NoResultsError("no ablation runs (K/V splits of cobra_kl/cobra_mse/kqsvd, "
                             "experiment=ablation, or non-default c2/rotation)")
    frame = drop_duplicate_seeds(frame)
    ppl_col = f"ppl_{ppl_dataset}"
    _check_metric(frame, ppl_col, "choose another with --ppl-dataset")
    _check_metric(frame, longbench_metric, "choose another with --longbench-metric")

    lb_header = "LongBench F1 ↑" if longbench_metric == DEFAULT_LONGBENCH_METRIC \
        else f"{longbench_metric} ↑"
    table = Table(columns=[
        Column("Config"), Column("Model"), Column("(K_bpd, V_bpd)"), Column("meas. (K, V)", "num"),
        Column(f"{ppl_dataset_name(ppl_dataset)} PPL ↓", "stat"), Column(lb_header, "stat"),
        Column("n", "num"),
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
        table.rows.append([
            Cell(label), Cell(model_name(first.model)),
            Cell(f"({fmt_bpd(first.target_k)}, {fmt_bpd(target_v)})"), measured,
            _metric_cell(runs, statuses, ppl_col, 2),
            _metric_cell(runs, statuses, longbench_metric, 2),
            count_cell(statuses),
        ])

    table.notes.append(
        "Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total "
        "when some are not ok. T = K_bpd + V_bpd (the seed's sum; bpd_KV = T/2); K-only rows "
        "keep V at 16 bits. w/o C2 = uniform per-head budget (method.c2=false); w/o Hadamard = "
        "method.rotation=none.")
    table.notes.append(f"PPL = {ppl_col}; " + _longbench_note(longbench_metric))
    table.notes.extend(marker_notes(table))
    return table
