"""Weights & Biases: one run per job (config as config, metrics and measured bpd as summary).

``wandb.mode`` is ``offline`` by default (no account needed; upload later with
``wandb sync runs/<sweep>/<job>/wandb/offline-run-*``), ``online`` or ``disabled``. Runs are grouped
by experiment and named model/method/bpd/seed. A W&B failure never fails the job: it is logged.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
MODES = ("offline", "online", "disabled")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def run_name(result: dict) -> str:
    b = result["bpd"]
    v = "" if b.get("target_v") in (None, 16.0) else f"+v{b['target_v']}"
    return f"{result['model']}/{result['method']}/bpd{b.get('target_k')}{v}/seed{result['seed']}"


def log_result(result: dict, wandb_cfg: dict, out_dir: Path) -> None:
    mode = wandb_cfg.get("mode", "offline")
    if mode not in MODES:
        raise ValueError(f"wandb.mode={mode!r}; valid choices: {', '.join(MODES)}")
    if mode == "disabled":
        return
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(
            project=wandb_cfg.get("project", "kvbench"),
            entity=wandb_cfg.get("entity"),
            group=result["config"].get("experiment") or "adhoc",
            name=run_name(result),
            config=result["config"],
            dir=str(out_dir),
            mode=mode,
            reinit="finish_previous",
        )
        summary = flatten({k: result[k] for k in ("status", "bpd", "metrics", "timings")})
        run.log(summary)
        run.summary.update(summary)
        run.finish()
    except Exception as err:  # noqa: BLE001 - tracking must not lose a finished result
        log.warning("W&B logging failed (%s); result.json is unaffected", err)
