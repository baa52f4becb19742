"""The RULER items: lm-eval's own generator for each (task, length), under the data of the running
evaluation (:func:`generation_data`), with its download points wrapped (:mod:`.patches`).

**Items**: by default lm-eval's own. lm-eval's generators draw from Python's and numpy's global
random state, which ``simple_evaluate`` seeds (``random`` 0, ``numpy`` 1234: ``lm_eval.defaults``)
before it builds the tasks, and cwe also shuffles with its module's ``Random(42)``; lm-eval then
scores the first ``limit`` of the 500 items per task and length. Here each (task, length) is
generated from exactly that state (the global seeds set again, cwe's ``Random(42)`` as it is
after import), so ``limit=N`` scores the N items ``lm_eval --tasks <task> --metadata
'{"max_seq_lengths":[L]}' --limit N`` scores. The generator's item count is capped at ``limit``:
the items are generated one after the other from one random state, so the first ``limit`` are the
same either way. ``task.ruler.item_seed=<int>`` instead seeds each (task, length) from a hash of
(item_seed, task, length) (other items, as many). Either way never the job seed: every method and
job seed gets the same items; the result records which (``items``, ``item_seed``). ``limit=null``
keeps 500. In one ``lm_eval`` call with several tasks or lengths the global state runs on from one
to the next, so its later tasks' items depend on which ran before; here a task's items never do.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import random

import numpy as np

from .catalog import LM_EVAL_DEFAULT_LENGTH, RULER_TASKS
from .nltk_data import ensure_punkt
from .patches import generator_patches
from .seeds import generation_seeds
from .sources import RulerData

_ACTIVE: RulerData | None = None


@contextlib.contextmanager
def generation_data(data: RulerData):
    """Make ``data`` what :func:`dataset` reads while lm-eval builds the tasks."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, data
    try:
        yield data
    finally:
        _ACTIVE = previous


def dataset(task: str, **kwargs) -> dict:
    """lm-eval's custom_dataset for ``task`` (one of RULER_TASKS) under the active
    :class:`RulerData`: one generation per length, each from its own seed."""
    import datasets

    data = _ACTIVE
    if data is None:
        raise RuntimeError("kvbench RULER tasks generate their data inside evaluate_ruler()")
    ensure_punkt()  # before lm-eval's prepare_niah is imported: it would download punkt_tab
    spec = RULER_TASKS[task]
    lengths = [int(x) for x in kwargs.get("max_seq_lengths", [LM_EVAL_DEFAULT_LENGTH])]
    parts = []
    for length in lengths:
        seed, np_seed = generation_seeds(data.item_seed, task, length)
        random.seed(seed)
        np.random.seed(np_seed)
        with contextlib.ExitStack() as stack:
            for p in generator_patches(task, data, seed):
                stack.enter_context(p)
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))  # vt prints per step
            module = importlib.import_module(f"lm_eval.tasks.ruler.{spec.module}")
            parts.append(getattr(module, spec.function)(max_seq_lengths=[length])["test"])
    return {"test": datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]}
