"""Runs from Weights & Biases (public API) converted to the result.json record schema.

A kvbench W&B run keeps the resolved Hydra config as its config and the result fields in its
summary. Accepted summary layouts, in order of preference:

1. ``summary["result"]``: the whole result record;
2. nested keys as in result.json (``status``, ``bpd``, ``metrics``, ``timings``...);
3. slash-flattened keys as ``wandb.log`` writes them (``metrics/ppl/wikitext2``,
   ``bpd/measured_k``), or metric groups at the top level (``ppl/wikitext2``).

Missing ``model``/``method``/``seed`` come from the config (``model.name`` or ``model``);
missing target budgets from ``config.bpd``/``config.v_bpd``. A run without a ``status`` counts
as ``failed`` when W&B marks it failed/crashed/killed and ``ok`` when finished; running runs are
skipped.

A run that kvbench writes (kvbench/store/wandb_keys.py) keeps numbers only in its summary: its
status, error and labels (``metrics/zeroshot/metric/piqa = acc_norm``, ``counts/ppl_track``...)
are in the config under ``kvbench``, and its scores are in percent (``kvbench.units.score``), so
zero-shot accuracy is divided by 100 again: the record is the result.json one.
"""

from __future__ import annotations

from typing import Any, Iterable

import pandas as pd

from analysis.load import NoResultsError, records_to_frame, validate_record, warn

RESERVED = {"status", "error", "model", "method", "seed", "bpd", "metrics", "timings", "config",
            "versions", "result"}
STATE_STATUS = {"finished": "ok", "failed": "failed", "crashed": "failed", "killed": "failed"}


def unflatten(flat: dict[str, Any], sep: str) -> dict[str, Any]:
    """``{"a/b": 1, "a/c": 2}`` -> ``{"a": {"b": 1, "c": 2}}``; keys starting with "_" dropped."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        if str(key).startswith("_"):
            continue
        parts = str(key).split(sep)
        node = tree
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]].update(unflatten(value, sep))
        else:
            node[parts[-1]] = unflatten(value, sep) if isinstance(value, dict) else value
    return tree


def _name(value: Any) -> Any:
    """A config group's name: ``{"name": "llama3_8b", ...}`` -> ``"llama3_8b"``."""
    return value.get("name") if isinstance(value, dict) else value


def summary_dict(run: Any) -> dict[str, Any]:
    """The run's summary as a plain dict, whatever the wandb version exposes."""
    metrics = getattr(run, "summary_metrics", None)
    if isinstance(metrics, dict):
        return dict(metrics)
    summary = getattr(run, "summary", None) or {}
    json_dict = getattr(summary, "_json_dict", None)
    return dict(json_dict) if isinstance(json_dict, dict) else dict(summary)


#: the job type of the runs ``--wandb-log`` writes (analysis/wandb_log.py): skipped when reading
ANALYSIS_JOB_TYPE = "analysis"
#: the result groups whose scores result.json keeps as fractions (W&B: percent)
FRACTION_GROUPS = ("zeroshot",)


def merge(tree: dict, other: dict) -> dict:
    """``other``'s leaves added into ``tree`` (in place), nested dicts merged."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            merge(tree[key], value)
        else:
            tree[key] = value
    return tree


def from_percent(metrics: dict) -> None:
    """Zero-shot scores in percent back to lm-eval's fractions (counts and times unchanged)."""
    for group in FRACTION_GROUPS:
        values = metrics.get(group)
        if not isinstance(values, dict):
            continue
        for key, value in list(values.items()):
            if key == "counts" or key.endswith("_s"):
                continue
            if isinstance(value, dict):
                values[key] = {k: v / 100.0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                               for k, v in value.items()}
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = value / 100.0


def run_to_record(run: Any) -> dict[str, Any] | None:
    """One W&B run -> a result record (same schema as result.json), or None for a running run."""
    config = unflatten(dict(getattr(run, "config", {}) or {}), ".")
    summary = unflatten(summary_dict(run), "/")
    if isinstance(summary.get("result"), dict):
        record = dict(summary["result"])
        record.setdefault("config", config)
        return record
    kvbench = config.get("kvbench") if isinstance(config.get("kvbench"), dict) else {}
    merge(summary, unflatten(dict(kvbench.get("labels") or {}), "/"))
    for key in ("status", "error", "unsupported_tasks"):
        if summary.get(key) is None and kvbench.get(key) is not None:
            summary[key] = kvbench[key]
    if (kvbench.get("units") or {}).get("score") == "percent" and isinstance(summary.get("metrics"), dict):
        from_percent(summary["metrics"])
    state = getattr(run, "state", None)
    status = summary.get("status")
    if status is None:
        if state not in STATE_STATUS:
            return None
        status = STATE_STATUS[state]
    metrics = summary.get("metrics")
    if not isinstance(metrics, dict):
        metrics = {k: v for k, v in summary.items() if k not in RESERVED and isinstance(v, dict)}
    bpd = dict(summary.get("bpd") or {})
    bpd.setdefault("target_k", config.get("bpd"))
    bpd.setdefault("target_v", config.get("v_bpd"))
    return {
        "status": status,
        "error": summary.get("error"),
        "model": summary.get("model") or _name(config.get("model")),
        "method": summary.get("method") or _name(config.get("method")),
        "seed": summary.get("seed", config.get("seed")),
        "bpd": bpd,
        "metrics": metrics,
        "timings": summary.get("timings") or {},
        "counts": summary.get("counts") or {},
        "unsupported_tasks": summary.get("unsupported_tasks") or {},
        "config": config,
        "versions": summary.get("versions") or {},
    }


def runs_to_frame(runs: Iterable[Any], project: str) -> pd.DataFrame:
    """Convert W&B runs into the runs DataFrame; unusable runs are skipped with a warning."""
    records = []
    for run in runs:
        if getattr(run, "job_type", None) == ANALYSIS_JOB_TYPE:  # a table, not a job (--wandb-log)
            continue
        source = f"wandb:{project}/{getattr(run, 'id', '?')}"
        record = run_to_record(run)
        if record is None:
            warn(f"skipping {source}: run state is {getattr(run, 'state', None)!r}")
            continue
        problem = validate_record(record)
        if problem:
            warn(f"skipping {source}: {problem}")
            continue
        records.append((source, record))
    if not records:
        raise NoResultsError(f"no usable runs in W&B project '{project}'")
    return records_to_frame(records)


def load_wandb(project: str, api: Any = None) -> pd.DataFrame:
    """All runs of ``ENTITY/PROJECT`` via the W&B public API (needs network and a login)."""
    if project.count("/") != 1:
        raise ValueError(f"--wandb expects ENTITY/PROJECT, got '{project}'")
    if api is None:
        import wandb
        api = wandb.Api()
    return runs_to_frame(api.runs(project), project)
