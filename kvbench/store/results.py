"""result.json: the contract of docs/design.md §4, written atomically.

A result is written to a temporary file in the same directory, flushed to disk, then renamed over
``result.json``; a crash at any moment leaves either the previous file or the new one, never a
truncated one. The file is left with mode 0644 (``tempfile`` creates 0600): collaborators reading a
shared sweep directory can open it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
from pathlib import Path

STATUSES = ("ok", "unsupported", "diverged", "failed")
FINISHED = ("ok", "unsupported", "diverged")
RESULT_FILE = "result.json"
#: per-item generations, written beside result.json (they would make it large)
PREDICTIONS_FILE = "predictions.json"
#: rw-r--r--: readable by the group and others (a plain ``open(..., "w")`` under umask 022)
RESULT_MODE = 0o644


def new_result(model: str, method: str, seed: int, target_k, target_v) -> dict:
    return {
        "status": "failed",
        "error": None,
        "model": model,
        "method": method,
        "seed": seed,
        "bpd": {"target_k": target_k, "target_v": target_v, "measured_k": None, "measured_v": None},
        "metrics": {},
        "timings": {},
        "config": {},
        "versions": versions(),
    }


def write_result(result: dict, out_dir: Path) -> Path:
    """The job's files: ``result["predictions"]`` (taken out of the result) into
    ``predictions.json`` when there are any, the result into ``result.json``; returns its path."""
    predictions = result.pop("predictions", None)
    if predictions:
        write_atomic(Path(out_dir) / PREDICTIONS_FILE, predictions)
    return write_atomic(Path(out_dir) / RESULT_FILE, result)


def _finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _clean(obj):
    """JSON has no NaN/inf: store them as null (the status says why)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _finite_or_none(obj)


def has_nonfinite(obj) -> bool:
    if isinstance(obj, dict):
        return any(has_nonfinite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_nonfinite(v) for v in obj)
    return isinstance(obj, float) and not math.isfinite(obj)


def write_atomic(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_clean(payload), f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, RESULT_MODE)  # before the rename: result.json is never seen as 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_result(path: str | Path) -> dict | None:
    """The result in ``path`` or None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


#: the checkout whose code a result comes from
HERE = Path(__file__).resolve().parent


def git_commit(cwd: Path = HERE) -> str | None:
    """The checkout's commit, ``-dirty`` appended when tracked files differ from it; None outside
    git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def diff_digest(cwd: Path = HERE) -> str:
    """8 hex digits of SHA-256 over ``git diff HEAD`` (the uncommitted change a ``-dirty`` commit
    carries); ``unknown`` when git cannot say."""
    try:
        out = subprocess.run(["git", "diff", "HEAD"], cwd=cwd, capture_output=True, timeout=10)
        return hashlib.sha256(out.stdout).hexdigest()[:8] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_state(cwd: Path = HERE) -> dict:
    """``git_commit`` and ``git_diff``: the :func:`diff_digest` of a ``-dirty`` commit, else None."""
    commit = git_commit(cwd)
    dirty = commit is not None and commit.endswith("-dirty")
    return {"git_commit": commit, "git_diff": diff_digest(cwd) if dirty else None}


def versions() -> dict:
    import torch

    info = {**code_state(), "python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "lm_eval", "datasets", "hydra", "wandb"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is recorded as None
            info[pkg] = None
    info["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    return info
