"""LongBench's normalize_answer / qa_f1_score and the Chinese qa_f1_zh_score on hand-worked
cases (docs/methods.md §9.3)."""

import importlib.util

import pytest

from kvbench.tasks.f1 import (
    best_f1,
    best_f1_zh,
    f1_score,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    zh_tokens,
)

needs_jieba = pytest.mark.skipif(importlib.util.find_spec("jieba") is None, reason="needs jieba")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Cat, sat!", "cat sat"),
        ("  A  an   apple ", "apple"),
        ("U.S. Army", "us army"),
        ("Theater and an anthem", "theater and anthem"),  # articles only as whole words
        # punctuation goes before articles: "the-end" -> "theend" (no article left);
        # removing articles first would have given "end"
        ("the-end", "theend"),
        ("A\tB\nC", "b c"),  # "a" is an article once lowercased
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_f1_hand_worked():
    # pred -> [cat, sat, on, mat] (4), gold -> [cat, on, mat] (3); common 3
    # P = 3/4, R = 3/3, F1 = 2 * 0.75 * 1 / 1.75 = 6/7
    assert qa_f1_score("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)


def test_f1_multiset_overlap():
    # [x, x, y] vs [x, y, y]: common = min(2,1) + min(1,2) = 2; P = R = 2/3, F1 = 2/3
    assert f1_score(["x", "x", "y"], ["x", "y", "y"]) == pytest.approx(2 / 3)
    # repeated prediction tokens are not counted more often than in the reference:
    # [paris, paris, paris] vs [paris]: common 1, P = 1/3, R = 1, F1 = 2*(1/3)/(4/3) = 1/2
    assert qa_f1_score("Paris paris PARIS", "Paris") == pytest.approx(0.5)


def test_f1_zero_cases():
    assert qa_f1_score("London", "Paris") == 0.0
    assert qa_f1_score("", "Paris") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # both normalize to nothing
    assert qa_f1_score("Paris.", "paris") == 1.0


def test_best_f1_takes_max_over_answers():
    # vs "New York City": [new, york] ∩ 2 of 3 -> P = 1, R = 2/3, F1 = 0.8; vs "NYC": 0
    assert best_f1("New York", ["NYC", "New York City"]) == pytest.approx(0.8)
    assert best_f1("anything", []) == 0.0


# ----------------------------------------------------------------------------- Chinese


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Hello, 世界！", "hello世界"),  # ASCII and full-width punctuation, lowercase
        (" 北京 大学 。", "北京大学"),  # all whitespace goes (Chinese has no word spaces)
        ("“引号”、（括号）", "引号括号"),
        ("《三体》", "《三体"),  # metrics.py's list has 》 but not 《: kept as released
        ("the Cat", "thecat"),  # no article removal in the Chinese normalizer
    ],
)
def test_normalize_zh_answer(text, expected):
    assert normalize_zh_answer(text) == expected


@needs_jieba
def test_zh_tokens_are_jieba_words_normalized():
    assert zh_tokens("我爱北京天安门") == ["我", "爱", "北京", "天安门"]
    # jieba cuts first ("，" and "！" are words of their own), normalizing empties them: dropped
    assert zh_tokens("北京，天安门！") == ["北京", "天安门"]
    assert zh_tokens(" 天安门 ") == ["天安门"]  # whitespace words dropped
    assert zh_tokens("Apple公司") == ["apple", "公司"]


@needs_jieba
def test_zh_f1_hand_worked():
    # [我, 爱, 北京, 天安门] vs [北京, 天安门]: common 2, P = 2/4, R = 2/2, F1 = 2·½·1/1.5 = 2/3
    assert qa_f1_zh_score("我爱北京天安门", "北京天安门") == pytest.approx(2 / 3)
    # [中华人民共和国, 成立, 于, 1949, 年] vs [1949, 年]: P = 2/5, R = 1, F1 = 0.8/1.4 = 4/7
    assert qa_f1_zh_score("中华人民共和国成立于1949年", "1949年") == pytest.approx(4 / 7)
    # punctuation words vanish: [北京, 天安门] vs [天安门]: P = 1/2, R = 1, F1 = 2/3
    assert qa_f1_zh_score("北京，天安门！", "天安门") == pytest.approx(2 / 3)
    # multiset: [北京, 北京] vs [北京]: common min(2, 1) = 1, P = 1/2, R = 1, F1 = 2/3
    assert qa_f1_zh_score("北京北京", "北京") == pytest.approx(2 / 3)
    # 《 survives normalization: [《, 三体] vs [三体]: P = 1/2, R = 1, F1 = 2/3
    assert qa_f1_zh_score("《三体》", "三体") == pytest.approx(2 / 3)
    assert qa_f1_zh_score("Apple 公司。", "apple公司") == 1.0
    assert qa_f1_zh_score("上海", "北京") == 0.0 and qa_f1_zh_score("", "北京") == 0.0


@needs_jieba
def test_zh_scorer_is_needed_for_chinese():
    # the English scorer splits on whitespace: a Chinese sentence is one token
    assert qa_f1_score("我爱北京天安门", "北京天安门") == 0.0
    assert qa_f1_zh_score("我爱北京天安门", "北京天安门") > 0.6


@needs_jieba
def test_best_f1_zh_takes_max_over_answers():
    # vs "天安门": [北京, 天安门] -> P = 1/2, R = 1, F1 = 2/3; vs "北京天安门": 1
    assert best_f1_zh("北京天安门", ["天安门", "北京天安门"]) == 1.0
    assert best_f1_zh("北京天安门", ["天安门", "上海"]) == pytest.approx(2 / 3)
    assert best_f1_zh("北京", []) == 0.0
