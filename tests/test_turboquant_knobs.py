"""TurboQuant's ceiling and knob search (docs/methods.md §0.1, §16.4, §16.10): the admissible
(key variant, split, plan) candidates, the paper's b + 1/2-bit settings, and the prod + split codec
against a naive float64 reference of Alg. 2 per instance."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvbench.fit import knob_search as KS
from methods import Regime, Unsupported, build_method
from methods.base import LayerStats, ModelShape
from methods.turboquant import TurboQuant, lloyd_max, paper_plan

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]

F64 = torch.float64
QALL = Regime("qall", 2048)
SMOLLM2 = ModelShape(30, 9, 3, 64)
LLAMA = ModelShape(32, 32, 8, 128)


def _candidates(shape, bpd, v_bpd=None, regime=QALL, **opts):
    m = TurboQuant(**opts)
    m.set_regime(regime)
    return m.knob_candidates(shape, bpd, v_bpd, 27)


def _configured(shape, knobs, bpd, v_bpd=None, regime=QALL, **opts):
    m = TurboQuant(**opts)
    m.set_regime(regime)
    m.use_knobs(knobs)
    m.configure(shape, bpd, v_bpd)
    return m


def _counts(widths):
    out = {}
    for b in widths:
        out[b] = out.get(b, 0) + 1
    return out


def test_the_paper_settings_literally():
    """§16.4: 2.5 bits = 32 @3 + 96 @2 + 2 norms (2.50 at d = 128, 2.75 at d = 64); 3.5 likewise;
    prod: one mse bit fewer on each instance, QJL's sign bit and gamma added."""
    for label, hi, lo in ((2.5, 3, 2), (3.5, 4, 3)):
        p = paper_plan(label, 128, "mse")
        assert [_counts(i.widths) for i in p.instances] == [{hi: 32}, {lo: 96}]
        assert p.bits == 128 * label and paper_plan(label, 64, "mse").bits == 64 * (label + 0.25)
        q = paper_plan(label, 128, "prod")
        assert [_counts(i.widths) for i in q.instances] == [{hi - 1: 32}, {lo - 1: 96}]
        assert q.bits == 32 * (hi - 1) + 96 * (lo - 1) + 128 + 4 * 16
    with pytest.raises(ValueError, match="b \\+ 1/2"):
        paper_plan(3.0, 128, "mse")


@pytest.mark.parametrize("regime", [QALL, Regime("prefill", 1536, 511)])
def test_candidates_are_admissible_and_the_paper_setting_leads(regime):
    # d = 128: the paper's 2.5-bit mse split measures 2.50 and leads; its prod form (2.75) is over
    cands = _candidates(LLAMA, 2.5, regime=regime)
    assert cands[0] == {"k_variant": "mse", "split": True, "plan": "paper"}
    assert {"k_variant": "prod", "split": True, "plan": "paper"} not in cands
    assert len(cands) == 4 and {(c["k_variant"], c["split"]) for c in cands} == {
        ("mse", True), ("prod", True), ("mse", False), ("prod", False)}
    # d = 64 (SmolLM2): the literal split measures 2.75 > 1.02 x 2.5: only the equal-budget plans
    cands = _candidates(SMOLLM2, 2.5, regime=regime)
    assert len(cands) == 4 and all(c["plan"] == "nearest" for c in cands)
    assert cands[0] == {"k_variant": "mse", "split": True, "plan": "nearest"}
    for shape, bpd, v_bpd in ((LLAMA, 2.5, None), (SMOLLM2, 2.5, None), (SMOLLM2, 3.5, 3.5), (SMOLLM2, 1.0, None)):
        for c in _candidates(shape, bpd, v_bpd, regime=regime):
            m = _configured(shape, c, bpd, v_bpd, regime=regime)
            pred = m.knobs()["predicted"]
            assert pred["bpd_k"] <= 1.02 * bpd and (v_bpd is None or pred["bpd_v"] <= 1.02 * v_bpd)
            assert m.knobs()["k_variant"] == c["k_variant"] and m.knobs()["split"] == c["split"]
            assert m.knobs()["fit"]["chosen_by"] == "held-out knob search"


def test_prod_is_dropped_where_it_cannot_fit_and_options_stay_fixed():
    assert {c["k_variant"] for c in _candidates(SMOLLM2, 1.0)} == {"mse"}  # prod from 1.25 at d = 64
    assert all(c["k_variant"] == "prod" for c in _candidates(SMOLLM2, 2.5, k_variant="prod"))
    assert all(not c["split"] for c in _candidates(SMOLLM2, 2.5, split=False))
    assert TurboQuant(k_variant="mse", split=False).searches() == ()
    assert TurboQuant(bits=3).searches() == () and _candidates(SMOLLM2, 2.5, bits=3) == []
    assert TurboQuant().searches() == ("knobs",)
    assert _candidates(SMOLLM2, 0.1) == []  # nothing admissible: configure says why
    with pytest.raises(Unsupported, match="reachable"):
        TurboQuant().configure(SMOLLM2, 0.1, None)


def test_the_budget_is_a_ceiling_under_is_allowed():
    m = TurboQuant()
    m.configure(SMOLLM2, 9.0, None)  # the widest plan, 8.25, is under the target
    assert m.knobs()["k_bits_per_vector"] == 8 * 64 + 16 and m.knobs()["fit"]["chosen_by"] == "preference"
    m = _configured(LLAMA, {"k_variant": "mse", "split": True, "plan": "paper"}, 2.5)
    assert [_counts(i.widths) for i in m._plans["k"].instances] == [{3: 32}, {2: 96}]
    with pytest.raises(Unsupported, match="paper's 2.5-bit setting"):
        _configured(SMOLLM2, {"k_variant": "mse", "split": True, "plan": "paper"}, 2.5)


def _stats(layers, heads, d):
    energy = torch.linspace(1.0, 3.0, d, dtype=F64)
    st = LayerStats(torch.zeros(heads, d, dtype=F64), torch.diag(energy).expand(heads, d, d),
                    torch.zeros(heads, d, dtype=F64), torch.eye(d, dtype=F64).expand(heads, d, d),
                    torch.eye(d, dtype=F64).expand(heads, d, d), 10)
    return [st] * layers


def test_the_search_scores_every_candidate_and_takes_the_lowest():
    shape = ModelShape(1, 2, 1, 64)
    ctx = SimpleNamespace(shape=shape, regime=QALL, stats=_stats(1, 1, 64), seed=0,
                          spec=SimpleNamespace(seqlen=64), model_id="tiny")
    method = build_method("turboquant")
    method.set_regime(QALL)
    cands = KS.candidates(ctx, method, 2.5, None)
    assert len(cands) == 4
    ppl = {(c["k_variant"], c["split"], c["plan"]): 10.0 + i for i, c in enumerate(cands[::-1])}
    out = KS.search(ctx, "turboquant", {}, 2.5, None, cands,
                    lambda m: ppl[(m.chosen_knobs["k_variant"], m.chosen_knobs["split"], m.chosen_knobs["plan"])])
    assert out["knobs"] == cands[-1] and out["ppl"] == 10.0
    assert all(c["predicted_bpd_k"] <= 1.02 * 2.5 for c in out["candidates"])


# ---- the prod + split codec against a naive float64 reference of Alg. 2 ------------------------


def naive_instance(x, rot, sketch, widths, qjl):
    """Alg. 1-2 on one subvector per row, numpy float64: nu = ||x|| (fp16), u = x / nu, y = Pi u,
    each coordinate the nearest of its width's Lloyd-Max centroids (argmin, no boundaries),
    u_hat = Pi^T c; prod: rho = u - u_hat, z = [S rho > 0], gamma = ||rho|| (fp16, 1 without an
    mse stage), x_hat = nu (u_hat + gamma sqrt(pi/2)/d S^T (2z - 1))."""
    d = x.shape[-1]
    nu = np.linalg.norm(x, axis=-1)
    u = x / nu[:, None]
    y = u @ rot.T
    c = np.zeros_like(y)
    for j, b in enumerate(widths):
        cent = np.array(lloyd_max(b, d).centroids)
        c[:, j] = cent[np.abs(y[:, j, None] - cent[None]).argmin(-1)]
    u_hat = c @ rot
    nu16 = nu.astype(np.float16).astype(np.float64)
    if not qjl:
        return nu16[:, None] * u_hat
    rho = u - u_hat
    z = (rho @ sketch.T) > 0
    gamma = np.linalg.norm(rho, axis=-1).astype(np.float16).astype(np.float64) if sum(widths) else np.ones(len(x))
    return nu16[:, None] * (u_hat + gamma[:, None] * math.sqrt(math.pi / 2) / d * ((2.0 * z - 1) @ sketch))


@pytest.mark.parametrize("d,bpd", [(128, None), (64, 2.5), (64, 3.5)])
def test_prod_split_codec_matches_the_naive_reference(d, bpd):
    """The split with prod keys (bpd None: the paper's 2.5-bit prod setting at d = 128, run as the
    plain row bits=2, 2.75 bpd; else the equal-budget prod split at d = 64): each instance, on its
    channels, is Alg. 2 at its own dimension with its own Pi and S; the stored bytes decode to the
    same vectors."""
    shape = ModelShape(1, 2, 1, d)
    m = TurboQuant(k_variant="prod", split=True, bits=2 if bpd is None else None)
    m.configure(shape, bpd, None)
    if bpd is None:
        assert m._plans["k"] == paper_plan(2.5, d, "prod")
    m.calibrate(_stats(1, 1, d), seed=3)
    codec = m.new_layer_state(0).key_codec
    x = torch.randn(1, 1, 300, d, generator=torch.Generator().manual_seed(5), dtype=F64) * 2
    packed, x_hat = codec.encode_decode(x)
    assert len(codec.instances) == 2
    for inst in codec.instances:
        assert inst.sketch is not None
        ch = inst.channels[0]
        ref = naive_instance(x[0, 0][:, ch].numpy(), inst.rot[0].numpy(), inst.sketch[0].numpy(),
                             inst.plan.widths, True)
        got = x_hat[0, 0][:, ch].numpy()
        assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()
    assert torch.equal(codec.decode(packed), x_hat)
    assert codec.bits(packed) == 300 * m._plans["k"].bits
