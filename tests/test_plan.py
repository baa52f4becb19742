"""``python -m analysis plan``: a sweep's GPU-hours from the committed device figures."""

from __future__ import annotations

from pathlib import Path

from analysis.cli import main
from analysis.plan import PAPER_ITEMS, job_seconds, read_rates, sweep_jobs

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "docs" / "performance" / "h200-2026-12-04"
MAIN = REPO / "conf" / "experiment" / "main_table.yaml"


def test_main_table_jobs_are_the_sweep_less_the_skipped_seeds():
    jobs, tasks, skipped = sweep_jobs(MAIN)
    assert tasks == ["ppl", "zeroshot", "longbench"]
    # 3 models x (1 + 10 x 2 rows) x 5 seeds = 315; fp16, kivi, h2o, snapkv skip seeds 1-4
    assert len(jobs) + skipped == 315 and skipped == 3 * (1 + 3 * 2) * 4


def test_a_job_costs_its_items_over_the_measured_rates():
    rates = read_rates(H200)
    jobs, tasks, _ = sweep_jobs(MAIN)
    fp16 = next(j for j in jobs if j.method == "fp16")
    one, many = job_seconds(fp16, tasks, rates, 1), job_seconds(fp16, tasks, rates, 32)
    # zero-shot: every request at plain transformers' measured rate (28.6/s at batch 1, 209.8 at 32)
    assert one["zeroshot"] == sum(PAPER_ITEMS["zeroshot"].values()) / 28.6
    assert many["zeroshot"] == sum(PAPER_ITEMS["zeroshot"].values()) / 209.8
    assert all(many[t] < one[t] for t in tasks)
    gear = next(j for j in jobs if j.method == "gear")
    assert job_seconds(gear, tasks, rates, 32)["ppl"] > 10 * many["ppl"]  # GEAR's measured 13.8x prefill


def test_the_command_prints_the_total_and_its_assumptions(capsys):
    assert main(["plan", str(MAIN), str(H200), "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "231 jobs (84 seeds skipped" in out and "GPU-hours" in out and "Assumptions:" in out


def test_a_batch_section_replaces_the_e2e_ratio(tmp_path):
    import json
    import shutil

    for name in ("anchor_batch.json", "e2e32k.json"):
        shutil.copy(H200 / name, tmp_path / name)
    rows = [{"section": "batch", "detail": {"task": "score", "method": "kivi", "batch": 8,
                                             "items_per_s": 50.0, "plain_items_per_s": 100.0}}]
    (tmp_path / "batch.json").write_text(json.dumps({"rows": rows}))
    rates, jobs = read_rates(tmp_path), sweep_jobs(MAIN)[0]
    kivi = next(j for j in jobs if j.method == "kivi")
    at8 = job_seconds(kivi, ["zeroshot"], rates, 8)["zeroshot"]
    assert at8 == sum(PAPER_ITEMS["zeroshot"].values()) / 183.1 * 2.0  # half plain's rate at batch 8
    at1 = job_seconds(kivi, ["zeroshot"], rates, 1)["zeroshot"]  # no batch-1 figure: the e2e prefill ratio
    assert at1 == sum(PAPER_ITEMS["zeroshot"].values()) / 28.6 * rates.prefill_ratio["kivi"]
