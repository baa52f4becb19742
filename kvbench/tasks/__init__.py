"""Evaluations over a CompressedLM (METHODS.md §9).

* ``zeroshot`` — lm-eval zero-shot accuracy (§9.2); offline task copies in ``lm_eval_tasks/``.
* ``longbench`` — LongBench v1, the seven English F1 subsets (§9.3); prompts in
  ``longbench_prompts``; metric in ``f1``.
* ``longqa_squad`` — an embedded long-context QA stand-in built from SQuAD (not LongBench).

Modules are imported on demand (lm-eval is slow to import).
"""
