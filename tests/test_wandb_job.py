"""A job's W&B run, read back record by record from its offline ``.wandb`` file
(tests/wandb_records.py): a tiny-model job in a sweep directory (PPL, zero-shot, longqa_squad,
KV-COBRA-KL) leaves its live history, tables, artifact, allocation figure, group, status and
runtime; a failed job ends its run as failed; a job killed with SIGKILL leaves the progress it
had logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, save_tiny_checkpoint

wandb = pytest.importorskip("wandb")
from wandb_records import history, kinds, records, run_file, summary  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = ["task.ppl.seqlen=64", "task.ppl.datasets=[ptb]", "calibration.n_windows=2",
        "calibration.seqlen=64", "wandb.mode=offline"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tokenizer):
    """A random 2-layer Llama with SmolLM2's tokenizer and room for a longqa_squad prompt."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), tokenizer, 4200)


def _run(out_dir: Path, checkpoint: Path, *overrides: str) -> dict:
    from kvbench.job import run_job

    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", [f"model.path={checkpoint}", *BASE, *overrides])
    return run_job(cfg, out_dir)


def _by_type(recs, kind: str) -> list:
    return [r for r in recs if r.WhichOneof("record_type") == kind]


def test_offline_run_holds_history_tables_artifact_figure(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    sweep = tmp_path / "sweep_a"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("{}\n")  # what Hydra writes into a sweep directory
    job = sweep / "method=cobra_kl"
    result = _run(job, tiny_checkpoint, "method=cobra_kl", "tasks=[ppl,zeroshot,longbench]", "task.ppl.limit=3",
                  "task.zeroshot.tasks=[piqa,arc_easy]", "task.zeroshot.limit=2", "task.longbench.limit=1")
    assert result["status"] == "ok", result["error"]
    recs = records(run_file(job))
    counts = kinds(recs)

    [run] = {r.run.run_id: r.run for r in _by_type(recs, "run")}.values()
    assert run.run_group == "sweep_a" != "adhoc"
    assert run.display_name == "smollm2_135m/cobra_kl/bpd1/seed0"
    config = {u.key: json.loads(u.value_json) for r in _by_type(recs, "config") for u in r.config.update}
    config.update({u.key: json.loads(u.value_json) for u in run.config.update})
    assert config["kvbench"]["job_id"] == result["job_id"] and config["kvbench"]["units"]["score"] == "percent"
    assert config["kvbench"]["status"] == "ok"
    assert config["kvbench"]["labels"]["metrics/zeroshot/metric/piqa"] == "acc_norm"

    rows = history(recs)
    ppl = [r for r in rows if "ppl/ptb/step" in r]
    assert [r["ppl/ptb/step"] for r in ppl] == [1, 2, 3]  # one row per window, its own step
    assert ppl[-1]["ppl/ptb/ppl"] == pytest.approx(result["metrics"]["ppl"]["ptb"], rel=1e-9)
    assert ppl[-1]["ppl/ptb/bpd_k"] == pytest.approx(1.0)
    zeroshot = [r for r in rows if "zeroshot/step" in r]
    assert [r["zeroshot/step"] for r in zeroshot] == [1, 2] and "zeroshot/arc_easy" in zeroshot[1]
    assert any("zeroshot/requests/done" in r for r in rows)
    longqa = [r for r in rows if "longqa_squad/step" in r]
    assert len(longqa) == 1 and longqa[0]["longqa_squad/prompt_tokens"] > 1000
    assert [r["tasks/step"] for r in rows if "tasks/step" in r] == [1, 2, 3]
    steps = {m.metric.name: m.metric.step_metric for m in _by_type(recs, "metric") if m.metric.name}
    assert steps["ppl/ptb/nll"] == "ppl/ptb/step" and steps["longqa_squad/f1"] == "longqa_squad/step"

    final = [r for r in rows if any(k.startswith("tables/") for k in r)]
    assert final and final[0]["tables/metrics/_type"] == "table-file"
    assert final[0]["tables/predictions/longqa_squad/_type"] == "table-file"
    assert final[0]["figures/allocation/_type"] == "image-file"
    [artifact] = [a.artifact for a in _by_type(recs, "artifact") if a.artifact.type == "result"]
    assert {c.path for c in artifact.manifest.contents} == {
        "result.json", "predictions.json", "config.yaml", "allocation.png"}
    png = job / "allocation.png"
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 2000

    s = summary(recs)
    assert s["metrics/zeroshot/piqa"] == pytest.approx(100 * result["metrics"]["zeroshot"]["piqa"])
    assert s["bpd/measured_kv"] == pytest.approx((1.0 + 16.0) / 2)
    numbers = {k: v for k, v in s.items() if k.split("/")[0] in ("metrics", "bpd", "timings", "counts")}
    assert numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers.values())

    # analysis --wandb reads the run back as the result.json record (zero-shot as fractions again)
    from analysis.wandb_source import run_to_record

    back = run_to_record(SimpleNamespace(id=run.run_id, state="finished", config=config, summary_metrics=s))
    on_disk = json.loads((job / "result.json").read_text())
    assert (back["status"], back["model"], back["method"], back["seed"]) == ("ok", "smollm2_135m", "cobra_kl", 0)
    for group in ("ppl", "zeroshot", "longqa_squad"):
        for key, value in on_disk["metrics"][group].items():
            if isinstance(value, float):
                assert back["metrics"][group][key] == pytest.approx(value, rel=1e-12), (group, key)
    assert back["metrics"]["zeroshot"]["metric"] == on_disk["metrics"]["zeroshot"]["metric"]

    [exit_record] = _by_type(recs, "exit")
    assert exit_record.exit.exit_code == 0
    total = result["timings"]["total_s"]
    assert total - 1 <= exit_record.exit.runtime <= total + 8, (exit_record.exit.runtime, total)
    assert counts["history"] >= 10 and counts["artifact"] >= 3  # the result and the two tables


def test_failed_job_ends_its_run_as_failed(tmp_path, tiny_checkpoint):
    result = _run(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null", "tasks=[ppl]",
                  "task.ppl.datasets=[nope]")
    assert result["status"] == "failed"
    recs = records(run_file(tmp_path))
    [exit_record] = _by_type(recs, "exit")
    assert exit_record.exit.exit_code == 1
    assert [r.run.run_group for r in _by_type(recs, "run")][0] == "single"
    assert not (tmp_path / "allocation.png").exists()


def test_killed_job_keeps_the_progress_it_logged(tmp_path, tiny_checkpoint):
    """SIGKILL (the OOM killer, a SLURM time limit) mid-PPL: no result.json, and the offline run
    holds the windows logged up to the last flush (kvbench/store/wandb_run.py FLUSH_S)."""
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "kvbench.run", f"hydra.run.dir={job}", f"model.path={tiny_checkpoint}",
           "method=fp16", "bpd=null", "tasks=[ppl]", "task.ppl.seqlen=32", "task.ppl.datasets=[ptb,wiki_proxy]",
           "limit=100000", "wandb.mode=offline"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               KVBENCH_CACHE=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")
    with open(tmp_path / "job.log", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        seen, deadline = [], time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            found = list(job.glob("wandb/offline-run-*/run-*.wandb"))
            seen = [r for r in history(records(found[0])) if "ppl/ptb/step" in r] if found else []
            if len(seen) >= 5:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    log = (tmp_path / "job.log").read_text()[-3000:]
    assert len(seen) >= 5, f"no progress flushed before the job ended:\n{log}"
    assert not (job / "result.json").exists(), "the job finished before it was killed"
    time.sleep(1.0)  # W&B's service notices its parent is gone and stops
    recs = records(run_file(job))
    after = [r for r in history(recs) if "ppl/ptb/step" in r]
    assert len(after) >= len(seen) and [r["ppl/ptb/step"] for r in after] == list(range(1, len(after) + 1))
    assert after[-1]["ppl/ptb/ppl"] > 1
    assert "exit" not in kinds(recs)  # no exit record: W&B shows the run as crashed


def test_interrupted_job_ends_its_run_as_failed_and_writes_no_result(tmp_path, tiny_checkpoint, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while the model loads: no result.json, the run closed as failed."""
    import kvbench.job

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvbench.job, "load_once", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tiny_checkpoint, "method=fp16", "bpd=null", "tasks=[ppl]")
    assert not (tmp_path / "result.json").exists()
    [exit_record] = _by_type(records(run_file(tmp_path)), "exit")
    assert exit_record.exit.exit_code == 1
