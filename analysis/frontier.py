"""``python -m analysis frontier RUNS_DIR``: the rate–distortion frontier (docs/methods.md §12).

Eviction (H2O, SnapKV), codecs (KIVI, KV-COBRA, ...) and their compositions (``method=compose``)
on one axis: a metric against the **measured** bpd_KV = (bpd_K + bpd_V)/2 of that metric's task
(docs/methods.md §0: the mean over the task's scored positions, ``bpd.by_task``), one line per method (a composition is one line, named by its
parts, ``SnapKV∘KIVI``), one point per target budget (the mean over seeds, the std as error bar).

The **Pareto front** of a model and metric is the set of compressed points that no other
compressed point beats on both axes: no other point has a measured bpd_KV no larger *and* a metric
no worse, one of the two strictly. FP16 (16 bits) is the reference line, not a front member.

Output: a Markdown report (stdout or ``--out``) with, per model and metric, a table (rows = lines,
columns = target budgets; each cell ``metric @ measured bpd_KV``, then ``(end X)``, the
end-of-sequence bpd_KV, where it differs (docs/methods.md §0); front members in bold and marked
◆; ``unsupported`` where the method cannot reach the target; the last two columns the line's
static bytes and the tokens × batch from which they are under 1% of the cache, ranges over its
budgets, analysis.accounting), the front in order of bpd_KV, and for each target budget the best
line and whether a composition is on the front there; and one PNG per model and metric
(``--figures``), the front drawn as a step line through its members, each point's end-of-sequence
bpd_KV a dotted tick beside it, the marks † and ‡ beside the points and the static MiB in the legend.

Decisions where docs/methods.md is silent:

* The front is computed on the points as drawn (seed means); a point's budget column is its target.
  As in the tables (docs/methods.md §0: the budget is a ceiling), a point whose measured figure
  is more than 2% over its target is marked †, more than 5% under it ‡. The per-budget ranking
  (best line, margin over the runner-up) takes only the points within their target: a † point is
  named as not ranked, since it was measured at a larger budget; a ‡ point is ranked.
* "Is a composition on the front at budget β": some composition's point of target β is a front
  member. Points of different targets compete with each other on the measured axis.
* Default metrics: the PPL mean over the datasets every run reports, and the long-context metric
  the runs have (``analysis.defaults``); ``--metric`` (repeatable) picks others.
* The PPL axis of the figure stops at :data:`PPL_CLIP` x FP16's PPL (a collapsed point, e.g. 1-bit
  KIVI at 6000, would flatten every other line); a point above is an arrow at the top edge with
  its value. The table always has every value.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

from analysis.accounting import (
    UNKNOWN, cache_bytes_per_token, fmt_mib, fmt_tokens, static_under_share,
)
from analysis.budget import (
    DAGGER, TOLERANCE, UNDER, UNDER_TOLERANCE, budget_mark, budget_target, over_target,
)
from analysis.defaults import choose_long_metric, choose_ppl_datasets
from analysis.derived import add_ppl_summaries
from analysis.load import NoResultsError
from analysis.naming import METHOD_ORDER, MODEL_ORDER, fmt_g, model_name, order_key
from analysis.plot import (
    DERIVED_METRICS, FP16_STYLE, available_metrics, direction, labelled_runs, log_axes,
    metric_label, metric_words, rate_distortion_points,
)

EVICTION = ("h2o", "snapkv")
FAMILY_MARKERS = {"eviction": "s", "codec": "o", "composition": "^"}
FRONT_MARK = "◆"
UNSUPPORTED_LINE = "—"
#: PPL axis top at this many times FP16's PPL; points above are marked at the edge with their value
PPL_CLIP = 6.0


def family(method: str) -> str:
    """``reference`` (FP16), ``eviction``, ``composition`` or ``codec``."""
    if method == "fp16":
        return "reference"
    if method in EVICTION:
        return "eviction"
    return "composition" if method == "compose" else "codec"


def pareto_mask(xs: list[float], ys: list[float], lower_is_better: bool) -> list[bool]:
    """Per point: is it on the Pareto front (no other point has x <= and y no worse, one strict)?"""
    sign = 1.0 if lower_is_better else -1.0
    out = []
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        dominated = any(
            xj <= xi and sign * yj <= sign * yi and (xj < xi or sign * yj < sign * yi)
            for j, (xj, yj) in enumerate(zip(xs, ys)) if j != i
        )
        out.append(not dominated)
    return out


def frontier_points(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The drawn points (``plot.rate_distortion_points`` on bpd_KV) with ``family`` and ``front``."""
    points = rate_distortion_points(frame, metric, "bpd_kv")
    points["family"] = points["method"].map(family)
    points["front"] = False
    lower = direction(metric).startswith("lower")
    for _, idx in points[points["family"] != "reference"].groupby("model", sort=False).groups.items():
        sub = points.loc[idx]
        points.loc[idx, "front"] = pareto_mask(list(sub["x"]), list(sub["y"]), lower)
    return points


def _statuses(frame: pd.DataFrame, metric: str) -> dict[tuple[str, str, str, float], list[str]]:
    """(model, label, method, target) -> the statuses of its runs (``unsupported`` cells, and the
    lines that have no drawable point at all)."""
    runs = labelled_runs(frame, metric, "bpd_kv")
    out: dict[tuple[str, str, str, float], list[str]] = {}
    for _, r in runs.iterrows():
        key = (r["model"], r["label"], r["method"], budget_target(r["target_k"], r["target_v"]))
        out.setdefault(key, []).append(str(r["status"]))
    return out


def _cell(point: pd.Series | None, statuses: list[str], decimals: int) -> str:
    if point is None:
        if statuses and all(s == "unsupported" for s in statuses):
            return "unsupported"
        return f"— ({', '.join(sorted(set(statuses)))})" if statuses else "—"
    y = f"{point['y']:.{decimals}f}"
    if point["n"] >= 2:
        y += f" ± {point['yerr']:.{decimals}f}"
    text = f"{y} @ {point['x']:.3g}{budget_mark(point['x'], point['target'])}{_end_text(point)}"
    return f"**{text}** {FRONT_MARK}" if point["front"] else text


def _end_text(point: pd.Series) -> str:
    """`` (end 0.48)``: the point's end-of-sequence bpd_KV where it reads otherwise than the
    measured one (empty when equal or not recorded)."""
    if math.isnan(point["end"]) or f"{point['end']:.3g}" == f"{point['x']:.3g}":
        return ""
    return f" (end {point['end']:.3g})"


def _static_range(values: list[float], fmt) -> str:
    """``"0.36–0.67"`` over a line's budgets (one value when they read alike; "?" if unknown)."""
    texts = [fmt(v) for v in sorted(values, key=lambda v: (math.isnan(v), v))]
    if not texts:
        return UNSUPPORTED_LINE
    return texts[0] if texts[0] == texts[-1] else f"{texts[0]}–{texts[-1]}"


def static_texts(line: pd.DataFrame) -> tuple[str, str]:
    """(static MiB, T·B from which they are under 1% of the cache) of a line's points: ranges over
    its budgets; the cache per token at each point's end-of-sequence bpd_KV (K and V at bpd_KV
    each on average, docs/methods.md §0)."""
    shares = [static_under_share(r.static, cache_bytes_per_token(r.model, r.end, r.end))
              for r in line.itertuples()]
    return _static_range(list(line["static"]), fmt_mib), _static_range(shares, fmt_tokens)


def _line_order(lines: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """(label, method) of each line: FP16, codecs, eviction, compositions (METHOD_ORDER within)."""
    rank = {"reference": 0, "codec": 1, "eviction": 2, "composition": 3}
    return sorted(lines, key=lambda lm: (rank[family(lm[1])], order_key(lm[1], METHOD_ORDER), lm[0]))


def model_section(points: pd.DataFrame, statuses: dict, model: str, metric: str, words: str,
                  figure: Path | None) -> list[str]:
    """The Markdown of one model and metric."""
    decimals = 2
    targets = sorted({t for (m, _, _, t) in statuses if m == model and math.isfinite(t) and t < 16})
    out = [f"### {model_name(model)}: {words} ({direction(metric)}) against measured bpd_KV", ""]
    if figure is not None:
        out += [f"![frontier]({figure})", ""]
    head = (["line", "family"] + [f"bpd_KV {fmt_g(t)}" for t in targets]
            + ["static MiB", "static < 1% from T·B"])
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mp = points[points["model"] == model]
    lines = {(lab, meth) for (m, lab, meth, _) in statuses if m == model}
    for label, method in _line_order(lines | {(r.label, r.method) for r in mp.itertuples()}):
        line = mp[mp["label"] == label]
        static = list(static_texts(line))
        if family(method) == "reference":
            value = f"{line['y'].mean():.{decimals}f} @ 16" if len(line) else "—"
            out.append(f"| {label} | reference | "
                       + " | ".join([value] * len(targets) + static) + " |")
            continue
        cells = []
        for t in targets:
            hit = line[line["target"] == t]
            cells.append(_cell(hit.iloc[0] if len(hit) else None,
                               statuses.get((model, label, method, t), []), decimals))
        out.append(f"| {label} | {family(method)} | " + " | ".join(cells + static) + " |")
    front = mp[mp["front"]].sort_values("x")
    out += ["", f"{FRONT_MARK} Pareto front, by measured bpd_KV: " + "; ".join(
        f"{r.label} ({fmt_g(r.target)}) {r.y:.{decimals}f} @ {r.x:.3g}" for r in front.itertuples()) + "."]
    for t in targets:
        every = mp[(mp["target"] == t) & (mp["family"] != "reference")]
        # a comparison holds only within the budget: † points (over it) are not ranked at their label
        at = every[[not over_target(x, t) for x in every["x"]]]
        left_out = sorted(set(every["label"]) - set(at["label"]))
        if at.empty:
            if len(every):
                out.append(f"- bpd_KV {fmt_g(t)}: no line within its target (all †): no ranking at "
                           "this budget.")
            continue
        lower = direction(metric).startswith("lower")
        best = at.loc[at["y"].idxmin() if lower else at["y"].idxmax()]
        tied = at[at["y"] == best["y"]]
        if len(tied) > 1:  # e.g. every F1 at 0: no ranking
            out.append(f"- bpd_KV {fmt_g(t)}: a tie at {best['y']:.{decimals}f} between "
                       f"{', '.join(tied['label'])}: no ranking at this budget.")
            continue
        comps = at[(at["family"] == "composition") & at["front"]]
        verdict = ("yes: " + ", ".join(_front_reason(c, best, lower) for _, c in comps.iterrows())
                   if len(comps) else "no")
        unranked = f" (not ranked, over target †: {', '.join(left_out)})" if left_out else ""
        out.append(f"- bpd_KV {fmt_g(t)}: best {best['label']} ({best['y']:.{decimals}f} @ "
                   f"{best['x']:.3g}){_margin(at, best, lower, decimals)}; a composition on the "
                   f"front: {verdict}{unranked}.")
    out.append("")
    return out


def _margin(at: pd.DataFrame, best: pd.Series, lower: bool, decimals: int) -> str:
    """How far the best line of a budget is ahead of the runner-up, against the seed spread: the
    margin exceeds it when the two means differ by more than the sum of their seed std's (their
    ±1 std bars do not overlap); a line with one seed, or two lines whose seeds all gave the same
    figure, have no spread to compare."""
    rest = at[at["label"] != best["label"]]
    if rest.empty:
        return ""
    second = rest.loc[rest["y"].idxmin() if lower else rest["y"].idxmax()]
    gap = abs(float(best["y"]) - float(second["y"]))
    text = f", ahead of {second['label']} by {gap:.{decimals}f}"
    if best["n"] < 2 or second["n"] < 2:
        return text + " (one seed on a side: no seed spread to compare)"
    spread = float(best["yerr"]) + float(second["yerr"])
    if spread == 0:  # e.g. rows whose seeds change nothing they read: a margin over 0 says nothing
        return text + " (each side gave the same figure for every seed: no seed spread to compare)"
    word = "exceeds" if gap > spread else "does not exceed"
    return text + f", which {word} the seed spread (std {best['yerr']:.{decimals}f} + {second['yerr']:.{decimals}f})"


def _front_reason(point: pd.Series, best: pd.Series, lower: bool) -> str:
    """A front member's label, and, when another point of its budget has a better metric, that it
    is on the front through its lower measured bpd_KV only."""
    if point["label"] == best["label"]:
        return point["label"]
    return (f"{point['label']} (through its lower measured bpd_KV {point['x']:.3g} only; "
            f"at this budget {best['label']} is better)")


def draw_frontier(points: pd.DataFrame, metric: str, title: str, ylabel: str):
    """One model's frontier figure (a matplotlib Figure; the caller saves and closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(10.0, 5.0))
    colors = plt.get_cmap("tab10")
    xs, ys, marked, ends = [], [], set(), False
    for i, (label, method) in enumerate(_line_order({(r.label, r.method) for r in points.itertuples()})):
        line = points[points["label"] == label].sort_values("x")
        if family(method) == "reference":
            y = float(line["y"].mean())
            ax.axhline(y, label=f"{label} (16 bits): {y:.2f}", **FP16_STYLE)
            ys.append(y)
            continue
        color = colors(i % 10)
        mib = static_texts(line)[0]
        static = "" if mib in ("0", UNKNOWN) else f"\nstatic {mib} MiB"  # a second line: narrow
        ax.errorbar(line["x"], line["y"], yerr=line["yerr"], marker=FAMILY_MARKERS[family(method)],
                    capsize=3, color=color, label=f"{label} [{family(method)}]{static}",
                    linestyle="-" if family(method) != "composition" else "--")
        for r in line.itertuples():
            if math.isfinite(r.end) and abs(r.end - r.x) > 0.005 * r.x:  # end of sequence
                ax.plot([r.x, r.end], [r.y, r.y], color=color, linestyle=":", linewidth=1.0,
                        marker="|", markevery=[1], markersize=9, alpha=0.8)
                xs.append(r.end)
                ends = True
            mark = budget_mark(r.x, r.target)
            if mark:
                ax.annotate(mark, xy=(r.x, r.y), xytext=(4, 3), textcoords="offset points",
                            color=color, fontsize="medium", fontweight="bold")
                marked.add(mark)
        xs += list(line["x"])
        ys += list(line["y"] - line["yerr"]) + list(line["y"] + line["yerr"])
    front = points[points["front"]].sort_values("x")
    if len(front):
        ax.step(front["x"], front["y"], where="post", color="black", linewidth=2.2, alpha=0.35,
                label="Pareto front", zorder=0)
        ax.scatter(front["x"], front["y"], s=140, facecolors="none", edgecolors="black", zorder=3)
    ref = points.loc[points["family"] == "reference", "y"]
    yhi = log_axes(ax, xs, ys, metric, PPL_CLIP * float(ref.mean()) if len(ref) else math.inf)
    if yhi is not None:
        stacked: dict[float, int] = {}  # labels at one x go one under the other, not over each other
        for r in points[points["y"] > yhi].sort_values("y", ascending=False).itertuples():
            key = round(math.log(r.x), 2)
            row = stacked[key] = stacked.get(key, -1) + 1
            ax.annotate(f"{r.label} {r.y:.0f} @ {r.x:.3g}", xy=(r.x, yhi), xytext=(0, -14 - 10 * row),
                        textcoords="offset points", ha="center", fontsize="x-small",
                        arrowprops={"arrowstyle": "->", "color": "gray"} if row == 0 else None)
    ax.set_xlabel("measured bits per dimension, bpd_KV = (K + V)/2 (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    handles, labels = ax.get_legend_handles_labels()
    if ends:
        handles.append(Line2D([], [], color="gray", linestyle=":", marker="|", markersize=9))
        labels.append("end-of-sequence bpd_KV (peak cache)")
    for mark, words in ((DAGGER, f"more than {TOLERANCE:.0%} over"),
                        (UNDER, f"more than {UNDER_TOLERANCE:.0%} under")):
        if mark in marked:  # the mark itself stands beside the points: a text-only entry
            handles.append(Line2D([], [], linestyle="none"))
            labels.append(f"{mark} = measured {words} its target")
    ax.legend(handles, labels, fontsize="x-small", loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # clear of the points
    fig.tight_layout()
    return fig


def default_metrics(frame: pd.DataFrame) -> list[str]:
    """The PPL mean (when runs report PPL) and the long-context metric (when they report one)."""
    out = ["ppl_mean"] if choose_ppl_datasets(frame).datasets else []
    long = choose_long_metric(frame).column
    return out + ([long] if long else [])


def frontier_report(frame: pd.DataFrame, metrics: list[str] | None, figures: str | Path | None,
                    markdown_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    """The Markdown report and the PNGs written (none when ``figures`` is None). Image links are
    relative to ``markdown_dir`` (where the report is written; None: the working directory)."""
    metrics = metrics or default_metrics(frame)
    if not metrics:
        raise NoResultsError("no run reports PPL or a long-context metric")
    datasets = choose_ppl_datasets(frame).datasets
    if any(m in DERIVED_METRICS for m in metrics):
        frame = add_ppl_summaries(frame, datasets)
    lines = ["# Rate–distortion frontier: eviction × quantization (docs/methods.md §12)", "",
             f"Cells: metric @ measured bpd_KV of the metric's task (the mean over its scored "
             f"positions, docs/methods.md §0), then (end X) = the end-of-sequence bpd_KV, what the "
             f"cache holds after the last scored position (its peak), where it differs; "
             f"**bold** {FRONT_MARK} = on the Pareto front; {DAGGER} = measured more than "
             f"{TOLERANCE:.0%} over the target (not ranked at it: the budget is a ceiling); "
             f"{UNDER} = more than {UNDER_TOLERANCE:.0%} under it. static MiB = the line's "
             "per-model constants (result field static_bytes, not in bpd); static < 1% from T·B = "
             "the tokens × batch from which they are under 1% of the cache, T·B > 100 × static "
             "bytes / (2 × end bpd_KV × L·H_kv·d / 8), rounded up (any = no static bytes); both "
             "ranges over the line's budgets.", ""]
    written: list[Path] = []
    for metric in metrics:
        if metric not in available_metrics(frame):
            raise ValueError(f"unknown metric '{metric}'; available: {', '.join(available_metrics(frame))}")
        points = frontier_points(frame, metric)
        if points.empty:
            lines += [f"(no ok run reports {metric} with a measured bpd_KV)", ""]
            continue
        statuses = _statuses(frame, metric)
        words = metric_words(metric, datasets if metric in DERIVED_METRICS else ())
        for model in sorted(points["model"].unique(), key=lambda m: order_key(m, MODEL_ORDER)):
            path = None
            if figures is not None:
                path = _save(points[points["model"] == model], metric, model, words, datasets, figures)
                written.append(path)
            link = None if path is None else Path(os.path.relpath(path, markdown_dir or "."))
            lines += model_section(points, statuses, model, metric, words, link)
    return "\n".join(lines), written


def _save(points: pd.DataFrame, metric: str, model: str, words: str, datasets, figures) -> Path:
    import matplotlib.pyplot as plt
    out = Path(figures)
    out.mkdir(parents=True, exist_ok=True)
    fig = draw_frontier(points, metric, f"{model_name(model)}: {words}\nagainst measured bpd_KV",
                        metric_label(metric, datasets if metric in DERIVED_METRICS else ()))
    path = out / f"frontier_{model}_{metric}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
