"""Entries of ``$KVBENCH_CACHE`` shared by parallel jobs (a SLURM array, ``hydra/launcher=joblib``).

Each entry (a converted checkpoint, calibration statistics, a held-out choice) is computed once and
read by every other job: :func:`computed_once` holds an inter-process file lock (``filelock``,
which comes with huggingface_hub) beside the entry while it checks for the entry and, if it is
absent, computes it; a job that finds the lock taken waits and then reads what the first one
wrote. Writes go to a temporary name unique to the process and are renamed into place
(:func:`unique_tmp`), so no reader ever sees a half-written file, even without the lock.

:func:`cached_json` is that pattern for a JSON entry named by the hash of its key: every held-out
choice and measurement of :mod:`kvbench.fit` is cached through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

#: seconds a job waits for another one computing the same entry before giving up
LOCK_TIMEOUT_S = 6 * 3600


def cache_dir() -> Path:
    """``$KVBENCH_CACHE``, or ``~/.cache/kvbench`` when it is unset or empty (an empty value would
    otherwise put the cache in the working directory)."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench")


def unique_tmp(path: Path) -> Path:
    """A temporary sibling of ``path`` no other process uses (pid and a nanosecond clock)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")


@contextlib.contextmanager
def computed_once(path: Path):
    """Hold the lock of cache entry ``path`` for the duration of the block: check, compute, write."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.with_name(f".{path.name}.lock")), timeout=LOCK_TIMEOUT_S)
    if lock.is_locked:
        log.info("waiting for another job computing %s", path.name)
    with lock:
        yield


def json_entry(kind: str, key: dict) -> Path:
    """``$KVBENCH_CACHE/<kind>/<16 hex digits of the key's hash>.json``; the key is hashed as
    sorted JSON (values that JSON cannot hold by their ``str``)."""
    blob = json.dumps(key, sort_keys=True, default=str)
    return cache_dir() / kind / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"


def write_json(path: Path, payload: dict) -> None:
    """``payload`` into ``path`` through a temporary file, renamed into place."""
    tmp = unique_tmp(path)
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def cached_json(kind: str, key: dict, compute: Callable[[], dict]) -> dict:
    """The entry of ``key`` under ``kind``: read when present, else ``compute()``d (once across
    parallel jobs) and written; with ``cache_hit`` added (True when read), which a result records
    so that a reader knows the time of a hit is not the time of the computation."""
    path = json_entry(kind, key)
    with computed_once(path):
        if path.exists():
            log.info("%s from cache %s", kind, path)
            return {**json.loads(path.read_text()), "cache_hit": True}
        out = compute()
        write_json(path, out)
    return {**out, "cache_hit": False}
