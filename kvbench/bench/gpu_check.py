"""The prepared device check (issue 15, item 6): ``make gpu-check`` / ``python -m kvbench.bench.gpu_check``.

One short script that says whether every method runs on a GPU, in bf16, end to end, and what it
costs there; no network (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``: the embedded SmolLM2,
PTB and SQuAD from the installed asset packages, random models built in memory).

1. **SmolLM2-135M-Instruct** (the embedded model) in bf16, calibrated on PTB train
   (``collect_stats``, 4 windows of 512 tokens), for FP16 (the plain model) and every method at the
   budgets of the overhead section (codecs 2 bpd with 16-bit values, H2O and SnapKV 4 bpd on K and
   V):

   * ``ppl`` — one PTB test window (2048 tokens; ``--quick`` 512), track A (SnapKV: track B with
     the first 3/4 as context); the row checks the perplexity is finite and reports it and the time.
   * ``longqa`` — one ``longqa_squad`` item (a 2000-4000-token prompt, ``--quick`` 1000-2000; 32
     greedy tokens through ``CompressedLM.generate``); finite F1 and its time.
   * ``inpass`` — one Q-all pass against token-by-token decoding through the compressed cache on the
     first 64 tokens (``--quick`` 32) of the PPL window (SnapKV, which has no Q-all form: an exact
     prefill of the first half, then the rest as one chunk against one token at a time; FP16: the
     plain model against its own ``DynamicCache``). The verdict is taken **in float64** (the model
     converted for the check), tolerance max |Δlogit| <= 1e-4 (the tests' bound): in bf16 the two
     paths round differently, a code at a rounding boundary flips and moves every later logit, so a
     bf16 difference says nothing about the method's logic (tests/test_smollm2.py measured 2.4 in
     float32). The max |Δlogit| in the run dtype is reported beside it, with FP16's own.

2. **e2e** — :mod:`kvbench.bench.e2e` on ``llama3_8b_random`` (random weights, Llama-3.1-8B's shape,
   bf16, all 32 layers) at 4k and 32k prompt tokens, 32 new tokens, every method against plain
   transformers. ``--quick`` (the CPU preset): 2 layers, 4k only, 16 new tokens.

Writes one JSON (``--out``, default ``runs/gpu_check/gpu-check-<device>-<preset>-<time>.json``) and
prints one table (every row with its target and PASS/MISS/INFO), then the e2e table. A method that
raises is recorded (``failed`` with the error) and the check goes on. The last row is the wall
time, target under 8 minutes on a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from . import e2e  # noqa: E402
from .cli import _loadavg, machine, markdown_table, verdict_summary, write_and_print  # noqa: E402
from .common import EVAL_CASES, INFO, PRESETS, BenchModel, Row, budget_label, calib_windows, make_method  # noqa: E402

log = logging.getLogger("kvbench.gpu_check")

#: (label, registry name or None for the plain model, options, bpd, v_bpd)
CASES = [("fp16", None, {}, None, None)] + [c[:5] for c in EVAL_CASES] + [("snapkv", "snapkv", {}, 4.0, 4.0)]
EXACT_TOL = 1e-4
WALL_TARGET_S = 480.0


@dataclass(frozen=True)
class Preset:
    name: str
    ppl_seqlen: int
    longqa_tokens: tuple
    inpass_tokens: int
    e2e_layers_cpu: int | None
    e2e_lengths: tuple
    e2e_new_tokens: int


PRESET = {
    "full": Preset("full", 2048, (2000, 4000), 64, None, (4096, 32768), 32),
    "quick": Preset("quick", 512, (1000, 2000), 32, 2, (4096,), 16),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvbench.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="the CPU preset: shorter inputs, e2e on 2 layers at 4k")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="SmolLM2 and e2e model dtype")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(c[0] for c in CASES)}")
    p.add_argument("--skip-e2e", action="store_true", help="only the SmolLM2 part")
    p.add_argument("--e2e-lengths", default=None, help="comma-separated prompt lengths for the e2e part")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    return p.parse_args(argv)


# ---- the SmolLM2 checks ---------------------------------------------------------------------------


def _plain_steps(model, ids: torch.Tensor) -> torch.Tensor:
    from ..integrate import cache_argument, returned_cache

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
    from ..integrate import attach

    if method is None:
        one = model(input_ids=ids, use_cache=False).logits
        return float((one - _plain_steps(model, ids)).abs().max())
    comp = attach(model, method)
    try:
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
    finally:
        comp.detach()


def check_method(bm: BenchModel, label, name, method, window, preset: Preset) -> dict:
    """PPL window, one longqa_squad item and the run-dtype in-pass gap of one method."""
    from ..compressed_lm import CompressedLM
    from ..evals.longqa_squad import evaluate_longqa_squad
    from ..integrate import attach
    from ..ppl import window_nll

    out: dict = {"label": label, "method": name or "fp16"}
    comp = attach(bm.model, method) if method is not None else None
    try:
        lm = CompressedLM(bm.model, bm.tokenizer, comp)
        track = "A" if lm.supports_in_pass else "B"
        t0 = time.perf_counter()
        nll, n = window_nll(lm, window, track, preset.ppl_seqlen * 3 // 4)
        out["ppl"] = {"value": math.exp(nll / n) if math.isfinite(nll) else float("nan"), "track": track,
                      "seconds": time.perf_counter() - t0, "measured_bpd": list(lm.measured_bpd)}
        t0 = time.perf_counter()
        res = evaluate_longqa_squad(lm, n_items=1, target_tokens=preset.longqa_tokens)
        rec = res["records"][0]
        out["longqa"] = {"f1": res["f1"], "seconds": time.perf_counter() - t0, "prompt_tokens": rec["prompt_tokens"],
                         "prediction": rec["prediction"], "answers": rec["answers"], "id": rec["id"],
                         "measured_bpd": list(lm.measured_bpd)}
    finally:
        if comp is not None:
            comp.detach()
    out["inpass_dtype"] = in_pass_gap(bm.model, method, window[: preset.inpass_tokens][None].to(bm.device))
    return out


def smollm2_part(device: str, dtype: str, preset: Preset, cases) -> tuple[list[Row], dict]:
    from ..calibrate import collect_stats
    from ..data.windows import ppl_windows
    from ..integrate import model_shape
    from ..models import load_model

    t0 = time.perf_counter()
    loaded = load_model("smollm2_135m", embedded=True, device=device, dtype=dtype)
    model = loaded.model
    bm = BenchModel(model, loaded.tokenizer, "smollm2_135m", next(model.parameters()).device,
                    next(model.parameters()).dtype, loaded.source)
    stats = collect_stats(model, calib_windows(bm, 512, 4))
    window = ppl_windows(bm.tokenizer, "ptb", preset.ppl_seqlen, 1)[0]
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
    info = {"source": loaded.source, "dtype": str(bm.dtype).replace("torch.", ""), "device": str(bm.device),
            "seconds": time.perf_counter() - t0}
    rows = smollm2_rows(results, preset, info["dtype"])
    del model, loaded, bm
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


def smollm2_rows(results: list[dict], preset: Preset, dtype: str) -> list[Row]:
    rows = []
    fp16_gap = next((r.get("inpass_dtype") for r in results if r["method"] == "fp16"), float("nan"))
    for r in results:
        tag = r["label"] + ("" if r.get("bpd") is None else f" ({budget_label(r['bpd'], r['v_bpd'])})")
        if "error" in r:
            rows.append(Row("smollm2", f"{tag}: failed", "error", float("nan"), "", "finite", 0.0, shown="failed",
                            note=r["error"][:160], detail=r))
            continue
        p, q = r["ppl"], r["longqa"]
        rows.append(Row("ppl", f"{tag}, track {p['track']}, 1x{preset.ppl_seqlen}", "perplexity", p["value"], "",
                        "finite", 0.0, shown=f"{p['value']:.4g}",
                        note=f"{p['seconds']:.2f} s; bpd K/V {p['measured_bpd'][0]:.3g}/{p['measured_bpd'][1]:.3g}",
                        detail={"method": r["method"], **p}))
        rows.append(Row("longqa", f"{tag}, 1 item", "F1", q["f1"], "", "finite", 0.0, shown=f"F1 {q['f1']:.1f}",
                        note=f"{q['seconds']:.2f} s; {q['prompt_tokens']} prompt tokens; {q['prediction'][:40]!r}",
                        detail={"method": r["method"], **q}))
        what = "prefill + chunk vs steps" if r["method"] == "snapkv" else "one pass vs steps"
        gap = r.get("inpass_f64", float("nan"))
        rows.append(Row("inpass", f"{tag}, {preset.inpass_tokens} tokens", "max |dlogit| float64", gap, "", "<=",
                        EXACT_TOL, shown=f"{gap:.2g}",
                        note=(f"{what}; {dtype}: {r['inpass_dtype']:.3g} (fp16's own {fp16_gap:.3g})"
                              + (f"; float64 error {r['inpass_f64_error']}" if "inpass_f64_error" in r else "")),
                        detail={"method": r["method"], "float64": gap, dtype: r["inpass_dtype"],
                                "fp16_" + dtype: fp16_gap, "tolerance": EXACT_TOL}))
    return rows


# ---- the whole check ------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    preset = PRESET["quick" if args.quick else "full"]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check --device cuda: no CUDA device here (on a CPU: make gpu-check DEVICE=cpu QUICK=1)")
    wanted = None if not args.methods else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(wanted or ()) - {c[0] for c in CASES})
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; valid choices: {', '.join(c[0] for c in CASES)}")
    cases = [c for c in CASES if wanted is None or c[0] in wanted]
    started, t_start, load_start = dt.datetime.now().astimezone(), time.perf_counter(), _loadavg()
    seconds = {}
    rows, smol = smollm2_part(args.device, args.dtype, preset, cases)
    seconds["smollm2"] = time.perf_counter() - t_start
    e2e_info = None
    if not args.skip_e2e:
        t0 = time.perf_counter()
        sizes = PRESETS["quick" if args.quick else "full"]
        from dataclasses import replace

        sizes = replace(sizes, e2e_layers_cpu=preset.e2e_layers_cpu)
        lengths = [int(x) for x in args.e2e_lengths.split(",")] if args.e2e_lengths else list(preset.e2e_lengths)
        bm = e2e.e2e_model(sizes, args.device, None if args.device == "cuda" else preset.e2e_layers_cpu, args.dtype)
        e2e_info = {"name": bm.name, "layers": int(bm.model.config.num_hidden_layers), "note": bm.note,
                    "dtype": str(bm.dtype).replace("torch.", ""), "lengths": lengths}
        methods = None if wanted is None else [m for m in wanted if m != "fp16"]
        rows += e2e.run(bm, sizes, lengths, methods, preset.e2e_new_tokens)
        del bm
        e2e.free(torch.device(args.device))
        seconds["e2e"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    on_gpu = args.device == "cuda" and not args.quick
    rows.append(Row("total", "wall time of the check", "seconds", seconds["total"], " s", "<=" if on_gpu else INFO,
                    WALL_TARGET_S, shown=f"{seconds['total']:.0f} s",
                    note="target on one GPU: under 8 minutes" + ("" if on_gpu else " (CPU preset: no target)")))
    device = torch.device(args.device)
    return {
        "schema": "kvbench.gpu_check/1",
        "command": "python -m kvbench.bench.gpu_check" + ("" if not argv else " " + " ".join(argv)),
        "date": started.isoformat(timespec="seconds"),
        "preset": asdict(preset),
        "device": str(device),
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
        report = run(args, argv)
    finally:
        torch.set_num_threads(threads)
    rows = report.pop("_rows")
    preset = "quick" if args.quick else "full"
    out = args.out or Path("runs") / "gpu_check" / f"gpu-check-{args.device}-{preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    m = report["machine"]
    title = f"kvbench device check ({preset}) on {report['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}"
    write_and_print(report, rows, out, title)
    return report


if __name__ == "__main__":
    main()
