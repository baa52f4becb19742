"""Evaluations over a CompressedLM (docs/methods.md §9), registered by name (:mod:`.registry`).

* ``ppl`` — perplexity, tracks A and B (§9.1): :mod:`.ppl`.
* ``zeroshot`` — lm-eval zero-shot accuracy (§9.2) through the HFLM subclass of :mod:`.hflm`;
  offline task copies in :mod:`.lm_eval_tasks`.
* ``longbench`` — LongBench v1, the English F1 subsets (§9.3; prompts in :mod:`.longbench_prompts`,
  metric in :mod:`.f1`), and ``longqa_squad``, an embedded long-context QA stand-in built from SQuAD
  (not LongBench): :mod:`.longbench`, :mod:`.longqa_squad`.
* ``ruler`` — RULER through lm-eval's own tasks (§9.4): :mod:`.ruler`.

Query-aware and query-agnostic generation (§9.5) share :mod:`.query_protocol`; what a task reports
while it runs (the job's progress callback, each item's bits) is in :mod:`.reporting`.
"""

from . import ppl, zeroshot, longbench, ruler  # noqa: F401, I001 - registers, in this order
from .registry import TASKS, check_tasks, headline_bpd, register_task, run_tasks  # noqa: F401
