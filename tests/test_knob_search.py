"""The knob search (kvbench/fit/knob_search.py, docs/methods.md §0.1): a method's admissible
configurations scored on held-out calibration windows through the protocol of kvbench/fit/search.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, save_tiny_checkpoint
from kvbench.fit import knob_search as KS
from kvbench.fit.statistics import CalibrationSpec
from kvbench.job import run_job
from methods import Regime, Unsupported, build_method
from methods.base import ModelShape

SHAPE = ModelShape(1, 2, 1, 64)
QALL = Regime("qall", 2048)


def _ctx(regime=QALL, seed=0):
    spec = CalibrationSpec(dataset="ptb", split="train", n_windows=2, seqlen=64, seed=0)
    return SimpleNamespace(shape=SHAPE, regime=regime, stats=None, seed=seed, spec=spec, model_id="tiny")


@pytest.mark.parametrize("name,bpd,v_bpd", [("kivi", 4.0, None), ("kivi", 5.0, 5.0), ("gear", 6.0, None)])
def test_search_takes_the_lowest_heldout_ppl_among_the_candidates(name, bpd, v_bpd):
    """A stub scorer gives each candidate a known perplexity: the search takes the lowest, records
    every candidate's score and prediction, and a tie goes to the earlier candidate."""
    ctx = _ctx()
    method = build_method(name)
    method.set_regime(ctx.regime)
    cands = KS.candidates(ctx, method, bpd, v_bpd)
    assert 1 < len(cands) <= KS.N_CANDIDATES == 27
    want = len(cands) // 2  # neither the first nor the method's own preference, in general
    ppl = {json.dumps(c, sort_keys=True): 10.0 + abs(i - want) for i, c in enumerate(cands)}

    def score(m):
        return ppl[json.dumps(m.chosen_knobs, sort_keys=True)]

    out = KS.search(ctx, name, {}, bpd, v_bpd, cands, score)
    assert out["knobs"] == cands[want] and out["ppl"] == 10.0
    assert [c["knobs"] for c in out["candidates"]] == cands
    assert [c["ppl"] for c in out["candidates"]] == [10.0 + abs(i - want) for i in range(len(cands))]
    assert all(c["predicted_bpd_k"] <= 1.02 * bpd for c in out["candidates"])
    tie = KS.search(ctx, name, {}, bpd, v_bpd, cands, lambda m: 1.0)
    assert tie["knobs"] == cands[0]


def test_an_inadmissible_candidate_is_recorded_and_never_chosen():
    ctx = _ctx()
    bad = {"bits": 8, "group": 32, "residual": 128, "v_bits": None, "v_group": None}
    good = build_method("kivi").knob_candidates(SHAPE, 4.0, None)[:1]
    out = KS.search(ctx, "kivi", {}, 4.0, None, [bad, *good], lambda m: 1.0)
    assert out["knobs"] == good[0] and "not admissible" in out["candidates"][0]["unsupported"]
    with pytest.raises(Unsupported, match="no knob candidate"):
        KS.search(ctx, "kivi", {}, 4.0, None, [bad], lambda m: 1.0)


def test_the_cache_key_changes_with_what_determines_the_outcome(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(ctx, name, options, bpd_k, bpd_v, cands, score=None):
        calls.append(1)
        return {"knobs": cands[0], "ppl": 1.0, "candidates": [], "seconds": 0.0}

    monkeypatch.setattr(KS, "search", fake)
    cands = build_method("kivi").knob_candidates(SHAPE, 4.0, None, 27)
    base = dict(ctx=_ctx(), name="kivi", options={}, bpd_k=4.0, bpd_v=None, cands=cands)
    assert KS.choose_knobs(**base)["cache_hit"] is False
    assert KS.choose_knobs(**base)["cache_hit"] is True and len(calls) == 1
    for change in ({"bpd_k": 4.5}, {"bpd_v": 4.0}, {"options": {"budget": "measured"}}, {"name": "gear"},
                   {"cands": cands[:3]}, {"ctx": _ctx(seed=1)}, {"ctx": _ctx(Regime("prefill", 1536, 511))}):
        assert KS.choose_knobs(**{**base, **change})["cache_hit"] is False
    assert len(calls) == 8


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), smollm2.tokenizer, 512)


def _job(tmp_path, checkpoint, *overrides):
    fast = ["tasks=[ppl]", "task.ppl.seqlen=256", "task.ppl.datasets=[ptb]", "limit=1",
            "calibration.n_windows=2", "calibration.seqlen=128", "wandb.mode=disabled"]
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", [f"model.path={checkpoint}", *fast, *overrides])
    run_job(cfg, tmp_path)
    return json.loads((Path(tmp_path) / "result.json").read_text())


@pytest.mark.parametrize("method,bpd", [("kivi", 8), ("gear", 8), ("turboquant", 2.5)])
def test_a_job_runs_the_search_and_records_it(tmp_path, tiny_checkpoint, monkeypatch, method, bpd):
    """A whole job: the knobs are the candidate with the lowest held-out perplexity, every candidate
    and its score are in result.json, the measured bpd is under the ceiling; a second job reads the
    search from the cache."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    r = _job(tmp_path / "a", tiny_checkpoint, f"method={method}", f"bpd={bpd}")
    assert r["status"] == "ok", r.get("error")
    ks = r["knob_search"]
    scored = [c for c in ks["candidates"] if c["ppl"] is not None]
    assert 1 < len(ks["candidates"]) <= 27 and len(ks["candidates"]) == min(27, ks["admissible"])
    assert ks["ppl"] == min(c["ppl"] for c in scored) and ks["heldout_windows"] == [8, 128]
    assert r["knobs"]["fit"]["chosen_by"] == "held-out knob search"
    if method != "gear":
        assert {k: r["knobs"][k] for k in ks["knobs"]} == ks["knobs"]
    else:
        assert r["knobs"]["block"] == ks["knobs"]["block"]
    assert r["bpd"]["measured_k"] <= 1.02 * bpd
    again = _job(tmp_path / "b", tiny_checkpoint, f"method={method}", f"bpd={bpd}")
    assert again["knob_search"]["cache_hit"] is True and again["knob_search"]["knobs"] == ks["knobs"]
