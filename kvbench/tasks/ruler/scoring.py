"""RULER's scores from lm-eval's results.

**Scores**: lm-eval's per-task value at each length, × 100 (RULER's and kvpress's scale);
``avg`` at each length is the unweighted mean over the tasks that ran (lm-eval's ``ruler`` group
aggregate, ``weight_by_size: False``); top level: each task's mean over lengths and their mean.
"""

from __future__ import annotations

from .catalog import RULER_TASKS


def task_scores(out: dict, tasks: list[str], lengths: list[int]) -> dict:
    """``{<task>: score, "avg", "by_length": {"<length>": {<task>: score, "avg"}}}`` from the output
    of ``simple_evaluate``."""
    by_length: dict[str, dict] = {}
    for length in lengths:
        scores = {}
        for task in tasks:
            value = out["results"][RULER_TASKS[task].lm_eval_name].get(f"{length},none")
            if value is not None and value != -1:
                scores[task] = round(100 * float(value), 2)
        if scores:
            scores["avg"] = round(sum(scores.values()) / len(scores), 2)
        by_length[str(length)] = scores
    per_task = {}
    for task in tasks:
        vals = [by_length[str(L)][task] for L in lengths if task in by_length[str(L)]]
        if vals:
            per_task[task] = round(sum(vals) / len(vals), 2)
    return {**per_task, "avg": round(sum(per_task.values()) / len(per_task), 2) if per_task else None,
            "by_length": by_length}
