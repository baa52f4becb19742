"""result.json: schema of docs/design.md §4 and the atomic write."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from kvbench.store import results
from kvbench.store.results import code_state, new_result, read_result, write_atomic
from kvbench.store.wandb_keys import code_version


def test_schema_keys():
    r = new_result("smollm2_135m", "cobra_kl", 0, 1.0, 16.0)
    assert set(r) >= {"status", "error", "model", "method", "seed", "bpd", "metrics", "timings",
                      "config", "versions"}
    assert set(r["bpd"]) == {"target_k", "target_v", "measured_k", "measured_v"}
    assert r["versions"]["torch"] and "transformers" in r["versions"]


def test_nonfinite_values_become_null(tmp_path):
    path = write_atomic(tmp_path / "result.json", {"metrics": {"ppl": {"ptb": float("nan")}}})
    assert json.loads(path.read_text())["metrics"]["ppl"]["ptb"] is None


def test_crash_mid_write_leaves_previous_result(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    write_atomic(path, {"status": "ok", "n": 1})

    def exploding_dump(obj, f, **kw):
        f.write('{"status": "ok", "trunc')  # half a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(results.json, "dump", exploding_dump)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, {"status": "ok", "n": 2})
    assert read_result(path) == {"status": "ok", "n": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left behind


def test_read_result_of_garbage_is_none(tmp_path):
    bad = tmp_path / "result.json"
    bad.write_text('{"status": ')
    assert read_result(bad) is None
    assert read_result(tmp_path / "absent.json") is None


def test_result_file_is_readable_by_the_group(tmp_path):
    import os
    import stat

    old = os.umask(0o077)  # the strictest umask a cluster account may have: mode is set, not masked
    try:
        path = write_atomic(tmp_path / "result.json", {"status": "ok"})
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # tempfile alone leaves 0600
        write_atomic(path, {"status": "ok", "n": 2})  # a rewrite too (the rename: a new inode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def _git(repo, *args) -> bytes:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                           *args], cwd=repo, check=True, capture_output=True).stdout


def test_a_dirty_tree_records_the_digest_of_its_diff(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    clean = code_state(tmp_path)
    assert len(clean["git_commit"]) == 40 and clean["git_diff"] is None
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty = code_state(tmp_path)
    assert dirty["git_commit"] == clean["git_commit"] + "-dirty"
    assert dirty["git_diff"] == hashlib.sha256(_git(tmp_path, "diff", "HEAD")).hexdigest()[:8]
    (tmp_path / "a.py").write_text("x = 3\n")
    assert code_state(tmp_path)["git_diff"] not in (None, dirty["git_diff"])  # another diff, another digest
    # the W&B run's code version names the digest the result recorded
    assert code_version(dirty) == f"{clean['git_commit'][:12]}+{dirty['git_diff']}"


def test_result_versions_name_the_diff_of_a_dirty_commit():
    v = new_result("smollm2_135m", "kivi", 0, 2.0, None)["versions"]
    assert "git_diff" in v
    assert (v["git_diff"] is not None) == (v["git_commit"] or "").endswith("-dirty")
