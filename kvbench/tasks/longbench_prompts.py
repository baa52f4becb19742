"""LongBench v1 prompt templates and generation lengths for the eight F1 subsets.

The seven English subsets scored with ``qa_f1_score`` and ``multifieldqa_zh`` scored with
``qa_f1_zh_score`` (docs/methods.md §9.3).

Copied verbatim from THUDM/LongBench ``config/dataset2prompt.json`` and
``config/dataset2maxlen.json`` (docs/methods.md §9.3), as released with LongBench v1 and as used by
KIVI, SnapKV and lm-eval's ``longbench`` tasks — including the release's "asconcisely" (sic) in
the NarrativeQA prompt. A later commit of the repository spells it "as concisely"; keeping the
release text keeps our FP16 rows comparable with the published baselines.
Placeholders ``{context}`` and ``{input}`` are filled with ``str.format`` as pred.py does.
"""

from __future__ import annotations

_MULTI_DOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output "
    "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question "
    "based on the given passages. Only give me the answer and do not output any other words."
    "\n\nQuestion: {input}\nAnswer:"
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. Do not "
        "provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the "
        "story asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as "
        "you can, using a single phrase or sentence if possible. If the question cannot be "
        'answered based on the information in the article, write "unanswerable". If the question '
        'is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any '
        "explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
        "concisely as you can, using a single phrase or sentence if possible. If the question "
        'cannot be answered based on the information in the article, write "unanswerable". If '
        'the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not '
        "provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other "
        "words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not "
        "output any other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，"
        "只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
}

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "triviaqa": 32,
    "multifieldqa_zh": 64,
}

#: the seven English subsets scored with qa_f1_score: "LongBench F1" is their mean
ENGLISH_F1 = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"
)
#: the Chinese F1 subset (``qa_f1_zh_score``); with ENGLISH_F1 it makes the "8-set mean"
CHINESE_F1 = ("multifieldqa_zh",)
ALL_F1 = ENGLISH_F1 + CHINESE_F1
#: pred.py: chat models are better off without the chat template on these (few-shot / code) sets
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
#: eval.py: only the first line of the prediction is scored on these
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
