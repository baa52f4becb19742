"""The prepared device check: ``make gpu-check`` / ``python -m kvbench.bench.gpu_check``.

One short script that says whether every method runs on a GPU, in bf16, end to end, and what it
costs there; no network (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``: the embedded SmolLM2,
PTB and SQuAD from the installed asset packages, random models built in memory).

1. **SmolLM2-135M-Instruct** (the embedded model) in the run dtype (bf16 on a GPU; on a CPU bf16
   where the CPU computes it natively, else float32: :func:`kvbench.bench.common.cpu_dtype`),
   calibrated on PTB train (``collect_stats``, 4 windows of 512 tokens), for FP16 (the plain model)
   and every method at the budgets of the overhead section (codecs 2 bpd with 16-bit values, GEAR
   4, H2O and SnapKV 4 bpd on K and V), but KIVI at 3 bpd (:data:`KIVI_BPD`); KVQuant fits on the
   key/value sample it asks for, from the same calibration windows:

   * ``ppl`` — one PTB test window (2048 tokens; ``--quick`` 512), track A (SnapKV: track B with
     the first 3/4 as context), against the **float32 CPU figure of the same preset** stored in
     :data:`REFERENCE` (same window, calibration windows, method options and budget; made by
     ``--write-reference``, which records its command and commit). The row's value is
     |ln(ppl / reference)|, target <= :data:`PPL_TOL` (0.2: what bf16 rounding moves, measured;
     see :data:`PPL_TOL`); a method at 10x the reference misses it by a factor of 11. A measured
     bpd other than the reference's is a MISS (the method changed: rerun ``--write-reference`` if
     that is intended). Where no reference matches (another model source, window, calibration
     text or method options) the row is INFO, with the reason; a non-finite perplexity is a MISS.
   * ``longqa`` — one ``longqa_squad`` item (a 2000-4000-token prompt, ``--quick`` 1000-2000; 32
     greedy tokens through ``CompressedLM.generate``): F1 and time, INFO (SmolLM2-135M answers no
     item of this length with any method, FP16 included, so an F1 is no evidence either way); a
     failure or a non-finite F1 is a MISS.
   * ``inpass`` — one Q-all pass against token-by-token decoding through the compressed cache on the
     first 64 tokens (``--quick`` 32) of the PPL window (SnapKV, which has no Q-all form: an exact
     prefill of the first half, then the rest as one chunk against one token at a time; FP16: the
     plain model against its own ``DynamicCache``). The verdict is taken **in float64** (the model
     converted for the check), tolerance max |Δlogit| <= 1e-4 (the tests' bound): in bf16 the two
     paths round differently, a code at a rounding boundary flips and moves every later logit, so a
     bf16 difference says nothing about the method's logic (tests/test_smollm2.py measured 2.4 in
     float32). The max |Δlogit| in the run dtype is reported beside it, with FP16's own. The row
     carries the ``ppl`` verdict over to the decode path, so it is a PASS only where the method's
     ``ppl`` row is one (else INFO: a method at 10x its perplexity decodes as consistently).

2. **e2e** — :mod:`kvbench.bench.e2e` on ``llama3_8b_random`` (random weights, Llama-3.1-8B's shape,
   the run dtype, all 32 layers) at 4k and 32k prompt tokens, 32 new tokens, every method against
   plain transformers (peak <= 1.1x, a PASS only where the weights do not hide the cache: the
   module's docstring). ``--quick`` (the CPU preset):
   2 layers, 4k only, 16 new tokens; in float32 (a CPU without native bf16) 1 layer at 1024 tokens.

3. **batch** — :mod:`kvbench.bench.batch` on the same model: items/s of PPL windows (2048 tokens),
   128-token scoring rows and generation (4096-token prompts, 16 new tokens) at batch 1 and 8, for
   FP16 and every method, over plain transformers on the same inputs and batch (FP16 >= 0.9x; at
   batch 8 codecs >= 0.6x, eviction >= 0.3x). ``--quick``: 64-token windows and prompts, batch 1
   and 2, FP16, KIVI and H2O only (:data:`QUICK_BATCH_METHODS`; the model's 128k-word head makes
   every pass seconds on a CPU), INFO but FP16. ``--skip-batch`` leaves it out.

Writes one JSON (``--out``, default ``runs/gpu_check/gpu-check-<device>-<preset>-<time>.json``) and
prints one table (every row with its target and PASS/MISS/INFO), then the e2e table. A method that
raises is recorded (``failed`` with the error: a MISS) and the check goes on. The last row is the
wall time, target under 10 minutes on a GPU (INFO on a CPU).

``--write-reference`` (on a CPU, float32) scores the PPL window of the chosen preset with every
method and stores the figures in :data:`REFERENCE` (or ``--out``), keeping the other preset's.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime as dt  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from . import batch, e2e  # noqa: E402
from .cli import _git_commit, _loadavg, machine, markdown_table, verdict_summary, write_and_print  # noqa: E402
from .common import (EVAL_CASES, FINITE, INFO, PRESETS, BenchModel, Row, bench_dtype, budget_label,  # noqa: E402
                     calib_windows, dtype_name, make_method, model_stats)

log = logging.getLogger("kvbench.gpu_check")

#: KIVI's budget here: 3 bpd, 2-bit codes in groups of 32 (the paper's KIVI-2). At the overhead
#: section's 2 bpd its codes are 1-bit and its perplexity 10-45x FP16's, which no perplexity check
#: can tell from a broken method's.
KIVI_BPD = 3.0
#: (label, registry name or None for the plain model, options, bpd, v_bpd)
CASES = ([("fp16", None, {}, None, None)]
         + [(c[0], c[1], c[2], KIVI_BPD if c[1] == "kivi" else c[3], c[4]) for c in EVAL_CASES]
         + [("snapkv", "snapkv", {}, 4.0, 4.0)])
EXACT_TOL = 1e-4
WALL_TARGET_S = 600.0
#: the float32 CPU perplexities the ``ppl`` rows are checked against (``--write-reference``)
REFERENCE = Path(__file__).with_name("gpu_check_reference.json")
REFERENCE_SCHEMA = "kvbench.gpu_check.reference/1"
#: |ln(ppl / float32 reference)| a ``ppl`` row may reach: what bf16 rounding moves. Measured on
#: this CPU (bf16 native) against the float32 figures, quick / full preset: FP16 0.003 / 0.0005
#: (its own rounding), H2O 0.0005 / 0.003, KQ-SVD 0.018 / 0.003, SVDq 0.041 / 0.036, SnapKV
#: 0.043 / 0.0003, KIVI 0.004 (3 bpd) / 0.078 (2 bpd), KV-COBRA-MSE 0.105 / 0.098, KV-COBRA-KL
#: 0.138 / 0.101. The methods move 10-300x more than FP16: a rounding moves a quantizer code, an
#: eviction or a calibration moment across a boundary, and the choices that follow (the C2
#: allocation of KV-COBRA's bits, every later token's codes) are discrete. 0.2 is about 1.5x the
#: largest gap measured, room for a GPU's other kernels; a method at 1.22x (or 1/1.22) of its
#: reference misses, one at 10x misses by a factor of 11.
PPL_TOL = 0.2
#: relative difference of measured bpd (K or V) from the reference's beyond which the method is
#: not the one the reference was made with
BPD_RTOL = 1e-3
CALIB_WINDOWS, CALIB_SEQLEN = 4, 512
#: the methods of the batch part in the CPU preset (besides FP16)
QUICK_BATCH_METHODS = ("kivi", "h2o")


@dataclass(frozen=True)
class Preset:
    name: str
    ppl_seqlen: int
    longqa_tokens: tuple
    inpass_tokens: int
    e2e_layers_cpu: int | None
    e2e_lengths: tuple
    e2e_new_tokens: int
    #: (layers, lengths, new tokens) of the e2e part on a CPU in float32 (None: as above)
    e2e_cpu_float32: tuple | None = None


PRESET = {
    "full": Preset("full", 2048, (2000, 4000), 64, None, (4096, 32768), 32),
    "quick": Preset("quick", 512, (1000, 2000), 32, 2, (4096,), 16, e2e_cpu_float32=(1, (1024,), 16)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvbench.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="the CPU preset: shorter inputs, e2e on 2 layers at 4k")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="SmolLM2 and e2e model dtype (auto: bfloat16 on a GPU and on a CPU with native bf16, "
                        "else float32)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(c[0] for c in CASES)}")
    p.add_argument("--skip-e2e", action="store_true", help="only the SmolLM2 part (no e2e, no batch part)")
    p.add_argument("--skip-batch", action="store_true", help="no batch part (items/s at batch 1 and 8 vs plain)")
    p.add_argument("--e2e-lengths", default=None, help="comma-separated prompt lengths for the e2e part")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--reference", type=Path, default=REFERENCE, help="float32 reference perplexities to check against")
    p.add_argument("--write-reference", action="store_true",
                   help="score the preset's PPL window with every method in float32 on the CPU and store the "
                        "figures in --reference (or --out), keeping the other preset's")
    return p.parse_args(argv)


# ---- the SmolLM2 checks ---------------------------------------------------------------------------


def _plain_steps(model, ids: torch.Tensor) -> torch.Tensor:
    from ..model.integrate import cache_argument, returned_cache

    name, cache, outs = cache_argument(model), None, []
    for t in range(ids.shape[1]):
        extra = {} if cache is None else {name: cache}
        out = model(input_ids=ids[:, t : t + 1], use_cache=True, **extra)
        cache = returned_cache(out)
        outs.append(out.logits)
    return torch.cat(outs, 1)


@torch.no_grad()
def in_pass_gap(model, method, ids: torch.Tensor) -> float:
    """max |Δlogit| between the one-pass form and token-by-token decoding (see the module docstring)."""
    from ..model.integrate import attached

    if method is None:
        one = model(input_ids=ids, use_cache=False).logits
        return float((one - _plain_steps(model, ids)).abs().max())
    with attached(model, method) as comp:
        t = ids.shape[1]
        if method.supports_in_pass:
            one = model(input_ids=ids, use_cache=False).logits
            with comp.session():
                steps = [comp.forward(ids[:, i : i + 1], i, prefill=False) for i in range(t)]
            return float((one - torch.cat(steps, 1)).abs().max())
        p = t // 2
        with comp.session():
            comp.forward(ids[:, :p], 0, prefill=True)
            chunk = comp.forward(ids[:, p:], p, prefill=False)
        with comp.session():
            comp.forward(ids[:, :p], 0, prefill=True)
            steps = [comp.forward(ids[:, i : i + 1], i, prefill=False) for i in range(p, t)]
        return float((chunk - torch.cat(steps, 1)).abs().max())


def window_ppl(lm, window: torch.Tensor, preset: Preset) -> dict:
    """Perplexity of the preset's window: track A where the method has a one-pass form, else
    track B with the first 3/4 as context."""
    from ..model.perplexity import window_nll

    track = "A" if lm.supports_in_pass else "B"
    t0 = time.perf_counter()
    nll, n = window_nll(lm, window, track, preset.ppl_seqlen * 3 // 4)
    return {"value": math.exp(nll / n) if math.isfinite(nll) else float("nan"), "track": track,
            "seconds": time.perf_counter() - t0, "measured_bpd": list(lm.measured_bpd)}


def check_method(bm: BenchModel, label, name, method, window, preset: Preset) -> dict:
    """PPL window, one longqa_squad item and the run-dtype in-pass gap of one method."""
    from ..model.compressed_lm import CompressedLM
    from ..tasks.longqa_squad import evaluate_longqa_squad
    from ..model.integrate import attached

    out: dict = {"label": label, "method": name or "fp16", "options": method_options(method)}
    with attached(bm.model, method) as comp:
        lm = CompressedLM(bm.model, bm.tokenizer, comp)
        out["ppl"] = window_ppl(lm, window, preset)
        t0 = time.perf_counter()
        res = evaluate_longqa_squad(lm, n_items=1, target_tokens=preset.longqa_tokens)
        rec = res["records"][0]
        out["longqa"] = {"f1": res["f1"], "seconds": time.perf_counter() - t0, "prompt_tokens": rec["prompt_tokens"],
                         "prediction": rec["prediction"], "answers": rec["answers"], "id": rec["id"],
                         "measured_bpd": list(lm.measured_bpd)}
    out["inpass_dtype"] = in_pass_gap(bm.model, method, window[: preset.inpass_tokens][None].to(bm.device))
    return out


def method_options(method) -> dict:
    """The options a method was built with (its dataclass fields, JSON-ready): what makes two
    runs of one registry name the same method. FP16 (None): none."""
    if method is None:
        return {}
    fields = dataclasses.fields(method) if dataclasses.is_dataclass(method) else ()
    return json.loads(json.dumps({f.name: getattr(method, f.name) for f in fields}, default=str))


def fingerprint(ids: torch.Tensor) -> str:
    """sha256 (16 hex digits) of token ids: the same window on every machine."""
    return hashlib.sha256(ids.to(torch.int64).cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def load_smollm2(device: str, dtype: torch.dtype) -> tuple[BenchModel, torch.Tensor, list, dict]:
    """The embedded SmolLM2 on ``device`` in ``dtype``, its calibration statistics and the data
    fingerprints a reference is matched on."""
    from ..fit.statistics import collect_stats
    from ..model.loading import load_model

    loaded = load_model("smollm2_135m", embedded=True, device=device, dtype=dtype_name(dtype))
    model = loaded.model
    bm = BenchModel(model, loaded.tokenizer, "smollm2_135m", next(model.parameters()).device,
                    next(model.parameters()).dtype, loaded.source)
    calib = calib_windows(bm, CALIB_SEQLEN, CALIB_WINDOWS)
    # the moments now; a method's key/value sample (KVQuant's) from the same windows when it is built
    stats = model_stats(model, calib, plain=collect_stats(model, calib))
    data = {"model": "smollm2_135m", "source": loaded.source,
            "calibration": {"dataset": "ptb", "split": "train", "windows": CALIB_WINDOWS, "seqlen": CALIB_SEQLEN,
                            "seed": 0, "sha256": fingerprint(calib)}}
    return bm, calib, stats, data


def ppl_window(bm: BenchModel, preset: Preset, data: dict) -> tuple[torch.Tensor, dict]:
    """The preset's PTB test window and its data fingerprints (``data`` plus the window's)."""
    from ..data.windows import ppl_windows

    window = ppl_windows(bm.tokenizer, "ptb", preset.ppl_seqlen, 1)[0]
    return window, {**data, "window": {"dataset": "ptb", "split": "test", "seqlen": preset.ppl_seqlen, "index": 0,
                                       "sha256": fingerprint(window)}}


def smollm2_part(device: str, dtype: torch.dtype, preset: Preset, cases,
                 reference: dict | None) -> tuple[list[Row], dict]:
    from ..model.integrate import model_shape

    t0 = time.perf_counter()
    bm, _, stats, data = load_smollm2(device, dtype)
    model = bm.model
    window, data = ppl_window(bm, preset, data)
    shape = model_shape(model)
    log.info("smollm2: loaded and calibrated in %.1f s", time.perf_counter() - t0)
    results, methods = [], {}
    for label, name, options, bpd, v_bpd in cases:
        log.info("smollm2: %s", label)
        try:
            method = None if name is None else make_method(name, options, shape, bpd, v_bpd, stats)
            methods[label] = method
            res = check_method(bm, label, name, method, window, preset)
        except Exception as err:  # noqa: BLE001 - a device check reports every failure, then goes on
            log.error("smollm2: %s failed: %s", label, err)
            res = {"label": label, "method": name or "fp16", "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc(limit=8)}
        res.update({"bpd": bpd, "v_bpd": v_bpd})
        results.append(res)
    exact_gaps(model, methods, window[: preset.inpass_tokens][None], results)
    info = {"source": bm.note, "dtype": dtype_name(bm.dtype), "device": str(bm.device), "data": data,
            "seconds": time.perf_counter() - t0}
    rows = smollm2_rows(results, preset, info["dtype"], reference_entries(reference, preset.name, data))
    del model, bm
    e2e.free(torch.device(device))
    return rows, {"info": info, "results": results}


def exact_gaps(model, methods: dict, ids: torch.Tensor, results: list[dict]) -> None:
    """The in-pass gaps again with the model in float64 (the verdict), then back to its dtype."""
    dtype = next(model.parameters()).dtype
    model.to(torch.float64)
    try:
        for res in results:
            if "error" in res:
                continue
            try:
                res["inpass_f64"] = in_pass_gap(model, methods[res["label"]], ids.to(next(model.parameters()).device))
            except Exception as err:  # noqa: BLE001
                res["inpass_f64_error"] = f"{type(err).__name__}: {err}"
    finally:
        model.to(dtype)


# ---- the float32 reference ------------------------------------------------------------------------


def load_reference(path: Path | None) -> dict | None:
    """The reference file, or None where there is none (every ``ppl`` row is then INFO)."""
    if path is None or not Path(path).exists():
        return None
    ref = json.loads(Path(path).read_text())
    if ref.get("schema") != REFERENCE_SCHEMA:
        raise ValueError(f"{path}: schema {ref.get('schema')!r}, expected {REFERENCE_SCHEMA!r}")
    return ref


def reference_entries(reference: dict | None, preset: str, data: dict) -> tuple[dict, str]:
    """The reference's methods for this preset and data, or ({}, why there are none)."""
    if reference is None:
        return {}, "no reference file"
    entry = reference.get("presets", {}).get(preset)
    if entry is None:
        return {}, f"no reference for preset {preset!r}"
    for key in ("model", "source", "calibration", "window"):
        if entry["data"].get(key) != data.get(key):
            return {}, f"reference made with another {key} ({entry['data'].get(key)} vs {data.get(key)})"
    return entry["methods"], ""


def match_reference(entries: tuple[dict, str], r: dict) -> tuple[dict | None, str]:
    """The reference of one result (same label, options, budget and track), or (None, why not)."""
    methods, why = entries
    if why:
        return None, why
    ref = methods.get(r["label"])
    if ref is None:
        return None, f"no reference for {r['label']}"
    for key in ("method", "bpd", "v_bpd", "options"):
        if ref.get(key) != r.get(key):
            return None, f"reference made with {key} {ref.get(key)} (this run: {r.get(key)})"
    if ref["track"] != r["ppl"]["track"]:
        return None, f"reference is track {ref['track']}"
    return ref, ""


def ppl_row(r: dict, tag: str, preset: Preset, dtype: str, entries: tuple[dict, str]) -> Row:
    """|ln(ppl / float32 reference)| <= PPL_TOL; INFO without a matching reference; MISS for a
    non-finite perplexity or a measured bpd other than the reference's."""
    p = r["ppl"]
    name = f"{tag}, track {p['track']}, 1x{preset.ppl_seqlen}"
    bpd_text = f"bpd K/V {p['measured_bpd'][0]:.3g}/{p['measured_bpd'][1]:.3g}"
    ref, why = match_reference(entries, r)
    detail = {"method": r["method"], "dtype": dtype, **p}
    if ref is None or not math.isfinite(p["value"]):
        return Row("ppl", name, "perplexity", p["value"], "", FINITE, 0.0, shown=f"{p['value']:.4g}",
                   note=f"{p['seconds']:.2f} s; {bpd_text}" + (f"; {why}: no verdict" if why else ""),
                   detail={**detail, "reference": None, "no_reference": why})
    gap = abs(math.log(p["value"] / ref["ppl"]))
    moved = [abs(a / b - 1.0) for a, b in zip(p["measured_bpd"], ref["measured_bpd"])]
    invalid = ""
    if max(moved) > BPD_RTOL:
        invalid = (f"measured bpd {p['measured_bpd']} differs from the reference's {ref['measured_bpd']} "
                   "(rerun --write-reference if the method changed on purpose)")
    return Row("ppl", name, "|ln(ppl / float32 ref)|", gap, "", "<=", PPL_TOL,
               shown=f"{p['value']:.4g} vs {ref['ppl']:.4g} ({100 * (p['value'] / ref['ppl'] - 1):+.2f}%)",
               note=f"{dtype} vs float32 CPU reference; {p['seconds']:.2f} s; {bpd_text}", invalid=invalid,
               detail={**detail, "reference": ref, "log_gap": gap, "tolerance": PPL_TOL})


def smollm2_rows(results: list[dict], preset: Preset, dtype: str,
                 entries: tuple[dict, str] = ({}, "no reference")) -> list[Row]:
    rows = []
    fp16_gap = next((r.get("inpass_dtype") for r in results if r["method"] == "fp16"), float("nan"))
    for r in results:
        tag = r["label"] + ("" if r.get("bpd") is None else f" ({budget_label(r['bpd'], r['v_bpd'])})")
        if "error" in r:
            rows.append(Row("smollm2", f"{tag}: failed", "error", float("nan"), "", FINITE, 0.0, shown="failed",
                            note=r["error"][:160], detail=r))
            continue
        q = r["longqa"]
        ppl = ppl_row(r, tag, preset, dtype, entries)
        rows.append(ppl)
        rows.append(Row("longqa", f"{tag}, 1 item", "F1", q["f1"], "", FINITE, 0.0, shown=f"F1 {q['f1']:.1f}",
                        note=f"{q['seconds']:.2f} s; {q['prompt_tokens']} prompt tokens; {q['prediction'][:40]!r}",
                        detail={"method": r["method"], **q}))
        what = "prefill + chunk vs steps" if r["method"] == "snapkv" else "one pass vs steps"
        gap = r.get("inpass_f64", float("nan"))
        inpass = Row("inpass", f"{tag}, {preset.inpass_tokens} tokens", "max |dlogit| float64", gap, "", "<=",
                     EXACT_TOL, shown=f"{gap:.2g}",
                     note=(f"{what}; {dtype}: {r['inpass_dtype']:.3g} (fp16's own {fp16_gap:.3g})"
                           + (f"; float64 error {r['inpass_f64_error']}" if "inpass_f64_error" in r else "")),
                     detail={"method": r["method"], "float64": gap, dtype: r["inpass_dtype"],
                             "fp16_" + dtype: fp16_gap, "tolerance": EXACT_TOL})
        rows.append(vouched_by(inpass, ppl))
    return rows


def vouched_by(inpass: Row, ppl: Row) -> Row:
    """An ``inpass`` PASS carries the ``ppl`` verdict over to the decode path (the two paths agree),
    so it says nothing where that perplexity was not itself a PASS: a method at 10x its perplexity
    can decode exactly as it scores. Such a row is INFO with the reason; a MISS stays a MISS."""
    if inpass.verdict != "PASS" or ppl.verdict == "PASS":
        return inpass
    return dataclasses.replace(inpass, op=INFO, note=f"the paths agree, but the perplexity row is {ppl.verdict}: "
                                                     f"nothing to carry over; {inpass.note}")


@torch.no_grad()
def reference_figures(preset: Preset, cases, dtype: torch.dtype = torch.float32) -> dict:
    """Every case's perplexity on the preset's window on the CPU, in float32: one preset's entry
    of the reference file (another ``dtype`` measures what that dtype's rounding moves)."""
    from ..model.compressed_lm import CompressedLM
    from ..model.integrate import attached, model_shape

    bm, _, stats, data = load_smollm2("cpu", dtype)
    window, data = ppl_window(bm, preset, data)
    shape = model_shape(bm.model)
    methods = {}
    for label, name, options, bpd, v_bpd in cases:
        log.info("reference: %s", label)
        method = None if name is None else make_method(name, options, shape, bpd, v_bpd, stats)
        with attached(bm.model, method) as comp:
            p = window_ppl(CompressedLM(bm.model, bm.tokenizer, comp), window, preset)
        if not math.isfinite(p["value"]):
            raise RuntimeError(f"reference: {label} gives a non-finite perplexity; nothing written")
        methods[label] = {"method": name or "fp16", "bpd": bpd, "v_bpd": v_bpd, "options": method_options(method),
                          "track": p["track"], "ppl": p["value"], "measured_bpd": p["measured_bpd"],
                          "seconds": p["seconds"]}
    return {"data": data, "dtype": dtype_name(dtype), "device": "cpu", "methods": methods}


def write_reference(args: argparse.Namespace, argv: list[str]) -> dict:
    """``--write-reference``: the chosen preset's figures into the reference file (the other
    preset's entry kept), with the command, commit and machine that made them."""
    if args.device != "cpu" or args.dtype not in ("auto", "float32"):
        raise SystemExit("--write-reference runs on the CPU in float32: use --device cpu (and no --dtype)")
    preset = PRESET["quick" if args.quick else "full"]
    path = args.out or args.reference
    cases = [c for c in CASES if not args.methods or c[0] in args.methods.split(",")]
    old = load_reference(path) or {"schema": REFERENCE_SCHEMA, "presets": {}}
    entry = reference_figures(preset, cases)
    entry.update({
        "command": "python -m kvbench.bench.gpu_check" + ("" if not argv else " " + " ".join(argv)),
        "commit": _git_commit(), "worktree_clean": _worktree_clean(),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(torch.device("cpu")),
    })
    kept = old["presets"].get(preset.name)
    if args.methods and kept is not None and kept["data"] == entry["data"]:
        # a subset rerun: the other methods' figures stay, each with the provenance of its own run
        for m in kept["methods"].values():
            m.setdefault("provenance", {k: kept.get(k) for k in ("command", "commit", "worktree_clean", "date")})
        for m in entry["methods"].values():
            m["provenance"] = {k: entry[k] for k in ("command", "commit", "worktree_clean", "date")}
        entry["methods"] = {**kept["methods"], **entry["methods"]}
    old["presets"][preset.name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    print(f"reference for preset {preset.name!r} ({len(entry['methods'])} methods) written to {path}")
    for label, m in entry["methods"].items():
        print(f"  {label:10s} track {m['track']}  ppl {m['ppl']:.6g}  bpd {m['measured_bpd']}")
    return old


def _worktree_clean() -> bool | None:
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "methods", "kvbench"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[2], timeout=10)
        return None if out.returncode else not out.stdout.strip()
    except Exception:  # noqa: BLE001 - provenance only
        return None


# ---- the whole check ------------------------------------------------------------------------------


def e2e_plan(preset: Preset, device: str, dtype: torch.dtype) -> tuple:
    """(layers on a CPU, lengths, new tokens) of the e2e part for this device and dtype."""
    if device == "cpu" and dtype == torch.float32 and preset.e2e_cpu_float32 is not None:
        layers, lengths, new_tokens = preset.e2e_cpu_float32
        return layers, tuple(lengths), new_tokens
    return preset.e2e_layers_cpu, preset.e2e_lengths, preset.e2e_new_tokens


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    preset = PRESET["quick" if args.quick else "full"]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check --device cuda: no CUDA device here (on a CPU: make gpu-check DEVICE=cpu QUICK=1)")
    wanted = None if not args.methods else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(wanted or ()) - {c[0] for c in CASES})
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; valid choices: {', '.join(c[0] for c in CASES)}")
    cases = [c for c in CASES if wanted is None or c[0] in wanted]
    dtype, why = bench_dtype(args.dtype, torch.device(args.device))
    reference = load_reference(args.reference)
    started, t_start, load_start = dt.datetime.now().astimezone(), time.perf_counter(), _loadavg()
    seconds = {}
    rows, smol = smollm2_part(args.device, dtype, preset, cases, reference)
    seconds["smollm2"] = time.perf_counter() - t_start
    e2e_info = None
    if not args.skip_e2e:
        t0 = time.perf_counter()
        layers, lengths, new_tokens = e2e_plan(preset, args.device, dtype)
        sizes = dataclasses.replace(PRESETS["quick" if args.quick else "full"], e2e_layers_cpu=layers)
        lengths = [int(x) for x in args.e2e_lengths.split(",")] if args.e2e_lengths else list(lengths)
        bm = e2e.e2e_model(sizes, args.device, None if args.device == "cuda" else layers, dtype)
        e2e_info = {"name": bm.name, "layers": int(bm.model.config.num_hidden_layers), "note": bm.note,
                    "dtype": dtype_name(bm.dtype), "dtype_reason": why, "lengths": lengths, "new_tokens": new_tokens}
        methods = None if wanted is None else [m for m in wanted if m != "fp16"]
        rows += e2e.run(bm, sizes, lengths, methods, new_tokens)
        seconds["e2e"] = time.perf_counter() - t0
        if not args.skip_batch:
            t0 = time.perf_counter()
            stats = model_stats(bm.model, calib_windows(bm, sizes.calib_seqlen, sizes.calib_windows).to(bm.device))
            chosen = [c for c in batch.CASES if (methods is None or c[0] in methods)
                      and (not args.quick or c[0] in QUICK_BATCH_METHODS)]
            rows += batch.run(bm, "check_quick" if args.quick else "check", stats, chosen)
            seconds["batch"] = time.perf_counter() - t0
        del bm
        e2e.free(torch.device(args.device))
    seconds["total"] = time.perf_counter() - t_start
    on_gpu = args.device == "cuda" and not args.quick
    rows.append(Row("total", "wall time of the check", "seconds", seconds["total"], " s", "<=" if on_gpu else INFO,
                    WALL_TARGET_S, shown=f"{seconds['total']:.0f} s",
                    note="target on one GPU: under 10 minutes" + ("" if on_gpu else " (CPU preset: no target)")))
    device = torch.device(args.device)
    return {
        "schema": "kvbench.gpu_check/1",
        "command": "python -m kvbench.bench.gpu_check" + ("" if not argv else " " + " ".join(argv)),
        "date": started.isoformat(timespec="seconds"),
        "preset": asdict(preset),
        "device": str(device),
        "dtype": dtype_name(dtype),
        "dtype_reason": why,
        "reference": None if reference is None else {
            "path": str(args.reference), "presets": {k: {"commit": v.get("commit"), "date": v.get("date")}
                                                      for k, v in reference.get("presets", {}).items()}},
        "machine": machine(device),
        "load_avg": {"start": load_start, "end": _loadavg()},
        "smollm2": smol,
        "e2e_model": e2e_info,
        "seconds": seconds,
        "rows": [r.as_dict() for r in rows],
        "summary": verdict_summary(rows),
        "table_markdown": markdown_table(rows),
        "_rows": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.write_reference:
            return write_reference(args, argv)
        report = run(args, argv)
    finally:
        torch.set_num_threads(threads)
    rows = report.pop("_rows")
    preset = "quick" if args.quick else "full"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / "gpu_check" / f"gpu-check-{args.device}-{preset}-{stamp}.json"
    m = report["machine"]
    title = (f"kvbench device check ({preset}) on {report['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}, "
             f"{report['dtype_reason']}")
    write_and_print(report, rows, out, title)
    return report


if __name__ == "__main__":
    main()
