"""The 13 RULER tasks of ``lm_eval/tasks/ruler``: lm-eval's task name, task file and generator for
each, which read the essay haystack, and lm-eval's item count and default length."""

from __future__ import annotations

from dataclasses import dataclass

BENCHMARK, STANDIN = "ruler", "ruler_wiki"
#: lm-eval's item count per task and length
NUM_SAMPLES = 500
#: the lengths lm-eval's task files name in metric_list; process_results always emits 4096
LM_EVAL_DEFAULT_LENGTH = 4096


@dataclass(frozen=True)
class RulerTask:
    lm_eval_name: str
    yaml: str  # in lm_eval/tasks/ruler/
    module: str  # lm_eval.tasks.ruler.<module>
    function: str  # lm-eval's custom_dataset


def _niah(name: str) -> RulerTask:
    return RulerTask(name, f"{name}.yaml", "niah_utils", name)


RULER_TASKS: dict[str, RulerTask] = {
    **{n: _niah(n) for n in (
        "niah_single_1", "niah_single_2", "niah_single_3",
        "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery",
    )},
    "vt": RulerTask("ruler_vt", "vt.yaml", "vt_utils", "get_vt_dataset"),
    "cwe": RulerTask("ruler_cwe", "cwe.yaml", "cwe_utils", "get_cw_dataset"),
    "fwe": RulerTask("ruler_fwe", "fwe.yaml", "fwe_utils", "fwe_download"),
    "qa_squad": RulerTask("ruler_qa_squad", "qa_squad.yaml", "qa_utils", "get_squad"),
    "qa_hotpot": RulerTask("ruler_qa_hotpot", "qa_hotpot.yaml", "qa_utils", "get_hotpotqa"),
}
#: the tasks whose haystack is the essay text (``get_haystack("essay")``)
ESSAY_TASKS = frozenset({"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"})
LM_EVAL_TO_TASK = {spec.lm_eval_name: name for name, spec in RULER_TASKS.items()}


class RulerDataMissing(FileNotFoundError):
    """A file given for RULER's data does not exist or cannot be read."""
