"""Measured bpd, convention v3 (docs/methods.md §0): what the cache held when each scored prediction
was made.

Every method's mean-over-positions figure (PPL track A, zero-shot) is checked against a direct
count of the bits its storage rule keeps (docs/methods.md §2.3-2.4, §3.3, §4.3, §5.4-5.10, §6.3-6.4,
§8, §13), written out here from the spec and from the knobs the method chose (bit widths, ranks,
per-head budgets, group sizes, residual windows), never from the method's own bpd formulas or
layer states; and the chunked pass against token-by-token decoding. The prefill-exact figure
(track B, generation) is the mean over the scored positions: the prediction the exact prefill
makes, at the end-of-prefill cache, then the decoded ones.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import configured_method, tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.compressed_lm import CompressedLM, summarize_readings
from kvbench.model.integrate import attach, model_shape
from methods.kivi import KiviLayerState

pytestmark = pytest.mark.numerics

T = 80
CASES = [
    ("fp16", {}, None, None),
    ("kivi", {"residual": 32, "group": 16, "v_group": 16}, 4.0, 3.0),
    ("kivi", {"residual": 32, "group": 16}, 3.0, None),
    ("svdq", {"group": 16}, 2.0, None),
    ("kqsvd", {}, 1.0, 4.0),
    ("cobra_kl", {}, 0.5, 4.0),
    ("cobra_kl", {"first_fp16": True}, 1.0, 4.0),
    ("cobra_plus", {}, 1.0, None),
    ("cobra_plus", {}, 1.0, 4.0),
    ("turboquant", {}, 2.0, 3.0),
    ("h2o", {}, 4.0, None),
    ("h2o", {"count_indices": True}, 2.0, None),
]


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1).double()
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (4, 64), generator=g))


def rotated_value_bits(method, d: int, v_bpd) -> float:
    """§5.8: values through the Hadamard rotation and a fixed step store b_V bits per element
    (one global integer, no metadata); no value target: 16-bit values."""
    if v_bpd is None:
        return 16.0 * d
    assert method.knobs()["v_codec"].startswith(f"rotated(b={int(v_bpd)},")
    return float(int(v_bpd) * d)


def per_head_budgets(knobs, target: float, shape, side: str = "k") -> list[int]:
    """§5.4 / §5.10: per-head code bits per token; they sum to floor(target d N) and a head of
    rank r codes r coordinates at b_min..b_max bits each (§5.3, §5.5)."""
    d, n = shape.head_dim, shape.n_heads_total
    budgets = [int(b) for b in knobs["budgets" if side == "k" else "v_budgets"]]
    assert len(budgets) == n
    if side == "k":
        for b, r in zip(budgets, knobs["ranks"]):
            assert (b == 0) == (r == 0) and 2 * r <= b <= 8 * r  # b_min = 2, b_max = 8
    else:
        assert all(d <= b <= 8 * d for b in budgets)  # full rank, 1..8 bits per coordinate
    if target is not None:
        assert sum(budgets) == math.floor(target * d * n + 1e-9)
    return budgets


def token_bits(method, shape, bpd, v_bpd) -> tuple[float, float]:
    """Bits stored per token, summed over the N KV heads, by a token-wise codec (every token
    coded on arrival, the same cost whatever the position: docs/methods.md §4.3, §5.9-5.10, §13)."""
    d, n = shape.head_dim, shape.n_heads_total
    knobs = method.knobs()
    if method.name == "fp16":
        return 16.0 * d * n, 16.0 * d * n
    if method.name == "kqsvd":  # §4.3: r latent coordinates at b bits each, r b = target d
        r, b = knobs["rank"], knobs["bits"]
        assert r * b == round(bpd * d) and r % 2 == 0 and 2 <= b <= 8
        return float(r * b * n), rotated_value_bits(method, d, v_bpd) * n
    if method.name == "cobra_plus" and knobs.get("joint_kv"):  # §13: one K + V budget per token
        k, v = per_head_budgets(knobs, None, shape), per_head_budgets(knobs, None, shape, "v")
        assert sum(k) + sum(v) == math.floor((bpd + v_bpd) * d * n + 1e-9) == knobs["joint_total_bits"]
        return float(sum(k)), float(sum(v))
    if method.name in ("cobra_kl", "cobra_mse", "cobra_plus"):  # §5.4, §5.8
        return float(sum(per_head_budgets(knobs, bpd, shape))), rotated_value_bits(method, d, v_bpd) * n
    if method.name == "turboquant":  # §16.7 (mse, unsplit): sum_j b_j + one fp16 norm per vector
        k, v = (sum(w for inst in knobs[f"{side}_widths"] for w in inst) + 16 for side in "kv")
        return float(k * n), float(v * n)
    raise AssertionError(f"no storage rule written for {method.name}")


def direct_bpd(method, shape, t: int, bpd=None, v_bpd=None) -> tuple[list[float], list[float]]:
    """bpd_K, bpd_V per query position p = 0..t-1 from the docs/methods.md storage rules."""
    d, n_heads = shape.head_dim, shape.n_heads_total
    ks, vs = [], []
    knobs = method.knobs()
    for p in range(t):
        n = p + 1  # tokens the query reads
        if method.name == "kivi":  # §2.3: key s quantized iff s < R floor(p/R); value iff s < p - R
            r = knobs["residual"]  # §2.4: b code bits + a 16-bit scale and minimum per group of G
            nq = r * (p // r)
            ks.append((nq * knobs["bits"] + (nq // knobs["group"]) * 32 + (n - nq) * 16) / n)
            if knobs["v_bits"] is None:
                vs.append(16.0)
            else:
                nv = max(0, p - r)
                g = knobs["v_group"]
                vs.append((nv * (d * knobs["v_bits"] + (d // g) * 32) / d + (n - nv) * 16) / n)
        elif method.name == "svdq":  # §3.3, calib basis: the KIVI key rule with R = G_t
            g, sched = knobs["group_tokens"], knobs["schedule"]
            m = d // len(sched)  # channels per latent group; a kept channel has a scale + minimum
            code_bits = sum(b * m for b in sched)
            meta_bits = sum(m for b in sched if b > 0) * 32
            nq = g * (p // g)
            ks.append((nq * code_bits / d + (nq // g) * meta_bits / d + (n - nq) * 16) / n)
            vs.append(16.0)
        elif method.name == "h2o":  # §6.3: the query reads min(p, C_{p-1}) kept tokens + itself
            rho, floor = knobs["rho_qall"], knobs["min_budget"]  # the Q-all ρ
            cap_before = max(floor, math.ceil(rho * p - 1e-9)) if p else 0
            kept = min(p, cap_before) + 1
            # §6.4: 16 bits per kept element; one fp32 score per kept token and KV head, shared by
            # K and V (16/d per element and side); count_indices: an int32 position, likewise
            extra = 32 * (2 if knobs["count_indices"] else 1) / 2
            ks.append(kept * (16 * d + extra) / (d * n))
            vs.append(kept * (16 * d + extra) / (d * n))
        else:  # token-wise codecs: a fixed number of bits per token
            k_tok, v_tok = token_bits(method, shape, bpd, v_bpd)
            k_el, v_el = k_tok / (n_heads * d), v_tok / (n_heads * d)
            if getattr(method, "first_fp16", False):
                ks.append((16.0 + p * k_el) / n)  # §5.9: the first token stored at 16 bits
                vs.append((16.0 + p * v_el) / n)
            else:
                ks.append(k_el)
                vs.append(v_el)
    return ks, vs


@pytest.mark.parametrize("name,options,bpd,v_bpd", CASES, ids=lambda x: str(x))
def test_track_a_mean_over_positions_equals_direct_computation(model_and_stats, name, options, bpd, v_bpd):
    model, stats = model_and_stats
    method = configured_method(model, name, options, bpd, v_bpd, stats)
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(5))
    comp = attach(model, method)
    try:
        lm = CompressedLM(model, None, comp)
        lm.logits(ids)
        per_k, per_v = comp.read_bpd()
        reading = lm.readings[-1]
        with comp.session(), torch.no_grad():  # token by token: each step reads one position
            steps = []
            for t in range(T):
                comp.forward(ids[:, t : t + 1], t, prefill=False)
                steps.append(comp.read_bpd())
    finally:
        comp.detach()
    ks, vs = direct_bpd(method, model_shape(model), T, bpd, v_bpd)
    # token-wise bit streams pad the last byte of each encode call: < 8 bits per layer and call
    tol = 8 * 2 / (model_shape(model).n_heads_total * model_shape(model).head_dim)
    assert per_k.tolist() == pytest.approx(ks, abs=tol)
    assert per_v.tolist() == pytest.approx(vs, abs=tol)
    assert reading.mean == pytest.approx((sum(ks) / T, sum(vs) / T), abs=tol)
    stepped_k = torch.cat([s[0] for s in steps])
    stepped_v = torch.cat([s[1] for s in steps])
    assert stepped_k.tolist() == pytest.approx(ks, abs=tol)
    assert stepped_v.tolist() == pytest.approx(vs, abs=tol)


def test_kivi_example_of_methods_section_0():
    """KIVI b=2, G=32, R=128 at T=2048: 3.00 at the end of the window, 4.885 over positions.

    docs/methods.md §0 quotes 4.86: that is the end-of-sequence formula §2.4 evaluated at every length
    t = p + 1, which counts a block of R keys as quantized from the query at p = R - 1 on; by §2.3
    that query still reads them at full precision (s < R floor(p/R) = 0), hence 4.885."""
    state = KiviLayerState(2, 32, 128, None, None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2048, 64, generator=g) for _ in range(3))
    state.attend(q, k, v, scaling=0.125, prefill=False)
    bits_k, _ = state.read_bits()
    per_position = bits_k / (torch.arange(1, 2049, dtype=torch.float64) * 64)
    assert state.stored_bits()[0] / (2048 * 64) == pytest.approx(3.0)
    assert float(per_position.mean()) == pytest.approx(4.8848, abs=1e-4)


def test_prefill_exact_headline_is_the_mean_over_the_scored_positions(model_and_stats):
    model, _ = model_and_stats
    method = configured_method(model, "snapkv", {"window": 8, "kernel": 3}, 4.0, None, None)
    lm = CompressedLM(model, None, attach(model, method))
    try:
        ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(2))
        lm.score(ids[:, :60], ids[:, 60:])
        lm.generate(ids[:, :60], 6)
    finally:
        lm.compressor.detach()
    scored, generated = lm.readings
    c = 15  # max(W + 1, round(60 * 4/16)) prompt tokens kept
    prefill_end = 16 * c / 60  # the compressed prompt: what the exact prefill's own prediction reads
    assert scored.prefill_end == generated.prefill_end == pytest.approx((prefill_end,) * 2)
    # 20 targets: the first predicted by the prefill, 19 by teacher-forced positions that read the
    # kept prompt plus themselves (and the targets before)
    reads = [prefill_end] + [16 * (c + i + 1) / (60 + i + 1) for i in range(19)]
    assert scored.positions == 20 and scored.mean == pytest.approx((sum(reads) / 20,) * 2)
    assert scored.end == pytest.approx((16 * (c + 19) / 79,) * 2)
    # generation: 6 tokens, the first from the prefill, then 5 decode steps (the last token is
    # never fed back)
    reads_gen = [prefill_end] + [16 * (c + i + 1) / (60 + i + 1) for i in range(5)]
    assert generated.positions == 6 and generated.mean == pytest.approx((sum(reads_gen) / 6,) * 2)
    summary = summarize_readings([scored, generated])
    assert summary["measured_k"] == pytest.approx((sum(reads) + sum(reads_gen)) / 26)
    assert summary["prefill_end_k"] == pytest.approx(prefill_end)


def test_the_plain_model_reads_sixteen_bits(model_and_stats):
    model, _ = model_and_stats
    lm = CompressedLM(model, None)
    ids = torch.randint(0, 128, (1, 20))
    lm.logits(ids)
    lm.score(ids[:, :10], ids[:, 10:])
    summary = summarize_readings(lm.readings)
    assert (summary["measured_k"], summary["measured_v"], summary["end_k"]) == (16.0, 16.0, 16.0)


def test_first_token_protection_keeps_in_pass_equal_to_decoding(model_and_stats):
    """§5.9 ``first_fp16``: the first token is stored exactly; one pass still equals decoding and
    differs from the unprotected codec only through that token."""
    model, stats = model_and_stats
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(9))
    outs = {}
    for flag in (False, True):
        method = configured_method(model, "cobra_kl", {"first_fp16": flag}, 1.0, 4.0, stats)
        comp = attach(model, method)
        try:
            with torch.no_grad():
                in_pass = model(input_ids=ids, use_cache=False).logits
                with comp.session():
                    steps = torch.cat([comp.forward(ids[:, t : t + 1], t, prefill=False) for t in range(T)], 1)
        finally:
            comp.detach()
        assert (in_pass - steps).abs().max() < 1e-9
        outs[flag] = in_pass
    with torch.no_grad():
        exact_first = model(input_ids=ids[:, :1], use_cache=False).logits[:, 0]
    assert (outs[True][:, 0] - exact_first).abs().max() < 1e-10  # position 0 reads only itself
    assert (outs[True] - outs[False]).abs().max() > 1e-6
