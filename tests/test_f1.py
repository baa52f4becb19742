"""LongBench's normalize_answer / qa_f1_score on hand-worked cases (METHODS.md §9.3)."""

import pytest

from kvbench.evals.f1 import best_f1, f1_score, normalize_answer, qa_f1_score


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
