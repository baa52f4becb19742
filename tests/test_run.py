"""The job: Hydra config -> result.json (docs/design.md §4), on a tiny checkpoint with SmolLM2's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import REPO, save_tiny_checkpoint
from kvbench.job import run_job

FAST = [
    "tasks=[ppl]",
    "task.ppl.seqlen=64",
    "task.ppl.datasets=[ptb]",
    "limit=2",
    "calibration.n_windows=2",
    "calibration.seqlen=64",
    "wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2):
    """A random 2-layer Llama with SmolLM2's tokenizer, saved like any local checkpoint."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), smollm2.tokenizer, 512)


def _job(tmp_path, checkpoint, *overrides):
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", [f"model.path={checkpoint}", *FAST, *overrides])
    result = run_job(cfg, tmp_path)
    on_disk = json.loads((Path(tmp_path) / "result.json").read_text())
    assert on_disk["status"] == result["status"]
    return on_disk


def test_default_method_writes_ok_result_with_measured_bpd(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    r = _job(tmp_path, tiny_checkpoint)
    assert r["status"] == "ok", r["error"]
    assert (r["method"], r["bpd"]["target_k"], r["bpd"]["target_v"]) == ("cobra_kl", 1.0, 16.0)
    assert r["bpd"]["measured_k"] == pytest.approx(1.0) and r["bpd"]["measured_v"] == 16.0
    assert r["metrics"]["ppl"]["ptb"] > 1 and r["counts"]["ppl_windows"] == {"ptb": 2}
    assert r["timings"]["calibrate_s"] > 0 and r["versions"]["transformers"]
    assert r["config"]["method"]["name"] == "cobra_kl"
    # a second budget reuses the calibration statistics from disk
    r2 = _job(tmp_path / "again", tiny_checkpoint, "bpd=0.5")
    assert r2["counts"]["calibration_cache_hit"] is True


def test_unreachable_budget_is_unsupported_not_a_crash(tmp_path, tiny_checkpoint):
    r = _job(tmp_path, tiny_checkpoint, "method=kivi", "bpd=1.0")
    assert r["status"] == "unsupported" and "reachable" in r["error"]
    assert r["metrics"] == {}


def test_snapkv_track_a_is_unsupported_and_track_b_runs(tmp_path, tiny_checkpoint):
    r = _job(tmp_path / "a", tiny_checkpoint, "method=snapkv", "bpd=4")
    assert r["status"] == "unsupported"
    r = _job(tmp_path / "b", tiny_checkpoint, "method=snapkv", "bpd=4", "task.ppl.track=B",
             "task.ppl.context=48", "method.window=8")
    assert r["status"] == "ok", r["error"]
    assert r["bpd"]["target_v"] == 4.0 and r["bpd"]["measured_k"] == r["bpd"]["measured_v"]


def test_failure_is_recorded_with_traceback(tmp_path, tiny_checkpoint):
    r = _job(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null", "task.ppl.datasets=[nope]")
    assert r["status"] == "failed" and "valid choices" in r["error"] and "Traceback" in r["error"]


def test_finished_job_is_skipped_unless_rerun(tmp_path, tiny_checkpoint):
    first = _job(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null")
    second = _job(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null")
    assert second["timings"] == first["timings"]  # not run again
    third = _job(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null", "rerun=true")
    assert third["timings"] != first["timings"]


def test_unknown_method_option_names_the_valid_ones(tmp_path, tiny_checkpoint):
    r = _job(tmp_path, tiny_checkpoint, "method=h2o", "+method.heavy=0.1")
    assert r["status"] == "failed" and "valid options" in r["error"]


def test_fp16_is_the_baseline_whatever_bpd_says(tmp_path, tiny_checkpoint):
    r = _job(tmp_path, tiny_checkpoint, "method=fp16")  # the default bpd=1.0 does not apply
    assert r["status"] == "ok", r["error"]
    b = r["bpd"]
    assert (b["target_k"], b["target_v"], b["measured_k"], b["measured_v"]) == (16.0, 16.0, 16.0, 16.0)
    assert b["by_task"]["ppl"]["end_k"] == 16.0 and b["from_task"] == "ppl"


def test_result_reports_the_convention_and_the_end_of_sequence_figure(tmp_path, tiny_checkpoint):
    r = _job(tmp_path, tiny_checkpoint, "method=kivi", "bpd=3", "method.residual=32")
    assert r["status"] == "ok", r["error"]
    b = r["bpd"]
    assert b["convention"].startswith("Q-all") and b["from_task"] == "ppl"
    # the residual window is paid for over positions: more than the end-of-window figure
    assert b["measured_k"] > b["end_k"] and b["end_k"] == b["by_task"]["ppl"]["end_k"]


def test_auto_kv_split_is_chosen_on_heldout_calibration_windows(tmp_path, tiny_checkpoint, monkeypatch):
    """docs/methods.md §5.8: bpd=β v_bpd=auto tries b_V in 2..8 with bpd_K = 2β - b_V, by held-out
    calibration PPL, and caches the choice."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    r = _job(tmp_path / "a", tiny_checkpoint, "method=cobra_kl", "bpd=2.5", "v_bpd=auto")
    assert r["status"] == "ok", r["error"]
    split, b = r["kv_split"], r["bpd"]
    assert [c["v_bpd"] for c in split["candidates"]] == [2, 3, 4]  # bpd_K = 3, 2, 1
    best = min((c for c in split["candidates"]), key=lambda c: c["ppl"])
    assert (split["bpd_k"], split["v_bpd"]) == (best["bpd_k"], best["v_bpd"])
    assert b["target_kv"] == 2.5 and (b["target_k"] + b["target_v"]) / 2 == 2.5
    assert b["measured_k"] == pytest.approx(b["target_k"]) and b["measured_v"] == pytest.approx(b["target_v"])
    again = _job(tmp_path / "b", tiny_checkpoint, "method=cobra_kl", "bpd=2.5", "v_bpd=auto")
    assert again["kv_split"]["cache_hit"] is True and again["kv_split"]["v_bpd"] == split["v_bpd"]


def test_heldout_windows_avoid_the_calibration_windows():
    from kvbench.data.windows import heldout_windows, random_starts

    ids = torch.arange(5000)
    avoid = random_starts(ids.numel(), 4, 100, seed=0)
    held = heldout_windows(ids, 8, 100, seed=1, avoid=avoid)
    for w in held:
        assert all(abs(int(w[0]) - a) >= 100 for a in avoid)


@pytest.mark.parametrize("overrides,regime", [
    (["tasks=[ppl]", "task.ppl.track=B", "task.ppl.context=1536", "task.ppl.seqlen=2048"], ("prefill", 1536, 511)),
    (["tasks=[ppl,ruler]", "task.ppl.track=A", "task.ppl.seqlen=2048"], ("qall", 2048, 0)),
    (["tasks=[ruler]", "task.ruler.lengths=[4096,8192]"], ("prefill", 8192, 32)),
    (["tasks=[longbench,ruler]"], ("prefill", 2048, 32)),
    (["tasks=[zeroshot]"], ("qall", 2048, 0)),
])
def test_job_regime_is_that_of_the_first_scored_task(overrides, regime):
    """The regime a job's budget is fitted to: PPL's track when PPL runs, RULER alone its longest
    length (a frontier's RULER half is its own job), LongBench a 2048-token prefill."""
    from kvbench.config import JobConfig, job_regime

    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", ["task=embedded", *overrides])
    r = job_regime(JobConfig.read(cfg))
    assert (r.kind, r.tokens, r.decode) == regime


def test_unknown_task_fails_before_the_model_loads(tmp_path, tiny_checkpoint, monkeypatch):
    """A wrong ``tasks=`` name is a failed result naming the valid tasks, without loading the
    model or calibrating (which would take minutes on a real model)."""
    import kvbench.job

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvbench.job, "load_once", no_load)
    r = _job(tmp_path, tiny_checkpoint, "tasks=[ppl,longqa_squad]")
    assert r["status"] == "failed"
    assert "unknown task(s) ['longqa_squad']; valid choices: ppl, zeroshot, longbench, ruler" in r["error"]
