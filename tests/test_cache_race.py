"""Parallel jobs on one empty ``$KVBENCH_CACHE`` (a SLURM array, ``hydra/launcher=joblib``): each
cache entry is computed once and read by the others (kvbench/store/cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from kvbench.store.cache import computed_once, unique_tmp

JOB = [
    "method=cobra_kl", "bpd=1.0", "tasks=[ppl]", "task.ppl.datasets=[ptb]", "task.ppl.seqlen=64",
    "limit=1", "calibration.n_windows=2", "calibration.seqlen=64", "wandb.mode=disabled",
]


@pytest.mark.slow
def test_two_jobs_on_an_empty_cache_convert_and_calibrate_once(tmp_path):
    from kvbench.model.loading import ModelNotFound, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelNotFound as err:
        pytest.skip(str(err))
    env = {**os.environ, "KVBENCH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(2):
        out = tmp_path / f"job{i}"
        cmd = [sys.executable, "-m", "kvbench.run", *JOB, "seed=0", f"hydra.run.dir={out}"]
        procs.append((out, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    logs = []
    for out, proc in procs:
        text, _ = proc.communicate(timeout=600)
        logs.append(text)
        assert proc.returncode == 0, text[-2000:]
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "ok", result["error"]
    joined = "\n".join(logs)
    assert joined.count("to safetensors in") == 1  # one conversion between the two jobs
    assert joined.count("calibrating on") == 1  # one calibration pass; the other read the file
    assert len(list((tmp_path / "cache" / "calibration").glob("*.pt"))) == 1
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_computed_once_serializes_writers(tmp_path):
    """Threads stand in for processes (filelock locks are per file handle): the entry is computed
    by exactly one of them, and every one reads the complete file."""
    path = tmp_path / "entry.json"
    computed, seen = [], []

    def job(i):
        with computed_once(path):
            if not path.exists():
                computed.append(i)
                time.sleep(0.2)
                tmp = unique_tmp(path)
                tmp.write_text(json.dumps({"by": i}))
                tmp.replace(path)
        seen.append(json.loads(path.read_text())["by"])

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1 and seen == [computed[0]] * 4
    assert unique_tmp(path) != unique_tmp(path) and unique_tmp(path).parent == Path(tmp_path)
