"""A job's live W&B run: opened when the job starts, fed progress while it runs, closed with its
tables, figures, artifact and status (:mod:`kvbench.store.tracking` decides whether there is one;
the names and numbers come from :mod:`.wandb_keys` and :mod:`.wandb_tables`).

W&B never fails a job: every call here catches what W&B raises, logs it once and stops tracking
(result.json is written before the run is closed, and does not depend on it). It does not hold a
job up either: offline is the default; online, ``wandb.init`` gets ``wandb.init_timeout`` seconds
(the config's ``wandb`` block) and a run that cannot start online is opened offline instead, with a
warning that says how to upload it. An id W&B refuses (a run deleted in the UI keeps its id
forever, or another conflict) is replaced by a fresh one, and the log says so.

The run's ``.wandb`` file is flushed every :data:`FLUSH_S` seconds, so a job killed without
warning (the OOM killer, a SLURM time limit) leaves a run that holds its progress up to then and
that W&B shows as crashed once synced.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from .wandb_keys import final_config, run_name, summary_of
from .wandb_tables import METRIC_COLUMNS, PREDICTION_COLUMNS, metric_rows, prediction_rows

log = logging.getLogger(__name__)
#: seconds between two flushes of the run's .wandb file (W&B's default is 15)
FLUSH_S = 2.0
#: what W&B's refusal of a run id says (a deleted run's id, an id taken by another run)
ID_REFUSED = re.compile(r"delet|conflict|already exists|409|not allowed to resume|cannot resume", re.I)


def _settings(wandb, timeout: float):
    """The run's settings; an SDK without the flush-interval setting keeps its own default."""
    try:
        return wandb.Settings(init_timeout=float(timeout), x_transaction_log_flush_interval=FLUSH_S,
                              silent=True)
    except Exception:  # noqa: BLE001 - an older SDK rejects the unknown setting
        return wandb.Settings(init_timeout=float(timeout), silent=True)


def _reinit(wandb):
    """``reinit`` that finishes a previous run of the process: ``"finish_previous"`` from wandb
    0.19.10 on, ``True`` before (GPU images may carry an older SDK)."""
    try:
        version = tuple(int(x) for x in re.findall(r"\d+", wandb.__version__)[:3])
    except Exception:  # noqa: BLE001
        return "finish_previous"
    return "finish_previous" if version >= (0, 19, 10) else True


def open_run(wandb, spec: dict, mode: str, timeout: float):
    """``wandb.init(**spec)`` in ``mode``; online, an id W&B refuses is retried once with a fresh
    id, and an init that still fails (no network, a timeout, no login) is opened offline."""
    def init(run_mode: str, run_id: str | None):
        return wandb.init(**{**spec, "id": run_id}, mode=run_mode, resume="allow",
                          reinit=_reinit(wandb), settings=_settings(wandb, timeout))

    try:
        return init(mode, spec.get("id"))
    except Exception as err:  # noqa: BLE001 - W&B's errors differ by version and transport
        if mode != "online":
            raise
        first = err
    if ID_REFUSED.search(str(first)):
        fresh = wandb.util.generate_id()
        log.warning("W&B refused the run id %s (%s); logging to the fresh id %s",
                    spec.get("id"), str(first).splitlines()[0][:200], fresh)
        try:
            return init("online", fresh)
        except Exception as err:  # noqa: BLE001
            first = err
    log.warning("W&B online init failed (%s): logging OFFLINE into %s/wandb instead; upload it "
                "later with `wandb sync %s/wandb/offline-run-*`", str(first).splitlines()[0][:200],
                spec["dir"], spec["dir"])
    return init("offline", spec.get("id"))


class WandbRun:
    """The open W&B run of one job."""

    enabled = True

    def __init__(self, wandb, run):
        self._wandb, self._run = wandb, run
        self._defined: set[str] = set()

    @property
    def run_id(self) -> str:
        return self._run.id

    def _stop(self, what: str, err: Exception) -> None:
        log.warning("W&B %s failed (%s); tracking stops here, result.json is unaffected", what, err)
        self.enabled = False

    def progress(self, section: str, step: int, **values) -> None:
        """One history row of ``section``: ``<section>/step`` and ``<section>/<name>`` per number
        in ``values``, each key plotted against its section's own step (``define_metric``)."""
        if not self.enabled:
            return
        try:
            step_key = f"{section}/step"
            row = {step_key: step}
            if step_key not in self._defined:
                self._run.define_metric(step_key)
                self._defined.add(step_key)
            for name, value in values.items():
                if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                key = f"{section}/{name}"
                if key not in self._defined:
                    self._run.define_metric(key, step_metric=step_key)
                    self._defined.add(key)
                row[key] = value
            self._run.log(row)
        except Exception as err:  # noqa: BLE001 - tracking must not fail the job
            self._stop("progress", err)

    def finish(self, result: dict, predictions: dict, figures: list[Path], out_dir: Path) -> None:
        """Summary, labels, tables, figures and the artifact, then ``finish`` with the job's
        status (exit code 1 for ``failed``)."""
        try:
            if self.enabled:
                self._close_out(result, predictions or {}, figures, Path(out_dir))
        except Exception as err:  # noqa: BLE001
            self._stop("logging the result", err)
        self.close(1 if result.get("status") == "failed" else 0)

    def _close_out(self, result, predictions, figures, out_dir) -> None:
        wandb, run = self._wandb, self._run
        run.config.update({"kvbench": {**dict(run.config.get("kvbench") or {}), **final_config(result)}},
                          allow_val_change=True)
        run.name = run_name(result)  # the targets the job settled on (fp16: 16/16; v_bpd=auto: the split)
        run.tags = tuple(dict.fromkeys([*(run.tags or ()), str(result.get("status"))]))
        run.summary.update(summary_of(result))
        logged = {"tables/metrics": wandb.Table(columns=METRIC_COLUMNS, data=metric_rows(result))}
        for source, rows in prediction_rows(result, predictions).items():
            logged[f"tables/predictions/{source}"] = wandb.Table(columns=PREDICTION_COLUMNS, data=rows)
        for path in figures:
            logged[f"figures/{Path(path).stem}"] = wandb.Image(str(path))
        run.log(logged)
        run.log_artifact(self._artifact(result, figures, out_dir))

    def _artifact(self, result, figures, out_dir):
        """result.json, predictions.json, the resolved config (config.yaml) and Hydra's overrides,
        and the figures, as one artifact of type ``result``."""
        from omegaconf import OmegaConf

        from .results import PREDICTIONS_FILE, RESULT_FILE

        art = self._wandb.Artifact(f"result-{self._run.id}", type="result",
                                   metadata={"status": result.get("status"), "job_id": result.get("job_id")})
        for name in (RESULT_FILE, PREDICTIONS_FILE):
            if (out_dir / name).is_file():
                art.add_file(str(out_dir / name), name=name)
        with art.new_file("config.yaml", encoding="utf-8") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(result.get("config") or {})))
        overrides = out_dir / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            art.add_file(str(overrides), name="overrides.yaml")
        for path in figures:
            art.add_file(str(path), name=Path(path).name)
        return art

    def close(self, exit_code: int) -> None:
        """``finish`` the run (state ``finished`` for 0, ``failed`` otherwise), then shut W&B's
        service down: ``finish`` returns before the service has written the run's last records,
        and the teardown waits for them, so that the run's file is whole when the job returns (a
        sweep killed during its next job cannot cut it; the next job's init starts the service
        again, about 0.3 s)."""
        try:
            self._run.finish(exit_code=exit_code)
            self._wandb.teardown()
        except Exception as err:  # noqa: BLE001
            log.warning("W&B finish failed (%s); result.json is unaffected", err)
        self.enabled = False


def start_run(spec: dict, mode: str, timeout: float) -> WandbRun:
    """Import wandb and open the run (:func:`open_run`); raises what wandb raises."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return WandbRun(wandb, open_run(wandb, spec, mode, timeout))

