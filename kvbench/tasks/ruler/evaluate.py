"""One RULER evaluation of a CompressedLM: the local task files, lm-eval's ``simple_evaluate`` on
the HFLM subclass of :mod:`kvbench.tasks.hflm`, then the scores, records and result.

**Protocol** (docs/methods.md §9.5): query-agnostic by default (kvpress's), ``task.ruler.query_aware=
true`` for query-aware; the question starts at the last match of kvpress's pattern for the task
family (:mod:`kvbench.tasks.query_protocol`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from pathlib import Path

from ...context import Progress, no_progress
from .catalog import LM_EVAL_TO_TASK, NUM_SAMPLES, RULER_TASKS, RulerDataMissing
from .items import generation_data
from .nltk_data import ensure_punkt
from .options import check_item_seed, check_lengths, check_tasks
from .records import item_counts, item_records, token_stats
from .reporting import report_scores
from .scoring import task_scores
from .seeds import evaluator_seeds
from .sources import RulerData, benchmark_name, skipped_tasks
from .task_files import write_tasks

log = logging.getLogger(__package__)  # the task's logger: kvbench.tasks.ruler


class _DropCustomKwargs(logging.Filter):
    """lm-eval warns once per custom-dataset task that kwargs can be passed; we pass them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_custom_dataset():
    logger, flt = logging.getLogger("lm_eval.api.task"), _DropCustomKwargs()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def question_start(req) -> int | None:
    """Character index in the request's context where the RULER question starts."""
    from ..query_protocol import ruler_question, tail_start

    task = LM_EVAL_TO_TASK.get(req.task_name, req.task_name)
    question = ruler_question(task, req.doc["input"])
    return tail_start(req.args[0], question)


def evaluate_ruler(
    lm,
    tasks=None,
    lengths=(4096,),
    limit: int | None = None,
    query_aware: bool = False,
    essays: str | None = None,
    squad: str | None = None,
    hotpot: str | None = None,
    item_seed: int | None = None,
    chat: bool | None = None,
    offline: str | bool = "auto",
    progress: Progress = no_progress,
    batch_size: int | str = 1,
) -> dict:
    """RULER scores of ``lm`` (a CompressedLM), docs/methods.md §9.4, ``batch_size`` items
    generated at a time (``"auto"``: the largest that fits the device).

    Returns ``{"benchmark": "ruler" | "ruler_wiki", <task>: score (0-100, mean over lengths),
    "avg", "by_length": {"4096": {<task>: score, "avg"}}, "tasks", "lengths", "skipped",
    "counts", "tokens", "protocol", "data", "chat", "items", "item_seed", "limit", "eval_s",
    "batch_size", "records": [...]}``; the caller stores the records. ``item_seed`` None (the default): lm-eval's
    own items (``items`` "lm-eval"); an integer re-seeds them (``items`` "item_seed").
    """
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from ..generation import context_window
    from ..query_protocol import protocol
    from ..zeroshot import compressed_hflm, quiet_lm_eval, resolve_offline

    t0 = time.perf_counter()
    names = check_tasks(tasks)
    window = context_window(lm.model)
    lengths = check_lengths(lengths, window)
    item_seed = check_item_seed(item_seed)
    data = RulerData(lm.tokenizer, NUM_SAMPLES if limit is None else int(limit), item_seed,
                     resolve_offline(offline), essays or None, squad or None, hotpot or None)
    for path in (essays, squad, hotpot):
        if path and not Path(path).expanduser().is_file():
            raise RulerDataMissing(f"RULER data file {path} does not exist")
    skipped = skipped_tasks(names, data)
    run = [t for t in names if t not in skipped]
    if not run:
        raise RulerDataMissing(f"no RULER task can run here: {skipped}")
    use_chat = getattr(lm.tokenizer, "chat_template", None) is not None if chat is None else bool(chat)
    ensure_punkt()
    with quiet_lm_eval(), _quiet_custom_dataset(), generation_data(data), \
            tempfile.TemporaryDirectory(prefix="kvbench-ruler-") as workdir:
        write_tasks(run, lengths, workdir)
        manager = TaskManager(include_path=workdir, include_defaults=False,
                              metadata={"max_seq_lengths": lengths})
        hflm = compressed_hflm(lm, max_length=window, batch_size=batch_size)
        hflm.query_aware = bool(query_aware)
        hflm.question_start = question_start
        hflm.progress, hflm.progress_prefix, hflm.progress_names = progress, "ruler", LM_EVAL_TO_TASK
        out = simple_evaluate(
            model=hflm,
            tasks=[RULER_TASKS[t].lm_eval_name for t in run],
            # the generator made ``limit`` items per length: score them all, every length's
            limit=None if limit is None else int(limit) * len(lengths),
            task_manager=manager,
            apply_chat_template=use_chat,
            bootstrap_iters=0,
            log_samples=True,
            **evaluator_seeds(item_seed),
        )
    scores = task_scores(out, run, lengths)
    records = item_records(out, hflm)
    counts = item_counts(records)
    result = {
        "benchmark": benchmark_name(run, data),
        **scores,
        "tasks": run,
        "lengths": lengths,
        "skipped": skipped,
        "counts": counts,
        "tokens": token_stats(records),
        "protocol": protocol(bool(query_aware)),
        "data": {k: v["source"] for k, v in data.sources().items()},
        "chat": use_chat,
        "items": "lm-eval" if item_seed is None else "item_seed",
        "item_seed": item_seed,
        "limit": limit,
        "records": records,
        "eval_s": round(time.perf_counter() - t0, 2),
        "batch_size": hflm.rows_used,
    }
    for name, score in scores.items():
        if name in RULER_TASKS:
            log.info("ruler %s: %.2f", name, score)
    report_scores(scores, run, lengths, progress)
    return result
