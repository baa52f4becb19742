"""``python -m kvbench.bench`` and the device check on tiny shapes, and the pieces their rows rest on.

The smoke report checks the JSON's structure and that every row carries a number and a verdict. No
timing assertions: the numbers of a smoke run mean nothing, and the machine may be busy. The
op-count rule, the e2e byte counts, the memory probe and the zero-shot scoring are checked against
hand counts and independent references; the verdicts against broken methods (10x a perplexity, a
NaN, an op count or a memory growth above its target), which must MISS.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from kvbench import bench
from kvbench.bench import e2e, opcount, shortseq
from methods import REGISTRY

SECTIONS = {"overhead", "allocation", "codecs", "memory", "calibration", "opcount", "zeroshot", "e2e"}
METHODS = {"kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl", "h2o"}
BASELINES = {"kvquant", "gear", "turboquant"}  # the published competitors: overhead, zeroshot, opcount, e2e


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
    assert {r["detail"]["method"] for r in by["overhead"]} == METHODS | BASELINES
    assert {r["detail"]["method"] for r in by["zeroshot"]} == METHODS | BASELINES
    codecs = [r for r in by["codecs"] if not r["name"].startswith("bound:")]
    assert {r["detail"]["method"] for r in codecs} == METHODS | {"snapkv"}
    assert len(by["codecs"]) == len(codecs) + 1  # the conversion bound under every codec row
    assert {r["detail"]["method"] for r in by["memory"]} == METHODS | {"snapkv"}
    assert {r["detail"]["heads"] for r in by["allocation"]} == {256, 112}
    for row in by["memory"]:
        d = row["detail"]
        assert d["bytes_held"] > 0 and len(d["measured_bpd"]) == len(d["nominal_bpd"]) == 2
    ops = {(r["detail"]["method"], r["detail"]["regime"]) for r in by["opcount"]}
    every = METHODS | BASELINES | {"fp16", "snapkv"}
    assert ops == ({(m, "decode") for m in every} | {(m, "one-pass") for m in every - {"snapkv"}}
                   | {(m, "rows") for m in every - {"snapkv"}})
    assert {r["detail"]["method"] for r in by["e2e"]} == METHODS | BASELINES | {"snapkv", "plain"}


def test_opcount_rows(report):
    rows = _by_section(report)["opcount"]
    for row in (r for r in rows if r["detail"]["regime"] == "rows"):  # 4 rows against one
        d = row["detail"]
        assert row["value"] == pytest.approx(d["kernels_per_layer"] / d["kernels_per_layer_one_row"])
        together = REGISTRY[d["method"]].rows_in_one_state
        assert d["rows_in_one_state"] is together
        assert (row["op"], row["target"]) == (("<=", 1.25) if together and not d["plain_model"] else ("info", 0.0))
        assert row["verdict"] == ("PASS" if together and not d["plain_model"] else "INFO"), row
        if not together:  # one state per row: the attention's ops times the rows
            assert row["value"] > 3.0
    rows = [r for r in rows if r["detail"]["regime"] != "rows"]
    plain = {r["detail"]["regime"]: r for r in rows if r["detail"]["plain_model"]}
    for row in rows:
        d = row["detail"]
        assert d["kernels_per_layer"] > 0 and d["views_per_layer"] >= 0
        assert d["ratio_to_fp16"] == pytest.approx(d["kernels_per_layer"] / plain[d["regime"]]["detail"]["kernels_per_layer"])
        assert d["all_ops_per_layer"] == pytest.approx(d["kernels_per_layer"] + d["host_ops_per_layer"])
        if d["method"] in ("kivi", "svdq", "kqsvd", "cobra_mse", "cobra_kl", *BASELINES):
            assert row["op"] == "<=" and row["target"] == 3.0
    gear = next(r for r in rows if r["detail"]["method"] == "gear" and r["detail"]["regime"] == "decode")
    assert gear["detail"]["decode_steps"] % 64 == 0  # whole flush cycles of its n_b-token buffer
    h2o = next(r for r in rows if r["detail"]["method"] == "h2o" and r["detail"]["regime"] == "one-pass")
    assert h2o["value"] == pytest.approx(h2o["detail"]["ratio_to_fp16"])  # the whole window's ops
    assert h2o["op"] == "<=" and h2o["target"] == 3.0
    assert h2o["detail"]["kernels_per_token_per_layer"] == pytest.approx(
        h2o["detail"]["kernels_per_layer"] / h2o["detail"]["tokens"])


def test_baseline_calibration_and_cost_rows(report):
    """KVQuant, GEAR and TurboQuant: the sample pass KVQuant's fit needs (a verdict, as the
    moments' pass), each method's fit time with what it fits (INFO; GEAR fits nothing), and the
    zero-shot and overhead rows against 1.2x."""
    by = _by_section(report)
    calib = {r["name"]: r for r in by["calibration"]}
    sample = calib["kvquant (bpd 2): sample pass"]
    assert sample["op"] == "<=" and sample["target"] == 1.3 and sample["detail"]["sample_tokens"] > 0
    assert calib["kvquant (bpd 2): fit"]["detail"]["calibrated"] and calib["kvquant (bpd 2): fit"]["value"] > 0
    assert "k-means" in calib["kvquant (bpd 2): fit"]["note"]
    assert calib["turboquant (bpd 2): fit"]["detail"]["calibrated"]
    assert not calib["gear (bpd 4): fit"]["detail"]["calibrated"] and calib["gear (bpd 4): fit"]["verdict"] == "INFO"
    for section in ("zeroshot", "overhead"):
        for row in by[section]:
            if row["detail"]["method"] in BASELINES:
                assert row["op"] == "<=" and row["target"] == 1.2, row


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
            assert row["value"] == pytest.approx(d["ratios"]["peak"])
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
    assert bench.Row("s", "r", "m", 5.0, "", "finite", 0.0).verdict == "INFO"  # a number is no evidence
    assert bench.Row("s", "r", "m", float("inf"), "", "finite", 0.0).verdict == "MISS"
    assert bench.Row("s", "r", "m", float("nan"), "", "finite", 0.0).verdict == "MISS"
    bad = bench.Row("s", "r", "m", 1.0, "x", "<=", 1.15, note="n", invalid="nothing compressed")
    assert bad.verdict == "MISS" and bad.note.startswith("nothing compressed")
    with pytest.raises(ValueError, match="valid choices"):
        bench.Row("s", "r", "m", 1.0, "x", "==", 1.0)


def test_no_pass_without_a_target(report):
    """A PASS is only ever earned against a numeric target (<=, <, >=), never by being finite."""
    for row in report["rows"]:
        if row["verdict"] == "PASS":
            assert row["op"] in ("<=", "<", ">="), row


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
    from kvbench.model.compressed_lm import CompressedLM
    from kvbench.tasks import zeroshot as zs

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


def _result(label, method, ppl, bpd=2.0, v_bpd=None, measured=(2.0, 16.0), track="A", **kw):
    """A device-check result of one method as :func:`gpu_check.check_method` returns it."""
    return {"label": label, "method": method, "bpd": bpd, "v_bpd": v_bpd, "options": {"o": 1},
            "ppl": {"value": ppl, "track": track, "seconds": 1.0, "measured_bpd": list(measured)},
            "longqa": {"f1": 0.0, "seconds": 1.0, "prompt_tokens": 10, "prediction": "x"},
            "inpass_dtype": 0.5, "inpass_f64": 1e-14, **kw}


def _reference(*results) -> tuple[dict, str]:
    """Reference entries (as :func:`gpu_check.reference_entries` returns them) at each result's ppl."""
    return {r["label"]: {"method": r["method"], "bpd": r["bpd"], "v_bpd": r["v_bpd"], "options": r["options"],
                         "track": r["ppl"]["track"], "ppl": r["ppl"]["value"],
                         "measured_bpd": r["ppl"]["measured_bpd"]} for r in results}, ""


def _verdicts(rows) -> dict:
    return {(r.section, r.detail.get("method", r.name)): r.verdict for r in rows}


def test_device_check_rows_follow_the_tolerance():
    from kvbench.bench import gpu_check

    preset = gpu_check.PRESET["quick"]
    fp16 = _result("fp16", "fp16", 96.0, None, None, (16.0, 16.0))
    ok = _result("kivi", "kivi", 1100.0)
    bad = _result("svdq", "svdq", 150.0, inpass_f64=2e-4)
    nan = _result("h2o", "h2o", 130.0, 4.0, 4.0, (3.87, 3.87))
    failed = {"label": "kqsvd", "method": "kqsvd", "bpd": 2.0, "v_bpd": None, "error": "RuntimeError: boom"}
    entries = _reference(fp16, ok, bad, nan)
    nan = {**nan, "ppl": {**nan["ppl"], "value": float("nan")}}
    run = [fp16, {**ok, "ppl": {**ok["ppl"], "value": 1100.0 * 1.02}}, bad, nan, failed]
    verdict = _verdicts(gpu_check.smollm2_rows(run, preset, "bfloat16", entries))
    assert verdict[("inpass", "kivi")] == "PASS" and verdict[("inpass", "svdq")] == "MISS"
    assert verdict[("ppl", "fp16")] == "PASS" and verdict[("ppl", "kivi")] == "PASS"  # 2% off its reference
    assert verdict[("ppl", "h2o")] == "MISS"  # NaN
    assert verdict[("inpass", "h2o")] == "INFO"  # its paths agree, but there is no perplexity to carry over
    assert verdict[("longqa", "kivi")] == "INFO"  # F1 0 for every method: no evidence either way
    rows = gpu_check.smollm2_rows(run, preset, "bfloat16", entries)
    assert [r.verdict for r in rows if r.section == "smollm2"] == ["MISS"]


def test_device_check_ppl_misses_a_broken_method():
    """10x FP16's perplexity, 10x its own reference, just outside the tolerance, or another measured
    bpd: MISS; inside the tolerance: PASS; no reference (or one for other options): INFO."""
    from kvbench.bench import gpu_check

    preset = gpu_check.PRESET["quick"]
    fp16 = _result("fp16", "fp16", 96.0, None, None, (16.0, 16.0))
    cobra = _result("cobra_kl", "cobra_kl", 200.0)
    entries = _reference(fp16, cobra)

    def verdict(value, bpd=None, **kw):
        r = {**cobra, **kw, "ppl": {**cobra["ppl"], "value": value, **({"measured_bpd": bpd} if bpd else {})}}
        return gpu_check.ppl_row(r, "cobra_kl", preset, "bfloat16", entries)

    tol = gpu_check.PPL_TOL
    assert verdict(200.0).verdict == "PASS"
    assert verdict(200.0 * math.exp(0.99 * tol)).verdict == "PASS"
    assert verdict(200.0 * math.exp(-0.99 * tol)).verdict == "PASS"
    assert verdict(200.0 * math.exp(1.01 * tol)).verdict == "MISS"
    assert verdict(10 * 96.0).verdict == "MISS"
    assert verdict(10 * 200.0).verdict == "MISS"
    assert verdict(float("inf")).verdict == "MISS"
    assert verdict(float("nan")).verdict == "MISS"
    moved = verdict(200.0, [2.5, 16.0])
    assert moved.verdict == "MISS" and "measured bpd" in moved.note
    other = verdict(200.0, options={"o": 2})
    assert other.verdict == "INFO" and "options" in other.note
    assert gpu_check.ppl_row(cobra, "cobra_kl", preset, "bfloat16", ({}, "no reference file")).verdict == "INFO"
    assert gpu_check.ppl_row({**cobra, "ppl": {**cobra["ppl"], "value": float("nan")}}, "cobra_kl", preset,
                             "bfloat16", ({}, "no reference file")).verdict == "MISS"


def test_device_check_reference_matches_data_and_preset():
    from kvbench.bench import gpu_check

    data = {"model": "smollm2_135m", "source": "s", "calibration": {"sha256": "a"}, "window": {"sha256": "b"}}
    ref = {"schema": gpu_check.REFERENCE_SCHEMA, "presets": {"quick": {"data": data, "methods": {"fp16": {}}}}}
    assert gpu_check.reference_entries(ref, "quick", data) == ({"fp16": {}}, "")
    assert gpu_check.reference_entries(ref, "full", data)[1] == "no reference for preset 'full'"
    other = {**data, "window": {"sha256": "c"}}
    assert gpu_check.reference_entries(ref, "quick", other)[1].startswith("reference made with another window")
    assert gpu_check.reference_entries(None, "quick", data)[1] == "no reference file"


def test_stored_reference_leaves_no_pass_to_a_tenfold_perplexity():
    """The committed float32 reference: every method's own figure passes, and a result at 10x
    FP16's perplexity or at 10x its own misses, for every method of every preset; a whole run at
    10x has no PASS row left (its in-pass rows have no perplexity verdict to carry over)."""
    from kvbench.bench import gpu_check

    ref = gpu_check.load_reference(gpu_check.REFERENCE)
    if ref is None:
        pytest.skip("no reference file")
    for name, entry in ref["presets"].items():
        preset = gpu_check.PRESET[name]
        entries = entry["methods"], ""
        fp16 = entries[0]["fp16"]["ppl"]
        for label, m in entries[0].items():
            r = _result(label, m["method"], m["ppl"], m["bpd"], m["v_bpd"], m["measured_bpd"], m["track"])
            r["options"] = m["options"]
            assert gpu_check.ppl_row(r, label, preset, "bfloat16", entries).verdict == "PASS", (name, label)
            for fake in (10 * fp16, 10 * m["ppl"]):
                r["ppl"]["value"] = fake
                assert gpu_check.ppl_row(r, label, preset, "bfloat16", entries).verdict == "MISS", (name, label, fake)
        run = [_result(label, m["method"], 10 * m["ppl"], m["bpd"], m["v_bpd"], m["measured_bpd"], m["track"],
                       options=m["options"]) for label, m in entries[0].items()]
        assert not [r.name for r in gpu_check.smollm2_rows(run, preset, "bfloat16", entries) if r.verdict == "PASS"]


def test_stored_reference_has_every_case_with_its_current_options():
    """A method option added or renamed since the reference was written would turn that method's
    ``ppl`` row into INFO (no matching reference) on every machine: every case of every preset must
    find its reference with the options the check builds it with today."""
    from kvbench.bench import gpu_check
    from kvbench.bench.common import bench_options
    from methods import build_method

    ref = gpu_check.load_reference(gpu_check.REFERENCE)
    assert ref is not None and set(ref["presets"]) == set(gpu_check.PRESET)
    for preset, entry in ref["presets"].items():
        for label, name, options, bpd, v_bpd in gpu_check.CASES:
            stored = entry["methods"].get(label)
            assert stored is not None, (preset, label)
            method = None if name is None else build_method(name, **bench_options(name, options))
            assert (stored["bpd"], stored["v_bpd"]) == (bpd, v_bpd), (preset, label)
            assert stored["options"] == gpu_check.method_options(method), (preset, label, "--write-reference")


def test_e2e_peak_passes_only_where_it_can_fail_a_method():
    """Where the weights are most of the peak, a method needing twice plain's growth stays under
    1.1x of plain's peak: such a row is INFO (MISS above the target), and a PASS needs a case where
    that method would miss."""
    gib = 2**30

    def case(before, peak, **kw):
        return {"status": "ok", "prefill_s": 1.0, "decode_s": 1.0, "decode_tok_s": 3.0,
                "before_bytes": int(before * gib), "peak_bytes": int(peak * gib), "stored_bytes": 2**24,
                "resident_bytes": 2**24, **kw}

    def row(res, base):
        return e2e.method_row("x", "kivi", 2.0, None, 64, 4, res, base, 5 * gib, "peak RSS", torch.float32)

    weights_bound = case(5.0, 5.4)  # growth 7% of the peak
    twice = row(case(5.0, 5.8), weights_bound)
    assert twice.value < 1.1 and twice.detail["ratios"]["peak_growth"] == pytest.approx(2.0)
    assert twice.verdict == "INFO" and not twice.detail["discriminates"] and twice.detail["dtype"] == "float32"
    assert row(case(5.0, 6.0), weights_bound).verdict == "MISS"  # above the target: MISS anyway
    cache_bound = case(2.0, 5.0)  # growth 60% of the peak
    assert row(case(2.0, 8.0), cache_bound).verdict == "MISS"  # twice the growth
    assert row(case(2.0, 5.2), cache_bound).verdict == "PASS"
    assert row({"status": "oom", "error": "RuntimeError: out of memory", "before_bytes": 0, "peak_bytes": 0},
               cache_bound).verdict == "MISS"


# ---- op-count verdicts ----------------------------------------------------------------------------


def _counts(fp16_decode, fp16_one, **methods) -> dict:
    c = {("fp16", "decode"): opcount.OpCount(fp16_decode, 0, 0, Counter()),
         ("fp16", "one-pass"): opcount.OpCount(fp16_one, 0, 0, Counter())}
    for label, (dec, one, host) in methods.items():
        c[label, "decode"] = opcount.OpCount(dec, 0, 0, Counter(), host)
        if one is not None:
            c[label, "one-pass"] = opcount.OpCount(one, 0, 0, Counter(), host)
    return c


def test_opcount_rows_miss_above_the_target():
    """Per layer (2 layers, 4 steps): a codec at 3.5x FP16 misses, at 2.9x passes; H2O's one-pass
    with a per-token recursion (5.6 ops per token over a 2048-token window) misses the per-window
    bound, one at 2.5x FP16's window passes; host ops are reported beside and not in the verdict."""
    from methods import ModelShape

    shape = ModelShape(n_layers=2, n_q_heads=32, n_kv_heads=8, head_dim=128)
    t, steps, layers = 2048, 4, 2
    n_dec = layers * steps
    counts = _counts(13 * n_dec, 11 * layers, kivi=(int(3.5 * 13 * n_dec), int(2.9 * 11 * layers), 0),
                     kqsvd=(int(2.9 * 13 * n_dec), int(2.9 * 11 * layers), 40 * layers),
                     h2o=(20 * n_dec, int(5.6 * t) * layers, 0))
    rows = {(r.detail["method"], r.detail["regime"]): r for r in opcount.rows_from(counts, t, steps, layers, shape)}
    assert rows["kivi", "decode"].verdict == "MISS" and rows["kivi", "one-pass"].verdict == "PASS"
    kq = rows["kqsvd", "one-pass"]
    assert kq.verdict == "PASS" and kq.detail["all_ops_per_layer"] == pytest.approx(kq.detail["kernels_per_layer"] + 40)
    assert kq.detail["all_ops_ratio_to_fp16"] > 3.0  # with the host ops it would miss: they are reported
    assert rows["h2o", "one-pass"].verdict == "MISS"
    assert rows["h2o", "decode"].verdict == "INFO"
    fixed = _counts(13 * n_dec, 11 * layers, h2o=(20 * n_dec, int(2.5 * 11) * layers, 0))
    h2o = [r for r in opcount.rows_from(fixed, t, steps, layers, shape) if r.detail["regime"] == "one-pass"
           and r.detail["method"] == "h2o"][0]
    assert h2o.verdict == "PASS"


def test_host_ops_are_only_ops_on_float64_host_data():
    """Inside a ``kvbench.host`` range, ops on float64 tensors and Python scalars are host ops; an
    op there with a float32 (a model's) tensor or a tensor list counts as a device op."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x32 = torch.randn(8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(opcount.ATTN):
            with record_function(opcount.HOST):
                p = torch.arange(0, 8, dtype=torch.float64)  # host
                b = (p + 1) * 16.0  # add, mul: host
                torch.floor(b / 3).clamp(min=0)  # div, floor, clamp: host
                x32 * 2.0  # a device op inside the range
                torch.cat([p, b])  # a tensor list: not checkable, a device op
    c = opcount.count_events(prof.events())
    assert c.host == 6
    assert c.kernels == 2 and c.by_name == {"aten::mul": 1, "aten::cat": 1}


@pytest.mark.parametrize("name", ["cobra_kl", "kivi"])
def test_host_ranges_of_the_methods_hold_host_data_only(name, monkeypatch, one_thread):
    """The methods' ``kvbench.host`` ranges (their read-bits bookkeeping) pass the host check op
    by op: counting every op in them as a host op gives the same device count as checking each
    (an op on the model's tensors put into such a range would make the two differ)."""
    from conftest import tiny_llama
    from kvbench.bench.common import make_method, synthetic_stats
    from kvbench.model.integrate import model_shape

    model = tiny_llama()
    assert next(model.parameters()).dtype == torch.float32  # no tensor of the model's is float64
    shape = model_shape(model)
    method = make_method(name, {}, shape, 2.0, None, synthetic_stats(shape))
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    opcount.one_pass(model, method, ids)  # the first pass prepares per-device constants
    checked = opcount.one_pass(model, method, ids)
    monkeypatch.setattr(opcount, "_host_only", lambda e: True)
    trusted = opcount.one_pass(model, method, ids)
    assert checked.host > 0
    assert (checked.kernels, checked.host) == (trusted.kernels, trusted.host)


# ---- the CPU dtype --------------------------------------------------------------------------------


def test_cpu_dtype_follows_native_bf16(monkeypatch):
    from kvbench.bench import common, gpu_check

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv(common.FORCE_NO_NATIVE_BF16, "1")
    assert not common.native_bf16() and common.cpu_dtype() == torch.float32
    dtype, why = common.bench_dtype("auto", cpu)
    assert dtype == torch.float32 and common.FORCE_NO_NATIVE_BF16 in why
    assert common.bench_dtype(None, cuda)[0] == torch.bfloat16
    assert common.bench_dtype("bfloat16", cpu)[0] == torch.bfloat16  # asked for: as given
    with pytest.raises(ValueError, match="valid choices: auto, bfloat16"):
        common.bench_dtype("bf16", cpu)
    quick = common.e2e_sizes(common.PRESETS["quick"], cpu, torch.float32)
    assert (quick.e2e_layers_cpu, quick.e2e_lengths, quick.e2e_new_tokens) == (1, (2048,), 16)
    assert common.e2e_sizes(common.PRESETS["quick"], cpu, torch.bfloat16) == common.PRESETS["quick"]
    assert common.e2e_sizes(common.PRESETS["quick"], cuda, torch.float32) == common.PRESETS["quick"]
    assert gpu_check.e2e_plan(gpu_check.PRESET["quick"], "cpu", torch.float32) == (1, (1024,), 16)
    assert gpu_check.e2e_plan(gpu_check.PRESET["quick"], "cpu", torch.bfloat16) == (2, (4096,), 16)
    monkeypatch.setenv(common.FORCE_NO_NATIVE_BF16, "0")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(common, "bf16_attention_runs", lambda: True)
    assert common.native_bf16() and common.cpu_dtype() == torch.bfloat16
    monkeypatch.setattr(common, "bf16_attention_runs", lambda: False)
    assert not common.native_bf16()
    assert "run no bf16 attention" in common.bench_dtype("auto", cpu)[1]
    monkeypatch.setattr(common, "bf16_attention_runs", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert common.cpu_dtype() == torch.float32
    assert "no native bf16" in common.bench_dtype("auto", cpu)[1]


def test_e2e_without_native_bf16_runs_in_float32(monkeypatch, tmp_path, one_thread):
    """The no-native-bf16 branch end to end: the e2e model, its rows and the JSON say float32."""
    from kvbench.bench import common

    monkeypatch.setenv(common.FORCE_NO_NATIVE_BF16, "1")
    out = tmp_path / "e2e.json"
    bench.main(["--smoke", "--model", "tiny", "--threads", "1", "--out", str(out), "--sections", "e2e",
                "--e2e-methods", "kivi"])
    rep = json.loads(out.read_text())
    assert rep["e2e_model"]["dtype"] == "float32" and common.FORCE_NO_NATIVE_BF16 in rep["e2e_model"]["dtype_reason"]
    assert {r["detail"]["dtype"] for r in rep["rows"]} == {"float32"}


def test_zeroshot_method_subset_and_unknown_name():
    assert [c[0] for c in shortseq.cases_named(["cobra_kl", "kivi"])] == ["kivi", "cobra_kl"]
    assert shortseq.cases_named(None) == shortseq.EVAL_CASES
    with pytest.raises(SystemExit, match="valid choices: kivi, svdq"):
        shortseq.cases_named(["nope"])


# ---- a deliberately slowed method misses ----------------------------------------------------------


def _per_head_codec(codec_cls, monkeypatch):
    """``codec_cls.encode_decode`` run head by head (a Python loop over the KV heads): what a
    per-head implementation launches. The codes are those of the vectorised form (tests only)."""
    original = codec_cls.encode_decode

    def per_head(self, x):
        for h in range(x.shape[1]):
            original(self, x[:, h : h + 1].expand_as(x).contiguous())
        return original(self, x)

    monkeypatch.setattr(codec_cls, "encode_decode", per_head)


@pytest.mark.parametrize("name", ["kvquant", "turboquant"])
def test_a_per_head_loop_misses_the_opcount_target(name, monkeypatch, one_thread):
    """The op count of a real KVQuant / TurboQuant decode step passes 3x FP16's; the same codec
    looping over the KV heads (4 of them here) launches its ops per head and misses. The decode of
    the stored cache each step attends over is a fixed cost counted apart here, as in
    tests/test_hotpaths.py (its range is skipped like the projections')."""
    from kvbench.bench.common import make_method, random_model, synthetic_source, tiny_config
    from kvbench.model.integrate import model_shape
    from methods import bookkeeping
    from methods.kvquant import KeyCodec
    from methods.turboquant import TurboCodec

    monkeypatch.setattr(bookkeeping, "DECODE_RANGE", opcount.PROJ)

    cfg = tiny_config()
    cfg.num_key_value_heads = 4
    model = random_model(cfg, torch.device("cpu"), torch.float32)
    shape = model_shape(model)
    ids = torch.randint(0, 128, (1, 68), generator=torch.Generator().manual_seed(0))
    plain = opcount.plain_decode(model, ids[:, :64], ids[:, 64:])

    def rows():
        method = make_method(name, {}, shape, 2.0, None, synthetic_source(shape))
        counts = {("fp16", "decode"): plain, ("fp16", "one-pass"): plain,
                  (name, "decode"): opcount.method_decode(model, method, ids[:, :64], ids[:, 64:])}
        return {r.detail["method"]: r for r in opcount.rows_from(counts, 64, 4, shape.n_layers, shape)
                if r.detail["regime"] == "decode"}

    assert rows()[name].verdict == "PASS"
    _per_head_codec(KeyCodec if name == "kvquant" else TurboCodec, monkeypatch)
    slowed = rows()[name]
    assert slowed.verdict == "MISS" and slowed.value > 3.0


def test_a_slowed_method_misses_the_zeroshot_target(monkeypatch, one_thread):
    """A TurboQuant whose layer states spend 20 ms per call (what a Python loop over tokens or
    heads costs a short request) against FP16 on the same requests: the row MISSes 1.2x."""
    import time

    from conftest import tiny_llama
    from kvbench.bench.common import BenchModel, synthetic_source
    from kvbench.model.integrate import model_shape
    from methods.codec_state import CodecLayerState

    model = tiny_llama()
    bm = BenchModel(model, None, "tiny", torch.device("cpu"), torch.float32)
    original = CodecLayerState.attend

    def slow(self, *args, **kw):
        time.sleep(0.02)
        return original(self, *args, **kw)

    monkeypatch.setattr(CodecLayerState, "attend", slow)
    monkeypatch.setattr(shortseq, "WARMUP_REQUESTS", 1)
    sizes = bench.common.PRESETS["smoke"]
    case = next(c for c in shortseq.EVAL_CASES if c[0] == "turboquant")
    row = shortseq.run(bm, sizes, synthetic_source(model_shape(model)), [case])[0]
    assert row.target == 1.2 and row.verdict == "MISS" and row.value > 1.2
