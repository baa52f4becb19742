"""LongBench's answer normalization and token F1 (docs/methods.md §9.3).

English (``qa_f1_score``): the recipe of ``normalize_answer``, ``f1_score`` and ``qa_f1_score`` in
THUDM/LongBench ``metrics.py`` (itself the SQuAD v1.1 evaluation script): lowercase, remove
punctuation, remove the articles a/an/the, collapse whitespace — applied in that order — then F1
over the multiset of whitespace tokens. No common token gives 0.

Chinese (``qa_f1_zh_score``, multifieldqa_zh): the text is first segmented into words by jieba
(precise mode, ``cut_all=False``); each word is then normalized by ``normalize_zh_answer``
(lowercase, remove ASCII and Chinese punctuation, remove all whitespace — there are no articles),
words that become empty are dropped, and the same multiset F1 is taken. Segmentation comes before
normalization, as in metrics.py: punctuation in the raw text can change where jieba cuts.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter

_PUNCTUATION = frozenset(string.punctuation)
#: the full-width and CJK punctuation metrics.py removes besides ``string.punctuation``, as released
#: (it lists 》 but not 《; ASCII "." twice)
CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗"
    "〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_PUNCTUATION = _PUNCTUATION | frozenset(CN_PUNCTUATION)
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


# ----------------------------------------------------------------------------- Chinese


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, drop all whitespace (metrics.py)."""
    text = "".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def _jieba():
    """jieba, imported on first use, with its dictionary-loading chatter below WARNING."""
    import jieba

    logging.getLogger("jieba").setLevel(logging.WARNING)
    return jieba


def zh_tokens(text: str) -> list[str]:
    """jieba's precise-mode words of ``text``, each normalized; empty words dropped."""
    words = (normalize_zh_answer(w) for w in _jieba().cut(text, cut_all=False))
    return [w for w in words if w]


def qa_f1_zh_score(prediction: str, ground_truth: str) -> float:
    """Token F1 over jieba words (LongBench metrics.py ``qa_f1_zh_score``)."""
    return f1_score(zh_tokens(prediction), zh_tokens(ground_truth))


def best_f1_zh(prediction: str, answers: list[str]) -> float:
    """Max of ``qa_f1_zh_score`` over the references."""
    return max((qa_f1_zh_score(prediction, a) for a in answers), default=0.0)


def dataset_score(f1s: list[float]) -> float:
    """eval.py ``scorer``: round(100 * mean, 2)."""
    return round(100 * sum(f1s) / len(f1s), 2) if f1s else float("nan")
