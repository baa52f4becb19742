"""Weights & Biases: one run per job (config as config, metrics and measured bpd as summary).

``wandb.mode`` is ``offline`` by default (no account needed; upload later with
``wandb sync runs/<sweep>/*/wandb/offline-run-*``, docs/sweeps.md), ``online`` or ``disabled``.
Runs are grouped by experiment (``adhoc`` outside one) and named model/method/bpd/seed. The run id
is derived from the job's identity (``job_id``, kvbench/store/identity.py) and its experiment, so a job
that is run again (after a failure, or with ``rerun=true``) updates its own W&B run instead of
adding a second one. A W&B failure never fails the job, and neither does a wrong ``wandb.mode``:
both are logged, and result.json is written before W&B is touched.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
MODES = ("offline", "online", "disabled")
#: result fields copied into the run's summary (slash-flattened: ``metrics/ppl/ptb``, ``bpd/measured_k``)
SUMMARY_FIELDS = (
    "status", "error", "model", "method", "seed", "job_id", "bpd", "metrics", "timings", "unsupported_tasks",
)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def _fmt(x) -> str:
    return "16" if x is None else f"{float(x):g}"


def run_name(result: dict) -> str:
    """``model/method/bpd/seed``, e.g. ``llama3_8b/cobra_kl/bpd1/seed0`` (``bpd1+v4`` for a K/V split)."""
    b = result["bpd"]
    v = "" if b.get("target_v") in (None, 16.0) else f"+v{_fmt(b['target_v'])}"
    return f"{result['model']}/{result['method']}/bpd{_fmt(b.get('target_k'))}{v}/seed{result['seed']}"


def group_name(result: dict) -> str:
    return (result.get("config") or {}).get("experiment") or "adhoc"


def run_id(result: dict) -> str | None:
    """A W&B run id stable across reruns of one job in one experiment (None without a job_id)."""
    jid = result.get("job_id")
    if not jid:
        return None
    return hashlib.sha256(f"{group_name(result)}/{jid}".encode()).hexdigest()[:16]


def summary_of(result: dict) -> dict:
    return flatten({k: result[k] for k in SUMMARY_FIELDS if k in result})


def log_result(result: dict, wandb_cfg: dict, out_dir: Path) -> None:
    mode = wandb_cfg.get("mode", "offline")
    if mode not in MODES:
        log.error("wandb.mode=%r; valid choices: %s. Not logged to W&B (result.json is written)",
                  mode, ", ".join(MODES))
        return
    if mode == "disabled":
        return
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        config = result.get("config") or {}
        run = wandb.init(
            project=wandb_cfg.get("project") or "kvbench",
            entity=wandb_cfg.get("entity"),
            group=group_name(result),
            job_type=result["method"],
            name=run_name(result),
            id=run_id(result),
            resume="allow",
            tags=[result["model"], result["method"], result["status"]],
            config=config,
            dir=str(out_dir),
            mode=mode,
            reinit="finish_previous",
        )
        run.summary.update(summary_of(result))
        run.finish(exit_code=0 if result["status"] != "failed" else 1)
    except Exception as err:  # noqa: BLE001 - tracking must not lose a finished result
        log.warning("W&B logging failed (%s); result.json is unaffected", err)
