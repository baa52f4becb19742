"""Analysis defaults on any sweep and the † / ‡ rules for measured bpd.

Runs are built from ``tests/data/analysis_smollm2_cobra_kl_result.json``, a real result file of
``python -m kvbench.run`` (SmolLM2, offline embedded task: ptb + wiki_proxy, the five zero-shot
tasks, longqa_squad; its ``knobs`` block dropped), with budgets and metrics overridden per run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from analysis.budget import over_target, under_target
from analysis.cli import main
from analysis.derived import add_ppl_summaries
from analysis.load import load_runs_dir
from analysis.plot import draw_model_figure, metric_label, rate_distortion_points

REAL = Path(__file__).resolve().parent / "data" / "analysis_smollm2_cobra_kl_result.json"
TRACK_A = "track A: mean over query positions"


def real_record() -> dict:
    return json.loads(REAL.read_text(encoding="utf-8"))


def write(root: Path, name: str, record: dict) -> Path:
    path = root / name / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def real_run(root: Path, name: str, *, method="cobra_kl", k=1.0, v=16.0, mk=None, mv=None,
             seed=0, ptb=100.0, by_task=None, status="ok", drop=(), **bpd_extra) -> dict:
    """One run like the real file: method, targets, measured figures and PTB PPL overridden."""
    record = real_record()
    record.update(method=method, seed=seed, status=status)
    record["config"].update(bpd=k, v_bpd=None if v == 16.0 else v, seed=seed)
    record["config"]["method"] = {"name": method}
    record["bpd"] = {"target_k": k, "target_v": v,
                     "measured_k": k if mk is None else mk, "measured_v": v if mv is None else mv,
                     **bpd_extra}
    if by_task is not None:
        record["bpd"]["by_task"] = by_task
    record["metrics"]["ppl"]["ptb"] = ptb
    for task in drop:
        record["metrics"].pop(task)
    if status != "ok":
        record["metrics"] = {}
        record["bpd"]["measured_k"] = record["bpd"]["measured_v"] = None
    write(root, name, record)
    return record


def offline_sweep(root: Path) -> Path:
    """FP16 plus `-m method=cobra_kl bpd=0.5,1.0` on the embedded offline task."""
    real_run(root, "fp16", method="fp16", k=16.0, ptb=54.9)
    for bpd, ppl in ((0.5, 300.0), (1.0, 263.58)):
        real_run(root, f"method=cobra_kl,bpd={bpd}", k=bpd, ptb=ppl)
    return root


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row_of(out: str, *words: str) -> dict[str, str]:
    """The table row whose cells contain every word, as {header: cell}."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = cells(lines[0])
    for line in lines[2:]:
        row = cells(line)
        if all(w in row for w in words):
            return dict(zip(header, row))
    raise AssertionError(f"no row with {words}:\n{out}")


# ---------------------------------------------------------------- default columns

@pytest.mark.parametrize("command", ["main-table", "ablation"])
def test_offline_sweep_defaults_have_no_missing_cell(tmp_path, capsys, command):
    root = offline_sweep(tmp_path / "runs")
    if command == "ablation":  # the ablation needs ablation runs: tag the sweep as one
        for path in root.rglob("result.json"):
            record = json.loads(path.read_text())
            record["config"]["experiment"] = "ablation"
            path.write_text(json.dumps(record))
    code, out, err = run_cli([command, root], capsys)
    assert code == 0, err
    assert "missing" not in out and "warning" not in err
    header = cells(out.splitlines()[0])
    assert "longqa_squad F1 (stand-in) ↑" in header
    if command == "main-table":
        assert "PPL arith. mean ↓" in header and "Zero-shot avg (%) ↑" in header
        assert "over ptb, wiki_proxy" in out and "track A, seqlen 512" in out
        row = row_of(out, "KV-COBRA-KL", "1.0")
        expected = (263.58 + 24.911395327682374) / 2  # ptb and wiki_proxy of the real file
        assert row["PPL arith. mean ↓"] == f"{expected:.2f}"
        assert row["Zero-shot avg (%) ↑"] == "60.0"
        assert row["longqa_squad F1 (stand-in) ↑"] == "0.00"
    else:
        assert "PTB PPL ↓" in header and "PPL = ppl_ptb (track A" in out
        assert "Also in every run: wiki_proxy." in out
    assert "a stand-in for LongBench F1, not LongBench" in out


def test_notes_name_the_zero_shot_split_read_from_the_file(tmp_path, capsys):
    root = offline_sweep(tmp_path / "runs")
    code, out, _ = run_cli(["main-table", root], capsys)
    assert ("split scored — validation: piqa, arc_easy, arc_challenge, hellaswag, winogrande."
            in out)
    assert "lm-eval scores arc_easy, arc_challenge on test with hub data" in out
    assert "(acc_norm: piqa, arc_easy, arc_challenge, hellaswag; acc: winogrande)" in out
    assert "Items per task: 2." in out
    # the split comes from metrics.zeroshot.split: change it in one file, the note follows
    path = root / "fp16" / "result.json"
    record = json.loads(path.read_text())
    record["metrics"]["zeroshot"]["split"]["arc_easy"] = "test"
    path.write_text(json.dumps(record))
    code, out, _ = run_cli(["main-table", root], capsys)
    assert "validation (2 runs) / test (1 runs): arc_easy" in out  # most common first


def test_zero_shot_split_falls_back_to_the_source(tmp_path, capsys):
    root = tmp_path / "runs"
    record = real_run(root, "hub", method="fp16", k=16.0)
    record["metrics"]["zeroshot"].pop("split")
    record["metrics"]["zeroshot"]["source"] = "hub"
    write(root, "hub", record)
    code, out, _ = run_cli(["main-table", root], capsys)
    assert "split scored — validation: piqa, hellaswag, winogrande; test: arc_easy, " \
           "arc_challenge." in out


def test_paper_task_columns_and_longbench_note(tmp_path, capsys):
    root = tmp_path / "runs"
    english = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
               "triviaqa"]
    for name, method, k in (("fp16", "fp16", 16.0), ("kl", "cobra_kl", 1.0)):
        record = real_run(root, name, method=method, k=k, drop=("longqa_squad",))
        record["metrics"]["ppl"] = {"wikitext2": 6.0, "ptb": 10.0, "c4": 9.0,
                                    "arith_mean": 8.33, "geo_mean": 8.14}
        scores = {d: 10.0 + i for i, d in enumerate(english)}
        record["metrics"]["longbench"] = {**scores, "avg": 13.0, "max_length": 31500,
                                          "chat": False, "eval_s": 1.0}
        write(root, name, record)
    code, out, err = run_cli(["main-table", root], capsys)
    assert code == 0 and "missing" not in out, err
    assert "over wikitext2, ptb, c4 (" in out  # kvbench's own arith_mean/geo_mean are no dataset
    assert "LongBench F1 = longbench_avg, the mean of the 7 English F1 sets" in out
    assert row_of(out, "FP16")["LongBench F1 ↑"] == "13.00"


def test_long_context_default_prefers_what_every_run_has(tmp_path, capsys):
    root = tmp_path / "runs"
    record = real_run(root, "a", seed=0)
    record["metrics"]["longbench"] = {"qasper": 12.0, "avg": 12.0}
    write(root, "a", record)
    real_run(root, "b", seed=1)  # longqa_squad only
    code, out, _ = run_cli(["main-table", root], capsys)
    assert "longqa_squad F1 (stand-in) ↑" in out.splitlines()[0]
    assert "Also in the result files: longbench_avg (choose with --longbench-metric)." in out
    code, out, _ = run_cli(["main-table", root, "--longbench-metric", "longbench_avg"], capsys)
    assert "LongBench F1 ↑" in out.splitlines()[0] and "12.00 (n=1)" in out
    assert "the mean over the sets run: qasper (not all 7 sets of docs/methods.md §9.3)" in out


def test_a_task_no_run_has_gets_no_column(tmp_path, capsys):
    root = tmp_path / "runs"
    real_run(root, "ppl_only", drop=("zeroshot", "longqa_squad"))
    code, out, _ = run_cli(["main-table", root], capsys)
    header = cells(out.splitlines()[0])
    assert not any("Zero-shot" in h or "F1" in h for h in header)
    assert "No column for zero-shot, long-context: no run of this table reports it" in out


def test_no_dataset_common_to_all_runs_averages_what_each_has(tmp_path, capsys):
    root = tmp_path / "runs"
    for name, ppl in (("a", {"ptb": 40.0}), ("b", {"wiki_proxy": 20.0})):
        record = real_run(root, name, seed=0 if name == "a" else 1)
        record["metrics"]["ppl"] = ppl
        write(root, name, record)
    code, out, _ = run_cli(["main-table", root], capsys)
    assert "missing" not in out and "30.00 ± 14.14 *" in out
    assert "No dataset is reported by every run that has PPL." in out


# ---------------------------------------------------------------- the † and ‡ rules

@pytest.mark.parametrize("measured, target, expected", [
    (1.0, 1.0, False), (1.02, 1.0, False), (0.98, 1.0, False), (1.0201, 1.0, True),
    (0.9799, 1.0, False), (0.5, 1.0, False), (4.86, 3.0, True), (0.51, 0.5, False),
    (0.511, 0.5, True), (math.nan, 1.0, False),
])
def test_over_target_threshold(measured, target, expected):
    """The budget is a ceiling (docs/methods.md §0): only more than 2% over it is marked †."""
    assert over_target(measured, target) is expected


@pytest.mark.parametrize("measured, target, expected", [
    (1.0, 1.0, False), (0.96, 1.0, False), (0.95, 1.0, False), (0.9499, 1.0, True),
    (0.94, 1.0, True), (1.5, 1.0, False), (0.475, 0.5, False), (0.47, 0.5, True),
    (math.nan, 1.0, False),
])
def test_under_target_threshold(measured, target, expected):
    assert under_target(measured, target) is expected


def naive_mark(method: str, k: float, v: float, mk: float, mv: float) -> str:
    """Independent statement of the rules: K-track compares bpd_K, KV-track (K + V)/2; more than
    2% over is †, more than 5% under is ‡."""
    if method == "fp16" or (k, v) == (16.0, 16.0):
        return ""
    if v == 16.0:
        measured, target = mk, k
    else:
        measured, target = (mk + mv) / 2, (k + v) / 2
    if (measured - target) / target > 0.02 + 1e-12:
        return "†"
    return "‡" if (target - measured) / target > 0.05 + 1e-12 else ""


CASES = [  # method, target (K, V), measured (K, V)
    ("kivi", 3.0, 16.0, 4.86, 16.0),      # K-track, the KIVI: marked
    ("svdq", 1.0, 16.0, 1.015, 16.0),     # 1.5% off: not marked
    ("svdq", 1.0, 16.0, 1.03, 16.0),      # 3% off: marked
    ("svdq", 1.0, 16.0, 0.97, 16.0),      # 3% under: admissible, not marked
    ("svdq", 1.0, 16.0, 0.96, 16.0),      # 4% under: not marked
    ("svdq", 1.0, 16.0, 0.94, 16.0),      # 6% under: ‡
    ("cobra_kl", 1.0, 16.0, 1.0, 17.0),   # K-track: V is not what the budget is about
    ("cobra_kl", 1.0, 4.0, 1.0, 4.2),     # KV-track: bpd_KV 2.6 vs 2.5, 4% off: marked
    ("kqsvd", 1.0, 4.0, 1.5, 3.55),       # KV-track: K 50% off but bpd_KV 2.525 (1%): not
    ("h2o", 1.0, 1.0, 1.18, 1.18),        # eviction: KV-track, 18% off: marked
    ("h2o", 0.5, 0.5, 0.505, 0.505),      # 1%: not
    ("h2o", 1.0, 1.0, 0.96, 0.96),        # 4% under: not
    ("cobra_kl", 1.0, 4.0, 0.8, 3.9),     # KV-track: bpd_KV 2.35 vs 2.5, 6% under: ‡
    ("cobra_kl", 1.0, 4.0, 0.5, 4.4),     # KV-track: K 50% under but bpd_KV 2.45 (2%): not
    ("fp16", 16.0, 16.0, 16.0, 16.0),     # the baseline: never
    ("fp16", 1.0, 16.0, 16.0, 16.0),      # an old FP16 file with the default bpd: never
]


@pytest.mark.parametrize("method, k, v, mk, mv", CASES)
def test_marks_match_the_naive_rule_in_both_tracks(tmp_path, capsys, method, k, v, mk, mv):
    root = tmp_path / "runs"
    real_run(root, "run", method=method, k=k, v=v, mk=mk, mv=mv)
    code, out, _ = run_cli(["main-table", root], capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("| SmolLM2"))
    row = dict(zip(cells(out.splitlines()[0]), cells(line)))
    mark = naive_mark(method, k, v, mk, mv)
    budget = row["bpd"].rstrip("†‡")
    assert row["bpd"] == budget + mark, row
    metric_cells = [row[h] for h in row if h.endswith(("↓", "↑"))]
    assert metric_cells and all(c.rstrip("†‡") + mark == c for c in metric_cells), row
    for symbol in "†‡":
        assert (f"{symbol} = the measured bpd" in out) is (mark == symbol)
    if mark:
        side = "bpd_K" if v == 16.0 else "bpd_KV"
        figure = mk if v == 16.0 else (mk + mv) / 2
        assert f"at {budget}: {side} {figure:.2f} (meas.)" in out


def test_dagger_uses_the_task_figure_where_the_file_has_one(tmp_path, capsys):
    """Top-level figure on target, zero-shot's own figure 10% off: only that cell is marked."""
    root = tmp_path / "runs"
    by_task = {"ppl": {"measured_k": 1.0, "measured_v": 16.0, "convention": TRACK_A},
               "zeroshot": {"measured_k": 1.1, "measured_v": 16.0, "convention": TRACK_A},
               "longqa_squad": {"measured_k": 1.01, "measured_v": 16.0,
                                "convention": "end of prefill + mean over decoded positions"}}
    real_run(root, "run", k=1.0, mk=1.0, by_task=by_task, end_k=1.0, end_v=16.0,
             convention=TRACK_A)
    code, out, _ = run_cli(["main-table", root], capsys)
    row = row_of(out, "KV-COBRA-KL")
    assert row["bpd"] == "1.0" and row["Zero-shot avg (%) ↑"] == "60.0†"
    assert not row["PPL arith. mean ↓"].endswith("†")
    assert not row["longqa_squad F1 (stand-in) ↑"].endswith("†")
    assert "SmolLM2-135M KV-COBRA-KL at 1.0: zero-shot 1.10." in out
    assert "end of prefill + mean over decoded positions (longqa_squad); " \
        "track A: mean over query positions (ppl, zeroshot)." in out  # conventions are named


def test_old_files_without_by_task_fall_back_to_the_top_level(tmp_path, capsys):
    root = tmp_path / "runs"
    real_run(root, "old", method="svdq", k=1.0, mk=1.16)  # no by_task, no convention
    code, out, _ = run_cli(["main-table", root], capsys)
    row = row_of(out, "SVDq")
    assert row["bpd"] == "1.0†" and row["PPL arith. mean ↓"].endswith("†")
    assert row["Zero-shot avg (%) ↑"].endswith("†")
    assert "1 ok run(s) carry no bpd convention label" in out
    assert "SVDq at 1.0: bpd_K 1.16 (meas.)." in out


def test_dagger_uses_the_mean_over_seeds_and_spares_unsupported(tmp_path, capsys):
    root = tmp_path / "runs"
    real_run(root, "s0", k=1.0, mk=1.0, seed=0)
    real_run(root, "s1", k=1.0, mk=1.05, seed=1)  # mean 1.025: 2.5% off
    real_run(root, "kivi", method="kivi", k=1.0, status="unsupported")
    code, out, _ = run_cli(["main-table", root], capsys)
    assert row_of(out, "KV-COBRA-KL")["bpd"] == "1.0†"
    kivi = row_of(out, "KIVI")
    assert kivi["bpd"] == "1.0" and all(c == "—" for h, c in kivi.items() if h.endswith("↓"))
    assert "KV-COBRA-KL at 1.0: bpd_K 1.02 (meas.)" in out  # 1.025 shown to 2 decimals


def test_ablation_marks_split_rows_in_the_kv_track(tmp_path, capsys):
    root = tmp_path / "runs"
    real_run(root, "on", method="kqsvd", k=1.0, v=4.0, mk=1.0, mv=4.0)
    real_run(root, "off", method="cobra_kl", k=2.0, v=3.0, mk=2.0, mv=3.4)  # bpd_KV 2.7 vs 2.5
    code, out, _ = run_cli(["ablation", root], capsys)
    assert row_of(out, "KQ-SVD (T=5) (1, 4)")["(K_bpd, V_bpd)"] == "(1.0, 4.0)"
    off = row_of(out, "KV-COBRA-KL (T=5) (2, 3)")
    assert off["(K_bpd, V_bpd)"] == "(2.0, 3.0)†" and off["PTB PPL ↓"].endswith("†")
    assert "bpd_KV 2.70 (meas.)" in out


# ---------------------------------------------------------------- the plot

def visible_tick_labels(axis) -> list[str]:
    """Texts of the tick labels drawn inside the axis' view (major and minor)."""
    axis.figure.canvas.draw()
    lo, hi = sorted(axis.get_view_interval())
    labels = []
    for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                        (axis.get_minor_ticks(), axis.get_minorticklocs())):
        for tick, loc in zip(ticks, locs):
            if lo <= loc <= hi and tick.label1.get_visible() and tick.label1.get_text():
                labels.append(tick.label1.get_text())
    return labels


def figure_of(root: Path, x: str = "bpd_k"):
    frame = add_ppl_summaries(load_runs_dir(root), ["ptb"])
    points = rate_distortion_points(frame, "ppl_mean", x)
    return draw_model_figure(points, "ppl_mean", x, "title", metric_label("ppl_mean", ["ptb"]))


def narrow_sweep(root: Path) -> Path:
    """Measured bpd_K between 1.0 and 1.09: less than a factor 2 (and less than a decade)."""
    real_run(root, "fp16", method="fp16", k=16.0, ptb=54.9)
    real_run(root, "kl", k=1.0, ptb=80.0)
    real_run(root, "svdq", method="svdq", k=1.0, mk=1.09, ptb=70.0)
    return root


def test_plot_bpd_axis_has_labelled_ticks_on_a_narrow_span(tmp_path):
    import matplotlib.pyplot as plt

    fig = figure_of(narrow_sweep(tmp_path / "runs"))
    ax = fig.axes[0]
    labels = visible_tick_labels(ax.xaxis)
    assert "1" in labels and len(labels) >= 3, labels
    assert all(float(t) > 0 for t in labels)  # plain numbers, no 2^0 mathtext
    assert len(visible_tick_labels(ax.yaxis)) >= 2
    fp16 = [line for line in ax.get_lines() if line.get_label().startswith("FP16")]
    assert len(fp16) == 1 and fp16[0].get_linestyle() == "--"
    assert list(fp16[0].get_ydata()) == [54.9, 54.9]
    assert "lower is better" in ax.get_ylabel() and "PTB perplexity" in ax.get_ylabel()
    plt.close(fig)


def test_plot_bpd_axis_wide_span_labels_powers_of_two(tmp_path):
    import matplotlib.pyplot as plt

    root = tmp_path / "runs"
    real_run(root, "fp16", method="fp16", k=16.0, ptb=54.9)
    for k, mk in ((0.5, 0.5), (1.0, 1.0), (3.0, 4.86)):
        real_run(root, f"kivi{k}", method="kivi" if k == 3.0 else "cobra_kl", k=k, mk=mk,
                 ptb=60.0 / k)
    fig = figure_of(root)
    labels = visible_tick_labels(fig.axes[0].xaxis)
    assert {"0.5", "1", "2", "4"} <= set(labels), labels
    plt.close(fig)


def test_plot_cli_defaults_title_in_words(tmp_path, capsys, monkeypatch):
    import analysis.plot as plot

    figures = []
    draw = plot.draw_model_figure
    monkeypatch.setattr(plot, "draw_model_figure",
                        lambda *args, **kw: figures.append(draw(*args, **kw)) or figures[-1])
    root = narrow_sweep(tmp_path / "runs")
    out_dir = tmp_path / "fig"
    code, out, err = run_cli(["plot", root, "--out", out_dir], capsys)
    assert code == 0, err
    png = out_dir / "smollm2_135m_ppl_mean_vs_bpd_k.png"  # K-track sweep: bpd_K on x
    assert out.split() == [str(png)] and png.stat().st_size > 1000
    [fig] = figures
    ax = fig.axes[0]
    assert ax.get_title() == ("SmolLM2-135M\nPerplexity (arith. mean of PTB, wiki_proxy) vs "
                              "measured key bits per dimension")
    assert ax.get_xlabel() == "Measured key bits per dimension, bpd_K (log scale)"
    assert ax.get_ylabel() == "Perplexity (arith. mean of PTB, wiki_proxy)\n(lower is better)"
    assert "ppl_mean" not in ax.get_title() + ax.get_xlabel() + ax.get_ylabel()
    code, _, err = run_cli(["plot", root, "--out", out_dir, "--ppl-datasets", "ptb"], capsys)
    assert code == 0, err
    ax = figures[-1].axes[0]
    assert ax.get_title() == "SmolLM2-135M\nPTB perplexity vs measured key bits per dimension"
    assert ax.get_ylabel() == "PTB perplexity (lower is better)"
    assert plot.metric_words("longqa_squad_f1") == "longqa_squad F1 (stand-in)"


def test_eight_set_mean_gets_its_own_column(tmp_path, capsys):
    """kvbench writes avg (English F1 sets) and, with multifieldqa_zh, avg8 (§9.3: report both)."""
    root = tmp_path / "runs"
    english = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
               "triviaqa"]
    record = real_run(root, "kl", drop=("longqa_squad",))
    scores = {d: float(10 + i) for i, d in enumerate(english)}
    record["metrics"]["longbench"] = {**scores, "multifieldqa_zh": 30.0, "avg": 13.0,
                                      "avg_sets": english, "avg8": 15.12,
                                      "avg8_sets": english + ["multifieldqa_zh"]}
    write(root, "kl", record)
    code, out, _ = run_cli(["main-table", root], capsys)
    row = row_of(out, "KV-COBRA-KL")
    assert row["LongBench F1 ↑"] == "13.00" and row["LongBench 8-set mean ↑"] == "15.12"
    assert "LongBench F1 = longbench_avg, the mean of the 7 English F1 sets" in out
    assert ("LongBench 8-set mean = longbench_avg8, the mean of the 7 English F1 sets and "
            "multifieldqa_zh") in out


def test_longqa_squad_figure_filed_under_its_kvbench_task(tmp_path, capsys):
    """kvbench runs longqa_squad inside the `longbench` task: by_task.longbench is its figure."""
    root = tmp_path / "runs"
    by_task = {"ppl": {"measured_k": 1.0, "measured_v": 16.0, "convention": TRACK_A},
               "zeroshot": {"measured_k": 1.0, "measured_v": 16.0, "convention": TRACK_A},
               "longbench": {"measured_k": 1.3, "measured_v": 16.0, "convention": "prefill"}}
    real_run(root, "run", method="svdq", k=1.0, mk=1.0, by_task=by_task, convention=TRACK_A,
             from_task="ppl")
    code, out, _ = run_cli(["main-table", root], capsys)
    row = row_of(out, "SVDq")
    assert row["longqa_squad F1 (stand-in) ↑"].endswith("†") and row["bpd"] == "1.0"
    assert not row["PPL arith. mean ↓"].endswith("†")
    assert "SVDq at 1.0: longqa_squad 1.30." in out
    assert "prefill (longbench); track A: mean over query positions (ppl, zeroshot)." in out
    assert "that of the first task run (ppl)" in out
