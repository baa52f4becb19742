"""``joint_kv``: one K+V budget for the integer codecs (methods/joint_budget.py): the mean of the
two sides' measured bpd within 2 % of bpd_KV, the most balanced pair first."""

import json

import pytest

from methods import Unsupported
from methods.base import ModelShape, Regime
from methods.gear import Gear
from methods.joint_budget import admissible_pairs
from methods.kivi import Kivi, residual_grid, side_points
from methods.kvquant import KVQuant

SMOL = ModelShape(30, 9, 3, 64)
LLAMA = ModelShape(32, 32, 8, 128)
QALL = Regime("qall", 2048)
TRACK_B = Regime("prefill", 1536, 511)


def test_the_first_pair_is_the_most_balanced_admissible_one_then_the_preference():
    keys, vals = [1.0, 1.98, 3.0], [1.0, 2.02, 3.0]
    pairs = [(k, v) for k in keys for v in vals]
    assert admissible_pairs(pairs, float, 2.0, 0.02, lambda k, v: (k,))[0] == (1.98, 2.02)
    tied = [(k, v) for k in (1.0, 3.0) for v in (1.0, 3.0)]
    assert admissible_pairs(tied, float, 2.0, 0.0, lambda k, v: (k,))[0] == (3.0, 1.0)  # |k - v| ties: more key bits
    assert admissible_pairs(pairs, float, 0.5, 0.02, lambda k, v: (k,)) == []


def test_the_pairs_band_is_on_the_mean():
    assert admissible_pairs([(1.95, 2.0)], float, 2.0, 0.02, lambda k, v: ()) == [(1.95, 2.0)]
    assert admissible_pairs([(1.9, 2.1)], float, 2.0, 0.0, lambda k, v: ()) == [(1.9, 2.1)]
    assert admissible_pairs([(2.0, 2.2)], float, 2.0, 0.02, lambda k, v: ()) == []


def _configured(cls, shape, regime, bpd, **opts):
    m = cls(**opts)
    m.set_regime(regime)
    m.configure(shape, bpd, bpd)
    return m


@pytest.mark.parametrize("shape,regime,bpd", [(SMOL, QALL, 4.0), (LLAMA, QALL, 3.0), (LLAMA, TRACK_B, 2.0)])
def test_kivi_joint_meets_the_mean_where_the_sides_alone_cannot(shape, regime, bpd):
    """One R for both sides: no point within 2 % of bpd on each side (the side-by-side fit takes
    one under each side's ceiling), a pair whose mean is; the measured reads of the configured
    state give that mean."""
    from test_kivi import _measure

    side = _configured(Kivi, shape, regime, bpd).knobs()["fit"]
    assert side["predicted_bpd_k"] < 0.98 * bpd or side["predicted_bpd_v"] < 0.98 * bpd
    m = _configured(Kivi, shape, regime, bpd, joint_kv=True)
    kn = m.knobs()
    assert kn["fit"]["joint_kv"] == bpd
    pk, pv = kn["fit"]["predicted_bpd_k"], kn["fit"]["predicted_bpd_v"]
    assert abs((pk + pv) / 2 - bpd) <= 0.02 * bpd
    mk, mv = _measure(m, regime, d=shape.head_dim)
    assert (mk, mv) == (pytest.approx(pk, abs=1e-9), pytest.approx(pv, abs=1e-9))
    # the most balanced admissible pair at any shared R
    best = min(abs(k[0] - v[0]) for r in residual_grid()
               for k in side_points("k", regime, shape.head_dim, r) for v in side_points("v", regime, shape.head_dim, r)
               if abs((k[0] + v[0]) / 2 - bpd) <= 0.02 * bpd + 1e-9)
    assert abs(pk - pv) == pytest.approx(best, abs=1e-9)


def test_kivi_joint_keeps_its_band_on_the_mean_where_the_sides_are_under_their_ceilings():
    """The side-by-side fit takes the most preferred point under each side's ceiling (docs/methods.md
    §0.1); joint_kv the most balanced pair whose mean is within 2 % of bpd_KV."""
    a = _configured(Kivi, SMOL, TRACK_B, 4.0).knobs()
    b = _configured(Kivi, SMOL, TRACK_B, 4.0, joint_kv=True).knobs()
    assert a["fit"]["predicted_bpd_k"] <= 4.08 and a["fit"]["predicted_bpd_v"] <= 4.08
    assert abs((b["fit"]["predicted_bpd_k"] + b["fit"]["predicted_bpd_v"]) / 2 - 4.0) <= 0.08


def test_kvquant_joint_reaches_bpd_kv_1_on_llama_and_2_3_4_on_smollm2():
    """Values cost b + 32/n more than keys: v_bpd = 1 alone is over its ceiling on Llama, the mean
    is not; on SmolLM2 (n = 192) bpd_KV 1 is out of reach (nuq1 + nuq1 = 1.083), 2-4 are reached
    under the ceiling through the outlier fractions (docs/methods.md §14.6)."""
    with pytest.raises(Unsupported):
        _configured(KVQuant, LLAMA, QALL, 1.0)
    kn = _configured(KVQuant, LLAMA, QALL, 1.0, joint_kv=True).knobs()
    assert (kn["k_bits"], kn["v_bits"], kn["joint_kv"]) == (1, 1, 1.0)
    assert (kn["predicted_bpd_k"] + kn["predicted_bpd_v"]) / 2 <= 1.02
    with pytest.raises(Unsupported, match="joint_kv"):
        _configured(KVQuant, SMOL, QALL, 1.0, joint_kv=True)
    for bpd in (2.0, 3.0, 4.0):
        kn = _configured(KVQuant, SMOL, QALL, bpd, joint_kv=True).knobs()
        assert (kn["predicted_bpd_k"] + kn["predicted_bpd_v"]) / 2 <= 1.02 * bpd + 1e-12


def test_gear_joint_matches_the_side_by_side_fit_where_it_exists_and_names_the_floor():
    a = _configured(Gear, SMOL, QALL, 4.0, seed=0).knobs()
    b = _configured(Gear, SMOL, QALL, 4.0, seed=0, joint_kv=True).knobs()
    assert (a["block"], a["k"], a["v"]) == (b["block"], b["k"], b["v"])
    assert b["fit"]["joint_kv"] == 4.0
    with pytest.raises(Unsupported, match="joint_kv"):
        _configured(Gear, SMOL, TRACK_B, 2.0, seed=0, joint_kv=True)


def test_admissible_pairs_are_under_the_ceiling_near_ones_first_then_the_largest_mean():
    pairs = [(k, v) for k in (1.0, 1.98, 3.0) for v in (1.0, 2.02, 3.0)]
    ranked = admissible_pairs(pairs, float, 2.0, 0.02, lambda k, v: (k,))
    assert ranked[0] == (1.98, 2.02)  # within 2%, the most balanced
    assert all((k + v) / 2 <= 2.04 for k, v in ranked)
    assert (3.0, 1.0) in ranked and (3.0, 3.0) not in ranked
    means = [(k + v) / 2 for k, v in ranked[1:]]
    assert means == sorted(means, reverse=True)  # the cheaper pairs, the largest mean first


def test_kivi_joint_offers_its_admissible_pairs_to_the_knob_search():
    m = Kivi(joint_kv=True)
    m.set_regime(QALL)
    cands = m.knob_candidates(SMOL, 4.0, 4.0, 27)
    assert 1 < len(cands) <= 27 and m.searches() == ("knobs",)
    for knobs in cands[:5]:
        m.use_knobs(knobs)
        m.configure(SMOL, 4.0, 4.0)
        kn = m.knobs()
        assert {k: kn[k] for k in knobs} == knobs
        assert (kn["fit"]["predicted_bpd_k"] + kn["fit"]["predicted_bpd_v"]) / 2 <= 4.0 * 1.02 + 1e-9


def test_gear_joint_offers_its_admissible_pairs_to_the_knob_search():
    """GEAR's joint_kv gets the search KIVI's and KVQuant's get: its admissible pairs at one n_b,
    each configured as chosen, the mean under the ceiling; a pair outside them is refused."""
    m = Gear(joint_kv=True, seed=0)
    m.set_regime(QALL)
    cands = m.knob_candidates(SMOL, 4.0, 4.0, 27)
    assert 1 < len(cands) <= 27 and m.searches() == ("knobs",)
    assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
    m.use_knobs(None)
    m.configure(SMOL, 4.0, 4.0)
    own = m.knobs()
    assert {"block": own["block"], "k": {x: own["k"][x] for x in cands[0]["k"]},
            "v": {x: own["v"][x] for x in cands[0]["v"]}} in cands  # the fit's own first pair
    family = lambda c: (c["k"]["bits"], c["v"]["bits"])  # noqa: E731
    families = {family(c) for c in m.knob_candidates(SMOL, 4.0, 4.0)}
    head = cands[: min(27, len(families))]
    assert len({family(c) for c in head}) == len(head)  # one pair per (key bits, value bits) first
    for knobs in cands[:4]:
        m.use_knobs(knobs)
        m.configure(SMOL, 4.0, 4.0)
        kn = m.knobs()
        assert kn["block"] == knobs["block"]
        for side in ("k", "v"):
            assert {x: kn[side][x] for x in knobs[side]} == knobs[side]
        assert kn["fit"]["chosen_by"] == "held-out knob search" and kn["fit"]["joint_kv"] == 4.0
        assert (kn["fit"]["predicted_bpd_k"] + kn["fit"]["predicted_bpd_v"]) / 2 <= 4.0 * 1.02 + 1e-9
    m.use_knobs({**cands[0], "block": 7})
    with pytest.raises(Unsupported, match="not an admissible joint pair"):
        m.configure(SMOL, 4.0, 4.0)
