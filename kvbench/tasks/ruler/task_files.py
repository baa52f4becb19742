"""The local RULER task files. Each is a YAML that ``include``s lm-eval's own task file and changes
two things:

* ``custom_dataset`` names ``kvbench.tasks.ruler.dataset_<task>``, the package's name for
  :func:`.items.dataset` on that task (lm-eval's generator under kvbench's data);
* ``metric_list`` names the requested lengths (lm-eval's lists 4096..131072 only).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .catalog import LM_EVAL_DEFAULT_LENGTH, RULER_TASKS, RulerDataMissing


def lm_eval_ruler_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / "ruler"
    if not path.is_dir():
        raise RulerDataMissing(f"lm-eval's RULER tasks are missing ({path}); lm-eval >= 0.4.8 has them")
    return path


def task_config(task: str, lengths: list[int]) -> dict:
    """The YAML body of the local copy of ``task``: lm-eval's file, kvbench's data, the lengths."""
    from ..lm_eval_tasks import _FunctionTag

    spec = RULER_TASKS[task]
    aggregate = _FunctionTag("lm_eval.tasks.ruler.common_utils.aggregate_metrics")
    names = sorted({LM_EVAL_DEFAULT_LENGTH, *lengths})
    return {
        "include": str(lm_eval_ruler_dir() / spec.yaml),
        "task": spec.lm_eval_name,
        "custom_dataset": _FunctionTag(f"{__package__}.dataset_{task}"),
        "metric_list": [{"metric": str(n), "aggregation": aggregate, "higher_is_better": True} for n in names],
    }


def write_tasks(tasks: list[str], lengths: list[int], out_dir: str | Path) -> Path:
    import yaml

    from ..lm_eval_tasks import _Dumper

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        text = yaml.dump(task_config(task, lengths), Dumper=_Dumper, sort_keys=False)
        (out / f"kvbench_ruler_{task}.yaml").write_text(text, encoding="utf-8")
    return out
