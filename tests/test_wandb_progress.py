"""The progress seam (kvbench/context.py ``Progress``): what each task reports while it runs,
collected by a plain function (no W&B), and the bits each generated item's record keeps."""

from __future__ import annotations

from conftest import OneByOne

import json

import pytest
import torch

from kvbench.context import no_progress


class Collect:
    """A progress callback that keeps every point: ``(section, step, values)``."""

    def __init__(self):
        self.points = []

    def __call__(self, section, step, **values):
        self.points.append((section, step, values))

    def section(self, name):
        return [(step, values) for s, step, values in self.points if s == name]


def tiny_lm(tok, window: int = 2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.model.compressed_lm import CompressedLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=window)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    return CompressedLM(model, tok)


def test_ppl_reports_every_window(tokenizer, one_thread):
    from kvbench.tasks.ppl import evaluate_ppl

    seen = Collect()
    out = evaluate_ppl(tiny_lm(tokenizer), ["ptb"], seqlen=32, limit=3, progress=seen)
    points = seen.section("ppl/ptb")
    assert [step for step, _ in points] == [1, 2, 3]
    assert points[-1][1]["ppl"] == pytest.approx(out["ppl"]["ptb"], rel=1e-12)  # the running PPL ends at the result
    assert {"nll", "window_ppl", "bpd_k", "bpd_v"} <= set(points[0][1])
    assert points[0][1]["bpd_k"] == 16.0  # the plain model


def test_ruler_reports_generations_then_scores(tokenizer, one_thread):
    from kvbench.tasks import ruler as R

    seen = Collect()
    out = R.evaluate_ruler(tiny_lm(tokenizer), tasks=["vt"], lengths=[1024], limit=1, progress=seen)
    [(step, gen)] = seen.section("ruler/vt")
    assert step == 1 and gen["prompt_tokens"] > 500 and gen["bpd_k"] == 16.0
    [(step, score)] = seen.section("ruler")
    assert score["vt"] == out["vt"] and score["vt/1024"] == out["by_length"]["1024"]["vt"]
    assert all(r["bpd_k"] == 16.0 and r["bpd_v"] == 16.0 for r in out["records"])  # the bits each item read


class EchoLM(OneByOne):
    """Answers with the item's first reference; one 16-bit reading per generation."""

    def __init__(self, tokenizer, answers):
        from kvbench.model.compressed_lm import BpdReading

        self.tokenizer, self.model, self.answers, self.readings = tokenizer, None, answers, []
        self._reading = BpdReading("prefill", (16.0, 16.0), (16.0, 16.0), 4, (16.0, 16.0))

    def generate(self, input_ids, max_new_tokens, stop_ids=()):
        self.readings.append(self._reading)
        return self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"]


def test_longbench_and_longqa_report_every_item(tmp_path, tokenizer):
    from kvbench.tasks.longbench import evaluate_longbench

    items = [{"input": f"What is item {i}?", "context": "Some text. " * 20, "answers": [f"answer {i}"],
              "length": 40, "dataset": "qasper", "language": "en", "all_classes": None, "_id": f"q{i}"}
             for i in range(2)]
    (tmp_path / "qasper.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    seen = Collect()
    out = evaluate_longbench(EchoLM(tokenizer, ["answer 0", "wrong"]), ["qasper"], tmp_path, None, 1024,
                             progress=seen)
    points = seen.section("longbench/qasper")
    assert [step for step, _ in points] == [1, 2]
    assert points[0][1]["item_f1"] == 100.0 and points[1][1]["f1"] == pytest.approx(out["qasper"])
    assert out["records"]["qasper"][0]["bpd_k"] == 16.0


def test_the_default_progress_is_inert():
    assert no_progress("ppl/ptb", 1, ppl=3.0) is None
