"""Golden tests for the analysis package: synthetic result.json files -> exact tables.

Every run directory is written into pytest's tmp_path; nothing touches the real runs/ folder.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.cells import Cell, stat_cell
from analysis.cli import main
from analysis.load import find_result_files, load_runs_dir

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OPTS = {"cobra_kl": {"c2": True, "rotation": "hadamard"},
                "cobra_mse": {"c2": True, "rotation": "hadamard"},
                "kqsvd": {"rotation": "none"}}


def write_run(root: Path, name: str, *, model="llama3_8b", method="cobra_kl", seed=0,
              status="ok", k=1.0, v=16.0, measured=True, ppl=None, zeroshot=None,
              longbench=None, options=None, experiment="main_table", limit=None) -> Path:
    """Write one synthetic run directory ``root/name/result.json`` following docs/design.md §4."""
    metrics = {}
    if ppl is not None:
        metrics["ppl"] = ppl
    if zeroshot is not None:
        metrics["zeroshot"] = {"avg": zeroshot}
    if longbench is not None:
        metrics["longbench"] = {"avg": longbench}
    method_cfg = {"name": method, **DEFAULT_OPTS.get(method, {}), **(options or {})}
    record = {
        "status": status, "error": "CUDA OOM" if status == "failed" else None,
        "model": model, "method": method, "seed": seed,
        "bpd": {"target_k": k, "target_v": v,
                "measured_k": k if measured and status != "unsupported" else None,
                "measured_v": v if measured and status != "unsupported" else None},
        "metrics": metrics,
        "timings": {"load_s": 1.0, "calibrate_s": 2.0, "eval_s": 3.0},
        "config": {"model": {"name": model}, "method": method_cfg, "bpd": k,
                   "v_bpd": None if v == 16.0 else v, "seed": seed, "experiment": experiment,
                   "tasks": ["ppl", "zeroshot", "longbench"], "limit": limit},
        "versions": {"torch": "2.13.0"},
    }
    path = root / name / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def ppl3(base: float) -> dict:
    """WikiText-2 / PTB / C4 perplexities base, base+10, base+20 (arithmetic mean base+10)."""
    return {"wikitext2": base, "ptb": base + 10.0, "c4": base + 20.0}


def make_runs(root: Path) -> Path:
    """A runs directory exercising every status and cell case of both tables."""
    write_run(root, "llama/fp16", method="fp16", k=16.0, ppl=ppl3(6.0), zeroshot=0.554,
              longbench=15.8)
    write_run(root, "llama/kivi_1", method="kivi", k=1.0, status="unsupported")
    for R in (32, 128):  # two variants at one budget -> labelled by the option that differs
        write_run(root, f"llama/kivi_2_R{R}", method="kivi", k=2.0, options={"R": R},
                  ppl=ppl3(7.0 if R == 32 else 6.5), zeroshot=0.55, longbench=15.0)
    write_run(root, "llama/kqsvd_1", method="kqsvd", status="failed")
    for s in range(5):  # n=5: PPL means 20..24 -> 22.00 ± 1.58
        write_run(root, f"llama/kl_1_s{s}", seed=s, ppl=ppl3(10.0 + s), zeroshot=0.51 + 0.01 * s,
                  longbench=11.0 + 0.5 * s)
        # LongBench missing for seed 4 -> "(n=4)"; zero-shot never run -> "missing"
        write_run(root, f"llama/mse_1_s{s}", method="cobra_mse", seed=s, ppl=ppl3(12.0),
                  longbench=None if s == 4 else 9.0 + s)
        # ablation runs: tagged, or non-default options; left out of the main table
        write_run(root, f"llama/abl_split_s{s}", seed=s, v=4.0, experiment="ablation",
                  ppl={"wikitext2": 14.0 + 0.2 * s}, longbench=11.0)
        write_run(root, f"llama/abl_noc2_s{s}", seed=s, options={"c2": False},
                  experiment="ablation", ppl={"wikitext2": 24.0 + s}, longbench=9.0)
    write_run(root, "llama/kqsvd_split", method="kqsvd", v=4.0, experiment="ablation",
              ppl={"wikitext2": 26.14}, longbench=6.21)
    write_run(root, "llama/norot", options={"rotation": "none"}, experiment=None,
              ppl={"wikitext2": 42.15}, longbench=6.54)
    write_run(root, "llama/h2o_s0", method="h2o", seed=0, v=1.0, status="diverged")
    write_run(root, "llama/h2o_s1", method="h2o", seed=1, v=1.0, ppl=ppl3(30.0))
    # a second model with a single seed (n=1: no std)
    write_run(root, "mistral/fp16", model="mistral_7b", method="fp16", k=16.0,
              ppl=ppl3(5.0), zeroshot=0.563, longbench=11.54)
    write_run(root, "mistral/kl_0.5", model="mistral_7b", k=0.5, ppl=ppl3(26.0),
              zeroshot=0.525, longbench=8.73)
    return root


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """The synthetic runs of make_runs in a fresh tmp dir."""
    return make_runs(tmp_path / "runs")


MAIN_MD = """\
| Model        | Method       | bpd      | bpd_K meas. / end | bpd_KV meas. / end | static MiB | static < 1% from T·B | PPL arith. mean ↓ | PPL geo. mean ↓ | Zero-shot avg (%) ↑ |     LongBench F1 ↑ |   n |
|:-------------|:-------------|:---------|------------------:|-------------------:|-----------:|---------------------:|------------------:|----------------:|--------------------:|-------------------:|----:|
| LLaMA-3.1-8B | FP16         | 16.0     |         16.00 / ? |          16.00 / ? |          ? |                    ? |             16.00 |           13.56 |                55.4 |              15.80 |   1 |
| LLaMA-3.1-8B | KIVI         | 1.0      |                 — |                  — |          — |                    — |                 — |               — |                   — |                  — | 0/1 |
| LLaMA-3.1-8B | KIVI (R=32)  | 2.0      |          2.00 / ? |           9.00 / ? |          ? |                    ? |             17.00 |           14.76 |                55.0 |              15.00 |   1 |
| LLaMA-3.1-8B | KIVI (R=128) | 2.0      |          2.00 / ? |           9.00 / ? |          ? |                    ? |             16.50 |           14.16 |                55.0 |              15.00 |   1 |
| LLaMA-3.1-8B | KQ-SVD       | 1.0      |          1.00 / ? |           8.50 / ? |          ? |                    ? |              fail |            fail |                fail |               fail | 0/1 |
| LLaMA-3.1-8B | KV-COBRA-MSE | 1.0      |          1.00 / ? |           8.50 / ? |          ? |                    ? |      22.00 ± 0.00 |    20.37 ± 0.00 |             missing | 10.50 ± 1.29 (n=4) |   5 |
| LLaMA-3.1-8B | KV-COBRA-KL  | 1.0      |          1.00 / ? |           8.50 / ? |          ? |                    ? |      22.00 ± 1.58 |    20.36 ± 1.72 |          53.0 ± 1.6 |       12.00 ± 0.79 |   5 |
| LLaMA-3.1-8B | H2O          | 1.0, 1.0 |          1.00 / ? |           1.00 / ? |          ? |                    ? |        div. (1/2) |      div. (1/2) |          div. (1/2) |         div. (1/2) | 1/2 |
| Mistral-7B   | FP16         | 16.0     |         16.00 / ? |          16.00 / ? |          ? |                    ? |             15.00 |           12.33 |                56.3 |              11.54 |   1 |
| Mistral-7B   | KV-COBRA-KL  | 0.5      |          0.50 / ? |           8.25 / ? |          ? |                    ? |             36.00 |           35.05 |                52.5 |               8.73 |   1 |

- Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total when some are not ok. bpd = target bits per K element with V at 16 (K, V when V has its own budget); meas. = measured, the mean over the scored positions (the ranking figure, docs/methods.md §0); end = end of sequence, what the cache holds after the last scored position (its peak memory); both means over runs; bpd_KV = (bpd_K + bpd_V)/2.
- PPL arith. mean = arithmetic mean of each run's PPL over wikitext2, ptb, c4 (the seed's convention, dominated by the largest PPL); geo. mean = geometric mean over the same datasets (track not recorded; the datasets every run with PPL reports, --ppl-datasets overrides).
- Zero-shot avg = zeroshot_avg × 100 (the result's mean; its tasks are not recorded).
- LongBench F1 = longbench_avg, the result's mean (its subsets are not recorded).
- 16 ok run(s) carry no bpd convention label (result files written before docs/methods.md §0 was labelled): their measured bpd is as recorded, the cache at the end of each PPL window (or of the last task).
- static MiB = the per-model constants the method fitted (result field static_bytes: projections, steps, signs, means), not in bpd (docs/methods.md §0), mean over runs; static < 1% from T·B = the tokens × batch from which they are under 1% of the cache, T·B > 100 × static bytes / ((end bpd_K + end bpd_V) × L·H_kv·d / 8), rounded up (any = no static bytes). ? = not recorded in the result files (or a model whose L·H_kv·d analysis/naming.py does not know).
- — = unsupported: the method cannot reach this budget (every run reported status `unsupported`).
- div. = diverged: at least one seed diverged (k/n = diverged of all runs); no mean is shown, since dropping the diverged seeds would flatter the method.
- fail = at least one run failed (k/n = failed of all runs; see `error` in its result.json); rerun it before reporting.
- missing = the metric is not in the result files (task not run); never filled in.
- (n=k) = only k of the ok runs report this metric; mean ± std over those k.
- 12 ablation run(s) (experiment=ablation, non-default c2/rotation, or cobra_plus with method.ablate) are left out; see `python -m analysis ablation`.
"""

ABLATION_MD = """\
| Config                        | Model        | (K_bpd, V_bpd) |  meas. (K, V) | WikiText-2 PPL ↓ | LongBench F1 ↑ |   n |
|:------------------------------|:-------------|:---------------|--------------:|-----------------:|---------------:|----:|
| KV-COBRA-KL (T=5) (1, 4)      | LLaMA-3.1-8B | (1.0, 4.0)     |  (1.00, 4.00) |     14.40 ± 0.32 |   11.00 ± 0.00 |   5 |
| KQ-SVD (T=5) (1, 4)           | LLaMA-3.1-8B | (1.0, 4.0)     |  (1.00, 4.00) |            26.14 |           6.21 |   1 |
| KV-COBRA-KL (1.0 bpd K-only)  | LLaMA-3.1-8B | (1.0, 16.0)    | (1.00, 16.00) |     12.00 ± 1.58 |   12.00 ± 0.79 |   5 |
| w/o C2 (1.0 bpd K-only)       | LLaMA-3.1-8B | (1.0, 16.0)    | (1.00, 16.00) |     26.00 ± 1.58 |    9.00 ± 0.00 |   5 |
| w/o Hadamard (1.0 bpd K-only) | LLaMA-3.1-8B | (1.0, 16.0)    | (1.00, 16.00) |            42.15 |           6.54 |   1 |

- Cells: mean ± sample std over seeds (std only when n ≥ 2); n = runs (seeds), ok/total when some are not ok. T = K_bpd + V_bpd (the seed's sum; bpd_KV = T/2); K-only rows keep V at 16 bits. w/o C2 = uniform per-head budget (method.c2=false); w/o Hadamard = method.rotation=none.
- PPL = ppl_wikitext2 (track not recorded; the first of the datasets every run with PPL reports, --ppl-dataset overrides). Left out (not in every run): ptb (5 of 17 runs), c4 (5 of 17 runs).
- LongBench F1 = longbench_avg, the result's mean (its subsets are not recorded).
- 17 ok run(s) carry no bpd convention label (result files written before docs/methods.md §0 was labelled): their measured bpd is as recorded, the cache at the end of each PPL window (or of the last task).
"""


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``python -m analysis`` in-process; return (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_main_table_markdown_golden(runs, capsys):
    code, out, err = run_cli(["main-table", runs], capsys)
    assert code == 0, err
    assert out == MAIN_MD
    assert "warning" not in err


def test_ablation_markdown_golden(runs, capsys):
    code, out, err = run_cli(["ablation", runs], capsys)
    assert code == 0, err
    assert out == ABLATION_MD


def test_n1_and_n5_cells():
    one = stat_cell(["ok"], [7.5], 2)
    assert one == Cell("7.50", 7.5, None, 1)
    five = stat_cell(["ok"] * 5, [20.0, 21.0, 22.0, 23.0, 24.0], 2)
    assert five.text == "22.00 ± 1.58" and five.n == 5
    assert math.isclose(five.std, math.sqrt(2.5))
    assert stat_cell(["ok", "ok"], [math.inf, 3.0], 2).text == "inf"
    assert stat_cell(["unsupported"] * 3, [math.nan] * 3, 2).text == "—"
    assert stat_cell(["ok", "failed"], [1.0, math.nan], 2).text == "fail (1/2)"
    assert stat_cell(["diverged"] * 2, [math.nan] * 2, 2).text == "div."
    assert stat_cell(["ok", "unsupported"], [1.0, math.nan], 2).text == "mixed (1/2)"
    assert stat_cell(["ok"], [math.nan], 2).text == "missing"
    assert stat_cell(["ok"] * 3, [0.5, 0.6, math.nan], 1, scale=100).text == "55.0 ± 7.1 (n=2)"


def _latex_rows(text: str) -> list[str]:
    body = text[text.index(r"\toprule"):text.index(r"\bottomrule")]
    return [line for line in body.splitlines() if line.endswith(r"\\")]


@pytest.mark.parametrize("command", ["main-table", "ablation"])
def test_latex_is_parseable(runs, capsys, command):
    code, out, err = run_cli([command, runs, "--format", "latex"], capsys)
    assert code == 0, err
    spec = re.search(r"\\begin\{tabular\}\{([lr]+)\}", out).group(1)
    rows = _latex_rows(out)
    assert len(rows) >= 2  # header + at least one body row
    for row in rows:  # every row has one cell per column: unescaped & count = columns - 1
        assert len(re.findall(r"(?<!\\)&", row)) == len(spec) - 1, row
    assert out.count(r"\begin{tabular}") == out.count(r"\end{tabular}") == 1
    unescaped = out.replace(r"\{", "").replace(r"\}", "")
    assert unescaped.count("{") == unescaped.count("}")
    assert "±" not in out and "—" not in out and "$\\pm$" in out
    assert "\\_" in out and "_" not in out.replace("\\_", "")


@pytest.mark.parametrize("command", ["main-table", "ablation"])
def test_csv_is_parseable(runs, capsys, command):
    code, out, err = run_cli([command, runs, "--format", "csv"], capsys)
    assert code == 0, err
    rows = list(csv.reader(io.StringIO(out)))
    header, body = rows[0], rows[1:]
    assert body and all(len(r) == len(header) for r in body)
    assert "note: Cells: mean ± sample std" in err  # notes go to stderr, not into the CSV
    if command == "main-table":
        kl = next(r for r in body if r[1] == "KV-COBRA-KL" and r[0] == "LLaMA-3.1-8B")
        col = header.index("PPL arith. mean")
        assert float(kl[col]) == 22.0 and math.isclose(float(kl[col + 1]), math.sqrt(2.5),
                                                        rel_tol=1e-5)
        assert kl[col + 2] == "5"
        kivi = next(r for r in body if r[1] == "KIVI")
        assert kivi[col] == "—"


def test_out_file(runs, tmp_path, capsys):
    target = tmp_path / "tables" / "main.md"
    code, out, err = run_cli(["main-table", runs, "--out", target], capsys)
    assert code == 0 and out == ""
    assert target.read_text(encoding="utf-8") == MAIN_MD
    assert f"wrote {target}" in err


def test_missing_dir_is_a_clear_error(tmp_path, capsys):
    code, out, err = run_cli(["main-table", tmp_path / "nope"], capsys)
    assert code == 2
    assert err.strip() == f"error: runs directory '{tmp_path / 'nope'}' does not exist"


def test_no_results_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    code, out, err = run_cli(["ablation", tmp_path / "empty"], capsys)
    assert code == 1
    assert err.strip() == f"error: no result.json found under '{tmp_path / 'empty'}'"


def test_neither_dir_nor_wandb_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["main-table"])
    assert exc.value.code == 2
    assert "give either RUNS_DIR or --wandb" in capsys.readouterr().err


def test_entry_point_runs_as_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis", "main-table", str(tmp_path / "x")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_malformed_files_are_skipped_with_a_warning(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, "good", method="fp16", k=16.0, ppl=ppl3(6.0))
    bad = {
        "truncated": '{"status": "ok", "model": "llama3_8b", "metr',
        "empty": "",
        "list": "[1, 2]",
        "nomodel": json.dumps({"status": "ok", "method": "fp16"}),
        "badstatus": json.dumps({"status": "done", "model": "m", "method": "fp16"}),
        "badmetrics": json.dumps({"status": "ok", "model": "m", "method": "x", "metrics": [1]}),
    }
    for name, text in bad.items():
        (root / name).mkdir(parents=True)
        (root / name / "result.json").write_text(text, encoding="utf-8")
    (root / "binary").mkdir()
    (root / "binary" / "result.json").write_bytes(b"\xff\xfe\x00garbage")
    code, out, err = run_cli(["main-table", root], capsys)
    assert code == 0
    assert "| FP16 " in out and out.count("\n| LLaMA") == 1
    for name in [*bad, "binary"]:
        assert f"warning: skipping {root / name / 'result.json'}:" in err, name
    assert "invalid or truncated JSON" in err and "empty file" in err
    assert "top level is a JSON list" in err and "missing 'model'" in err
    assert "unknown status 'done'" in err and "'metrics' is not an object" in err
    assert "not UTF-8 text" in err


def test_only_malformed_files_is_an_error(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text("{", encoding="utf-8")
    code, out, err = run_cli(["main-table", tmp_path], capsys)
    assert code == 1
    assert "warning: skipping" in err and "could be read" in err


def test_duplicate_seed_keeps_the_newest_with_a_warning(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, "2026-01-01/a", ppl=ppl3(10.0))
    write_run(root, "2026-01-02/b", ppl=ppl3(12.0))
    code, out, err = run_cli(["main-table", root], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "KV-COBRA-KL" in line)
    assert "22.00" in row and "20.00" not in row and row.rstrip().endswith("1 |")
    assert "duplicate run (llama3_8b, cobra_kl, seed 0)" in err and "2026-01-01" in err


def smollm_runs(root: Path) -> Path:
    """SmolLM2 smoke runs: PPL on ptb + wiki_proxy only; one seed lacks wiki_proxy."""
    write_run(root, "fp16", model="smollm2_135m", method="fp16", k=16.0,
              ppl={"ptb": 40.0, "wiki_proxy": 20.0})
    write_run(root, "kl_s0", model="smollm2_135m", seed=0, ppl={"ptb": 60.0, "wiki_proxy": 30.0})
    write_run(root, "kl_s1", model="smollm2_135m", seed=1, ppl={"ptb": 64.0})
    return root


def test_ppl_datasets_named_but_absent_are_missing_not_filled(tmp_path, capsys):
    code, out, err = run_cli(["main-table", smollm_runs(tmp_path / "r"),
                              "--ppl-datasets", "wikitext2,ptb,c4"], capsys)
    assert code == 0
    assert out.count("| missing ") + out.count(" missing |") >= 2
    assert "no run reports ppl dataset(s) wikitext2, c4 (available: ptb, wiki_proxy)" in err


def test_ppl_datasets_default_is_the_common_set(tmp_path, capsys):
    """ptb is in every run, wiki_proxy in 2 of 3: the default column is PTB alone, and the note
    names what was left out."""
    code, out, err = run_cli(["main-table", smollm_runs(tmp_path / "r")], capsys)
    assert code == 0 and "warning" not in err
    assert "PTB PPL ↓" in out.splitlines()[0] and "PPL arith. mean" not in out
    rows = [line for line in out.splitlines() if "SmolLM2" in line]
    assert " 40.00 |" in rows[0] and " 62.00 ± 2.83 |" in rows[1]  # ptb: 60 and 64
    assert "missing" not in out
    assert "PPL = perplexity on ptb" in out
    assert "Left out (not in every run): wiki_proxy (2 of 3 runs)." in out


def test_ppl_datasets_option_and_partial(tmp_path, capsys):
    root = smollm_runs(tmp_path / "r")
    code, out, _ = run_cli(["main-table", root, "--ppl-datasets", "ptb,wiki_proxy"], capsys)
    rows = [line for line in out.splitlines() if "SmolLM2" in line]
    assert "30.00" in rows[0]  # FP16: (40 + 20) / 2
    assert "45.00 (n=1)" in rows[1]  # seed 1 lacks wiki_proxy: not averaged in
    assert "over ptb, wiki_proxy" in out
    code, out, _ = run_cli(["main-table", root, "--ppl-datasets", "ptb,wiki_proxy",
                            "--ppl-partial"], capsys)
    rows = [line for line in out.splitlines() if "SmolLM2" in line]
    assert "54.50 ± 13.44 *" in rows[1]  # runs: 45 (both) and 64 (ptb only)
    assert "* = mean over the datasets present only (--ppl-partial): ptb." in out


def test_ablation_ppl_dataset_option(tmp_path, capsys):
    root = tmp_path / "r"
    write_run(root, "split", model="smollm2_135m", v=4.0, ppl={"wiki_proxy": 33.0})
    code, out, err = run_cli(["ablation", root, "--ppl-dataset", "wiki_proxy"], capsys)
    assert code == 0
    assert "wiki_proxy PPL ↓" in out and "33.00" in out
    assert "KV-COBRA-KL (T=5) (1, 4)" in out


def test_flattened_columns(tmp_path):
    root = tmp_path / "r"
    path = write_run(root, "a", ppl={"wikitext2": 9.0, "wiki_proxy": 8.0})
    record = json.loads(path.read_text())
    record["metrics"]["zeroshot"] = {"piqa_acc": 0.7, "piqa_acc_norm": 0.72, "avg": 0.6}
    record["metrics"]["longbench"] = {"longqa_squad": 12.5}
    record["metrics"]["longqa"] = {"squad": 12.5, "note": "text is ignored"}
    path.write_text(json.dumps(record))
    frame = load_runs_dir(root)
    row = frame.iloc[0]
    assert row["zeroshot_piqa_acc_norm"] == 0.72 and row["zeroshot_avg"] == 0.6
    assert row["longbench_longqa_squad"] == 12.5 and row["longqa_squad"] == 12.5
    assert row["ppl_wiki_proxy"] == 8.0 and row["bpd_kv"] == 8.5
    assert row["config.method.c2"] is True and row["config.v_bpd"] is None
    assert row["timings.eval_s"] == 3.0 and "longqa_note" not in frame.columns
    assert find_result_files(root) == [path]


def test_protocol_differences_split_rows(tmp_path, capsys):
    root = tmp_path / "r"
    for seed, track in enumerate(["A", "B"]):
        path = write_run(root, f"s{seed}", seed=seed, ppl=ppl3(10.0 + seed))
        record = json.loads(path.read_text())
        record["config"]["task"] = {"ppl": {"track": track, "seqlen": 2048}}
        path.write_text(json.dumps(record))
    code, out, _ = run_cli(["main-table", root], capsys)
    rows = [line for line in out.splitlines() if "KV-COBRA-KL" in line]
    assert len(rows) == 2
    assert "KV-COBRA-KL (ppl_track=A)" in rows[0] and " 20.00 |" in rows[0]
    assert "KV-COBRA-KL (ppl_track=B)" in rows[1] and " 21.00 |" in rows[1]


def test_task_the_method_cannot_run_is_na_not_missing(tmp_path, capsys):
    """SnapKV in track A: status ok, `unsupported_tasks: {ppl: ...}`, no PPL metric -> "n/a"."""
    root = tmp_path / "r"
    path = write_run(root, "snapkv", method="snapkv", zeroshot=0.5, longbench=10.0)
    record = json.loads(path.read_text())
    record["unsupported_tasks"] = {"ppl": "snapkv compresses a prefilled context; use track B"}
    path.write_text(json.dumps(record))
    write_run(root, "h2o", method="h2o", zeroshot=0.5, longbench=10.0)  # PPL simply not run
    code, out, _ = run_cli(["main-table", root, "--ppl-datasets", "wikitext2,ptb,c4"], capsys)
    assert code == 0
    snap = next(line for line in out.splitlines() if "SnapKV" in line)
    h2o = next(line for line in out.splitlines() if "H2O" in line)
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    assert cells(snap).count("n/a") == 2 and "missing" not in snap
    assert cells(h2o).count("missing") == 2 and "n/a" not in h2o
    assert "n/a = not applicable" in out


def test_cobra_plus_ablation_rows_and_times(tmp_path, capsys):
    """experiment=cobra_plus_ablation: one row per removed part (method.ablate), the full method
    as reference, found without --experiment; --times adds the cost columns, a calibration found
    in the cache (0 s) is left out of its mean."""
    root = tmp_path / "runs"
    for ablate, base in (("none", 90.0), ("q_model", 120.0), ("sensitivity", 88.0)):
        for s in range(2):
            path = write_run(root, f"cp/{ablate}_s{s}", model="smollm2_135m", method="cobra_plus",
                             seed=s, ppl={"ptb": base + s}, options={"ablate": ablate},
                             experiment="cobra_plus_ablation")
            record = json.loads(path.read_text())
            record["timings"] = {"calibrate_s": 70.0 if s == 0 else 0.0, "allocate_s": 1.5 + s}
            path.write_text(json.dumps(record))
    code, out, err = run_cli(["ablation", str(root), "--times"], capsys)
    assert code == 0, err
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "cobra" in line.lower()}
    labels = list(rows)
    assert any("w/o q_model" in lab for lab in labels) and any("+ sensitivity" in lab for lab in labels)
    full = next(lab for lab in labels if "w/o" not in lab and "+ sensitivity" not in lab)
    assert rows[full][3] == "90.50 ± 0.71"  # PTB over seeds 0 and 1
    assert rows[full][4:6] == ["2.00", "70"]  # alloc. mean of 1.5 and 2.5; calib. of the run that computed it
    code, plain, _ = run_cli(["ablation", str(root)], capsys)
    assert code == 0 and "alloc. s" not in plain and "alloc. s" in out


def write_ruler_run(root: Path, name: str, *, method="snapkv", seed=0, query_aware=False,
                    scores=None, item_seed=0, count=5, k=2.0, measured=2.0) -> Path:
    """A RULER run as kvbench writes it: the ruler_wiki block with by_length, counts, tokens."""
    scores = scores or {"niah_single_1": 80.0, "vt": 20.0}
    avg = sum(scores.values()) / len(scores)
    protocol = "query_aware" if query_aware else "query_agnostic"
    block = {"benchmark": "ruler_wiki", **scores, "avg": avg,
             "by_length": {"4096": {**scores, "avg": avg}}, "tasks": list(scores),
             "lengths": [4096], "counts": {t: {"4096": count} for t in scores},
             "tokens": {"4096": {"prompt_tokens_min": 2225, "prompt_tokens_max": 4060}},
             "protocol": protocol, "item_seed": item_seed, "limit": count, "eval_s": 600.0 + seed}
    path = write_run(root, name, model="smollm2_135m", method=method, seed=seed, k=k, v=k,
                     experiment="ruler_smoke")
    record = json.loads(path.read_text())
    record["metrics"] = {"ruler_wiki": block}
    record["bpd"].update(measured_k=measured, measured_v=measured)
    record["config"]["task"] = {"ruler": {"query_aware": query_aware, "limit": count}}
    record["config"]["tasks"] = ["ruler"]
    path.write_text(json.dumps(record))
    return path


def test_ruler_table_per_task_protocol_and_pairing(tmp_path, capsys):
    """One row per variant: the protocol splits SnapKV's rows, tasks in lm-eval's order, seeds
    averaged, the measured bpd marked when off target, and the items checked to be the same."""
    root = tmp_path / "runs"
    write_ruler_run(root, "fp16", method="fp16", k=16.0, measured=16.0,
                    scores={"vt": 40.0, "niah_single_1": 100.0})
    for s in range(2):
        write_ruler_run(root, f"agn{s}", seed=s, scores={"niah_single_1": 10.0 * s, "vt": 0.0})
    write_ruler_run(root, "aware", query_aware=True, measured=2.3)
    code, out, err = run_cli(["ruler", root], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[7:10] == ["S1", "VT", "avg ↑"]
    rows = {c[1] + " " + c[4]: c for c in
            ([x.strip() for x in line.strip("|").split("|")] for line in lines[1:])}
    assert rows["FP16 query-agnostic"][7:10] == ["100.0", "40.0", "70.00"]
    agn = rows["SnapKV (ruler_query_aware=False) query-agnostic"]
    assert agn[7:10] == ["5.0 ± 7.1", "0.0 ± 0.0", "2.50 ± 3.54"] and agn[-1] == "2" and agn[-3] == "600"
    aware = rows["SnapKV (ruler_query_aware=True) query-aware"]
    assert aware[5] == "2.0, 2.0†" and aware[9] == "50.00†" and aware[-2] == "2225–4060"
    assert "Paired: every row scored the same items, 5 per task and length" in out

    write_ruler_run(root, "other_items", method="h2o", item_seed=1)
    code, out, _ = run_cli(["ruler", root], capsys)
    assert code == 0 and "NOT paired" in out and "H2O at 2.0, 2.0" in out.split("NOT paired")[1]


def test_ruler_table_without_ruler_runs_is_a_clear_error(runs, capsys):
    code, _, err = run_cli(["ruler", runs], capsys)
    assert code == 1 and "no run reports RULER" in err
