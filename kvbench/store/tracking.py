"""Weights & Biases tracking of one job: a run that lives as long as the job (docs/sweeps.md).

:func:`start_tracking` is called when the job starts, before the model loads: ``wandb.mode`` is
``offline`` (default: no account or network; the run lies in ``<job dir>/wandb/offline-run-*``,
``wandb sync`` uploads it), ``online`` or ``disabled``. It returns a :class:`Tracker`:

* ``progress(section, step, **values)`` while the job runs (the job passes it down as the
  context's :data:`kvbench.context.Progress`): the run's history, one curve per value, each
  against its section's own step;
* ``finish(result, predictions, figures, out_dir)`` after result.json is written: summary (numbers
  only), labels in the config, the metrics and predictions tables, the figures, the artifact, and
  the run's end with the job's status (``failed`` ends it as failed);
* ``abort(exit_code)`` when the job is interrupted (Ctrl-C, ``SystemExit``): the run ends as
  failed with what it had logged.

``disabled`` (and a wrong ``wandb.mode``, which is logged) gives the inert :class:`Tracker`:
wandb is not even imported. A W&B failure never fails the job and never touches result.json
(:mod:`.wandb_run`). Names, group, id, config and summary: :mod:`.wandb_keys`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .wandb_keys import code_version, group_name, run_config, run_id, run_name

log = logging.getLogger(__name__)
MODES = ("offline", "online", "disabled")
#: seconds an online ``wandb.init`` may take before the run is opened offline instead
INIT_TIMEOUT_S = 20.0


class Tracker:
    """No tracking: every call does nothing."""

    enabled = False
    run_id = None

    def progress(self, section: str, step: int, **values) -> None:
        """Nothing to record."""

    def finish(self, result: dict, predictions: dict, figures: list, out_dir: Path) -> None:
        """Nothing to close."""

    def abort(self, exit_code: int) -> None:
        """Nothing to close."""


class _Tracked(Tracker):
    """A job with a W&B run (:class:`kvbench.store.wandb_run.WandbRun`)."""

    def __init__(self, run):
        self._run = run

    @property
    def enabled(self) -> bool:
        return self._run.enabled

    @property
    def run_id(self) -> str:
        return self._run.run_id

    def progress(self, section: str, step: int, **values) -> None:
        self._run.progress(section, step, **values)

    def finish(self, result: dict, predictions: dict, figures: list, out_dir: Path) -> None:
        self._run.finish(result, predictions, figures, out_dir)

    def abort(self, exit_code: int) -> None:
        self._run.close(exit_code)


def run_spec(result: dict, wandb_cfg: dict, out_dir: Path) -> dict:
    """The keyword arguments of ``wandb.init`` for the job whose fresh result is ``result``."""
    config = result.get("config") or {}
    group = group_name(config, out_dir)
    code = code_version(result.get("versions") or {})
    return {
        "project": wandb_cfg.get("project") or "kvbench",
        "entity": wandb_cfg.get("entity"),
        "group": group,
        "job_type": result["method"],
        "name": run_name(result),
        "id": run_id(group, result.get("job_id"), code),
        "tags": [result["model"], result["method"]],
        "config": run_config(result, out_dir, code),
        "dir": str(out_dir),
    }


def start_tracking(wandb_cfg: dict, result: dict, out_dir: Path) -> Tracker:
    """The job's tracker: a live W&B run, or the inert :class:`Tracker` (``disabled``, a wrong
    mode, or a run that could not be opened: each logged)."""
    mode = wandb_cfg.get("mode", "offline")
    if mode not in MODES:
        log.error("wandb.mode=%r; valid choices: %s. Not logged to W&B (result.json is written)",
                  mode, ", ".join(MODES))
        return Tracker()
    if mode == "disabled":
        return Tracker()
    try:
        from .wandb_run import start_run

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        spec = run_spec(result, wandb_cfg, Path(out_dir))
        run = start_run(spec, mode, float(wandb_cfg.get("init_timeout") or INIT_TIMEOUT_S))
        log.info("W&B run %s (%s, group %s) in %s", run.run_id, mode, spec["group"], out_dir)
        return _Tracked(run)
    except Exception as err:  # noqa: BLE001 - tracking must not fail the job
        log.warning("W&B run not started (%s); the job runs untracked, result.json is unaffected", err)
        return Tracker()
