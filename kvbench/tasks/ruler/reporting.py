"""What RULER reports while it runs: each generated item is a point of the section ``ruler/<task>``
(items done, prompt and new tokens, the bits it read: :mod:`kvbench.tasks.hflm`); once lm-eval
has scored them, the section ``ruler`` gets one point per task (:func:`report_scores`)."""

from __future__ import annotations

from ...context import Progress


def report_scores(scores: dict, tasks: list[str], lengths: list[int], progress: Progress) -> None:
    """One progress point of ``ruler`` per task that was scored: its score (0-100) and its score at
    each length (``<task>/<length>``)."""
    done = 0
    for task in tasks:
        if task not in scores:
            continue
        at = {f"{task}/{L}": scores["by_length"][str(L)][task] for L in lengths
              if task in scores["by_length"].get(str(L), {})}
        done += 1
        progress("ruler", done, **{task: scores[task]}, **at)
