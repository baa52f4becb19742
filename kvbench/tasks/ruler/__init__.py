"""RULER through lm-eval's own task definitions, on a compressed model (docs/methods.md §9.4, §9.5).

The 13 tasks of ``lm_eval/tasks/ruler`` (niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
niah_multiquery, vt, cwe, fwe, qa_squad, qa_hotpot) run with lm-eval's generators, templates,
``gen_prefix``, generation lengths and scorers (``string_match_all``; ``string_match_part`` for
QA), through ``simple_evaluate`` on the HFLM subclass of :mod:`kvbench.tasks.hflm`, whose
``generate_until`` decodes greedily through ``CompressedLM`` (prefill exact, compress, decode).
A local task file includes lm-eval's and changes only the data and the lengths (:mod:`.task_files`).

Decisions where docs/methods.md is silent: the item cap and per-(task, length) seeding
(:mod:`.items`); the chat template follows the model config (``chat``, as LongBench); SQuAD v1.1 as
the offline qa_squad source (:mod:`.patches`).

Files, in the order of one evaluation: :mod:`.options` (the ``task.ruler`` checks),
:mod:`.sources` (where the data comes from, the result's name, the skipped tasks),
:mod:`.nltk_data` (punkt_tab offline), :mod:`.task_files` (the local task YAMLs), :mod:`.items`
(lm-eval's generators per task and length, seeded by :mod:`.seeds`, their download points wrapped
by :mod:`.patches`, the files read by :mod:`.readers`), :mod:`.evaluate` (``simple_evaluate`` and
the result), :mod:`.scoring`, :mod:`.records`, :mod:`.reporting`; :mod:`.catalog` lists the 13
tasks. Here: the registered task ``ruler`` and ``dataset_<task>``, the function a local task YAML
names as its ``custom_dataset``.
"""

from __future__ import annotations

from functools import partial

from ...context import Progress, no_progress
from ..batch_size import batch_setting
from ..query_protocol import query_aware_setting
from ..registry import register_task, task_limit
from .catalog import (
    BENCHMARK,
    ESSAY_TASKS,
    LM_EVAL_DEFAULT_LENGTH,
    LM_EVAL_TO_TASK,
    NUM_SAMPLES,
    RULER_TASKS,
    STANDIN,
    RulerDataMissing,
    RulerTask,
)
from .evaluate import evaluate_ruler, question_start
from .items import dataset, generation_data
from .nltk_data import ensure_punkt
from .options import check_item_seed, check_lengths, check_tasks
from .readers import _haystack_words, essay_haystack, read_essays, squad_standin  # noqa: F401 - tests
from .records import token_stats
from .reporting import report_scores
from .seeds import cwe_rng, generation_seeds
from .sources import RulerData, benchmark_name, skipped_tasks
from .task_files import lm_eval_ruler_dir, task_config, write_tasks

__all__ = [
    "BENCHMARK",
    "ESSAY_TASKS",
    "LM_EVAL_DEFAULT_LENGTH",
    "LM_EVAL_TO_TASK",
    "NUM_SAMPLES",
    "RULER_TASKS",
    "STANDIN",
    "RulerData",
    "RulerDataMissing",
    "RulerTask",
    "benchmark_name",
    "check_item_seed",
    "check_lengths",
    "check_tasks",
    "cwe_rng",
    "dataset",
    "ensure_punkt",
    "essay_haystack",
    "evaluate_ruler",
    "generation_data",
    "generation_seeds",
    "lm_eval_ruler_dir",
    "question_start",
    "read_essays",
    "report_scores",
    "run_ruler",
    "skipped_tasks",
    "squad_standin",
    "task_config",
    "token_stats",
    "write_tasks",
]


def __getattr__(name: str):
    """``dataset_<task>``: the function a local task YAML names as its ``custom_dataset``."""
    if name.startswith("dataset_") and name[len("dataset_"):] in RULER_TASKS:
        return partial(dataset, name[len("dataset_"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@register_task("ruler")
def run_ruler(job, lm, result: dict, progress: Progress = no_progress) -> None:
    """RULER (``ruler``, or ``ruler_wiki`` on stand-in data); query-agnostic unless
    ``task.ruler.query_aware=true``; the task's own item seed, never the job's."""
    r = job.task.get("ruler") or {}
    tasks = r.get("tasks")
    out = evaluate_ruler(
        lm,
        tasks=None if tasks is None else list(tasks),
        lengths=list(r.get("lengths", [4096])),
        limit=task_limit(job, r),
        query_aware=query_aware_setting(r, "task.ruler", False),
        essays=r.get("essays"),
        squad=r.get("squad"),
        hotpot=r.get("hotpot"),
        item_seed=r.get("item_seed"),
        chat=bool(job.model.chat) if r.get("chat") is None else bool(r.get("chat")),
        progress=progress,
        batch_size=batch_setting(job, lm),
    )
    result.setdefault("batch_size", {})["ruler"] = out.pop("batch_size")
    name = out["benchmark"]
    result["predictions"][name] = out.pop("records")
    result["counts"][f"{name}_items"] = out["counts"]
    result["metrics"][name] = out
