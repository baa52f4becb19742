"""``python -m kvbench.bench`` (issues 7 and 15) on tiny shapes, and the pieces its rows rest on.

The smoke report checks the JSON's structure and that every row carries a number and a verdict. No
timing assertions: the numbers of a smoke run mean nothing, and the machine may be busy. The
op-count rule, the e2e byte counts, the memory probe and the zero-shot scoring are checked against
hand counts and independent references.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench import bench
from kvbench.bench import e2e, opcount, shortseq

SECTIONS = {"overhead", "allocation", "codecs", "memory", "calibration", "opcount", "zeroshot", "e2e"}
METHODS = {"kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl", "h2o"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    threads = torch.get_num_threads()
    # one thread: a loaded 2-core machine makes multi-threaded tiny ops pathologically slow
    bench.main(["--smoke", "--model", "tiny", "--threads", "1", "--out", str(out),
                "--sections", ",".join(sorted(SECTIONS))])
    assert torch.get_num_threads() == threads  # restored
    return json.loads(out.read_text())


def _by_section(report) -> dict:
    by: dict = {}
    for row in report["rows"]:
        by.setdefault(row["section"], []).append(row)
    return by


def test_report_structure(report):
    for key in ("schema", "command", "date", "preset", "sizes", "model", "machine", "load_avg",
                "seconds", "rows", "summary", "table_markdown", "e2e_model"):
        assert key in report, key
    assert report["preset"] == "smoke"
    assert report["command"].startswith("python -m kvbench.bench --smoke")
    assert report["model"]["name"] == "tiny"
    assert {r["section"] for r in report["rows"]} == SECTIONS
    s = report["summary"]
    assert s["rows"] == len(report["rows"]) == s["pass"] + s["miss"] + s["info"]


def test_every_row_has_a_number_and_a_verdict(report):
    for row in report["rows"]:
        assert isinstance(row["value"], float), row
        assert row["verdict"] in ("PASS", "MISS", "INFO"), row
        assert row["op"] in ("<=", "<", ">=", "info", "finite") and isinstance(row["target"], float), row
        assert row["name"] and row["shown"] and row["target_text"], row
        if row["verdict"] != "INFO":
            assert math.isfinite(row["value"]) or row["verdict"] == "MISS", row


def test_rows_cover_every_method(report):
    by = _by_section(report)
    assert {r["detail"]["method"] for r in by["overhead"]} == METHODS
    assert {r["detail"]["method"] for r in by["zeroshot"]} == METHODS
    codecs = [r for r in by["codecs"] if not r["name"].startswith("bound:")]
    assert {r["detail"]["method"] for r in codecs} == METHODS | {"snapkv"}
    assert len(by["codecs"]) == len(codecs) + 1  # the conversion bound under every codec row
    assert {r["detail"]["method"] for r in by["memory"]} == METHODS | {"snapkv"}
    assert {r["detail"]["heads"] for r in by["allocation"]} == {256, 112}
    for row in by["memory"]:
        d = row["detail"]
        assert d["bytes_held"] > 0 and len(d["measured_bpd"]) == len(d["nominal_bpd"]) == 2
    ops = {(r["detail"]["method"], r["detail"]["regime"]) for r in by["opcount"]}
    every = METHODS | {"fp16", "snapkv"}
    assert ops == {(m, "decode") for m in every} | {(m, "one-pass") for m in every - {"snapkv"}}
    assert {r["detail"]["method"] for r in by["e2e"]} == METHODS | {"snapkv", "plain"}


def test_opcount_rows(report):
    rows = _by_section(report)["opcount"]
    plain = {r["detail"]["regime"]: r for r in rows if r["detail"]["plain_model"]}
    for row in rows:
        d = row["detail"]
        assert d["kernels_per_layer"] > 0 and d["views_per_layer"] >= 0
        assert d["ratio_to_fp16"] == pytest.approx(d["kernels_per_layer"] / plain[d["regime"]]["detail"]["kernels_per_layer"])
        if d["method"] in ("kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl"):
            assert row["op"] == "<=" and row["target"] == 3.0
    h2o = next(r for r in rows if r["detail"]["method"] == "h2o" and r["detail"]["regime"] == "one-pass")
    assert h2o["value"] == pytest.approx(h2o["detail"]["kernels_per_layer"] / h2o["detail"]["tokens"])
    assert h2o["target"] == 20.0


def test_e2e_plain_cache_bytes_are_the_dynamic_cache(report):
    """The baseline's stored bytes are exactly K and V of every token it attended over: prompt +
    new tokens - 1 (the last token is never fed back), per layer and KV head, in the model dtype."""
    rows = _by_section(report)["e2e"]
    cfg = bench.common.tiny_config()
    itemsize = torch.empty((), dtype=getattr(torch, report["e2e_model"]["dtype"])).element_size()
    for row in rows:
        d = row["detail"]
        assert d["status"] == "ok", row
        assert d["prefill_s"] > 0 and d["decode_tok_s"] > 0 and d["peak_bytes"] > 0
        if d["method"] != "plain":
            assert d["ratios"]["peak"] == pytest.approx(row["value"])
            continue
        tokens = d["tokens_prompt"] + d["new_tokens"] - 1
        expect = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens * cfg.head_dim * itemsize
        assert d["stored_bytes"] == d["resident_bytes"] == expect


def test_verdict_follows_the_target():
    assert bench.Row("s", "r", "m", 1.0, "x", "<=", 1.15).verdict == "PASS"
    assert bench.Row("s", "r", "m", 1.2, "x", "<=", 1.15).verdict == "MISS"
    assert bench.Row("s", "r", "m", 30.0, "%", ">=", 25.0).verdict == "PASS"
    assert bench.Row("s", "r", "m", float("nan"), "%", ">=", 25.0).verdict == "MISS"
    assert bench.Row("s", "r", "m", 5.0, "x", "info", 0.0).verdict == "INFO"
    assert bench.Row("s", "r", "m", 5.0, "", "finite", 0.0).verdict == "PASS"
    assert bench.Row("s", "r", "m", float("inf"), "", "finite", 0.0).verdict == "MISS"


def test_python_m_entry_point_is_the_package():
    import importlib.util

    spec = importlib.util.find_spec("kvbench.bench.__main__")
    assert spec is not None and spec.origin.endswith("kvbench/bench/__main__.py")
    args = bench.parse_args(["--quick", "--sections", "e2e", "--e2e-lengths", "4096,8192"])
    assert args.quick and args.sections == "e2e"


# ---- the op-count rule ----------------------------------------------------------------------------


def test_opcount_rule_against_a_hand_count():
    """A region with known ops: views and no-op conversions launch nothing, a real conversion is one
    copy, softmax of a non-contiguous tensor is its kernel plus the layout copy it makes, a
    reshape that must copy is one copy, the projection range and ops outside the region are
    excluded, ``float(t)`` is a kernel op and a sync."""
    from torch.profiler import ProfilerActivity, profile, record_function

    a, w = torch.randn(4, 8), torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(opcount.ATTN):
            x = a.view(8, 4).transpose(0, 1)  # 2 views
            y = x * 2.0  # mul: 1 (the scalar's host-side copy is not a launch)
            z = y.to(torch.float64)  # copy_: 1
            z = z.to(torch.float64)  # no-op: 0
            s = torch.softmax(z, -1)  # _softmax + its contiguous copy: 2
            x.reshape(32)  # non-contiguous: clone -> copy_: 1
            with record_function(opcount.PROJ):
                torch.nn.functional.linear(a, w)  # excluded
            float(s.sum())  # sum: 1; _local_scalar_dense: 1 (a sync)
        a * 3  # outside: excluded
    c = opcount.count_events(prof.events())
    assert c.kernels == 7
    assert c.syncs == 1
    assert c.by_name == {"aten::mul": 1, "aten::copy_": 3, "aten::_softmax": 1, "aten::sum": 1,
                         "aten::_local_scalar_dense": 1}
    assert c.views >= 2


def test_opcount_plain_llama_layer_matches_its_source(one_thread):
    """FP16's decode step in transformers' Llama, counted by hand from modeling_llama: RoPE on q
    and k (x*cos, neg, cat, *sin, add: 5 each), DynamicCache.update (cat of K, cat of V), one
    fused sdpa; the one-pass forward has no cache update. 13 and 11 ops per layer."""
    from conftest import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    dec = opcount.plain_decode(model, ids[:, :20], ids[:, 20:])
    one = opcount.one_pass(model, None, ids)
    layers = model.config.num_hidden_layers
    assert dec.kernels == 13 * layers * 4
    assert one.kernels == 11 * layers
    assert dec.by_name["aten::cat"] == 4 * layers * 4


# ---- e2e pieces -----------------------------------------------------------------------------------


def test_memory_probe_sees_a_touched_allocation():
    probe = e2e.MemoryProbe(torch.device("cpu"))
    probe.start()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
    peak = probe.peak()
    del x
    if not probe.rss_reset:
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak - probe.before >= 60 * 2**20


def test_address_space_guard_turns_a_huge_allocation_into_a_caught_oom():
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    avail = e2e._meminfo_kib("MemAvailable")
    if avail is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(RuntimeError) as info:
        with e2e.address_space_guard(torch.device("cpu")) as limit:
            assert limit is not None
            torch.empty(int(avail * 1024 * 0.95), dtype=torch.uint8)  # never touched: no pages used
    assert e2e.is_oom(info.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert not e2e.is_oom(RuntimeError("shape mismatch"))


# ---- zero-shot requests ---------------------------------------------------------------------------


def test_score_request_is_what_hflm_computes():
    """The timed work per request equals lm-eval's own ``_loglikelihood_tokens`` at batch 1."""
    from conftest import tiny_llama, tiny_tokenizer
    from kvbench.compressed_lm import CompressedLM
    from kvbench.evals import zeroshot as zs

    lm = CompressedLM(tiny_llama(), tiny_tokenizer())
    reqs = shortseq.synthetic_requests(128, 5, seed=3)
    with zs.quiet_lm_eval():
        ref = zs.compressed_hflm(lm)._loglikelihood_tokens([(None, c, t) for c, t in reqs], disable_tqdm=True)
    got = [shortseq.score_request(lm, c, t, 1024) for c, t in reqs]
    for (lg, gg), (lr, gr) in zip(got, ref):
        assert lg == pytest.approx(lr, abs=1e-4)
        assert gg == gr


def test_captured_requests_are_real_lm_eval_requests(tokenizer):
    from conftest import tiny_llama
    from kvbench.bench.common import BenchModel

    bm = BenchModel(tiny_llama(), tokenizer, "tiny", torch.device("cpu"), torch.float32)
    reqs = shortseq.capture_requests(bm, 12, tasks=("piqa", "arc_easy"))
    assert len(reqs) == 12
    for ctx, cont in reqs:
        assert ctx and cont and all(isinstance(t, int) for t in ctx + cont)
    texts = [tokenizer.decode(c) for c, _ in reqs]
    assert all(t.startswith("Question:") and t.rstrip().endswith("Answer:") for t in texts)  # both tasks' prompt
    assert len(set(texts)) >= 4  # several documents, not one request repeated


# ---- the device check -----------------------------------------------------------------------------


class _OffByOneChunk:
    """An FP16 state that scales its output by 1.01 whenever it gets more than one token: a
    method whose one-pass form differs from its decoding, which the check must catch."""

    def __init__(self, inner):
        self.inner = inner

    def attend(self, q, k, v, **kw):
        out = self.inner.attend(q, k, v, **kw)
        return out * 1.01 if q.shape[2] > 1 else out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_in_pass_gap_is_zero_for_exact_paths_and_catches_a_broken_one(one_thread):
    from conftest import tiny_llama
    from kvbench.bench import gpu_check
    from methods.fp16 import Fp16

    model = tiny_llama().to(torch.float64)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    assert gpu_check.in_pass_gap(model, None, ids) < 1e-10
    assert gpu_check.in_pass_gap(model, Fp16(), ids) < 1e-10

    class Broken(Fp16):
        def new_layer_state(self, layer):
            return _OffByOneChunk(super().new_layer_state(layer))

    assert gpu_check.in_pass_gap(model, Broken(), ids) > 1e-3


def test_device_check_rows_follow_the_tolerance():
    from kvbench.bench import gpu_check

    preset = gpu_check.PRESET["quick"]
    ok = {"label": "kivi", "method": "kivi", "bpd": 2.0, "v_bpd": None,
          "ppl": {"value": 12.0, "track": "A", "seconds": 1.0, "measured_bpd": [2.0, 16.0]},
          "longqa": {"f1": 0.0, "seconds": 1.0, "prompt_tokens": 10, "prediction": "x"},
          "inpass_dtype": 0.5, "inpass_f64": 1e-14}
    bad = {**ok, "label": "svdq", "method": "svdq", "inpass_f64": 2e-4}
    nan = {**ok, "label": "h2o", "method": "h2o", "ppl": {**ok["ppl"], "value": float("nan")}}
    failed = {"label": "kqsvd", "method": "kqsvd", "bpd": 2.0, "v_bpd": None, "error": "RuntimeError: boom"}
    rows = gpu_check.smollm2_rows([ok, bad, nan, failed], preset, "bfloat16")
    verdict = {(r.section, r.detail.get("method", r.name)): r.verdict for r in rows}
    assert verdict[("inpass", "kivi")] == "PASS" and verdict[("inpass", "svdq")] == "MISS"
    assert verdict[("ppl", "kivi")] == "PASS" and verdict[("ppl", "h2o")] == "MISS"
    assert [r.verdict for r in rows if r.section == "smollm2"] == ["MISS"]


def test_zeroshot_method_subset_and_unknown_name():
    assert [c[0] for c in shortseq.cases_named(["cobra_kl", "kivi"])] == ["kivi", "cobra_kl"]
    assert shortseq.cases_named(None) == shortseq.EVAL_CASES
    with pytest.raises(SystemExit, match="valid choices: kivi, svdq"):
        shortseq.cases_named(["nope"])
