"""Rate–distortion figures: a metric against measured bpd, one line per method, one PNG per model.

Points are the mean over seeds of each (method, budget) variant, error bars the sample std.
Only ``ok`` runs are drawn; FP16 is drawn as a dashed horizontal reference line. matplotlib is
imported lazily (Agg backend) so the table commands never pay for it.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis.derived import DEFAULT_PPL_DATASETS, add_ppl_summaries
from analysis.load import NoResultsError, metric_columns, warn
from analysis.naming import METHOD_ORDER, MODEL_ORDER, method_name, model_name, order_key
from analysis.select import add_variants, describe_options, distinguishing_options, \
    drop_duplicate_seeds, select_main

X_AXES = {"bpd_kv": "measured bpd_KV = (bpd_K + bpd_V)/2", "bpd_k": "measured bpd_K"}
DERIVED_METRICS = ("ppl_mean", "ppl_gmean")


def available_metrics(frame: pd.DataFrame) -> list[str]:
    """Metric names ``--metric`` accepts here: the PPL means plus every numeric metric."""
    have = [c for c in metric_columns(frame) if c != "ppl_used" and frame[c].notna().any()]
    return sorted(set(have) | set(DERIVED_METRICS))


def metric_label(metric: str) -> str:
    """Axis label; zero-shot metrics are shown in %."""
    if metric.startswith("zeroshot_"):
        return f"{metric} (%)"
    if metric == "ppl_mean":
        return "PPL (arithmetic mean over datasets)"
    if metric == "ppl_gmean":
        return "PPL (geometric mean over datasets)"
    return metric


def rate_distortion_points(frame: pd.DataFrame, metric: str, x: str = "bpd_kv") -> pd.DataFrame:
    """One row per (model, line label, variant): x mean, y mean, y std (0 for n=1), n.

    The input is the runs frame after ``add_ppl_summaries``; ablation runs are left out, as in
    the main table.
    """
    frame, _ = select_main(add_variants(frame))
    frame = drop_duplicate_seeds(frame)
    ok = frame[(frame["status"] == "ok") & frame[metric].notna() & frame[x].notna()]
    if len(ok) < len(frame):
        warn(f"plot: {len(frame) - len(ok)} run(s) not drawn (status not ok, or no {metric} "
             f"or {x})")
    scale = 100.0 if metric.startswith("zeroshot_") else 1.0
    rows = []
    for _, model_runs in ok.groupby("model", sort=False):
        for method, method_runs in model_runs.groupby("method", sort=False):
            variants = list(method_runs.groupby("variant", sort=False))
            keys = distinguishing_options([v.iloc[0]["options"] for _, v in variants])
            for _, runs in variants:
                opts = runs.iloc[0]["options"]
                label = method_name(method) + (f" ({describe_options(opts, keys)})"
                                               if keys else "")
                ys = [float(v) * scale for v in runs[metric]]
                rows.append({
                    "model": runs.iloc[0]["model"], "method": method, "label": label,
                    "x": statistics.fmean(runs[x]), "y": statistics.fmean(ys),
                    "yerr": statistics.stdev(ys) if len(ys) >= 2 else 0.0, "n": len(ys),
                })
    return pd.DataFrame(rows, columns=["model", "method", "label", "x", "y", "yerr", "n"])


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def plot_rate_distortion(frame: pd.DataFrame, metric: str, out_dir: str | Path, x: str = "bpd_kv",
                         ppl_datasets: Sequence[str] = DEFAULT_PPL_DATASETS,
                         ppl_partial: bool = False) -> list[Path]:
    """Write one PNG per model into ``out_dir``; return the paths written.

    Raises ValueError for an unknown metric or x axis and NoResultsError when nothing is drawable.
    """
    if x not in X_AXES:
        raise ValueError(f"unknown x axis '{x}' (expected one of {', '.join(X_AXES)})")
    frame = add_ppl_summaries(frame, list(ppl_datasets), ppl_partial) if metric in DERIVED_METRICS \
        else frame
    if metric not in available_metrics(frame):
        raise ValueError(f"unknown metric '{metric}'; available: "
                         f"{', '.join(available_metrics(frame))}")
    points = rate_distortion_points(frame, metric, x)
    if points.empty:
        raise NoResultsError(f"no ok run reports both {metric} and {x}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _pos: f"{value:g}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.get_cmap("tab10")
    written = []
    models = sorted(points["model"].unique(), key=lambda m: order_key(m, MODEL_ORDER))
    for model in models:
        fig, ax = plt.subplots(figsize=(6.0, 4.2))
        model_points = points[points["model"] == model]
        lines = sorted(model_points.groupby("label", sort=False),
                       key=lambda g: (order_key(g[1].iloc[0]["method"], METHOD_ORDER), g[0]))
        for label, line in lines:
            method = line.iloc[0]["method"]
            color = colors(order_key(method, METHOD_ORDER)[0] % 10)
            line = line.sort_values("x")
            if method == "fp16":
                ax.axhline(line["y"].mean(), color="gray", linestyle="--", linewidth=1,
                           label=label)
                continue
            ax.errorbar(line["x"], line["y"], yerr=line["yerr"], marker="o", capsize=3,
                        color=color, label=label)
        if metric.startswith("ppl"):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plain)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(metric_label(metric))
        ax.set_title(f"{model_name(model)}: {metric} vs {x}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{_slug(model)}_{_slug(metric)}_vs_{x}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
