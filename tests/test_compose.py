"""compose(evict, codec), docs/methods.md §12: eviction x codec in one cache.

Checked against references that do not use the composed states: a naive per-head loop of H2O over
KIVI-stored tokens (arrival-indexed rules, groups of the kept members only), H2O's own naive
reference run over decoded tokens, KIVI's own layer state run on SnapKV's kept sequence, the codec
alone (keep=1), the eviction alone (exact codec), and direct counts of the stored bits and of what
each query read (docs/methods.md §0 v2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.integrate import attach, model_shape
from methods import Regime, Unsupported, build_method
from methods.base import ModelShape
from methods.compose import (
    KeptPositions,
    KiviComposedState,
    SnapKiviState,
    TokenwiseComposedState,
    position_bits,
)
from methods.groupquant import fake_quantize_groups
from methods.h2o import H2OLayerState
from methods.kivi import KiviLayerState
from methods.latent_codec import KiviValueCodec
from methods.snapkv import SnapKVLayerState
from test_h2o import h2o_reference, make_qkv
from test_run import _job, tiny_checkpoint  # noqa: F401 - the job tests' tiny checkpoint fixture

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]

T = 80
KIVI = {"bits": 2, "group": 16, "v_bits": 2, "v_group": 16, "residual": 32}
SNAP = {"window": 8, "kernel": 3}
SNAP_EVICT = {**SNAP, "decode": "evict"}


# ------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def model_and_stats():
    """The tiny Llama in float64: exactness through rounding quantizers needs it (test_integration)."""
    model = tiny_llama(seed=1).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (4, 64), generator=g))


def _method(model, stats, name, bpd=None, v_bpd=None, regime=Regime("qall", T), **options):
    method = build_method(name, **options)
    method.set_regime(regime)
    method.configure(model_shape(model), bpd, v_bpd)
    if method.needs_calibration:
        method.calibrate(stats, seed=0)
    return method


def _ids(seed=7):
    return torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(seed))


def _qall(model, method, ids):
    """(one-pass logits, token-by-token logits, bpd after each, reads of the one pass)."""
    comp = attach(model, method)
    try:
        with torch.no_grad():
            one = model(input_ids=ids, use_cache=False).logits
            bpd_one, reads = comp.measured_bpd(), comp.read_bpd()
            with comp.session():
                steps = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(T)], 1)
            bpd_steps = comp.measured_bpd()
    finally:
        comp.detach()
    return one, steps, bpd_one, bpd_steps, reads


def _track_b(model, method, ids, p=50, steps=False):
    """Exact prefill of p tokens, then the rest in one chunk (or token by token): (logits,
    end-of-prefill bpd, end bpd, reads of the decode pass, the per-layer states)."""
    comp = attach(model, method)
    try:
        with torch.no_grad(), comp.session():
            comp.forward(ids[:, :p], 0, prefill=True)
            prefill_end = comp.measured_bpd()
            if steps:
                logits = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(p, T)], 1)
                reads = None
            else:
                logits = comp.forward(ids[:, p:], p, prefill=False)
                reads = comp.read_bpd()
            end, states = comp.measured_bpd(), list(comp.states[0])
    finally:
        comp.detach()
    return logits, prefill_end, end, reads, states


# ------------------------------------------------------------------------------------------------
# options and flags


def test_options_are_validated_with_the_valid_choices():
    with pytest.raises(ValueError, match="valid choices: h2o, snapkv"):
        build_method("compose", evict="streaming")
    with pytest.raises(ValueError, match="valid choices: fp16, kivi, kqsvd"):
        build_method("compose", codec="nope")
    with pytest.raises(ValueError, match="svdq.*not supported yet"):
        build_method("compose", codec="svdq")
    with pytest.raises(ValueError, match="valid choices"):
        build_method("compose", codec="h2o")  # an eviction is not a codec
    with pytest.raises(TypeError, match="valid options"):
        build_method("compose", evict_options={"heavy": 0.1})
    with pytest.raises(TypeError, match="valid options"):
        build_method("compose", codec="kivi", codec_options={"bit": 2})
    with pytest.raises(ValueError, match="keep must be a fraction"):
        build_method("compose", keep=1.5)
    with pytest.raises(ValueError, match="not both"):
        build_method("compose", keep=0.5, split=0.25)
    with pytest.raises(ValueError, match="gqa='mean'"):
        build_method("compose", evict="snapkv", evict_options={"gqa": "repeat"})


def test_capability_flags_come_from_the_parts():
    m = build_method("compose", evict="snapkv", codec="cobra_kl")
    assert m.needs_calibration and not m.supports_in_pass and m.evicts_tokens
    m = build_method("compose", evict="h2o", codec="kivi")
    assert not m.needs_calibration and m.supports_in_pass


# ------------------------------------------------------------------------------------------------
# budget


def _h2o_qall_held(rho, t, floor=8):
    """Tokens each query reads in Q-all (§6.3), written from the spec."""
    return np.array([min(p, max(floor, math.ceil(rho * p - 1e-9))) + 1 if p else 1 for p in range(t)])


def _h2o_qall_share(rho, t, floor=8):
    """Kept share each query reads in Q-all (§6.3)."""
    return _h2o_qall_held(rho, t, floor) / np.arange(1, t + 1)


def naive_position_encoding(kept, seen):
    """(encoding, bits per KV head) of the stored positions (§12.3), written out: nothing evicted,
    nothing; else the cheaper of ⌈log₂ seen⌉-bit positions (whole bytes each, the remaining bits
    packed into bytes) and a kept mask of one bit per seen position (packed into bytes)."""
    if kept == seen:
        return "none", 0
    w = max(1, math.ceil(math.log2(seen)))
    as_positions = (w // 8) * kept + math.ceil(kept * (w % 8) / 8)
    as_mask = math.ceil(seen / 8)
    return ("positions", 8 * as_positions) if as_positions <= as_mask else ("mask", 8 * as_mask)


def naive_position_bits(kept, seen):
    return naive_position_encoding(kept, seen)[1]


def _qall_position_bpd(rho, t, d):
    """Key-side bpd of the positions of a pre-RoPE codec under H2O in Q-all, mean over positions."""
    held = _h2o_qall_held(rho, t)
    return float(np.mean([naive_position_bits(int(n), p + 1) / ((p + 1) * d) for p, n in enumerate(held)]))


def test_fixed_keep_gives_the_codec_the_rest_of_the_budget():
    shape = ModelShape(4, 8, 4, 64)
    m = build_method("compose", evict="h2o", codec="cobra_kl", keep=0.25)
    m.set_regime(Regime("qall", 2048))
    m.configure(shape, 1.0, None)
    share = _h2o_qall_share(0.25, 2048).mean()
    k = m.knobs()
    assert k["rho"] == pytest.approx(0.25) and not k["fitted"]
    # fp32 score: 16/d per side; the keys (pre-RoPE) also pay for the stored positions (§12.3)
    pos = _qall_position_bpd(0.25, 2048, 64)
    assert 0 < pos == pytest.approx(k["predicted_positions_bpd_k"]) and k["positions"] == "stored"
    assert k["codec_target_k"] == pytest.approx((1.0 - pos) / share - 16 / 64)
    # values take an integer b_V (§5.8): the largest one below the share, 3 of 3.62
    assert k["codec_target_v"] == math.floor(1.0 / share - 0.25) == 3
    assert k["codec_knobs"]["target_bpd_v"] == 3.0


def test_fitted_rho_spends_the_target_and_unreachable_targets_name_the_range():
    shape = ModelShape(30, 9, 3, 64)
    m = build_method("compose", evict="snapkv", codec="kivi", codec_options={"residual": 32})
    m.set_regime(Regime("prefill", 1536, 511))
    m.configure(shape, 1.0, None)
    k = m.knobs()
    assert k["fitted"] and k["predicted_bpd_kv"] == pytest.approx(1.0, abs=2e-3)
    assert k["positions"] == "none" and k["predicted_positions_bpd_k"] == 0  # KIVI is post-RoPE
    # prefill-exact: the headline is the mean over the 512 scored reads (docs/methods.md §0 v3), the
    # prefill's own prediction at C_0 = round(0.25 * 1536) kept tokens, then 511 decoded targets,
    # each appended (decode=keep)
    c0, j = round(0.25 * 1536), np.arange(512)
    assert k["kept_share_at_split"] == pytest.approx(np.mean((c0 + j) / (1536 + j)))
    with pytest.raises(Unsupported, match="reachable range"):  # below KIVI's own floor
        m.configure(shape, 0.2, None)
    m = build_method("compose", evict="snapkv", codec="kivi", split=0.125)
    m.set_regime(Regime("prefill", 1536, 511))
    # decode=keep: at least W + 1 = 33 prompt tokens and every decoded one are read, the last 128 at fp16
    with pytest.raises(Unsupported, match=r"unreachable in this regime .* reachable \[0\.957"):
        m.configure(shape, 0.9, None)
    # decode=evict holds the budget while decoding: the same target is reachable
    m = build_method("compose", evict="snapkv", codec="kivi", split=0.125, evict_options={"decode": "evict"})
    m.set_regime(Regime("prefill", 1536, 511))
    m.configure(shape, 0.9, None)
    assert m.knobs()["predicted_bpd_kv"] == pytest.approx(0.9, rel=2e-3)
    assert m.knobs()["evict_knobs"]["decode"] == "evict"


def test_predicted_bpd_equals_a_direct_computation():
    """H2O + a token-wise codec, Q-all: mean_p held_p (codec bits + 16/d) / (p + 1)."""
    shape = ModelShape(4, 8, 4, 64)
    m = build_method("compose", evict="h2o", codec="cobra_kl", keep=0.125)
    m.set_regime(Regime("qall", 512))
    m.configure(shape, 2.0, 4.0)
    bk, bv = m._codec.nominal_bpd(512)
    share = _h2o_qall_share(0.125, 512).mean()
    pos = _qall_position_bpd(0.125, 512, 64)
    assert m.predicted_bpd() == pytest.approx(((bk + 0.25) * share + pos, (bv + 0.25) * share))


# ------------------------------------------------------------------------------------------------
# layer states against naive references


def test_h2o_over_a_tokenwise_codec_is_h2o_over_the_decoded_tokens():
    """Decode semantics: the scores accumulate from attention over the decoded cache."""
    q, k, v = make_qkv(1, 2, 2, 60, 16, dtype=torch.float64, seed=3)
    codec = KiviValueCodec(2, 8)  # per-token groups: a token-wise codec for keys and values
    state = TokenwiseComposedState(H2OLayerState(0.2, 0.2), codec, codec)
    out = state.attend(q, k, v, scaling=0.25, prefill=False)
    k_hat, v_hat = (fake_quantize_groups(x, 2, 8, axis=-1) for x in (k, v))
    ref, kept = h2o_reference(q, k_hat, v_hat, 0.25, 0.2, 0.2)
    assert (out - ref).abs().max() < 1e-10
    pos = state.evict.kept_positions()
    assert {(0, h): pos[0, h].tolist() for h in range(2)} == kept
    # stored: the held tokens at the codec's bits per token (2 + 32/8 per element) + the fp32 score
    n = len(kept[0, 0])
    assert state.stored_bits() == (n * 2 * (16 * 6 + 16),) * 2


def kivi_under_h2o_reference(q, k, v, scaling, rho, r, gk, b, bv, gv, floor=8):
    """Python loops per KV head: H2O's Q-all recursion (§6.3) over KIVI-stored tokens (§2.3 on
    arrival indices = positions); a key group is quantized at its flush from its kept members only;
    bits held by each query before it reads, and at the end."""
    bsz, hq, t_len, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros_like(q)
    reads_k, reads_v = torch.zeros(t_len, dtype=torch.float64), torch.zeros(t_len, dtype=torch.float64)
    final = {}

    def bits(kept, n):
        flushed = r * (n // r)
        qk = [j for j in kept if j < flushed]
        groups = {j // gk for j in qk}
        bk = len(qk) * b * d + (len(kept) - len(qk)) * 16 * d + len(groups) * 32 * d
        qv = [j for j in kept if j < n - r]
        bvv = len(qv) * (bv * d + 32 * d // gv) + (len(kept) - len(qv)) * 16 * d
        return bk, bvv

    for h in range(hkv):
        kept, score, ks, vs = [], {}, {}, {}
        for t in range(t_len):
            bk, bvv = bits(kept, t)
            reads_k[t] += bk + 16 * d + 16 * (len(kept) + 1)
            reads_v[t] += bvv + 16 * d + 16 * (len(kept) + 1)
            kept.append(t)
            score[t], ks[t], vs[t] = 0.0, k[0, h, t], v[0, h, t]
            for qh in range(h * g, (h + 1) * g):
                kk = torch.stack([ks[j] for j in kept])
                p = torch.softmax(kk @ q[0, qh, t] * scaling, dim=0)
                out[0, qh, t] = p @ torch.stack([vs[j] for j in kept])
                for j, pj in zip(kept, p.tolist()):
                    score[j] += pj / g
            cap = max(floor, math.ceil(rho * (t + 1) - 1e-9))
            c_r = math.floor(cap * 0.5 + 0.5)
            while len(kept) > cap:
                kept.remove(min((j for j in kept if j <= t - c_r), key=lambda j: (score[j], j)))
            n = t + 1
            if n % r == 0:  # flush: groups of gk arrivals, quantized from their kept members
                for g0 in range(n - r, n, gk):
                    mem = [j for j in kept if g0 <= j < g0 + gk]
                    if mem:
                        x = torch.stack([k[0, h, j] for j in mem])[None, None]
                        xq = fake_quantize_groups(x, b, len(mem), axis=2)[0, 0]
                        for i, j in enumerate(mem):
                            ks[j] = xq[i]
            a = n - r - 1
            if a >= 0 and a in kept:
                vs[a] = fake_quantize_groups(v[0, h, a][None], bv, gv, axis=-1)[0]
        final[h] = (list(kept), bits(kept, t_len), {j: ks[j] for j in kept})
    return out, reads_k, reads_v, final


def test_kivi_under_h2o_eviction_matches_a_naive_reference():
    q, k, v = make_qkv(1, 2, 2, 96, 16, dtype=torch.float64, seed=5)
    r, gk = 32, 16
    state = KiviComposedState(H2OLayerState(0.15, 0.15), 2, gk, r, 2, 8)
    out = state.attend(q, k, v, scaling=0.25, prefill=False)
    ref, reads_k, reads_v, final = kivi_under_h2o_reference(q, k, v, 0.25, 0.3, r, gk, 2, 2, 8)
    assert (out - ref).abs().max() < 1e-10
    pos = state.evict.kept_positions()
    k_stored, _ = state.evict.kept_kv()
    for h in range(2):
        kept, _, ks = final[h]
        assert pos[0, h].tolist() == kept
        assert torch.allclose(k_stored[0, h], torch.stack([ks[j] for j in kept]), atol=1e-12)
    # some key group lost members before its flush, so the holes path was exercised
    assert any(len([j for j in final[h][0] if j < 32]) < 32 for h in range(2))
    bits_k = sum(final[h][1][0] for h in range(2)) + 16 * pos.shape[-1] * 2
    bits_v = sum(final[h][1][1] for h in range(2)) + 16 * pos.shape[-1] * 2
    assert state.stored_bits() == (bits_k, bits_v)
    got_k, got_v = state.read_bits()
    assert torch.allclose(got_k, reads_k) and torch.allclose(got_v, reads_v)


def test_snapkv_then_kivi_is_kivi_on_the_kept_sequence():
    """Prefill-exact: SnapKV selects from exact attention, then KIVI stores the kept sequence with
    its own residual rule; decoding appends through KIVI (KIVI's own layer state as reference)."""
    q, k, v = make_qkv(1, 2, 2, 110, 16, dtype=torch.float64, seed=9)
    p = 90
    cap = lambda n: 40  # noqa: E731
    state = KiviComposedState(SnapKVLayerState(8, 3, "max", "mean", cap), 2, 16, 32, 2, 16)
    pre = state.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.25, prefill=True)
    dec = state.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.25, prefill=False)

    snap = SnapKVLayerState(8, 3, "max", "mean", cap)
    ref_pre = snap.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.25, prefill=True)
    idx = snap.kept_prompt_positions()
    take = lambda x: x.gather(2, idx[..., None].expand(*idx.shape, 16))  # noqa: E731
    kivi = KiviLayerState(2, 16, 32, 2, 16)
    kivi.attend(q[:, :, p - 1 : p], take(k[:, :, :p]), take(v[:, :, :p]), scaling=0.25, prefill=True)
    ref_dec = kivi.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.25, prefill=False)
    assert torch.equal(pre, ref_pre)
    assert (dec - ref_dec).abs().max() < 1e-10
    assert state.stored_bits() == kivi.stored_bits()
    rk, rv = state.read_bits()
    ek, ev = kivi.read_bits()
    assert torch.equal(rk, ek) and torch.equal(rv, ev)

    # the state the job builds (KIVI's own on the kept sequence, one-pass chunk) against the
    # arrival-index state above, which runs the chunk token by token through SnapKV's
    fast = SnapKiviState(SnapKVLayerState(8, 3, "max", "mean", cap), KiviLayerState(2, 16, 32, 2, 16))
    assert torch.equal(fast.attend(q[:, :, :p], k[:, :, :p], v[:, :, :p], scaling=0.25, prefill=True), pre)
    assert (fast.attend(q[:, :, p:], k[:, :, p:], v[:, :, p:], scaling=0.25, prefill=False) - dec).abs().max() < 1e-10
    assert fast.stored_bits() == state.stored_bits()
    assert (fast.n_seen, fast.n_kept) == (state.n_seen, state.n_kept) == (110, 60)
    fk, fv = fast.read_bits()
    assert torch.allclose(fk, rk, rtol=0, atol=1e-6) and torch.allclose(fv, rv, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# inside the model


@pytest.mark.parametrize("codec,options,bpd", [("cobra_kl", {}, 2.0), ("kqsvd", {}, 2.0), ("kivi", KIVI, None)])
def test_h2o_codec_one_pass_equals_token_by_token_decoding(model_and_stats, codec, options, bpd):
    model, stats = model_and_stats
    method = _method(model, stats, "compose", bpd, codec=codec, codec_options=options, keep=0.5)
    ids = _ids()
    one, steps, bpd_one, bpd_steps, _ = _qall(model, method, ids)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    assert (one - steps).abs().max() < 1e-4
    assert (one - ref).abs().max() > 1e-3
    # a bit-packed codec pads each encode call to a byte: < 8 bits per layer and decoded token
    shape = model_shape(model)
    assert bpd_one == pytest.approx(bpd_steps, abs=8 / (shape.n_kv_heads * shape.head_dim))


@pytest.mark.parametrize("evict,codec,options,bpd,ev", [
    ("h2o", "cobra_kl", {}, 2.0, {}), ("h2o", "kivi", KIVI, None, {}),
    ("snapkv", "kivi", KIVI, None, SNAP), ("snapkv", "cobra_kl", {}, 2.0, SNAP),
    ("snapkv", "kivi", KIVI, None, SNAP_EVICT), ("snapkv", "cobra_kl", {}, 2.0, SNAP_EVICT),
])
def test_prefill_then_chunk_equals_prefill_then_steps(model_and_stats, evict, codec, options, bpd, ev):
    model, stats = model_and_stats
    method = _method(model, stats, "compose", bpd, evict=evict, codec=codec, codec_options=options,
                     evict_options=ev, keep=0.4, regime=Regime("prefill", 50, 29))
    ids = _ids(3)
    chunk = _track_b(model, method, ids)[0]
    steps = _track_b(model, method, ids, steps=True)[0]
    assert (chunk - steps).abs().max() < 1e-4


@pytest.mark.parametrize("codec,options,bpd", [("kivi", KIVI, None), ("cobra_kl", {}, 2.0)])
def test_keep_one_equals_the_codec_alone(model_and_stats, codec, options, bpd):
    """Q-all through H2O at rho = 1 (nothing evicted; the fp32 scores are still stored), and
    prefill-exact through SnapKV at rho = 1 (the prompt is not compressed)."""
    model, stats = model_and_stats
    ids = _ids()
    comp_h = _method(model, stats, "compose", bpd, codec=codec, codec_options=options, keep=1.0)
    alone = comp_h._codec  # the same configured, calibrated codec, used through its own state
    one, _, bpd_c, _, reads_c = _qall(model, comp_h, ids)
    ref, _, bpd_a, _, reads_a = _qall(model, alone, ids)
    d = model_shape(model).head_dim
    assert (one - ref).abs().max() < 1e-10
    assert bpd_c == pytest.approx((bpd_a[0] + 16 / d, bpd_a[1] + 16 / d))
    assert torch.allclose(reads_c[0], reads_a[0] + 16 / d) and torch.allclose(reads_c[1], reads_a[1] + 16 / d)

    comp_s = _method(model, stats, "compose", bpd, evict="snapkv", codec=codec, codec_options=options,
                     evict_options=SNAP, keep=1.0, regime=Regime("prefill", 50, 29))
    if bpd is not None:  # the same codec budget as the H2O composition had, less the score
        comp_s._codec = alone
    got, pre_c, end_c, reads_c, _ = _track_b(model, comp_s, ids)
    ref, pre_a, end_a, reads_a, _ = _track_b(model, comp_s._codec, ids)
    assert (got - ref).abs().max() < 1e-10
    assert (pre_c, end_c) == (pytest.approx(pre_a), pytest.approx(end_a))
    assert torch.allclose(reads_c[0], reads_a[0]) and torch.allclose(reads_c[1], reads_a[1])


@pytest.mark.parametrize("evict,ev", [("h2o", {}), ("snapkv", SNAP), ("snapkv", SNAP_EVICT)])
def test_an_exact_codec_equals_the_eviction_alone(model_and_stats, evict, ev):
    model, stats = model_and_stats
    ids = _ids()
    regime = Regime("prefill", 50, 29)
    comp = _method(model, stats, "compose", evict=evict, codec="fp16", evict_options=ev, keep=0.3, regime=regime)
    alone = comp._evictor
    a = _track_b(model, comp, ids)
    b = _track_b(model, alone, ids)
    assert torch.equal(a[0], b[0]) and a[1:3] == b[1:3]
    assert torch.equal(a[3][0], b[3][0]) and torch.equal(a[3][1], b[3][1])
    if evict == "h2o":
        one_c, _, bpd_c, _, reads_c = _qall(model, comp, ids)
        one_a, _, bpd_a, _, reads_a = _qall(model, alone, ids)
        assert torch.equal(one_c, one_a) and bpd_c == bpd_a and torch.equal(reads_c[0], reads_a[0])


def test_stored_bits_are_kept_share_times_codec_bits_plus_scores(model_and_stats):
    """Direct count per layer: held tokens x (the codec's bits over all T tokens alone) / T + an
    fp32 score per held token and KV head, half to each side."""
    model, stats = model_and_stats
    ids = _ids()
    comp = _method(model, stats, "compose", 1.0, codec="cobra_kl", keep=0.25)
    codec_alone = attach(model, comp._codec)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        alone_bits = list(codec_alone.last_bits[0])
    finally:
        codec_alone.detach()
    c = attach(model, comp)
    try:
        with torch.no_grad(), c.session():
            c.forward(ids, 0, prefill=False)
            held = [s.n_kept for s in c.states[0]]
            got = list(c.last_bits[0])
    finally:
        c.detach()
    hkv = model_shape(model).n_kv_heads
    assert 0 < min(held) < T
    for n, (bk, bv, _), (ak, av, _) in zip(held, got, alone_bits):
        # KV-COBRA keys are pre-RoPE: the held positions are stored too (§12.3)
        assert bk == round(n * ak / T) + n * hkv * 16 + hkv * naive_position_bits(n, T)
        assert bv == round(n * av / T) + n * hkv * 16


def test_read_bits_mean_over_positions_equals_a_direct_computation(model_and_stats):
    model, stats = model_and_stats
    shape = model_shape(model)
    d = shape.head_dim
    ids = _ids(11)
    # H2O + KV-COBRA, Q-all: held_p (codec bpd + 16/d) / (p + 1) at every position p, and the
    # stored positions of the held keys (pre-RoPE)
    comp = _method(model, stats, "compose", 1.0, 1.0, codec="cobra_kl", keep=0.25)
    _, _, _, _, (rk, rv) = _qall(model, comp, ids)
    bk, bv = comp._codec.nominal_bpd(T)
    share = torch.tensor(_h2o_qall_share(0.25, T))
    held = _h2o_qall_held(0.25, T)
    pos = torch.tensor([naive_position_bits(int(n), p + 1) / ((p + 1) * d) for p, n in enumerate(held)])
    assert pos.max() > 0
    tol = 8 * shape.n_layers / (shape.n_heads_total * d * T)  # < 8 padding bits per layer and call
    assert torch.allclose(rk, share * (bk + 16 / d) + pos, atol=tol)
    assert torch.allclose(rv, share * (bv + 16 / d), atol=tol)
    # SnapKV + KIVI, prefill-exact: KIVI's §2.3 rule on the kept sequence of C + i + 1 tokens
    comp = _method(model, stats, "compose", evict="snapkv", codec="kivi", codec_options=KIVI,
                   evict_options=SNAP, keep=0.4, regime=Regime("prefill", 50, 29))
    _, pre, _, (rk, rv), _ = _track_b(model, comp, ids)
    c, r, rate = 20, 32, 2 + 32 / 16  # C = round(0.4 * 50); b + 32/G on both sides
    n = torch.arange(c + 1, c + 31, dtype=torch.float64)
    nk, nv = r * torch.div(n - 1, r, rounding_mode="floor"), (n - 1 - r).clamp(min=0)
    seen = torch.arange(51, 81, dtype=torch.float64)
    assert torch.allclose(rk, (nk * rate + (n - nk) * 16) / seen)
    assert torch.allclose(rv, (nv * rate + (n - nv) * 16) / seen)
    assert pre == pytest.approx((16 * c / 50,) * 2)  # 20 < R: the kept prompt stays fp16


def test_fitted_budget_is_met_by_the_measured_figure(model_and_stats):
    """H2O + KV-COBRA fitted to bpd = 1 (K and V) in a Q-all regime of T tokens: the measured
    mean over positions is the target in bpd_KV (one side above, one below: integer b_V)."""
    model, stats = model_and_stats
    comp = _method(model, stats, "compose", 1.0, codec="cobra_kl")
    assert comp.knobs()["fitted"]
    _, _, _, _, (rk, rv) = _qall(model, comp, _ids())
    assert (float(rk.mean()) + float(rv.mean())) / 2 == pytest.approx(1.0, rel=0.02)


# ------------------------------------------------------------------------------------------------
# the job: the split chosen by calibration-corpus PPL (kvbench/fit/budget_share.py)


def test_job_chooses_the_split_on_heldout_calibration_windows(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    args = ("method=compose", "method.codec=cobra_kl", "bpd=2")
    r = _job(tmp_path / "a", tiny_checkpoint, *args)
    assert r["status"] == "ok", r["error"]
    choice, knobs, b = r["keep_fraction"], r["knobs"], r["bpd"]
    assert [c["split"] for c in choice["candidates"]] == [0.5, 0.25, 0.125]
    best = min((c for c in choice["candidates"] if c["ppl"] is not None), key=lambda c: c["ppl"])
    assert choice["split"] == best["split"] == knobs["split"] and knobs["fitted"]
    assert (b["target_k"], b["target_v"]) == (2.0, 2.0)  # an eviction: the budget covers K and V
    assert (b["measured_k"] + b["measured_v"]) / 2 == pytest.approx(2.0, rel=0.05)
    again = _job(tmp_path / "b", tiny_checkpoint, *args)
    assert again["keep_fraction"]["cache_hit"] is True and again["knobs"]["rho"] == knobs["rho"]


def test_job_with_dict_options_and_an_unreachable_target(tmp_path, tiny_checkpoint, monkeypatch):
    """Hydra dicts carry the parts' options; a target no kept fraction reaches is `unsupported`
    with the reachable range (here KIVI's 128-token fp16 window holds a 64-token window whole)."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    snap = ("method=compose", "method.evict=snapkv", "method.codec=kivi", "method.evict_options={window:8,kernel:3}",
            "task.ppl.track=B", "task.ppl.context=48")
    r = _job(tmp_path / "a", tiny_checkpoint, *snap, "method.codec_options={group:16,v_group:16,residual:32}",
             "method.keep=0.5", "bpd=4")
    assert r["status"] == "ok", r["error"]
    k = r["knobs"]
    assert k["evict_knobs"]["window"] == 8 and k["rho"] == 0.5 and k["codec_knobs"]["residual"] == 32
    r = _job(tmp_path / "b", tiny_checkpoint, *snap, "+method.codec_options.group=16",
             "+method.codec_options.v_group=16", "bpd=1")
    assert r["status"] == "unsupported" and "reachable [" in r["error"]


@pytest.mark.slow
def test_h2o_cobra_one_pass_equals_decoding_on_smollm2(smollm2):
    """The real SmolLM2 (30 layers, d = 64) in float64 (see tests/test_smollm2.py): H2O's scores
    from attention over KV-COBRA-decoded keys, one pass = 256 decode steps."""
    from test_smollm2 import _in_pass_and_steps, float64

    from kvbench.data.text import corpus_text
    from kvbench.data.windows import encode

    model = smollm2.model
    ids = encode(smollm2.tokenizer, corpus_text("ptb", "test")[:20_000])
    stats = collect_stats(model, ids[:1024].view(4, 256))
    with float64(model):
        method = _method(model, stats, "compose", 1.0, codec="cobra_kl", keep=0.25, regime=Regime("qall", 256))
        in_pass, steps = _in_pass_and_steps(model, method, ids[1024:1280][None])
    assert in_pass.dtype == torch.float64
    assert (in_pass - steps).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------
# positions of held tokens under a pre-RoPE codec (docs/methods.md §12.3)


@pytest.mark.parametrize("n_seen", [2, 100, 256, 257, 1536, 2048, 2049, 70_000])
def test_kept_positions_decode_exactly_and_count_the_cheaper_encoding(n_seen):
    gen = torch.Generator().manual_seed(n_seen)
    for kept in sorted({1, n_seen // 40 + 1, n_seen // 16, n_seen // 3, n_seen - 1, n_seen} - {0}):
        pos = torch.stack([torch.randperm(n_seen, generator=gen)[:kept].sort().values for _ in range(6)])
        pos = pos.view(2, 3, kept)
        if kept == n_seen:
            pos = torch.arange(n_seen).expand(2, 3, n_seen)
        stored = KeptPositions(pos, n_seen)
        kind, bits = naive_position_encoding(kept, n_seen)
        assert torch.equal(stored.positions(), pos)
        assert stored.kind == kind and stored.bits() == 6 * bits
        assert float(position_bits(torch.tensor(kept), torch.tensor(n_seen))) == bits
    assert KeptPositions(torch.tensor([[[0, 5, 9]]]), 4096).kind == "positions"  # 3 x 12 bits < 512


def test_pre_rope_compositions_store_positions_post_rope_ones_do_not(model_and_stats):
    """H2O at keep = 0.25 in Q-all: KV-COBRA (pre-RoPE keys) stores the held positions, counted on
    the key side, in the stored form the eviction's kept set decodes to; KIVI and FP16 (post-RoPE)
    store none."""
    model, stats = model_and_stats
    ids = _ids(5)
    hkv = model_shape(model).n_kv_heads
    for codec, options, bpd, stores in (("cobra_kl", {}, 1.0, True), ("kqsvd", {}, 2.0, True),
                                        ("kivi", KIVI, None, False), ("fp16", {}, None, False)):
        comp = _method(model, stats, "compose", bpd, codec=codec, codec_options=options, keep=0.25)
        assert comp.knobs().get("positions", "none") == ("stored" if stores else "none")
        c = attach(model, comp)
        try:
            with torch.no_grad(), c.session():
                c.forward(ids, 0, prefill=False)
                states = list(c.states[0])
        finally:
            c.detach()
        for st in states:
            n = st.n_kept
            assert n < T
            if not stores:
                assert getattr(st, "position_bits", lambda: 0)() == 0
                continue
            assert st.position_bits() == hkv * naive_position_bits(n, T)
            assert torch.equal(st._positions.positions(), st.evict.kept_positions())


def test_prefill_rotation_reads_the_stored_positions(model_and_stats, monkeypatch):
    """compose(snapkv, kqsvd) after an exact prefill: the kept keys are decoded and rotated at the
    positions the cache stores (``KeptPositions.positions``), which are SnapKV's kept ones."""
    model, stats = model_and_stats
    comp = _method(model, stats, "compose", 2.0, evict="snapkv", codec="kqsvd", evict_options=SNAP,
                   keep=0.3, regime=Regime("prefill", 50, 29))
    calls = []
    decode = KeptPositions.positions

    def spy(self):
        out = decode(self)
        calls.append(out)
        return out

    monkeypatch.setattr(KeptPositions, "positions", spy)
    _, pre, _, _, states = _track_b(model, comp, _ids(2))
    assert len(calls) == len(states)  # one decode of the stored positions per layer's prefill
    c0 = round(0.3 * 50)
    hkv = model_shape(model).n_kv_heads
    for pos, st in zip(calls, states):
        assert pos.shape[-1] == c0 and st.position_bits() == hkv * naive_position_bits(st.n_kept, st.n_seen)
    for st in states:  # the key side carries them
        ck, cv = st.codec_token_bits()
        assert st.stored_bits() == (round(st.n_kept * ck) + st.position_bits(), round(st.n_kept * cv))


@pytest.mark.parametrize("evict,ev,bpd", [
    ("h2o", {}, 2.0), ("snapkv", SNAP_EVICT, 2.0), ("snapkv", SNAP, 4.0),
])
def test_fitted_pre_rope_budget_is_met_in_the_prefill_regime(model_and_stats, evict, ev, bpd):
    """compose(·, KV-COBRA) fitted to bpd_KV in a 400-token prefill + 99 decoded regime: the
    measured headline, the mean over the 100 scored reads (the prefill's own prediction at the
    end-of-prefill figure, then the decoded ones, docs/methods.md §0 v3), positions included, is the
    prediction and the target within 2%."""
    model, stats = model_and_stats
    p, n = 400, 99
    comp = _method(model, stats, "compose", bpd, evict=evict, codec="cobra_kl", evict_options=ev,
                   regime=Regime("prefill", p, n))
    k = comp.knobs()
    assert k["fitted"] and k["positions"] == "stored" and k["predicted_positions_bpd_k"] > 0
    ids = torch.randint(0, 128, (1, p + n), generator=torch.Generator().manual_seed(4))
    c = attach(model, comp)
    try:
        with torch.no_grad(), c.session():
            c.forward(ids[:, :p], 0, prefill=True)
            first = c.measured_bpd()
            c.forward(ids[:, p:], p, prefill=False)
            rk, rv = c.read_bpd()
    finally:
        c.detach()
    mk, mv = (first[0] + float(rk.sum())) / (n + 1), (first[1] + float(rv.sum())) / (n + 1)
    assert mk == pytest.approx(k["predicted_bpd_k"], rel=1e-3)
    assert mv == pytest.approx(k["predicted_bpd_v"], rel=1e-3)
    assert (mk + mv) / 2 == pytest.approx(bpd, rel=0.02)


def test_snapkv_evict_drops_the_codes_of_evicted_tokens(model_and_stats):
    """compose(snapkv with decode=evict, ·): the re-selections evict held tokens; a token-wise
    codec's bits follow the held count, KIVI's follow its rules on the held arrivals (§2.3 on the
    arrival index: the kept prompt in position order, then every decoded token), counted here from
    SnapKV's kept positions alone."""
    model, stats = model_and_stats
    shape = model_shape(model)
    hkv, d = shape.n_kv_heads, shape.head_dim
    ids = _ids(6)
    regime = Regime("prefill", 50, 29)
    comp = _method(model, stats, "compose", evict="snapkv", codec="kivi", codec_options=KIVI,
                   evict_options=SNAP_EVICT, keep=0.4, regime=regime)
    _, _, _, _, states = _track_b(model, comp, ids)
    snap = comp._evictor
    c0 = snap.capacity_for(50)
    r, gk, b = KIVI["residual"], KIVI["group"], KIVI["bits"]
    per_qv = KIVI["v_bits"] * d + (d // KIVI["v_group"]) * 32
    for st in states:
        assert isinstance(st, KiviComposedState)
        pos = st.evict.kept_positions()[0]  # [H, n]
        n_arr = c0 + T - 50  # _track_b decodes the T - 50 tokens after the prefill
        assert pos.shape[-1] == snap.held_counts(50, T - 50)[-1] < n_arr  # evicted while decoding
        prompt = st.evict.kept_prompt_positions()[0]
        bits_k = bits_v = 0
        for h in range(hkv):
            rank = {int(x): i for i, x in enumerate(prompt[h].tolist())}
            arr = [rank[x] if x < 50 else x - 50 + c0 for x in pos[h].tolist()]
            flushed = r * (n_arr // r)
            qk = [a for a in arr if a < flushed]
            bits_k += len(qk) * b * d + (len(arr) - len(qk)) * 16 * d + len({a // gk for a in qk}) * 32 * d
            qv = [a for a in arr if a < n_arr - r]
            bits_v += len(qv) * per_qv + (len(arr) - len(qv)) * 16 * d
        assert st.stored_bits() == (bits_k, bits_v)
    comp = _method(model, stats, "compose", 2.0, evict="snapkv", codec="cobra_kl", evict_options=SNAP_EVICT,
                   keep=0.4, regime=regime)
    _, _, _, _, states = _track_b(model, comp, ids)
    for st in states:
        ck, cv = st.codec_token_bits()
        n = st.n_kept
        assert n < c0 + T - 50 and st._encoded == c0 + T - 50  # every token encoded on arrival
        assert st.stored_bits() == (round(n * ck) + st.position_bits(), round(n * cv))


# ------------------------------------------------------------------------------------------------
# the job: the kept fraction refitted to the measured figure (kvbench/fit/measured_keep.py)


def test_only_kivi_under_decode_eviction_has_an_inexact_prediction():
    cases = [("h2o", "cobra_kl", "keep", True), ("snapkv", "kivi", "keep", True), ("h2o", "fp16", "keep", True),
             ("snapkv", "cobra_kl", "evict", True), ("h2o", "kivi", "keep", False),
             ("snapkv", "kivi", "evict", False)]
    for evict, codec, decode, exact in cases:
        ev = {"decode": decode} if evict == "snapkv" else None
        comp = build_method("compose", evict=evict, codec=codec, evict_options=ev)
        assert comp.prediction_exact is exact, (evict, codec, decode)


def test_the_refit_converges_on_a_biased_measurement(model_and_stats, monkeypatch):
    """A measurement that reads 0.85x the prediction, plus a constant: the refit moves rho until the
    measured figure is within TOL of the target, and keeps the codec's budgets."""
    from kvbench.fit import measured_keep as MK

    model, stats = model_and_stats
    comp = _method(model, stats, "compose", 4.0, regime=Regime("prefill", 960, 240), codec="kivi",
                   codec_options={"group": 16, "v_group": 16, "residual": 16})
    codec = comp.knobs()["codec_knobs"]

    def fake(ctx, method, windows):
        k, v = method.predicted_bpd()
        return 0.85 * k + 0.05, 0.85 * v + 0.05

    class Ctx:
        tokenizer = spec = None
    monkeypatch.setattr(MK, "measured_kv", fake)
    monkeypatch.setattr(MK, "measurement_windows", lambda *a: torch.zeros(2, 64, dtype=torch.long))
    out = MK._search(Ctx(), comp, 4.0, None)
    assert abs(out["measured_kv"] - 4.0) <= MK.TOL * 4.0 and len(out["points"]) <= MK.MAX_MEASUREMENTS
    assert out["points"][0]["measured_kv"] < 3.6 and out["rho"] > out["points"][0]["rho"]
    comp.set_kept_fraction(out["rho"])
    assert sum(fake(None, comp, None)) / 2 == pytest.approx(out["measured_kv"])
    assert comp.knobs()["codec_knobs"] == codec
    # 48 prompt tokens: one kept token moves bpd_KV by more than TOL; the refit stops at the two
    # counts that bracket the target, measures no configuration twice and keeps the nearer one
    comp = _method(model, stats, "compose", 4.0, regime=Regime("prefill", 48, 15), codec="kivi",
                   codec_options={"group": 16, "v_group": 16, "residual": 16})
    out = MK._search(Ctx(), comp, 4.0, None)
    got = [p["measured_kv"] for p in out["points"]]
    assert len(set(got)) == len(got) and min(got) < 4.0 < max(got)
    assert out["measured_kv"] == min(got, key=lambda m: abs(m - 4.0))


def test_job_refits_h2o_kivi_to_the_measured_figure(tmp_path, tiny_checkpoint, monkeypatch):
    """compose(h2o, kivi) in PPL track B: the job measures the headline on calibration-corpus
    windows and refits rho; the evaluation's figure is nearer the target than the prediction's."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    args = ("method=compose", "method.codec=kivi", "method.split=0.5", "bpd=4", "task.ppl.track=B",
            "task.ppl.context=48", "method.codec_options={group:16,v_group:16,residual:16}")
    r = _job(tmp_path / "a", tiny_checkpoint, *args)
    assert r["status"] == "ok", r["error"]
    fit, knobs, b = r["measured_fit"], r["knobs"], r["bpd"]
    assert fit["windows"] == [2, 64] and fit["points"][0]["rho"] == knobs["measured_fit"]["rho_predicted"]
    assert knobs["rho"] == fit["rho"] and knobs["measured_fit"]["measurements"] == len(fit["points"])
    first = fit["points"][0]["measured_kv"]
    assert abs(fit["measured_kv"] - 4.0) <= abs(first - 4.0)
    measured = (b["measured_k"] + b["measured_v"]) / 2
    assert measured == pytest.approx(4.0, rel=0.1)
    again = _job(tmp_path / "b", tiny_checkpoint, *args)
    assert again["measured_fit"]["cache_hit"] is True and again["knobs"]["rho"] == knobs["rho"]
