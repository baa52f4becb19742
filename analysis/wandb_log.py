"""``--wandb-log``: one analysis command's table and figures as one W&B run in the sweep's group,
so that the dashboard has the paper table beside the sweep's runs (docs/sweeps.md).

The run: project and entity those of the runs (their ``config.wandb.project``/``entity``, the
most common; else ``kvbench``), group ``--wandb-group`` or the runs directory's name (a sweep's
jobs are grouped by their sweep directory's name, kvbench/store/wandb_keys.py), job type
``analysis`` (``--wandb`` skips such runs when it reads a project back), name
``analysis/<command>``, a fresh id each time. It holds the table as a
``wandb.Table`` under ``analysis/<command>`` (the cells' text, and the mean of each mean ± std
column as a number), the figures as images under ``figures/<file name>``, and an artifact with the
Markdown and the PNGs. Offline by default (``--wandb-log online`` uploads at once); the offline run
lies in ``<runs dir>/wandb/offline-run-*`` (``wandb sync`` uploads it).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from analysis.wandb_source import ANALYSIS_JOB_TYPE

MODES = ("offline", "online")


def _common(frame: pd.DataFrame, column: str) -> str | None:
    if column not in frame.columns:
        return None
    values = Counter(v for v in frame[column] if isinstance(v, str) and v)
    return values.most_common(1)[0][0] if values else None


def table_data(table) -> tuple[list[str], list[list]]:
    """Columns and rows of an ``analysis.cells.Table``: each column's text, and for a mean ± std
    column also its mean (``<header> mean``), so W&B can plot it."""
    columns, stat = [], []
    for i, col in enumerate(table.columns):
        columns.append(col.header)
        if col.kind == "stat":
            columns.append(f"{col.header} mean")
            stat.append(i)
    rows = []
    for row in table.rows:
        cells = []
        for i, cell in enumerate(row):
            cells.append(cell.text)
            if i in stat:
                cells.append(cell.mean)
        rows.append(cells)
    return columns, rows


def log_analysis(command: str, runs_dir: str | None, frame: pd.DataFrame, *, table=None,
                 text: str | None = None, figures: list[Path] = (), mode: str = "offline",
                 group: str | None = None) -> str:
    """Open the analysis run, log ``table``, ``text`` (Markdown) and ``figures``, close it; returns
    the run's directory."""
    if mode not in MODES:
        raise ValueError(f"--wandb-log {mode!r}; valid choices: {', '.join(MODES)}")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    where = Path(runs_dir) if runs_dir else Path.cwd()
    group = group or (where.resolve().name if runs_dir else "analysis")
    run = wandb.init(
        project=_common(frame, "config.wandb.project") or "kvbench",
        entity=_common(frame, "config.wandb.entity"),
        group=group, job_type=ANALYSIS_JOB_TYPE, name=f"analysis/{command}", dir=str(where), mode=mode,
        config={"command": command, "runs_dir": str(where.resolve()), "runs": int(len(frame)),
                "argv": sys.argv[1:]},
        settings=wandb.Settings(silent=True, init_timeout=20.0), reinit="finish_previous",
    )
    logged = {}
    if table is not None:
        columns, rows = table_data(table)
        logged[f"analysis/{command}"] = wandb.Table(columns=columns, data=rows)
        run.config.update({"notes": list(table.notes)})
    for path in figures:
        logged[f"figures/{Path(path).stem}"] = wandb.Image(str(path))
    if logged:
        run.log(logged)
    art = wandb.Artifact(f"analysis-{command}-{run.id}", type="analysis")
    if text is not None:
        with art.new_file(f"{command}.md", encoding="utf-8") as f:
            f.write(text)
    for path in figures:
        art.add_file(str(path), name=Path(path).name)
    run.log_artifact(art)
    run_dir = run.settings.sync_dir
    run.finish()
    wandb.teardown()  # the service writes the run's last records before it exits
    return str(run_dir)
