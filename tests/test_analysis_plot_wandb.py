"""Tests of the plot command and of the W&B conversion (fake run objects; no network)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import analysis.wandb_source as wandb_source
from analysis.cli import main
from analysis.tables import main_table
from analysis.wandb_source import load_wandb, run_to_record, runs_to_frame

try:  # tests/ as rootdir-inserted folder (default) or as a package
    from test_analysis import make_runs
except ImportError:  # pragma: no cover
    from tests.test_analysis import make_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_one_png_per_model(tmp_path, capsys):
    runs = make_runs(tmp_path / "runs")
    out_dir = tmp_path / "fig"
    assert main(["plot", str(runs), "--out", str(out_dir)]) == 0
    printed = capsys.readouterr().out.split()
    pngs = sorted(out_dir.glob("*.png"))
    assert [p.name for p in pngs] == ["llama3_8b_ppl_mean_vs_bpd_kv.png",
                                      "mistral_7b_ppl_mean_vs_bpd_kv.png"]
    assert sorted(printed) == sorted(str(p) for p in pngs)
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_other_metric_and_x(tmp_path, capsys):
    runs = make_runs(tmp_path / "runs")
    code = main(["plot", str(runs), "--out", str(tmp_path / "f"), "--metric", "zeroshot_avg",
                 "--x", "bpd_k"])
    assert code == 0
    assert (tmp_path / "f" / "llama3_8b_zeroshot_avg_vs_bpd_k.png").stat().st_size > 0


def test_plot_unknown_metric_lists_the_available_ones(tmp_path, capsys):
    runs = make_runs(tmp_path / "runs")
    assert main(["plot", str(runs), "--out", str(tmp_path / "f"), "--metric", "bleu"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown metric 'bleu'; available:" in err and "longbench_avg" in err


def fake_run(run_id, config, summary, state="finished", legacy=False):
    """A stand-in for wandb.apis.public.Run: config, summary, state and id."""
    if legacy:  # older wandb: only run.summary (an HTTPSummary with _json_dict)
        return SimpleNamespace(id=run_id, state=state, config=config,
                               summary=SimpleNamespace(_json_dict=summary))
    return SimpleNamespace(id=run_id, state=state, config=config, summary_metrics=summary)


CONFIG = {"model": {"name": "llama3_8b"}, "method": {"name": "cobra_kl", "c2": True,
                                                     "rotation": "hadamard"},
          "bpd": 1.0, "v_bpd": None, "seed": 0, "experiment": "main_table"}


def fake_runs():
    """Four layouts of one configuration (seeds 0-2 and a running run)."""
    nested = fake_run("a1", CONFIG, {
        "status": "ok", "bpd": {"target_k": 1.0, "target_v": 16.0, "measured_k": 1.0,
                                "measured_v": 16.0},
        "metrics": {"ppl": {"wikitext2": 10.0, "ptb": 20.0, "c4": 30.0},
                    "longbench": {"avg": 11.0}}, "_step": 3, "_wandb": {"runtime": 5}})
    slashed = fake_run("b2", {**CONFIG, "seed": 1}, {
        "status": "ok", "bpd/measured_k": 1.0, "bpd/measured_v": 16.0,
        "metrics/ppl/wikitext2": 12.0, "metrics/ppl/ptb": 22.0, "metrics/ppl/c4": 32.0,
        "metrics/longbench/avg": 12.0}, legacy=True)
    whole = fake_run("c3", {"method.name": "cobra_kl", "model.name": "llama3_8b"}, {
        "result": {"status": "diverged", "model": "llama3_8b", "method": "cobra_kl", "seed": 2,
                   "bpd": {"target_k": 1.0, "target_v": 16.0}, "metrics": {},
                   "config": {**CONFIG, "seed": 2}}})
    running = fake_run("d4", CONFIG, {}, state="running")
    return [nested, slashed, whole, running]


def test_run_to_record_layouts():
    nested, slashed, whole, running = fake_runs()
    record = run_to_record(nested)
    assert record["model"] == "llama3_8b" and record["method"] == "cobra_kl"
    assert record["seed"] == 0 and record["bpd"]["target_k"] == 1.0
    assert record["bpd"]["target_v"] == 16.0
    assert record["metrics"]["ppl"]["c4"] == 30.0 and "_step" not in record
    record = run_to_record(slashed)
    assert record["metrics"]["ppl"]["wikitext2"] == 12.0 and record["seed"] == 1
    assert record["bpd"]["measured_k"] == 1.0
    assert record["bpd"]["target_v"] is None  # from config v_bpd: null -> 16 (K-only) on load
    assert run_to_record(whole)["status"] == "diverged"
    assert run_to_record(running) is None
    crashed = fake_run("e5", CONFIG, {"metrics": {}}, state="crashed")
    assert run_to_record(crashed)["status"] == "failed"
    flat_groups = fake_run("f6", CONFIG, {"status": "ok", "ppl/wikitext2": 9.0})
    assert run_to_record(flat_groups)["metrics"] == {"ppl": {"wikitext2": 9.0}}


def test_wandb_runs_build_the_same_table(capsys):
    frame = runs_to_frame(fake_runs(), "ent/proj")
    assert "skipping wandb:ent/proj/d4: run state is 'running'" in capsys.readouterr().err
    assert list(frame["source"]) == ["wandb:ent/proj/a1", "wandb:ent/proj/b2",
                                     "wandb:ent/proj/c3"]
    assert list(frame["target_v"]) == [16.0, 16.0, 16.0]
    table = main_table(frame)
    [row] = table.rows
    assert [c.text for c in row][:2] == ["LLaMA-3.1-8B", "KV-COBRA-KL"]
    assert row[7].text == "div. (1/3)" and row[-1].text == "2/3"


def test_load_wandb_uses_the_api_and_cli_option(monkeypatch, capsys):
    class FakeApi:
        def runs(self, path):
            assert path == "ent/proj"
            return fake_runs()[:2]

    frame = load_wandb("ent/proj", api=FakeApi())
    assert len(frame) == 2
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        load_wandb("just-a-project", api=FakeApi())

    monkeypatch.setattr(wandb_source, "load_wandb", lambda path: load_wandb(path, FakeApi()))
    assert main(["main-table", "--wandb", "ent/proj"]) == 0
    out = capsys.readouterr().out
    assert "21.00 ± 1.41" in out  # seeds 0 and 1: PPL means 20 and 22
