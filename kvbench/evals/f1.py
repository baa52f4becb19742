"""LongBench's answer normalization and token F1 (METHODS.md §9.3).

A transcription of ``normalize_answer``, ``f1_score`` and ``qa_f1_score`` from THUDM/LongBench
``metrics.py`` (itself the SQuAD v1.1 evaluation script): lowercase, remove punctuation, remove the
articles a/an/the, collapse whitespace — applied in that order — then F1 over the multiset of
whitespace tokens. No common token gives 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (LongBench metrics.py)."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: list[str], ground_truth: list[str]) -> float:
    """F1 of two token lists with multiset overlap (LongBench metrics.py ``f1_score``)."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 between a prediction and one reference after ``normalize_answer``."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def best_f1(prediction: str, answers: list[str]) -> float:
    """Max of ``qa_f1_score`` over the references (LongBench eval.py ``scorer``)."""
    return max((qa_f1_score(prediction, a) for a in answers), default=0.0)
