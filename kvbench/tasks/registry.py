"""The task registry: ``@register_task("name")`` on a function ``run(job, lm, result, progress)``
that evaluates ``lm`` (a :class:`kvbench.model.compressed_lm.CompressedLM`) and writes its
metrics, counts and predictions into ``result``, telling ``progress`` (the job's
:data:`kvbench.context.Progress`; :func:`~kvbench.context.no_progress` by default) how far it is.
:func:`run_tasks` runs the job's ``tasks`` in order, pools each task's measured bpd and reports it
(section ``tasks``: one point per task done).

Registering is importing: :mod:`kvbench.tasks` imports every task module, in the order the error
message lists them. A task module keeps lm-eval's import inside its function (it takes seconds).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from methods import Unsupported

from ..context import Progress, no_progress
from ..model.compressed_lm import NotInPass, summarize_readings

log = logging.getLogger("kvbench")

TASKS: dict[str, Callable] = {}


def register_task(name: str):
    """Register ``run(job, lm, result, progress=no_progress)`` under the ``tasks=`` name ``name``."""
    def register(fn: Callable) -> Callable:
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = fn
        return fn

    return register


def task_limit(job, section) -> int | None:
    """Items per task: the job's ``limit`` when set, else the task section's own."""
    return job.limit if job.limit is not None else section.get("limit")


def check_tasks(names) -> None:
    """A ``ValueError`` naming the valid choices when a name in ``names`` is no registered task
    (the job checks before it loads anything)."""
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; valid choices: {', '.join(TASKS)}")


def run_tasks(job, lm, result: dict, progress: Progress = no_progress) -> None:
    """Run every task of ``job.tasks``; a task the method cannot do is listed, not fatal."""
    check_tasks(job.tasks)
    by_task = result["bpd"].setdefault("by_task", {})
    for done, task in enumerate(job.tasks, 1):
        mark, t0 = len(lm.readings), time.perf_counter()
        try:
            TASKS[task](job, lm, result, progress)
        except NotInPass as err:
            result.setdefault("unsupported_tasks", {})[task] = str(err)
            log.warning("%s: unsupported for %s: %s", task, lm.method.name, err)
        summary = summarize_readings(lm.readings[mark:])
        if summary is not None:
            by_task[task] = summary
        bpd = {} if summary is None else {"bpd_k": summary["measured_k"], "bpd_v": summary["measured_v"]}
        progress("tasks", done, seconds=time.perf_counter() - t0, **bpd)
    if len(result.get("unsupported_tasks", {})) == len(job.tasks):
        raise Unsupported("; ".join(result["unsupported_tasks"].values()))
    headline = headline_bpd(by_task, job.tasks)
    if headline is not None:
        result["bpd"].update(headline)


def headline_bpd(by_task: dict, tasks) -> dict | None:
    """The result's top-level measured bpd: that of the first task run in the order of ``tasks``
    (PPL first by default), labelled with its task and convention (docs/methods.md §0 v3: the mean
    over the task's scored positions; the end-of-prefill and end-of-sequence figures beside it)."""
    keep = ("measured_k", "measured_v", "end_k", "end_v", "prefill_end_k", "prefill_end_v", "convention")
    for task in tasks:
        if task in by_task:
            b = by_task[task]
            return {**{k: b[k] for k in keep if k in b}, "from_task": task}
    return None
