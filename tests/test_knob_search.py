"""The knob search (kvbench/fit/knob_search.py, docs/methods.md §0.1): a method's admissible
configurations scored on held-out calibration windows through the protocol of kvbench/fit/search.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import REPO, save_tiny_checkpoint
from kvbench.fit import knob_search as KS
from kvbench.fit.statistics import CalibrationSpec
from kvbench.job import run_job
from methods import Regime, Unsupported, build_method
from methods.base import LayerStats, ModelShape
from methods.cobra import KNOB_GRID, PAPER_KNOBS
from methods.kqsvd import candidates as kqsvd_pairs
from methods.svdq import PAPER_SCHEDULE

SHAPE = ModelShape(1, 2, 1, 64)
QALL = Regime("qall", 2048)


def _stats(shape=SHAPE, seed=0):
    """Random float64 moments with a decaying key spectrum, one LayerStats per layer."""
    g = torch.Generator().manual_seed(seed)
    h, d, out = shape.n_kv_heads, shape.head_dim, []
    for _ in range(shape.n_layers):
        spd = []
        for _ in range(3):
            x = torch.randn(h, d, d, generator=g, dtype=torch.float64)
            x = x * torch.exp(-torch.arange(d, dtype=torch.float64) / (d / 6))
            spd.append(x @ x.transpose(-1, -2) / d + 1e-3 * torch.eye(d, dtype=torch.float64))
        mu = torch.randn(h, d, generator=g, dtype=torch.float64)
        out.append(LayerStats(mu, spd[0], mu.clone(), spd[1], spd[2], 4096))
    return out


def _ctx(regime=QALL, seed=0, stats=None):
    spec = CalibrationSpec(dataset="ptb", split="train", n_windows=2, seqlen=64, seed=0)
    return SimpleNamespace(shape=SHAPE, regime=regime, stats=stats, seed=seed, spec=spec, model_id="tiny")


@pytest.mark.parametrize("name,bpd,v_bpd", [
    ("kivi", 4.0, None), ("kivi", 5.0, 5.0), ("gear", 6.0, None), ("svdq", 2.0, None), ("svdq", 1.0, None), ("kqsvd", 1.0, None),
    ("kqsvd", 0.5, 4.0), ("cobra_kl", 1.0, None), ("cobra_mse", 0.5, 2.0)])
def test_search_takes_the_lowest_heldout_ppl_among_the_candidates(name, bpd, v_bpd):
    """A stub scorer gives each candidate a known perplexity: the search takes the lowest, records
    every candidate's score and prediction, and a tie goes to the earlier candidate. Every
    candidate configures and calibrates (it is admissible) under the ceiling."""
    ctx = _ctx(stats=_stats())
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
    assert all("unsupported" not in c and c["predicted_bpd_k"] <= 1.02 * bpd for c in out["candidates"])
    tie = KS.search(ctx, name, {}, bpd, v_bpd, cands, lambda m: 1.0)
    assert tie["knobs"] == cands[0]


@pytest.mark.parametrize("v_bpd", [None, 4.0])
def test_a_candidate_measured_over_the_ceiling_is_recorded_and_never_chosen(v_bpd):
    """Where the held-out pass is the job's regime (Q-all over the held-out length) its headline is
    the job's figure: the best-scoring candidate measured at 1.03 x the target (the KV mean in the
    KV-track) is passed over, one at exactly 1.02 x is not; none under: Unsupported."""
    ctx = _ctx(stats=_stats())
    ctx.spec = CalibrationSpec(dataset="ptb", split="train", n_windows=2, seqlen=2048, seed=0)
    method = build_method("kivi")
    method.set_regime(QALL)
    cands = KS.candidates(ctx, method, 4.0, v_bpd)[:3]
    assert len(cands) == 3
    side = 4.0
    over, at = {"measured_k": 1.03 * side, "measured_v": 16.0 if v_bpd is None else 1.03 * side}, \
        {"measured_k": 1.02 * side, "measured_v": 16.0 if v_bpd is None else 1.02 * side}
    got = [(1.0, over), (2.0, at), (3.0, at)]
    out = KS.search(ctx, "kivi", {}, 4.0, v_bpd, cands, lambda m: got.pop(0))
    assert out["knobs"] == cands[1] and out["ppl"] == 2.0
    first = out["candidates"][0]
    assert first["ppl"] == 1.0 and first["measured_bpd_k"] == 1.03 * side
    assert first["over_ceiling"].startswith("bpd_K 4.12" if v_bpd is None else "bpd_KV 4.12")
    assert "over_ceiling" not in out["candidates"][1]
    with pytest.raises(Unsupported, match="no knob candidate is reachable under the ceiling"):
        KS.search(ctx, "kivi", {}, 4.0, v_bpd, cands, lambda m: (1.0, over))


def test_elsewhere_the_heldout_excess_over_the_formula_is_added_to_the_prediction():
    """A job at 2048 positions, held-out windows of 64: the job's figure is the candidate's
    prediction plus the held-out end-of-sequence bpd beyond ``nominal_bpd`` at 64 tokens."""
    ctx = _ctx(stats=_stats())
    method = build_method("kivi")
    method.set_regime(QALL)
    cand = KS.candidates(ctx, method, 4.0, None)[0]
    probe = build_method("kivi")
    probe.set_regime(QALL)
    probe.use_knobs(cand)
    probe.configure(SHAPE, 4.0, None)
    nk, nv = probe.nominal_bpd(64)
    predicted = probe.knobs()["predicted"]["bpd_k"]
    room = 1.02 * 4.0 - predicted
    measured = {"measured_k": 99.0, "measured_v": 99.0, "end_k": nk + room / 2, "end_v": nv}
    row = KS.search(ctx, "kivi", {}, 4.0, None, [cand], lambda m: (1.0, measured))["candidates"][0]
    assert row["measured_bpd_k"] == pytest.approx(predicted + room / 2) and "over_ceiling" not in row
    measured["end_k"] = nk + room + 0.01
    with pytest.raises(Unsupported, match="bpd_K 4.09 as the held-out windows measure it"):
        KS.search(ctx, "kivi", {}, 4.0, None, [cand], lambda m: (1.0, measured))


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
    _measured_as_predicted(ks)
    again = _job(tmp_path / "b", tiny_checkpoint, f"method={method}", f"bpd={bpd}")
    assert again["knob_search"]["cache_hit"] is True and again["knob_search"]["knobs"] == ks["knobs"]


def _measured_as_predicted(ks):
    """These methods' bits do not depend on the data: the figure the held-out windows measure for
    each candidate, carried to the job's regime (256 tokens against held-out windows of 128), is
    its prediction."""
    for c in ks["candidates"]:
        assert "over_ceiling" not in c
        assert c["measured_bpd_k"] == pytest.approx(c["predicted_bpd_k"], rel=1e-9, abs=1e-9), c
        assert c["measured_bpd_v"] == pytest.approx(c["predicted_bpd_v"] or 16.0, rel=1e-9, abs=1e-9), c


# ---- SVDq, KQ-SVD, KV-COBRA: their grids (docs/methods.md §3.3, §4.3, §5.12) -----------------

@pytest.mark.parametrize("name", ["cobra_kl", "cobra_mse"])
def test_cobra_searches_eta_b_min_and_the_rank_step_from_the_seeds_setting(name):
    m = build_method(name)
    m.set_regime(QALL)
    cands = m.knob_candidates(SHAPE, 1.0, None, KS.N_CANDIDATES)
    assert len(cands) == 27 and cands[0] == PAPER_KNOBS
    assert {tuple(c.values()) for c in cands} == {(e, b, r) for e in KNOB_GRID["eta"] for b in KNOB_GRID["b_min"]
                                                   for r in KNOB_GRID["rank_step"]}
    away = [sum(c[k] != PAPER_KNOBS[k] for k in PAPER_KNOBS) for c in cands]
    assert away == sorted(away) and away[1:7] == [1] * 6
    # eta moves nothing without the seed's C2: only the b_min x rank_step grid
    assert len(build_method(name, c2="exact").knob_candidates(SHAPE, 1.0, None)) == 9
    # a grid point whose per-head range misses the budget is not a candidate (4 bits per head)
    low = m.knob_candidates(SHAPE, 4 / 64, None)
    assert low and all(c["b_min"] * c["rank_step"] <= 4 for c in low)
    # explicit knobs: no search, the given value in force
    fixed = build_method(name, b_min=3)
    assert fixed.searches() == () and fixed.knob_candidates(SHAPE, 1.0, None) == []


def test_cobra_use_knobs_changes_the_allocation():
    stats = _stats()
    out = {}
    for knobs in (None, {"eta": 0.3, "b_min": 3, "rank_step": 4}):
        m = build_method("cobra_kl")
        m.use_knobs(knobs)
        m.configure(SHAPE, 1.0, None)
        m.calibrate(stats)
        out[str(knobs)] = m.knobs()
    chosen = out[str({"eta": 0.3, "b_min": 3, "rank_step": 4})]
    assert chosen["b_min"] == 3 and chosen["rank_step"] == 4 and chosen["fit"]["chosen_by"] == "held-out knob search"
    assert all(r % 4 == 0 for r in chosen["ranks"]) and chosen["predicted"]["bpd_k"] <= 1.0
    assert "b_min" not in out["None"]  # no search: the seed's setting, knobs as before
    assert chosen["ranks"] != out["None"]["ranks"]


def test_kqsvd_candidates_start_with_the_proxy_set_and_use_knobs_fixes_r_b():
    m = build_method("kqsvd")
    m.set_regime(QALL)
    cands = m.knob_candidates(SHAPE, 1.0, None, KS.N_CANDIDATES)
    pairs = [(c["rank"], c["bits"]) for c in cands]
    exact = kqsvd_pairs(1.0, 64)
    assert pairs[:len(exact)] == exact == [(8, 8), (16, 4), (32, 2)]  # the proxy chooses among these
    assert sorted(b for _, b in pairs) == list(range(2, 9))  # one point per bit width
    assert all(r % 2 == 0 and r * b <= 1.02 * 64 for r, b in pairs)
    stats = _stats()
    m.use_knobs({"rank": 20, "bits": 3})
    m.configure(SHAPE, 1.0, None)
    m.calibrate(stats)
    k = m.knobs()
    assert (k["rank"], k["bits"]) == (20, 3) and k["predicted"]["bpd_k"] == 60 / 64
    m.use_knobs({"rank": 34, "bits": 2})  # 1.0625 x the target
    with pytest.raises(Unsupported, match="not admissible"):
        m.configure(SHAPE, 1.0, None)
    fixed = build_method("kqsvd", rank=16, bits=4)
    assert fixed.searches() == () and fixed.knob_candidates(SHAPE, 1.0, None) == []
    fixed.configure(SHAPE, 1.0, None)
    fixed.calibrate(stats)
    assert (fixed.knobs()["rank"], fixed.knobs()["bits"]) == (16, 4)


def test_svdq_candidates_one_per_group_size_the_paper_schedule_first():
    m = build_method("svdq")
    m.set_regime(Regime("prefill", 1536, 511))
    cands = m.knob_candidates(SHAPE, 4.0, None, KS.N_CANDIDATES)
    assert cands[0] == {"group": 128, "total_bits": 16}
    assert sorted(c["group"] for c in cands[1:]) == [8, 16, 24, 32, 48, 64, 96, 128]
    q = build_method("svdq")
    q.set_regime(QALL)
    assert q.knob_candidates(SHAPE, 0.5, None) == []  # below the reach: configure says why
    stats = _stats()
    for knobs, sched in (({"group": 16, "total_bits": None}, None), ({"group": 128, "total_bits": 16}, PAPER_SCHEDULE)):
        m = build_method("svdq")
        m.set_regime(Regime("prefill", 1536, 511))
        m.use_knobs(knobs)
        m.configure(SHAPE, 4.0, None)
        m.calibrate(stats)
        k = m.knobs()
        assert k["group_tokens"] == knobs["group"] and k["fit"]["chosen_by"] == "held-out knob search"
        assert k["predicted"]["bpd_k"] <= 1.02 * 4.0
        if sched:
            assert tuple(k["schedule"]) == sched
    assert build_method("svdq", group=16).searches() == () and build_method("svdq", budget="mean").searches() == ()


@pytest.mark.parametrize("method,bpd", [("cobra_kl", 1), ("kqsvd", 2), ("svdq", 8)])
def test_a_job_searches_the_knobs_of_the_latent_codecs(tmp_path, tiny_checkpoint, monkeypatch, method, bpd):
    """SVDq, KQ-SVD and KV-COBRA jobs search their knobs (the tiny model: d = 16), record every
    candidate's held-out perplexity and run the choice under the ceiling; explicit knobs: no search."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    r = _job(tmp_path / "a", tiny_checkpoint, f"method={method}", f"bpd={bpd}")
    assert r["status"] == "ok", r.get("error")
    ks = r["knob_search"]
    assert len(ks["candidates"]) == min(27, ks["admissible"]) and all(c["ppl"] is not None for c in ks["candidates"])
    assert ks["ppl"] == min(c["ppl"] for c in ks["candidates"])
    assert r["knobs"]["fit"]["chosen_by"] == "held-out knob search"
    assert r["bpd"]["measured_k"] <= 1.02 * bpd
    _measured_as_predicted(ks)
    if method == "svdq":
        assert r["knobs"]["group_tokens"] == ks["knobs"]["group"]
    else:
        assert {k: r["knobs"][k] for k in ks["knobs"]} == ks["knobs"]
    explicit = {"cobra_kl": "method.eta=0.3", "kqsvd": "method.rank=16", "svdq": "method.group=16"}[method]
    fixed = _job(tmp_path / "b", tiny_checkpoint, f"method={method}", f"bpd={bpd}", explicit,
                 *(["method.bits=8"] if method == "kqsvd" else []))
    assert fixed["status"] == "ok", fixed.get("error")
    assert "knob_search" not in fixed
