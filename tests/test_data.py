"""Corpus loaders and windows (docs/methods.md §1.2, §9.1)."""

from __future__ import annotations

import torch

from kvbench.data.text import (
    DatasetNotFound,
    ptb_sentences_from_package,
    wiki_proxy_text,
    wikitext2_text,
    wikitext_rows_from_file,
)
from kvbench.data.windows import nonoverlapping_windows, random_windows

import pytest


def test_wikitext_rows_rebuild_dataset_rows_and_join(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_bytes(b" = A = \r\n\r\n Body one . \r\n \r\n = = B = = \r\n")
    rows = wikitext_rows_from_file(raw)
    # the dataset's rows: each line keeps its newline, blank lines are empty rows
    assert rows == [" = A = \n", "", " Body one . \n", "", " = = B = = \n"]
    # a row with its newline, then the "\n\n" separator, an empty row, the separator again
    assert wikitext2_text("test", str(tmp_path)).startswith(" = A = \n" + "\n\n" + "\n\n" + " Body")


def test_real_wikitext2_test_file(shared_data):
    path = shared_data / "wikitext-2-raw" / "wiki.test.raw"
    rows = wikitext_rows_from_file(path)
    assert len(rows) == 2891
    assert rows[0] == " = Robert Boulter = \n"
    text = wikitext2_text("test", str(path))
    assert text == "\n\n".join(rows)
    assert "\r" not in text


def test_missing_wikitext_names_what_to_pass(tmp_path, monkeypatch):
    with pytest.raises(DatasetNotFound, match="wiki.test.raw"):
        wikitext2_text("test", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetNotFound, match="data_dir"):
        wikitext2_text("test", None)


def test_ptb_from_package_is_the_mikolov_split():
    test = ptb_sentences_from_package("test")
    assert len(test) == 3761  # sentences in ptb.test.txt
    assert test[0].startswith("no it was n't black monday")
    assert len(ptb_sentences_from_package("validation")) == 3370


def test_wiki_proxy_is_real_prose():
    text = wiki_proxy_text()
    assert len(text) > 1_000_000 and "\n\n" in text


def test_windows():
    ids = torch.arange(10_000)
    w = nonoverlapping_windows(ids, 2048)
    assert w.shape == (4, 2048) and int(w[1, 0]) == 2048
    assert nonoverlapping_windows(ids, 2048, limit=2).shape == (2, 2048)
    a, b = random_windows(ids, 5, 100, seed=3), random_windows(ids, 5, 100, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, random_windows(ids, 5, 100, seed=4))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(5, 99, dtype=torch.long))
    with pytest.raises(ValueError, match="shorter"):
        nonoverlapping_windows(torch.arange(10), 2048)
