"""Rate–distortion figures: a metric against measured bpd, one line per method, one PNG per model.

Points are the mean over seeds of each (method, budget) variant, error bars the sample std.
Only ``ok`` runs are drawn; FP16 is drawn as a dashed horizontal reference line, labelled with its
value. The x axis is the measured bpd under the convention of the metric's task (docs/methods.md §0,
v2; ``bpd.by_task`` where the result breaks it out), on a log-2 axis whose ticks are labelled with
plain numbers even when the budgets span less than a factor of two. matplotlib is imported lazily
(Agg backend) so the table commands never pay for it.

Decisions where docs/methods.md is silent:

- ``--x auto`` plots bpd_K when every compressed run keeps V at 16 bits (the K-track) and bpd_KV
  otherwise, for all models alike (so the figures of one sweep share their axis);
- ``--metric`` defaults to the PPL mean over the datasets every run with PPL reports, else the
  zero-shot average, else the long-context metric the runs have (analysis.defaults).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis.accounting import present_mean
from analysis.budget import budget_target, bpd_task_of, is_fp16, is_kv_track, measured_sides
from analysis.defaults import choose_long_metric, choose_ppl_datasets, long_header, zeroshot_tasks
from analysis.derived import add_ppl_summaries
from analysis.load import NoResultsError, metric_columns, warn
from analysis.naming import (
    METHOD_ORDER, MODEL_ORDER, method_name, model_name, order_key, ppl_dataset_name,
)
from analysis.select import add_variants, distinguishing_options, drop_duplicate_seeds, \
    line_label, select_main

X_AXES = {"bpd_kv": "measured bits per dimension, (K + V)/2",
          "bpd_k": "measured key bits per dimension"}
X_SYMBOLS = {"bpd_kv": "bpd_KV", "bpd_k": "bpd_K"}
DERIVED_METRICS = ("ppl_mean", "ppl_gmean")
FP16_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.2}


def available_metrics(frame: pd.DataFrame) -> list[str]:
    """Metric names ``--metric`` accepts here: the PPL means plus every numeric metric."""
    have = [c for c in metric_columns(frame) if c != "ppl_used" and frame[c].notna().any()]
    return sorted(set(have) | set(DERIVED_METRICS))


def _ppl_words(datasets: Sequence[str], kind: str) -> str:
    names = [ppl_dataset_name(d) for d in datasets]
    if len(names) == 1:
        return f"{names[0]} perplexity"
    return f"Perplexity ({kind} mean of {', '.join(names)})"


def metric_words(metric: str, datasets: Sequence[str] = (), zeroshot_n: int | None = None) -> str:
    """The metric in words: ``"PTB perplexity"``, ``"Zero-shot accuracy, mean of 5 tasks (%)"``."""
    if metric == "ppl_mean":
        return _ppl_words(datasets, "arith.") if datasets else "Perplexity (mean over datasets)"
    if metric == "ppl_gmean":
        return _ppl_words(datasets, "geo.") if datasets else "Perplexity (geometric mean)"
    if metric.startswith("ppl_"):
        return f"{ppl_dataset_name(metric[4:])} perplexity"
    if metric == "zeroshot_avg":
        tasks = f" of {zeroshot_n} tasks" if zeroshot_n else ""
        return f"Zero-shot accuracy, mean{tasks} (%)"
    if metric.startswith("zeroshot_"):
        return f"Zero-shot {metric[len('zeroshot_'):]} (%)"
    if metric.startswith(("longbench_", "longqa_", "ruler")):
        return long_header(metric)
    return metric


def direction(metric: str) -> str:
    """``"lower is better"`` for perplexities, ``"higher is better"`` for scores."""
    return "lower is better" if metric.startswith("ppl") else "higher is better"


def metric_label(metric: str, datasets: Sequence[str] = (), zeroshot_n: int | None = None) -> str:
    """The y-axis label: the metric in words and which way is better (two lines if long)."""
    words = metric_words(metric, datasets, zeroshot_n)
    sep = " " if len(words) <= 30 else "\n"
    return f"{words}{sep}({direction(metric)})"


def choose_x(frame: pd.DataFrame) -> str:
    """``bpd_k`` when every ok compressed run is in the K-track (V at 16), else ``bpd_kv``."""
    ok = frame[frame["status"] == "ok"]
    compressed = [tv for m, tk, tv in zip(ok["method"], ok["target_k"], ok["target_v"])
                  if not is_fp16(m, tk, tv)]
    return "bpd_kv" if any(is_kv_track(tv) for tv in compressed) else "bpd_k"


def default_metric(frame: pd.DataFrame) -> str:
    """ppl_mean when some run has PPL, else zeroshot_avg, else the long-context metric."""
    if choose_ppl_datasets(frame).datasets:
        return "ppl_mean"
    if "zeroshot_avg" in frame.columns and frame["zeroshot_avg"].notna().any():
        return "zeroshot_avg"
    long = choose_long_metric(frame).column
    if long is None:
        raise NoResultsError("no run reports PPL, zero-shot or a long-context metric")
    return long


def rate_distortion_points(frame: pd.DataFrame, metric: str, x: str = "bpd_kv") -> pd.DataFrame:
    """One row per (model, line label, variant): x mean, y mean, y std (0 for n=1), n, target,
    end (the end-of-sequence figure on the x axis' side(s), NaN where not recorded) and static
    (static bytes, NaN where not recorded), both means over the runs that record them.

    The input is the runs frame after ``add_ppl_summaries``; ablation runs are left out, as in
    the main table. x is the measured bpd of the metric's task (``bpd.by_task`` where present).
    """
    frame = labelled_runs(frame, metric, x)
    ok = frame[(frame["status"] == "ok") & frame[metric].notna() & frame["_x"].notna()]
    if len(ok) < len(frame):
        warn(f"plot: {len(frame) - len(ok)} run(s) not drawn (status not ok, or no {metric} "
             f"or measured {X_SYMBOLS.get(x, x)})")
    scale = 100.0 if metric.startswith("zeroshot_") else 1.0
    rows = []
    for _, model_runs in ok.groupby("model", sort=False):
        for method, method_runs in model_runs.groupby("method", sort=False):
            for _, runs in method_runs.groupby("variant", sort=False):
                first = runs.iloc[0]
                label = first["label"]
                ys = [float(v) * scale for v in runs[metric]]
                rows.append({
                    "model": first["model"], "method": method, "label": label,
                    "x": statistics.fmean(runs["_x"]), "y": statistics.fmean(ys),
                    "yerr": statistics.stdev(ys) if len(ys) >= 2 else 0.0, "n": len(ys),
                    "target": budget_target(first["target_k"], first["target_v"]),
                    "end": present_mean(runs["_end"]),
                    "static": present_mean(runs["static_bytes"]) if "static_bytes" in runs.columns
                    else math.nan,
                })
    return pd.DataFrame(rows, columns=["model", "method", "label", "x", "y", "yerr", "n", "target",
                                       "end", "static"])


def ran_task(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The runs whose job ran the metric's task (``config.tasks``; runs without it are kept). A job
    fits its budget to one regime, so a sweep that scores two regimes (the frontier's PPL track B
    and RULER) runs each task as its own job of the same variant and seed: per metric, only one of
    them is that run."""
    if "config.tasks" not in frame.columns or frame.empty:
        return frame
    task = {"ruler_wiki": "ruler"}.get(bpd_task_of(metric), bpd_task_of(metric))

    def ran(tasks) -> bool:
        return not isinstance(tasks, str) or task in json.loads(tasks)

    return frame[frame["config.tasks"].map(ran)]


def labelled_runs(frame: pd.DataFrame, metric: str, x: str = "bpd_kv") -> pd.DataFrame:
    """The main (non-ablation) runs, one per (variant, seed), with ``_x`` (the measured bpd of
    the metric's task), ``_end`` (its end-of-sequence figure, docs/methods.md §0) and ``label``
    (:func:`line_label`; the options that tell a method's variants apart are taken over all its
    runs, whatever their status)."""
    frame, _ = select_main(add_variants(ran_task(frame, metric)))
    frame = drop_duplicate_seeds(frame)
    if frame.empty:
        return frame.assign(_x=pd.Series(dtype=float), _end=pd.Series(dtype=float),
                            label=pd.Series(dtype=object))
    mk, mv = measured_sides(frame, bpd_task_of(metric))
    ek, ev = measured_sides(frame, bpd_task_of(metric), "end")
    frame = frame.assign(_x=mk if x == "bpd_k" else (mk + mv) / 2,
                         _end=ek if x == "bpd_k" else (ek + ev) / 2)
    labels = pd.Series("", index=frame.index, dtype=object)
    for (_, method), runs in frame.groupby(["model", "method"], sort=False):
        variants = runs.groupby("variant", sort=False)
        keys = distinguishing_options([v.iloc[0]["options"] for _, v in variants])
        for idx, row in runs.iterrows():
            labels[idx] = line_label(method, row["options"], keys)
    return frame.assign(label=labels)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _plain(value: float, _pos=None) -> str:
    """A tick label as a plain number: 0.5, 1, 1.25, 60 (never 2^0 or 10^1)."""
    return f"{value:g}"


def padded_range(lo: float, hi: float, pad: float = 1.15, min_ratio: float = 2.0
                 ) -> tuple[float, float]:
    """Log-axis limits around [lo, hi]: a margin of ``pad`` each side, at least ``min_ratio``
    wide (centred geometrically), so that labelled ticks fall inside."""
    lo, hi = lo / pad, hi * pad
    if hi / lo < min_ratio:
        centre, half = math.sqrt(lo * hi), math.sqrt(min_ratio)
        lo, hi = centre / half, centre * half
    return lo, hi


def set_log_ticks(axis, lo: float, hi: float, base: int) -> None:
    """A log axis on [lo, hi] with plain-number labels on major and (narrow spans) minor ticks.

    Base 2 (bpd): majors at powers of two, minors at 1.25, 1.5, 1.75 × 2^k, all labelled while
    the span is at most 2 octaves, only 1.5 × 2^k up to 4 octaves. Base 10 (PPL): majors at
    powers of ten, minors at 2..9 × 10^k (plus 1.5 and 2.5 on narrow spans), all labelled up to a factor 5, only 2 and 5 up to a
    factor 100.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ratio = hi / lo
    narrow = ratio <= (4.0 if base == 2 else 5.0)
    if base == 2:
        subs = (1.25, 1.5, 1.75)
    else:
        subs = (1.5, 2.0, 2.5, *range(3, 10)) if narrow else tuple(range(2, 10))
    axis.set_major_locator(LogLocator(base=base, subs=(1.0,)))
    axis.set_minor_locator(LogLocator(base=base, subs=subs))
    axis.set_major_formatter(FuncFormatter(_plain))
    if narrow:
        axis.set_minor_formatter(FuncFormatter(_plain))
    elif ratio <= (16.0 if base == 2 else 100.0):
        keep = (1.5,) if base == 2 else (2.0, 5.0)

        def some(value, _pos=None):
            lead = round(value / base ** math.floor(math.log(value, base) + 1e-9), 6)
            return _plain(value) if lead in keep else ""
        axis.set_minor_formatter(FuncFormatter(some))
    else:
        axis.set_minor_formatter(NullFormatter())


def log_axes(ax, xs: list[float], ys: list[float], metric: str, y_cap: float = math.inf
             ) -> float | None:
    """The log-2 bpd axis over ``xs`` and, for a perplexity, the log PPL axis over ``ys`` (up to
    the largest value at or below ``y_cap``); returns the PPL axis top (None when linear)."""
    ax.set_xscale("log", base=2)
    lo, hi = padded_range(min(xs), max(xs)) if xs else (0.25, 16.0)
    ax.set_xlim(lo, hi)
    set_log_ticks(ax.xaxis, lo, hi, 2)
    finite = [v for v in ys if math.isfinite(v) and v > 0]
    if not (metric.startswith("ppl") and finite):
        return None
    ax.set_yscale("log")
    top = max([v for v in finite if v <= y_cap] or [y_cap])
    ylo, yhi = padded_range(min(finite), top, pad=1.08, min_ratio=1.5)
    ax.set_ylim(ylo, yhi)
    set_log_ticks(ax.yaxis, ylo, yhi, 10)
    return yhi


def draw_model_figure(points: pd.DataFrame, metric: str, x: str, title: str, ylabel: str):
    """The figure of one model's points (a matplotlib Figure; the caller saves and closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    colors = plt.get_cmap("tab10")
    lines = sorted(points.groupby("label", sort=False),
                   key=lambda g: (order_key(g[1].iloc[0]["method"], METHOD_ORDER), g[0]))
    xs, ys = [], []
    for i, (label, line) in enumerate(lines):
        method = line.iloc[0]["method"]
        line = line.sort_values("x")
        if method == "fp16":
            y = float(line["y"].mean())
            ax.axhline(y, label=f"{label} reference (16 bits): {y:.2f}", **FP16_STYLE)
            ax.annotate(f"{label} {y:.2f}", xy=(1.0, y), xycoords=("axes fraction", "data"),
                        xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom",
                        fontsize="small")
            ys.append(y)
            continue
        color = colors(i % 10)  # one colour per line (a method's variants and compositions differ)
        ax.errorbar(line["x"], line["y"], yerr=line["yerr"], marker="o", capsize=3,
                    color=color, label=label)
        xs += list(line["x"])
        ys += list(line["y"] - line["yerr"]) + list(line["y"] + line["yerr"])
    log_axes(ax, xs, ys, metric)
    ax.set_xlabel(f"{X_AXES[x][0].upper()}{X_AXES[x][1:]}, {X_SYMBOLS[x]} (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_rate_distortion(frame: pd.DataFrame, metric: str | None, out_dir: str | Path,
                         x: str = "auto", ppl_datasets: Sequence[str] | None = None,
                         ppl_partial: bool = False) -> list[Path]:
    """Write one PNG per model into ``out_dir``; return the paths written.

    ``metric``/``x``/``ppl_datasets`` None or "auto": chosen from the runs (module docstring).
    Raises ValueError for an unknown metric or x axis and NoResultsError when nothing is drawable.
    """
    if x != "auto" and x not in X_AXES:
        raise ValueError(f"unknown x axis '{x}' (expected auto or one of {', '.join(X_AXES)})")
    main_runs, _ = select_main(add_variants(frame))
    if metric is None:
        metric = default_metric(main_runs)
    if x == "auto":
        x = choose_x(main_runs)
    datasets: list[str] = []
    if metric in DERIVED_METRICS:
        if ppl_datasets is None:
            choice = choose_ppl_datasets(main_runs)
            datasets, ppl_partial = choice.datasets, ppl_partial or choice.partial
        else:
            datasets = list(ppl_datasets)
        frame = add_ppl_summaries(frame, datasets, ppl_partial)
    if metric not in available_metrics(frame):
        raise ValueError(f"unknown metric '{metric}'; available: "
                         f"{', '.join(available_metrics(frame))}")
    points = rate_distortion_points(frame, metric, x)
    if points.empty:
        raise NoResultsError(f"no ok run reports both {metric} and measured {X_SYMBOLS[x]}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_tasks = len(zeroshot_tasks(main_runs)) or None
    words = metric_words(metric, datasets, n_tasks)
    ylabel = metric_label(metric, datasets, n_tasks)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    models = sorted(points["model"].unique(), key=lambda m: order_key(m, MODEL_ORDER))
    for model in models:
        model_points = points[points["model"] == model]
        if not (model_points["method"] == "fp16").any():
            warn(f"plot: no FP16 run for {model}: no reference line")
        title = f"{model_name(model)}\n{words} vs {X_AXES[x]}"
        fig = draw_model_figure(model_points, metric, x, title, ylabel)
        path = out_dir / f"{_slug(model)}_{_slug(metric)}_vs_{x}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
