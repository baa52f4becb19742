"""LongBench v1 mechanics (docs/methods.md §9.3; THUDM/LongBench pred.py, eval.py)."""

from __future__ import annotations

from conftest import OneByOne

import json
from pathlib import Path

import pytest

from kvbench.tasks import longbench as lb
from kvbench.tasks.f1 import zh_tokens
from kvbench.tasks.longbench_prompts import (
    ALL_F1,
    CHINESE_F1,
    DATASET2MAXLEN,
    DATASET2PROMPT,
    ENGLISH_F1,
)

LONGBENCH_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "longbench"


@pytest.fixture
def data_dir() -> Path:
    if not LONGBENCH_DIR.is_dir():
        pytest.skip("../shared/data/longbench is absent (only on the project's own machines)")
    return LONGBENCH_DIR


class ToyTokenizer:
    """One token per whitespace-separated word; id = position in a growing vocabulary."""

    def __init__(self):
        self.vocab: list[str] = []

    def __call__(self, text, truncation=False, add_special_tokens=True):
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab.append(word)
            ids.append(self.vocab.index(word))
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] + " " for i in ids)


# ------------------------------------------------------------------------------ config


def test_english_f1_subsets_and_lengths():
    assert ENGLISH_F1 == (
        "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"
    )
    assert CHINESE_F1 == ("multifieldqa_zh",) and ALL_F1 == ENGLISH_F1 + CHINESE_F1
    assert DATASET2MAXLEN == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64,
        "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "triviaqa": 32, "multifieldqa_zh": 64,
    }
    for name in ALL_F1:
        assert "{context}" in DATASET2PROMPT[name] and "{input}" in DATASET2PROMPT[name]
    # dataset2prompt.json's multifieldqa_zh template, character for character
    assert DATASET2PROMPT["multifieldqa_zh"] == (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n"
        "问题：{input}\n回答："
    )


# -------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("max_length, half", [(6, 3), (7, 3)])
def test_truncate_middle_keeps_first_and_last_halves(max_length, half):
    tok = ToyTokenizer()
    words = [f"w{i}" for i in range(20)]
    text, truncated = lb.truncate_middle(" ".join(words), tok, max_length)
    assert truncated
    assert text.split() == words[:half] + words[-half:]  # int(max_length / 2) each side


def test_truncate_middle_leaves_short_prompts_alone():
    tok = ToyTokenizer()
    assert lb.truncate_middle("a b c", tok, 3) == ("a b c", False)


def test_truncate_middle_real_tokenizer(tokenizer):
    words = [f"word{i}" for i in range(3000)]
    prompt = "BEGIN " + " ".join(words) + " Question: who? Answer:"
    ids = tokenizer(prompt)["input_ids"]
    text, truncated = lb.truncate_middle(prompt, tokenizer, 500)
    assert truncated
    assert text == tokenizer.decode(ids[:250], skip_special_tokens=True) + tokenizer.decode(
        ids[-250:], skip_special_tokens=True
    )
    assert text.startswith("BEGIN word0 word1") and text.endswith("Question: who? Answer:")
    assert "word1500" not in text
    assert abs(len(tokenizer(text)["input_ids"]) - 500) <= 2


# ------------------------------------------------------------------------------- data


def test_loader_reads_official_jsonl(data_dir):
    for name in ENGLISH_F1:
        items = lb.load_longbench(name, data_dir)
        assert len(items) == 2
        first = items[0]
        assert list(first) == [
            "input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"
        ]
        assert first["dataset"] == name and isinstance(first["answers"], list)
    # `limit` items are the first lines of the file: no seed, the same for every method and job
    first_line = (data_dir / "qasper.jsonl").read_text(encoding="utf-8").splitlines()[0]
    assert lb.load_longbench("qasper", data_dir, limit=1) == [json.loads(first_line)]


def test_loader_accepts_the_zip_layout(tmp_path, data_dir):
    (tmp_path / "data").mkdir()
    line = (data_dir / "qasper.jsonl").read_text(encoding="utf-8").splitlines()[0]
    (tmp_path / "data" / "qasper.jsonl").write_text(line + "\n", encoding="utf-8")
    assert lb.load_longbench("qasper", tmp_path)[0] == json.loads(line)


def test_missing_dataset_names_where_it_looked(tmp_path):
    with pytest.raises(lb.LongBenchDataMissing) as err:
        lb.load_longbench("musique", tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "musique.jsonl") in msg and "data_dir" in msg


def test_offline_without_data_dir_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(lb.LongBenchDataMissing, match="data_dir"):
        lb.load_longbench("qasper", None)


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("name", ENGLISH_F1)
def test_prompt_for_each_subset(name, data_dir, tokenizer):
    item = lb.load_longbench(name, data_dir, limit=1)[0]
    plain = lb.build_prompt(item, name, tokenizer, max_length=100_000, chat=False)
    expected = DATASET2PROMPT[name].format(**item)
    assert plain["text"] == expected and not plain["truncated"]
    assert plain["input_ids"] == tokenizer(expected)["input_ids"]
    chat = lb.build_prompt(item, name, tokenizer, max_length=100_000, chat=True)
    if name == "triviaqa":  # pred.py: no chat template on the few-shot sets
        assert chat == plain
    else:
        assert chat["chat"] and chat["text"].startswith("<|im_start|>")
        assert expected in chat["text"] and chat["text"].endswith("<|im_start|>assistant\n")
    short = lb.build_prompt(item, name, tokenizer, max_length=256, chat=False)
    assert short["truncated"] and abs(len(short["input_ids"]) - 256) <= 4
    assert short["text"].endswith(expected[-20:])  # the question at the end survives


def test_first_line_only_on_triviaqa():
    pred = "\nParis\nThe answer is London"
    assert lb.postprocess("triviaqa", pred) == "Paris"
    assert lb.postprocess("hotpotqa", pred) == pred
    assert lb.score_item("triviaqa", pred, ["London"]) == 0.0
    assert lb.score_item("hotpotqa", pred, ["London"]) > 0.0


def test_dataset_score_rounds_like_eval_py():
    assert lb.dataset_score([1.0, 0.0, 0.5]) == 50.0
    assert lb.dataset_score([1 / 3]) == 33.33


def test_multifieldqa_zh_is_scored_with_jieba_f1():
    pytest.importorskip("jieba")
    # [我, 爱, 北京, 天安门] vs [北京, 天安门]: F1 = 2/3 (the English scorer would give 0)
    assert lb.score_item("multifieldqa_zh", "我爱北京天安门", ["北京天安门"]) == pytest.approx(2 / 3)
    assert lb.score_item("multifieldqa_en", "我爱北京天安门", ["北京天安门"]) == 0.0


def test_seven_set_mean_and_eight_set_mean():
    seven = {name: 10.0 * (i + 1) for i, name in enumerate(ENGLISH_F1)}  # 10 .. 70: mean 40
    means = lb.summary_means(seven)
    assert means == {"avg": 40.0, "avg_sets": list(ENGLISH_F1)}  # no avg8 without the zh set
    eight = lb.summary_means({**seven, "multifieldqa_zh": 80.0})
    assert eight["avg"] == 40.0  # LongBench F1 stays the English mean
    assert eight["avg8"] == 45.0 and eight["avg8_sets"] == list(ALL_F1)  # (10 + ... + 80) / 8
    part = lb.summary_means({"qasper": 33.33, "triviaqa": 12.5, "multifieldqa_zh": 1.0})
    assert part["avg"] == round((33.33 + 12.5) / 2, 2)
    assert part["avg_sets"] == ["qasper", "triviaqa"]
    assert part["avg8"] == round((33.33 + 12.5 + 1.0) / 3, 2)


# -------------------------------------------------------------------------- evaluation


class EchoLM(OneByOne):
    """Answers every item with its first reference; records what it was asked."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.model, self.answers, self.calls = tokenizer, None, answers, []

    def generate(self, input_ids, max_new_tokens, stop_ids=()):
        self.calls.append((input_ids.shape, max_new_tokens, tuple(stop_ids)))
        return self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"]


def test_evaluate_longbench_pipeline(data_dir, tokenizer):
    names = ["qasper", "triviaqa"]
    firsts = [it["answers"][0] for n in names for it in lb.load_longbench(n, data_dir)]
    lm = EchoLM(tokenizer, list(firsts))
    out = lb.evaluate_longbench(lm, names, data_dir, None, 1024, True)
    assert out["qasper"] == 100.0 and out["triviaqa"] == 100.0 and out["avg"] == 100.0
    assert out["counts"] == {"qasper": 2, "triviaqa": 2}
    assert [c[1] for c in lm.calls] == [128, 128, 32, 32]
    assert all(c[0][0] == 1 and c[0][1] <= 1024 + 64 for c in lm.calls)
    assert lm.calls[0][2] == (tokenizer.eos_token_id,)
    rec = out["records"]["qasper"][0]
    assert set(rec) >= {"prediction", "answers", "f1", "_id", "truncated"} and rec["f1"] == 1.0


ZH_RECORD = {  # a hand-made record in LongBench's format (no multifieldqa_zh file ships here)
    "input": "天安门在哪个城市？",
    "context": "天安门位于北京市中心。它是中国的象征之一。",
    "answers": ["北京"],
    "length": 30,
    "dataset": "multifieldqa_zh",
    "language": "zh",
    "all_classes": None,
    "_id": "zh-0",
}


def test_evaluate_multifieldqa_zh_pipeline(tmp_path, tokenizer):
    pytest.importorskip("jieba")
    en = {**ZH_RECORD, "input": "Where is it?", "context": "It is in Beijing.",
          "answers": ["Beijing"], "dataset": "qasper", "language": "en", "_id": "en-0"}
    for name, rec in (("multifieldqa_zh", ZH_RECORD), ("qasper", en)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(rec, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    # zh: [在, 北京] vs [北京]: P = 1/2, R = 1, F1 = 2/3 -> 66.67; qasper: exact -> 100
    lm = EchoLM(tokenizer, ["在北京", "Beijing"])
    out = lb.evaluate_longbench(lm, ["multifieldqa_zh", "qasper"], tmp_path, None, 1024, True)
    assert zh_tokens("在北京") == ["在", "北京"]
    assert out["multifieldqa_zh"] == 66.67 and out["qasper"] == 100.0
    assert out["avg"] == 100.0 and out["avg_sets"] == ["qasper"]  # LongBench F1: English only
    assert out["avg8"] == round((66.67 + 100.0) / 2, 2)
    assert [c[1] for c in lm.calls] == [64, 128]  # dataset2maxlen: multifieldqa_zh 64
    prompt = lb.build_prompt(ZH_RECORD, "multifieldqa_zh", tokenizer, 1024, chat=True)
    assert prompt["chat"]  # not one of pred.py's no-chat sets
    assert DATASET2PROMPT["multifieldqa_zh"].format(**ZH_RECORD) in prompt["text"]


def test_unknown_subset_is_rejected():
    with pytest.raises(ValueError, match="supported"):
        lb.evaluate_longbench(None, ["gov_report"], None, 1, 100, False)


@pytest.mark.slow
def test_real_generation_smollm2(smollm2, data_dir):
    from kvbench.model.compressed_lm import CompressedLM

    lm = CompressedLM(smollm2.model, smollm2.tokenizer)
    out = lb.evaluate_longbench(lm, ["hotpotqa"], data_dir, 1, 256, True)
    rec = out["records"]["hotpotqa"][0]
    assert isinstance(rec["prediction"], str) and rec["truncated"]
    assert 0.0 <= out["hotpotqa"] <= 100.0


def test_max_length_fits_the_model_window():
    assert lb.fit_context(31500, 128, 32768, "qasper") == 31500  # a 32k model: as asked
    assert lb.fit_context(31500, 128, 8192, "qasper") == 8192 - 128  # SmolLM2: prompt + answer fit
    assert lb.fit_context(3500, 128, None) == 3500  # no window in the config: as asked


def test_records_carry_the_max_length_used(data_dir, tokenizer):
    class Config:
        max_position_embeddings = 600

    lm = EchoLM(tokenizer, ["x", "y"])
    lm.model = type("Model", (), {"config": Config()})()
    out = lb.evaluate_longbench(lm, ["triviaqa"], data_dir, None, 31500, False)
    assert [r["max_length"] for r in out["records"]["triviaqa"]] == [600 - 32] * 2
    assert all(c[0][1] <= 600 for c in lm.calls)
