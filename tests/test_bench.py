"""Smoke test of ``python -m kvbench.bench`` (issue 7) on tiny shapes.

Checks the JSON report's structure and that every row carries a number and a verdict. No timing
assertions: the numbers of a smoke run mean nothing, and the machine may be busy.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench import bench

SECTIONS = {"overhead", "allocation", "codecs", "memory", "calibration"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    threads = torch.get_num_threads()
    # one thread: a loaded 2-core machine makes multi-threaded tiny ops pathologically slow
    bench.main(["--smoke", "--model", "tiny", "--threads", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads  # restored
    return json.loads(out.read_text())


def test_report_structure(report):
    for key in ("schema", "command", "date", "preset", "sizes", "model", "machine", "load_avg",
                "seconds", "rows", "summary", "table_markdown"):
        assert key in report, key
    assert report["preset"] == "smoke"
    assert report["command"].startswith("python -m kvbench.bench --smoke")
    assert report["model"]["name"] == "tiny"
    assert {r["section"] for r in report["rows"]} == SECTIONS
    s = report["summary"]
    assert s["rows"] == len(report["rows"]) == s["pass"] + s["miss"]


def test_every_row_has_a_number_and_a_verdict(report):
    for row in report["rows"]:
        assert isinstance(row["value"], float) and math.isfinite(row["value"]), row
        assert row["verdict"] in ("PASS", "MISS"), row
        assert row["op"] in ("<=", "<", ">=") and isinstance(row["target"], float), row
        assert row["name"] and row["shown"] and row["target_text"], row


def test_rows_cover_every_method(report):
    by = {}
    for row in report["rows"]:
        by.setdefault(row["section"], []).append(row)
    methods = {"kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl", "h2o"}
    assert {r["detail"]["method"] for r in by["overhead"]} == methods
    codecs = [r for r in by["codecs"] if not r["name"].startswith("bound:")]
    assert {r["detail"]["method"] for r in codecs} == methods | {"snapkv"}
    assert len(by["codecs"]) == len(codecs) + 1  # the conversion bound under every codec row
    assert {r["detail"]["method"] for r in by["memory"]} == methods | {"snapkv"}
    assert {r["detail"]["heads"] for r in by["allocation"]} == {256, 112}
    for row in by["memory"]:
        d = row["detail"]
        assert d["bytes_held"] > 0 and len(d["measured_bpd"]) == len(d["nominal_bpd"]) == 2


def test_verdict_follows_the_target():
    assert bench.Row("s", "r", "m", 1.0, "x", "<=", 1.15).verdict == "PASS"
    assert bench.Row("s", "r", "m", 1.2, "x", "<=", 1.15).verdict == "MISS"
    assert bench.Row("s", "r", "m", 30.0, "%", ">=", 25.0).verdict == "PASS"
    assert bench.Row("s", "r", "m", float("nan"), "%", ">=", 25.0).verdict == "MISS"
