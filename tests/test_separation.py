"""Calibration, selection and evaluation text never overlap (docs/methods.md §1.2 "Separation").

For every embedded calibration corpus (ptb, wiki_proxy) and the five calibration seeds: the
calibration windows and the held-out selection windows are token ranges of the corpus's train split
that do not overlap (held-out against calibration and against one another); evaluation reads other
text, checked by hashing every 64-token span of the calibration and held-out windows against every
64-token span of the embedded evaluation texts (ptb test, wiki_proxy's evaluation part, the SQuAD
passages of longqa_squad and RULER's qa_squad). RULER's offline essay haystack is wiki_proxy's
evaluation part (tests/test_ruler.py). Zero-shot items are too short for 64-token spans and come
from neither calibration corpus.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.fit.statistics import CalibrationSpec, calibration_ids, calibration_starts, calibration_windows
from kvbench.data.text import (
    EVALUATION_SPLITS,
    corpus_text,
    ptb_text,
    wiki_proxy_articles,
    wiki_proxy_parts,
    wiki_proxy_text,
)
from kvbench.data.windows import encode, ppl_windows
from kvbench.fit import heldout

SPAN = 64
SEEDS = range(5)
N_HELDOUT = 16  # more than v_bpd=auto's 8: selections may ask for more (the first 8 are the same)
#: PTB's standard splits share WSJ text that recurs in the train split itself: tables printed day
#: after day, identical once numbers read "N" ("the key u.s. and foreign annual interest rates
#: below are a guide to general levels ..."), and a few reprinted stories. 4,672 of the train
#: split's 1,093,406 64-token spans (0.6% of its tokens) occur in the test split, every one of
#: them at least twice in the train split. So for ptb a span shared with evaluation text must be
#: one that recurs in the calibration split; text shared by construction would not be (and would
#: share nearly every span, see the control below).
DATASETS_WITH_RECURRING_TEXT = ("ptb",)

_WEIGHTS = torch.randint(1, 2**40, (SPAN,), generator=torch.Generator().manual_seed(0))


def span_hashes(ids: torch.Tensor) -> torch.Tensor:
    """A random linear hash of every SPAN-token span of ``ids`` (int64: token ids < 2^17, weights
    < 2^40, no overflow); equal hashes are then compared token for token."""
    spans = ids.to(torch.int64).unfold(0, SPAN, 1)
    return torch.cat([(chunk * _WEIGHTS).sum(1) for chunk in spans.split(1 << 16)])


class SpanIndex:
    """Every SPAN-token span of some texts (spans never cross from one text into the next)."""

    def __init__(self, texts: list[torch.Tensor]):
        texts = [t for t in texts if t.numel() >= SPAN]
        self.texts = texts
        h = torch.cat([span_hashes(t) for t in texts])
        n = [t.numel() - SPAN + 1 for t in texts]
        where = torch.cat([torch.stack([torch.full((k,), i), torch.arange(k)], 1) for i, k in enumerate(n)])
        self.hashes, order = h.sort()
        self.where = where[order]

    def shared(self, window: torch.Tensor) -> list[int]:
        """Offsets in ``window`` of the spans that occur, token for token, in one of the texts."""
        out = []
        hashes = span_hashes(window)
        first = torch.searchsorted(self.hashes, hashes)
        hit = self.hashes[first.clamp(max=self.hashes.numel() - 1)] == hashes
        for off in hit.nonzero().flatten().tolist():  # equal hashes, then the tokens themselves
            lo = int(first[off])
            span = window[off : off + SPAN]
            while lo < self.hashes.numel() and self.hashes[lo] == hashes[off]:
                text, pos = self.where[lo].tolist()
                if torch.equal(self.texts[text][pos : pos + SPAN], span):
                    out.append(off)
                    break
                lo += 1
        return out


def recurring_hashes(ids: torch.Tensor) -> torch.Tensor:
    """Sorted hashes of the spans that occur at least twice in ``ids``."""
    values, counts = torch.unique(span_hashes(ids), return_counts=True)
    return values[counts >= 2]


def _in(sorted_values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if sorted_values.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    pos = torch.searchsorted(sorted_values, x).clamp(max=sorted_values.numel() - 1)
    return sorted_values[pos] == x


@pytest.fixture(scope="module")
def evaluation_index(tokenizer):
    """The embedded evaluation texts, as the evaluations tokenize them."""
    from kvbench.tasks.longqa_squad import load_squad

    texts = [encode(tokenizer, corpus_text(name, EVALUATION_SPLITS[name])) for name in ("ptb", "wiki_proxy")]
    passages = sorted({q.passage for q in load_squad()})
    texts += [encode(tokenizer, p, cache=False) for p in passages]
    return SpanIndex(texts)


def _overlap(a: int, b: int, seqlen: int) -> bool:
    return abs(a - b) < seqlen


@pytest.mark.parametrize("dataset", ["ptb", "wiki_proxy"])
@pytest.mark.parametrize("n_windows", [16, 32])  # the embedded default and the paper's count
def test_calibration_heldout_and_evaluation_windows_are_disjoint(tokenizer, evaluation_index, dataset,
                                                                  n_windows):
    seqlen = 1024
    recurring = None
    for seed in SEEDS:
        spec = CalibrationSpec(dataset=dataset, split="train", n_windows=n_windows, seqlen=seqlen, seed=seed)
        ids = calibration_ids(tokenizer, spec)
        cal = calibration_starts(ids.numel(), spec)
        held = heldout.heldout_starts(ids.numel(), spec, n=N_HELDOUT)
        # token ranges of the train split: inside it, held-out against calibration and one another
        assert all(0 <= s and s + seqlen <= ids.numel() for s in cal + held)
        assert not any(_overlap(h, c, seqlen) for h in held for c in cal)
        assert not any(_overlap(a, b, seqlen) for i, a in enumerate(held) for b in held[i + 1:])
        # what the harness reads are exactly these ranges; fewer held-out windows are the first ones
        windows = calibration_windows(tokenizer, spec)
        assert torch.equal(windows, torch.stack([ids[s : s + seqlen] for s in cal]))
        held_windows = heldout.heldout(tokenizer, spec, n=N_HELDOUT)
        assert torch.equal(held_windows, torch.stack([ids[s : s + seqlen] for s in held]))
        assert torch.equal(heldout.heldout(tokenizer, spec), held_windows[: heldout.N_HELDOUT])
        # different splits are different texts: no 64-token span in common with evaluation text,
        # but for text that recurs in the corpus's own train split (PTB's tables, see above)
        for w in torch.cat([windows, held_windows]):
            shared = evaluation_index.shared(w)
            if not shared:
                continue
            assert dataset in DATASETS_WITH_RECURRING_TEXT, f"seed {seed}: {dataset} shares evaluation text"
            recurring = recurring_hashes(ids) if recurring is None else recurring
            assert bool(_in(recurring, span_hashes(w)[shared]).all()), f"seed {seed}: shared, not recurring"


@pytest.mark.parametrize("dataset", ["ptb", "wiki_proxy"])
def test_measurement_windows_overlap_no_calibration_or_selection_window(tokenizer, evaluation_index, dataset):
    """compose's measured refit (kvbench/fit/measured_keep.py) reads windows of the job's regime
    length: token ranges of the train split apart from the calibration windows, the selection
    windows and one another, sharing no evaluation text (but PTB's recurring tables)."""
    from kvbench.fit import measured_keep as MK
    from methods import Regime

    seqlen = 1024
    for regime in (Regime("prefill", 1536, 511), Regime("prefill", 4096, 32), Regime("qall", 2048)):
        length = MK.window_length(regime)
        for seed in SEEDS:
            spec = CalibrationSpec(dataset=dataset, split="train", n_windows=16, seqlen=seqlen, seed=seed)
            ids = calibration_ids(tokenizer, spec)
            ranges = [(s, s + seqlen) for s in calibration_starts(ids.numel(), spec)]
            ranges += [(s, s + seqlen) for s in heldout.heldout_starts(ids.numel(), spec, n=heldout.N_HELDOUT)]
            meas = MK.measurement_starts(ids.numel(), spec, length)
            assert len(meas) == MK.N_WINDOWS and all(0 <= s and s + length <= ids.numel() for s in meas)
            mine = [(s, s + length) for s in meas]
            assert not any(a < d and c < b for a, b in mine for c, d in ranges)
            assert not any(a < d and c < b for i, (a, b) in enumerate(mine) for c, d in mine[i + 1:])
            windows = MK.measurement_windows(tokenizer, spec, regime)
            assert torch.equal(windows, torch.stack([ids[a:b] for a, b in mine]))
            for w in windows:
                shared = evaluation_index.shared(w)
                assert not shared or dataset in DATASETS_WITH_RECURRING_TEXT, f"seed {seed}: shares evaluation text"


def test_the_span_check_sees_shared_text(tokenizer, evaluation_index):
    """Control: windows cut from the evaluation split itself share every span."""
    ids = encode(tokenizer, ptb_text("test"))
    for w in (ids[5000 : 5000 + 1024], ids[-1024:]):
        assert evaluation_index.shared(w) == list(range(1024 - SPAN + 1))


def test_wiki_proxy_is_cut_once_into_disjoint_parts():
    """By article (title order): the evaluation part is the first 80%, a prefix of the whole joined
    text, the calibration part the rest."""
    articles = wiki_proxy_articles()
    parts = wiki_proxy_parts(len(articles))
    assert parts["test"].start == 0 and parts["test"].stop == parts["train"].start == 8026
    assert parts["train"].stop == len(articles) == 10033
    whole = "\n\n".join(articles)
    test, train = wiki_proxy_text("test"), wiki_proxy_text("train")
    assert whole == test + "\n\n" + train  # character ranges [0, len(test)) and the rest
    assert corpus_text("wiki_proxy", "test") == test and corpus_text("wiki_proxy", "train") == train
    with pytest.raises(ValueError, match="valid splits: test .*train"):
        wiki_proxy_text("validation")


def test_wiki_proxy_evaluation_windows_are_those_of_the_whole_text(tokenizer):
    """wiki_proxy PPL reads the windows of the evaluation part: the whole text's first 416 windows
    of 2048 (of its 521)."""
    windows = ppl_windows(tokenizer, "wiki_proxy", 2048)
    assert windows.shape == (416, 2048)
    whole_start = encode(tokenizer, "\n\n".join(wiki_proxy_articles()[:200]))
    n = whole_start.numel() // 2048 - 1  # windows well inside the first 200 articles
    assert n >= 4 and torch.equal(windows[:n].flatten(), whole_start[: n * 2048])


@pytest.mark.parametrize("dataset, split, why", [
    ("ptb", "test", "the split perplexity evaluation reads"),
    ("wikitext2", "test", "the split perplexity evaluation reads"),
    ("wiki_proxy", "test", "the split perplexity evaluation reads"),
    ("ptb", "validation", "not the train split"),
])
def test_a_calibration_split_that_is_not_train_is_refused(dataset, split, why):
    with pytest.raises(ValueError, match=f"{why}.*valid splits: train"):
        CalibrationSpec(dataset=dataset, split=split)


def test_calibration_corpora_and_split_files():
    with pytest.raises(ValueError, match="valid choices: wikitext2, ptb, wiki_proxy"):
        CalibrationSpec(dataset="c4")
    CalibrationSpec(dataset="wiki_proxy")  # its calibration part


def test_a_file_of_another_split_is_refused(tmp_path):
    for name in ("wiki.test.raw", "wiki.valid.raw", "wiki.train.raw"):
        (tmp_path / name).write_text(" = A = \n")
    with pytest.raises(ValueError, match="another split than 'train'"):
        CalibrationSpec(dataset="wikitext2", data_dir=str(tmp_path / "wiki.test.raw"))
    CalibrationSpec(dataset="wikitext2", data_dir=str(tmp_path / "wiki.train.raw"))
    CalibrationSpec(dataset="wikitext2", data_dir=str(tmp_path))  # a folder: wiki.train.raw in it
    with pytest.raises(ValueError, match="another split than 'test'"):
        corpus_text("wikitext2", "test", str(tmp_path / "wiki.train.raw"))  # evaluation on train text


# ---------------------------------------------------------------------------------- the job

from test_run import _job, tiny_checkpoint  # noqa: E402,F401 - the tiny checkpoint and job runner


def test_calibration_split_test_is_an_error_before_the_model_loads(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    for method in ("cobra_kl", "kivi"):
        r = _job(tmp_path / method, tiny_checkpoint, f"method={method}", "calibration.split=test")
        assert r["status"] == "failed"
        assert "calibration.split='test' is the split perplexity evaluation reads for ptb" in r["error"]
        assert "valid splits: train" in r["error"]
        assert "load_s" not in r["timings"]  # raised before the model loads


def test_auto_split_of_an_uncalibrated_method_is_unsupported(tmp_path, tiny_checkpoint):
    """``method=kivi bpd=2 v_bpd=auto``: v_bpd=auto chooses by calibration PPL, KIVI has none."""
    for method in ("kivi", "h2o", "snapkv"):
        r = _job(tmp_path / method, tiny_checkpoint, f"method={method}", "bpd=2", "v_bpd=auto", "limit=1")
        assert r["status"] == "unsupported", r["error"]
        assert r["error"] == f"v_bpd=auto chooses a split by calibration PPL; {method} is not calibrated"


@pytest.mark.parametrize("dataset", ["ptb", "wiki_proxy"])
def test_the_knob_search_scores_on_the_heldout_windows(tokenizer, dataset, monkeypatch):
    """kvbench/fit/knob_search.py scores every candidate on exactly the held-out selection windows
    checked above (calibration text, apart from the calibration windows, no evaluation text)."""
    from types import SimpleNamespace

    from kvbench.fit import knob_search as KS
    from methods import Regime, build_method
    from methods.base import ModelShape

    seen = []
    monkeypatch.setattr(KS, "heldout_scored", lambda ctx, method, windows: seen.append(windows) or (1.0, None))
    spec = CalibrationSpec(dataset=dataset, split="train", n_windows=16, seqlen=1024, seed=3)
    ctx = SimpleNamespace(tokenizer=tokenizer, spec=spec, shape=ModelShape(30, 9, 3, 64), stats=None, seed=0,
                          regime=Regime("qall", 2048))
    method = build_method("kivi")
    method.set_regime(ctx.regime)
    cands = KS.candidates(ctx, method, 4.0, None)
    out = KS.search(ctx, "kivi", {}, 4.0, None, cands)
    assert len(seen) == len(cands) and out["heldout_windows"] == [heldout.N_HELDOUT, 1024]
    want = heldout.heldout(tokenizer, spec)
    assert all(torch.equal(w, want) for w in seen)
    ids = calibration_ids(tokenizer, spec)
    cal = calibration_starts(ids.numel(), spec)
    assert not any(_overlap(h, c, 1024) for h in heldout.heldout_starts(ids.numel(), spec) for c in cal)
