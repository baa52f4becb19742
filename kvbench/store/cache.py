"""Entries of ``$KVBENCH_CACHE`` shared by parallel jobs (a SLURM array, ``hydra/launcher=joblib``).

Each entry (a converted checkpoint, a calibration statistics file, a K/V split) is computed once
and read by every other job: :func:`computed_once` holds an inter-process file lock (``filelock``,
which comes with huggingface_hub) beside the entry while it checks for the entry and, if it is
absent, computes it; a job that finds the lock taken waits and then reads what the first one
wrote. Writes go to a temporary name unique to the process and are renamed into place
(:func:`unique_tmp`), so no reader ever sees a half-written file, even without the lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: seconds a job waits for another one computing the same entry before giving up
LOCK_TIMEOUT_S = 6 * 3600


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
