"""analysis and W&B: ``python -m analysis main-table RUNS_DIR --wandb-log`` logs the table and the
rate-distortion plot as one offline run in the sweep's group (read back record by record), and a
run that kvbench writes reads back as its result.json record (analysis/wandb_source.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from analysis.cli import main

wandb = pytest.importorskip("wandb")
from wandb_records import history, kinds, records  # noqa: E402

try:  # tests/ as rootdir-inserted folder (default) or as a package
    from test_analysis import make_runs
except ImportError:  # pragma: no cover
    from tests.test_analysis import make_runs


def _by_type(recs, kind: str) -> list:
    return [r for r in recs if r.WhichOneof("record_type") == kind]


def test_main_table_logs_table_and_plot_into_the_sweeps_group(tmp_path, capsys):
    runs = make_runs(tmp_path / "my_sweep")
    assert main(["main-table", str(runs), "--wandb-log"]) == 0
    out, err = capsys.readouterr()
    assert "| LLaMA-3.1-8B" in out and "wrote W&B run" in err
    [path] = runs.glob("wandb/offline-run-*/run-*.wandb")
    recs = records(path)
    [run] = {r.run.run_id: r.run for r in _by_type(recs, "run")}.values()
    assert run.run_group == "my_sweep" and run.display_name == "analysis/main-table"
    [row] = [r for r in history(recs) if "analysis/main-table/_type" in r]
    assert row["analysis/main-table/_type"] == "table-file"
    images = [k[: -len("/_type")] for k, v in row.items() if k.startswith("figures/") and v == "image-file"]
    assert sorted(images) == ["figures/llama3_8b_ppl_mean_vs_bpd_kv", "figures/mistral_7b_ppl_mean_vs_bpd_kv"]
    [artifact] = [a.artifact for a in _by_type(recs, "artifact") if a.artifact.type == "analysis"]
    assert {c.path for c in artifact.manifest.contents} == {
        "main-table.md", "llama3_8b_ppl_mean_vs_bpd_kv.png", "mistral_7b_ppl_mean_vs_bpd_kv.png"}
    table = next(path.parent.glob("files/media/table/analysis/main-table_*.table.json"))
    data = json.loads(table.read_text())
    assert data["columns"][:2] == ["Model", "Method"] and data["data"][0][:2] == ["LLaMA-3.1-8B", "FP16"]
    assert any(c.endswith(" mean") for c in data["columns"])  # the mean ± std columns as numbers too
    assert kinds(recs)["exit"] == 1


def test_wandb_log_mode_is_checked(tmp_path, capsys):
    runs = make_runs(tmp_path / "runs")
    with pytest.raises(SystemExit):
        main(["main-table", str(runs), "--wandb-log", "sometimes"])
    assert "invalid choice" in capsys.readouterr().err


def test_analysis_reads_a_kvbench_run_back():
    from analysis.wandb_source import run_to_record
    from kvbench.store import wandb_keys as keys
    from test_wandb_keys import _result

    r = _result(status="unsupported")
    config = {**r["config"], "kvbench": {"units": dict(keys.UNITS), **keys.final_config(r)}}
    run = SimpleNamespace(id="x", state="finished", config=config, summary_metrics=keys.summary_of(r))
    record = run_to_record(run)
    assert record["status"] == "unsupported"  # from the config: W&B's state says finished
    z = record["metrics"]["zeroshot"]
    assert z["piqa"] == pytest.approx(0.75) and z["acc"]["piqa"] == pytest.approx(0.7)
    assert z["counts"]["piqa"] == 20 and z["metric"]["piqa"] == "acc_norm"
    assert record["metrics"]["longqa_squad"]["f1"] == 12.5 and record["counts"]["ppl_track"] == "A"
    assert (record["model"], record["method"], record["seed"]) == ("llama3_8b", "cobra_kl", 2)  # from the config


def test_reading_a_project_back_skips_the_analysis_runs(capsys):
    from analysis.wandb_source import runs_to_frame
    from kvbench.store import wandb_keys as keys
    from test_wandb_keys import _result

    r = _result()
    job = SimpleNamespace(id="j", state="finished", job_type="cobra_kl", summary_metrics=keys.summary_of(r),
                          config={**r["config"], "kvbench": {"units": dict(keys.UNITS), **keys.final_config(r)}})
    table = SimpleNamespace(id="t", state="finished", job_type="analysis", config={"command": "main-table"},
                            summary_metrics={})
    frame = runs_to_frame([job, table], "ent/proj")
    assert list(frame["source"]) == ["wandb:ent/proj/j"] and "skipping" not in capsys.readouterr().err
