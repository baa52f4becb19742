"""The two accountings in the tables (docs/methods.md §0) and the marks against the target (§0).

Beside the headline measured bpd (the mean over the scored positions) the main table and the
frontier show the end-of-sequence figure and the static bytes with the tokens × batch from which
they are under 1% of the cache; a cell more than 5% under its target is marked ‡, more than 2%
over it †. Synthetic result files whose headline and end figures differ, with known static bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from analysis.accounting import cache_bytes_per_token, fmt_mib, fmt_tokens, static_under_share
from analysis.cli import main
from analysis.frontier import draw_frontier, frontier_points, frontier_report
from analysis.load import load_runs_dir

try:  # tests/ as rootdir-inserted folder (default) or as a package
    from test_analysis import write_run
except ImportError:  # pragma: no cover
    from tests.test_analysis import write_run

SMOL_ND = 30 * 3 * 64  # SmolLM2-135M: L·H_kv·d elements per token and side
LLAMA_ND = 32 * 8 * 128


def accounted_run(root: Path, name: str, *, model="smollm2_135m", method="cobra_kl", k=1.0,
                  v=16.0, mk=None, mv=None, ek=None, ev=None, static=None, by_task=None,
                  seed=0, ppl=100.0, experiment="main_table") -> Path:
    """One ok run with headline (mk, mv), end-of-sequence (ek, ev) figures and static bytes."""
    path = write_run(root, name, model=model, method=method, k=k, v=v, seed=seed,
                     ppl={"ptb": ppl}, experiment=experiment)
    record = json.loads(path.read_text())
    bpd = record["bpd"]
    bpd.update(measured_k=k if mk is None else mk, measured_v=v if mv is None else mv)
    if ek is not None:
        bpd.update(end_k=ek, end_v=ev)
    if by_task is not None:
        bpd["by_task"] = by_task
    if static is not None:
        record["static_bytes"] = static
    path.write_text(json.dumps(record))
    return path


def table_rows(out: str) -> list[dict[str, str]]:
    """The Markdown table's rows as {header: cell}."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    header = split(lines[0])
    return [dict(zip(header, split(line))) for line in lines[2:]]


def main_table(root: Path, capsys) -> tuple[list[dict[str, str]], str]:
    assert main(["main-table", str(root)]) == 0
    out = capsys.readouterr().out
    return table_rows(out), out


# ---------------------------------------------------------------- the numbers

def test_static_threshold_from_known_numbers():
    # KQ-SVD at bpd_K 4 on SmolLM2: 1 500 480 static bytes; a token holds (4 + 16) · 5760 / 8
    # = 14 400 bytes, so the static bytes are 1% of the cache at 10 420 tokens × batch
    per_token = cache_bytes_per_token("smollm2_135m", 4.0, 16.0)
    assert per_token == 20 * SMOL_ND / 8 == 14400
    assert static_under_share(1_500_480, per_token) == pytest.approx(10420)
    # 1 MiB on Llama-3.1-8B at bpd_KV 2: 4 · 32768 / 8 = 16 384 bytes a token, 1% at 6 400
    assert static_under_share(2 ** 20, cache_bytes_per_token("llama3_8b", 2.0, 2.0)) == 6400
    assert static_under_share(0, 14400) == 0
    assert math.isnan(cache_bytes_per_token("tiny_model_not_in_conf", 1.0, 1.0))


@pytest.mark.parametrize("tokens, text", [
    (10420, "11k"), (6400, "6.4k"), (9999, "10k"), (104_200, "110k"), (1_234_567, "1.3M"),
    (880, "880"), (0.3, "1"), (0, "any"), (math.nan, "?"),
])
def test_threshold_is_rounded_up_to_two_digits(tokens, text):
    assert fmt_tokens(tokens) == text


@pytest.mark.parametrize("size, text", [
    (1_500_480, "1.43"), (2 ** 20, "1.00"), (23_160, "0.02"), (104, "< 0.01"), (0, "0"),
    (math.nan, "?"),
])
def test_static_mib(size, text):
    assert fmt_mib(size) == text


# ---------------------------------------------------------------- main table

def test_main_table_shows_headline_and_end_of_sequence(tmp_path, capsys):
    """A KIVI-like K-track row reads 4.86 over its positions but holds 3.00 at the end; a KV-track
    eviction row grows past its headline. Each column pairs the headline with the end figure."""
    root = tmp_path / "runs"
    accounted_run(root, "kivi", method="kivi", k=5.0, mk=4.86, ek=3.0, ev=16.0, static=0)
    accounted_run(root, "snap", method="snapkv", k=2.0, v=2.0, mk=2.5, mv=2.3, ek=4.4, ev=4.2,
                  static=0)
    rows, out = main_table(root, capsys)
    kivi = next(r for r in rows if r["Method"] == "KIVI")
    assert kivi["bpd_K meas. / end"] == "4.86 / 3.00"
    assert kivi["bpd_KV meas. / end"] == "10.43 / 9.50"  # (4.86 + 16)/2, (3 + 16)/2
    assert kivi["bpd"] == "5.0"  # 2.8% under: admissible, not marked
    snap = next(r for r in rows if r["Method"] == "SnapKV")
    assert snap["bpd_K meas. / end"] == "2.50 / 4.40"
    assert snap["bpd_KV meas. / end"] == "2.40 / 4.30"
    assert snap["bpd"] == "2.0, 2.0†"  # the headline decides the mark, not the end figure
    assert "end = end of sequence, what the cache holds after the last scored position" in out


def test_end_figure_is_the_mean_over_seeds_and_unknown_when_not_recorded(tmp_path, capsys):
    root = tmp_path / "runs"
    accounted_run(root, "s0", mk=1.0, ek=0.8, ev=16.0, seed=0, static=1000)
    accounted_run(root, "s1", mk=1.0, ek=0.9, ev=16.0, seed=1, static=3000)
    accounted_run(root, "old", method="svdq", mk=1.0)  # an older file: no end, no static bytes
    rows, out = main_table(root, capsys)
    kl = next(r for r in rows if r["Method"] == "KV-COBRA-KL")
    assert kl["bpd_K meas. / end"] == "1.00 / 0.85"
    # static: mean 2000 bytes over a cache of (0.85 + 16) · 5760 / 8 = 12 132 bytes a token
    assert kl["static MiB"] == "< 0.01"
    assert kl["static < 1% from T·B"] == fmt_tokens(100 * 2000 / ((0.85 + 16) * SMOL_ND / 8)) == "17"
    old = next(r for r in rows if r["Method"] == "SVDq")
    assert old["bpd_K meas. / end"] == "1.00 / ?" and old["static MiB"] == "?"
    assert "? = not recorded in the result files" in out


def test_static_columns_from_known_numbers(tmp_path, capsys):
    root = tmp_path / "runs"
    accounted_run(root, "fp16", method="fp16", k=16.0, ek=16.0, ev=16.0, static=0)
    accounted_run(root, "kqsvd", method="kqsvd", k=4.0, ek=4.0, ev=16.0, static=1_500_480)
    accounted_run(root, "llama", model="llama3_8b", k=2.0, v=2.0, ek=2.0, ev=2.0, static=2 ** 20)
    accounted_run(root, "unknown", model="tiny_model_not_in_conf", k=2.0, ek=2.0, ev=16.0,
                  static=2 ** 20)
    rows, out = main_table(root, capsys)
    by_method = {(r["Model"], r["Method"]): r for r in rows}
    fp16 = by_method[("SmolLM2-135M", "FP16")]
    assert (fp16["static MiB"], fp16["static < 1% from T·B"]) == ("0", "any")
    kqsvd = by_method[("SmolLM2-135M", "KQ-SVD")]
    assert (kqsvd["static MiB"], kqsvd["static < 1% from T·B"]) == ("1.43", "11k")  # 10 420
    llama = by_method[("LLaMA-3.1-8B", "KV-COBRA-KL")]
    assert (llama["static MiB"], llama["static < 1% from T·B"]) == ("1.00", "6.4k")  # 6 400
    unknown = by_method[("tiny_model_not_in_conf", "KV-COBRA-KL")]
    assert (unknown["static MiB"], unknown["static < 1% from T·B"]) == ("1.00", "?")
    assert "static < 1% from T·B = the tokens × batch from which they are under 1%" in out
    assert "Static bytes per model" not in out  # the columns replace the list


def test_unsupported_row_has_no_accounting(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, "kivi", model="smollm2_135m", method="kivi", k=1.0, status="unsupported")
    accounted_run(root, "kl", ek=1.0, ev=16.0, static=0)
    rows, _ = main_table(root, capsys)
    kivi = next(r for r in rows if r["Method"] == "KIVI")
    assert [kivi[h] for h in ("bpd_K meas. / end", "bpd_KV meas. / end", "static MiB",
                              "static < 1% from T·B")] == ["—"] * 4


# ---------------------------------------------------------------- ‡: more than 5% under

def test_six_percent_under_is_marked_four_percent_is_not(tmp_path, capsys):
    root = tmp_path / "runs"
    accounted_run(root, "six", method="svdq", mk=0.94, ek=0.94, ev=16.0)
    accounted_run(root, "four", method="kqsvd", mk=0.96, ek=0.96, ev=16.0)
    accounted_run(root, "kv", method="h2o", k=1.0, v=1.0, mk=0.9, mv=0.98, ek=0.9, ev=0.98)
    rows, out = main_table(root, capsys)
    six = next(r for r in rows if r["Method"] == "SVDq")
    four = next(r for r in rows if r["Method"] == "KQ-SVD")
    kv = next(r for r in rows if r["Method"] == "H2O")
    assert six["bpd"] == "1.0‡" and six["PTB PPL ↓"] == "100.00‡"
    assert four["bpd"] == "1.0" and four["PTB PPL ↓"] == "100.00"
    assert kv["bpd"] == "1.0, 1.0‡"  # bpd_KV 0.94: 6% under (K 10%, V 2%)
    assert "‡ = the measured bpd (headline figure, docs/methods.md §0) is more than 5% under" in out
    assert "SmolLM2-135M SVDq at 1.0: bpd_K 0.94 (meas.)" in out
    assert "H2O at 1.0, 1.0: bpd_KV 0.94 (meas.)" in out
    assert "KQ-SVD at 1.0" not in out and "† =" not in out


def test_under_and_over_marks_follow_each_task_figure(tmp_path, capsys):
    """Headline (PPL) on target, zero-shot's own figure 6% under, longqa_squad's 3% over: only
    those cells are marked, each with its own mark and note."""
    root = tmp_path / "runs"
    path = accounted_run(root, "run", mk=1.0, ek=1.0, ev=16.0, by_task={
        "ppl": {"measured_k": 1.0, "measured_v": 16.0},
        "zeroshot": {"measured_k": 0.94, "measured_v": 16.0},
        "longbench": {"measured_k": 1.03, "measured_v": 16.0}})
    record = json.loads(path.read_text())
    record["metrics"].update(zeroshot={"avg": 0.6}, longbench={"avg": 10.0})
    path.write_text(json.dumps(record))
    rows, out = main_table(root, capsys)
    [row] = rows
    assert row["bpd"] == "1.0" and row["PTB PPL ↓"] == "100.00"
    assert row["Zero-shot avg (%) ↑"] == "60.0‡" and row["LongBench F1 ↑"] == "10.00†"
    assert "SmolLM2-135M KV-COBRA-KL at 1.0: zero-shot 0.94." in out
    assert "SmolLM2-135M KV-COBRA-KL at 1.0: LongBench 1.03." in out


# ---------------------------------------------------------------- frontier

def frontier_sweep(root: Path) -> Path:
    """FP16, H2O 6% under at 1 (end 0.8), KIVI 4% under at 1, a composition with static bytes."""
    run = lambda *a, **kw: accounted_run(root, *a, experiment="frontier", **kw)  # noqa: E731
    run("fp16", method="fp16", k=16.0, v=16.0, ek=16.0, ev=16.0, static=0, ppl=55.0)
    run("h2o", method="h2o", k=1.0, v=1.0, mk=0.94, mv=0.94, ek=0.8, ev=0.8, static=0, ppl=90.0)
    run("kivi", method="kivi", k=1.0, v=1.0, mk=0.96, mv=0.96, ek=0.96, ev=0.96, static=0, ppl=95.0)
    for b, ppl, static in ((1.0, 80.0, 1_440_000), (2.0, 70.0, 1_500_000)):
        run(f"kl_{b}", k=b, v=b, ek=b, ev=b, static=static, ppl=ppl)
    return root


def test_frontier_cells_show_end_marks_and_static(tmp_path):
    text, _ = frontier_report(load_runs_dir(frontier_sweep(tmp_path / "runs")), ["ppl_ptb"], None)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in text.splitlines() if line.startswith("| ")}
    header = rows["line"]
    assert header[-2:] == ["static MiB", "static < 1% from T·B |"]
    h2o = rows["H2O"]
    assert h2o[2] == "**90.00 @ 0.94‡ (end 0.8)** ◆"  # 6% under: ‡; the cache ends at 0.8
    assert rows["KIVI"][2] == "95.00 @ 0.96"  # 4% under: no mark, end equal: not repeated
    # KV-COBRA-KL: 1 440 000 bytes over 2 · 1 · 5760 / 8 = 1440 bytes a token -> 100 000; at 2,
    # 1 500 000 over 2880 -> 52 084: the ranges over the line's budgets
    kl = rows["KV-COBRA-KL"]
    assert kl[-2:] == ["1.37–1.43", "53k–100k |"]
    assert rows["FP16"][-2:] == ["0", "any |"]
    # a ‡ point is within its budget: ranked at 1 (H2O 90 is beaten by KV-COBRA-KL's 80)
    assert "- bpd_KV 1: best KV-COBRA-KL (80.00 @ 1), ahead of H2O by 10.00" in text
    assert "(not ranked, over target" not in text
    assert "‡ = more than 5% under it" in text and "(end X) = the end-of-sequence bpd_KV" in text


def test_frontier_figure_labels_end_marks_and_static(tmp_path):
    import matplotlib.pyplot as plt

    points = frontier_points(load_runs_dir(frontier_sweep(tmp_path / "runs")), "ppl_ptb")
    points = points[points["model"] == "smollm2_135m"]
    fig = draw_frontier(points, "ppl_ptb", "title", "PTB")
    try:
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "KV-COBRA-KL [codec]\nstatic 1.37–1.43 MiB" in legend
        assert "H2O [eviction]" in legend  # no static bytes: nothing added
        assert "end-of-sequence bpd_KV (peak cache)" in legend
        assert "‡ = measured more than 5% under its target" in legend
        assert not any(t.startswith("†") for t in legend)  # no point over its target
        assert [a.get_text() for a in ax.texts if a.get_text() in "†‡"] == ["‡"]
        # H2O's end tick: a dotted segment from its measured 0.94 to its end 0.8 at its PPL
        ends = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert any(list(line.get_xdata()) == [0.94, 0.8] and list(line.get_ydata()) == [90.0, 90.0]
                   for line in ends)
    finally:
        plt.close(fig)
