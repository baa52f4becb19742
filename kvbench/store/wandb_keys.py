"""What a job's W&B run is called and what its config and summary hold, as plain data (no wandb
import; docs/sweeps.md, "Weights & Biases").

* **name** ``model/method/bpd/seed``, e.g. ``llama3_8b/cobra_kl/bpd1/seed0`` (``bpd1+v4`` for a K/V
  split).
* **group**: the name of the Hydra sweep directory the job's output directory lies in (the nearest
  ancestor holding Hydra's ``multirun.yaml``), else the ``experiment``, else ``single``. A sweep's
  directory comes first so that two sweeps of one experiment kept side by side
  (``hydra.sweep.dir=...``) stay apart, and so that ``python -m analysis ... runs/<sweep>
  --wandb-log`` lands in the same group as the sweep's jobs; an experiment's sweep directory is
  ``runs/<experiment>``, so its group is the experiment's name.
* **id**: 16 hex digits of SHA-256 over the group, the job id (kvbench/store/identity.py) and the
  code version (the git commit; a dirty tree adds a digest of ``git diff HEAD``). A job run again
  on the same code updates its own run; after a code change it gets a new run, so that no key of
  the earlier code's run can pass as current. The run's config records the commit as well.
* **config**: the resolved Hydra config plus ``kvbench`` (job id, commit, code version, output
  directory, the units below; at the end the status, the error's last line, the tasks a method
  could not run and every label of the result: the strings, flags and lists that are not
  measurements, e.g. ``metrics/zeroshot/metric/piqa = acc_norm``).
* **summary**: numbers only: ``metrics/<task>/...``, ``bpd/...`` with ``bpd/measured_kv`` (the mean
  of ``measured_k`` and ``measured_v``), ``timings/...``, ``counts/...``, ``seed``,
  ``static_bytes``.

Units, one per kind of number (:data:`UNITS`): every score is in percent (0-100) in W&B. result.json
keeps zero-shot accuracy as lm-eval's fraction (docs/design.md §4); its W&B keys are multiplied by
100 (:func:`wandb_value`), and ``analysis`` reading runs back divides them again (the config's
``kvbench.units.score`` says so).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from .results import diff_digest

#: the unit of each kind of number a run holds, recorded in its config (``kvbench.units``)
UNITS = {
    "score": "percent",  # accuracy, F1, RULER's string match: metrics/zeroshot, longbench, longqa_squad, ruler*
    "ppl": "perplexity",
    "nll": "nats per token",
    "bpd": "bits per element",
    "time": "seconds",
    "count": "items",
}
#: the metric groups whose scores result.json keeps as fractions in [0, 1]
FRACTION_GROUPS = frozenset({"zeroshot"})
#: the group of a single run, outside any sweep and experiment
SINGLE = "single"
#: Hydra's record of a sweep, written in the sweep directory before its jobs start
SWEEP_MARK = "multirun.yaml"
#: how many directories above a job's output directory the sweep directory is looked for (an
#: override such as ``model.path=/a/b`` puts slashes into Hydra's job subdirectory)
SWEEP_DEPTH = 6
ID_LENGTH = 16


def _fmt(x) -> str:
    if x is None:
        return "16"
    return f"{float(x):g}" if is_number(x) else str(x)


def run_name(result: dict) -> str:
    """``model/method/bpd/seed``, e.g. ``llama3_8b/cobra_kl/bpd1/seed0`` (``bpd1+v4`` for a K/V
    split). Before the job has set its targets (when the run opens), the budget as configured
    (``bpd``, ``v_bpd``: ``+vauto`` for a split still to be chosen); the run is renamed when it
    closes."""
    b, cfg = result.get("bpd") or {}, result.get("config") or {}
    k, v = b.get("target_k"), b.get("target_v")
    if k is None and v is None:
        k, v = cfg.get("bpd"), cfg.get("v_bpd")
    tail = "" if v is None or (is_number(v) and float(v) == 16.0) else f"+v{_fmt(v)}"
    return f"{result['model']}/{result['method']}/bpd{_fmt(k)}{tail}/seed{result['seed']}"


def sweep_dir(out_dir: Path) -> Path | None:
    """The Hydra sweep directory ``out_dir`` lies in (the nearest ancestor with ``multirun.yaml``)."""
    for parent in list(Path(out_dir).resolve().parents)[:SWEEP_DEPTH]:
        if (parent / SWEEP_MARK).is_file():
            return parent
    return None


def group_name(config: dict, out_dir: Path) -> str:
    """The sweep directory's name, else the experiment, else :data:`SINGLE`."""
    sweep = sweep_dir(out_dir)
    if sweep is not None:
        return sweep.name
    return (config or {}).get("experiment") or SINGLE


def code_version(versions: dict) -> str:
    """The code a result came from: 12 digits of the commit, ``+<diff digest>`` for a dirty tree
    (the result's ``git_diff``, else :func:`kvbench.store.results.diff_digest` now),
    ``unversioned`` outside git."""
    versions = versions or {}
    commit = versions.get("git_commit") or ""
    if not commit:
        return "unversioned"
    base = commit.split("-")[0][:12]
    if not commit.endswith("-dirty"):
        return base
    return f"{base}+{versions.get('git_diff') or diff_digest()}"


def run_id(group: str, job_id: str | None, code: str) -> str | None:
    """The W&B run id of a job (None without a job id): stable across reruns of one job in one
    group on one code version."""
    if not job_id:
        return None
    return hashlib.sha256(f"{group}/{job_id}/{code}".encode()).hexdigest()[:ID_LENGTH]


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def wandb_value(path: str, value: float) -> float:
    """``value`` of the result key ``metrics/<group>/...`` in the W&B unit: a score of a
    :data:`FRACTION_GROUPS` group in percent; counts and times unchanged."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == "metrics" and parts[1] in FRACTION_GROUPS:
        if "counts" not in parts[2:] and not parts[-1].endswith("_s"):
            return 100.0 * value
    return value


def _walk(obj, prefix: str):
    """(slash path, leaf) of every leaf of nested dicts (lists are leaves)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, obj


def summary_of(result: dict) -> dict[str, float]:
    """The run's summary: every number of the result's metrics, bpd, timings and counts
    (slash-flattened, W&B units), ``bpd/measured_kv``, ``seed`` and ``static_bytes``."""
    out: dict[str, float] = {}
    for section in ("metrics", "bpd", "timings", "counts"):
        for path, value in _walk(result.get(section) or {}, section):
            if is_number(value):
                out[path] = wandb_value(path, value)
    b = result.get("bpd") or {}
    if is_number(b.get("measured_k")) and is_number(b.get("measured_v")):
        out["bpd/measured_kv"] = (b["measured_k"] + b["measured_v"]) / 2
    if is_number(b.get("target_k")) and is_number(b.get("target_v")):
        out.setdefault("bpd/target_kv", (b["target_k"] + b["target_v"]) / 2)
    for key in ("seed", "static_bytes"):
        if is_number(result.get(key)):
            out[key] = result[key]
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}


def labels_of(result: dict) -> dict:
    """Everything of the result's metrics, bpd and counts that is not a number (names, flags,
    lists, strings), slash-flattened: it goes to the run's config, never its summary."""
    out = {}
    for section in ("metrics", "bpd", "counts"):
        for path, value in _walk(result.get(section) or {}, section):
            if value is not None and not is_number(value):
                out[path] = value
    return out


def last_line(error: str | None) -> str | None:
    """An error's last line (its traceback stays in result.json)."""
    if not error:
        return None
    lines = error.strip().splitlines()
    return lines[-1][:500] if lines else None


def run_config(result: dict, out_dir: Path, code: str) -> dict:
    """The config a run starts with: the resolved Hydra config and ``kvbench``'s identity."""
    return {
        **(result.get("config") or {}),
        "kvbench": {
            "job_id": result.get("job_id"),
            "commit": (result.get("versions") or {}).get("git_commit"),
            "code": code,
            "out_dir": str(Path(out_dir).resolve()),
            "units": dict(UNITS),
        },
    }


def final_config(result: dict) -> dict:
    """What the run's config gains at the end (under ``kvbench``): status, error, labels."""
    return {
        "status": result.get("status"),
        "error": last_line(result.get("error")),
        "unsupported_tasks": result.get("unsupported_tasks") or {},
        "labels": labels_of(result),
    }
