"""``python -m kvbench.bench``: what compression costs the harness, the allocator and the codecs.

Sections, measured in one process as ratios against a baseline timed beside them; one module
each in this package:

1. **overhead** — PPL track A wall time per method / FP16's, same windows (:mod:`.overhead`);
   targets <= 1.15x (codecs), <= 1.2x (KVQuant, GEAR, TurboQuant), <= 2x (H2O).
2. **allocation** — KV-COBRA C1 + C2 for 256 and 112 heads x d=128 (:mod:`.allocation`); < 10 ms.
3. **codecs** — key encode + decode throughput vs a plain copy (:mod:`.codec_speed`); >= 25%.
4. **memory** — bytes held after a prefill vs FP16, measured bpd vs ``nominal_bpd`` (:mod:`.memory`); within 2%.
5. **calibration** — calibration pass vs a plain forward pass per 1k tokens (:mod:`.calibration`); <= 1.3x;
   for KVQuant, GEAR and TurboQuant also the pass with the sample a method asks for (<= 1.3x) and
   the seconds of its fit (INFO, with what it fits).
6. **opcount** — aten ops per layer per decode step and per one-pass forward vs FP16's
   (:mod:`.opcount`); codecs (KVQuant, GEAR and TurboQuant too) <= 3x, H2O's one-pass <= 3x FP16's
   ops for the whole window.
7. **zeroshot** — 100 real lm-eval zero-shot requests through each method vs FP16 (:mod:`.shortseq`);
   <= 1.15x (codecs), <= 1.2x (KVQuant, GEAR, TurboQuant), <= 2x (H2O).
8. **batch** — items/s of PPL windows, zero-shot-style scoring and generation at batch 1, 8, 32
   (``--quick``: 1, 4) for FP16 and every method vs plain transformers on the same inputs and
   batch (:mod:`.batch`); FP16 >= 0.9x plain; on a GPU at batch >= 8 codecs >= 0.6x, eviction >= 0.3x.
9. **e2e** — generation on ``llama3_8b_random`` at 4k-32k tokens vs plain transformers: prefill,
   decode tokens/s, peak memory, stored/resident cache bytes (:mod:`.e2e`); peak <= 1.1x (a PASS only where that can fail a method).
   Not in the default set (minutes to hours): ask for it with ``--sections e2e``. bf16 on a GPU
   and on a CPU with native bf16, else float32 at the smaller sizes of ``Sizes.e2e_cpu_float32``
   (:func:`kvbench.bench.common.cpu_dtype`).

A row PASSes only against a target that a broken method would miss; a row without one is INFO
(docs/performance.md, "Verdicts").

Writes a JSON file (``--out``, default ``runs/bench/bench-<model>-<preset>-<time>.json``) and
prints a table with the target and PASS/MISS (INFO: no target) of every row, then the e2e table
when that section ran. ``--quick`` shortens everything; ``--smoke`` is for tests. ``--model
llama3_8b_random`` builds a randomly initialized model of Llama-3.1-8B's shape (meant for a GPU;
``--layers N`` keeps N layers for a CPU smoke run). The device check is
:mod:`kvbench.bench.gpu_check` (``make gpu-check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import allocation, batch, calibration, codec_speed, e2e, memory, opcount, overhead, shortseq
from .common import PRESETS, Row, bench_dtype, dtype_name, e2e_sizes, load_bench_model

log = logging.getLogger("kvbench.bench")

#: the order they run in (calibration first: overhead and zeroshot use its statistics)
SECTIONS = ("calibration", "overhead", "zeroshot", "batch", "allocation", "codecs", "memory", "opcount", "e2e")
#: the order of the table (the numbering of docs/performance.md)
ORDER = ("overhead", "allocation", "codecs", "memory", "calibration", "opcount", "zeroshot", "batch", "e2e")
DEFAULT = tuple(s for s in ORDER if s != "e2e")
NEEDS_STATS = ("overhead", "zeroshot", "batch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvbench.bench", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter windows and fewer repetitions (< 3 min on a CPU)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every row is produced (tests)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="smollm2_135m", choices=("smollm2_135m", "llama3_8b_random", "tiny"),
                   help="tiny: the tests' 2-layer random Llama")
    p.add_argument("--layers", type=int, default=None,
                   help="llama3_8b_random (and the e2e section's model): keep this many layers (CPU runs)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run (default: torch's own choice)")
    p.add_argument("--sections", default=",".join(DEFAULT),
                   help=f"comma-separated subset of {','.join(ORDER)} (default: all but e2e; overhead and "
                        "zeroshot need calibration's statistics, run anyway)")
    o = p.add_argument_group("opcount section")
    o.add_argument("--ops-methods", default=None,
                   help=f"comma-separated subset of {','.join(c[0] for c in opcount.CASES[1:])} (default: all; "
                        "the plain fp16 baseline always runs)")
    z = p.add_argument_group("zeroshot section")
    z.add_argument("--zs-methods", default=None,
                   help=f"comma-separated subset of {','.join(c[0] for c in shortseq.EVAL_CASES)} (default: all)")
    z.add_argument("--zs-reps", type=int, default=None,
                   help="repetitions over the requests per method, FP16 and the method interleaved request "
                        "by request (default 3; --quick 2): more narrows the ratio's noise")
    e = p.add_argument_group("e2e section")
    e.add_argument("--e2e-lengths", default=None,
                   help="comma-separated prompt lengths (default: 4096,8192,16384,32768; --quick 4096,8192)")
    e.add_argument("--e2e-methods", default=None,
                   help=f"comma-separated subset of {','.join(c[0] for c in e2e.CASES)} (default: all)")
    e.add_argument("--e2e-new-tokens", type=int, default=None, help="tokens generated per case (default 64; --quick 16)")
    e.add_argument("--e2e-dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                   help="dtype of the random 8B-shape model (auto: bfloat16 on a GPU and on a CPU with native "
                        "bf16, else float32 at smaller sizes)")
    return p.parse_args(argv)


def _csv(text: str | None, cast=str):
    return None if not text else [cast(x.strip()) for x in text.split(",") if x.strip()]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - provenance only
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(device: torch.device) -> dict:
    import transformers

    info = {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "git_commit": _git_commit(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def format_table(rows: list[Row]) -> str:
    head = ("section", "row", "value", "target", "verdict", "note")
    body = [(r.section, r.name, r.shown, r.target_text, r.verdict, r.note) for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = []
    for i, cells in enumerate([head, *body]):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + "  " + cells[-1])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| section | row | value | target | verdict | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.section} | {r.name} | {r.shown} | {r.target_text} | {r.verdict} | {r.note} |" for r in rows]
    return "\n".join(lines)


def verdict_summary(rows: list[Row]) -> dict:
    """Rows and PASS / MISS / INFO counts of a report."""
    return {"rows": len(rows), **{v.lower(): sum(r.verdict == v for r in rows) for v in ("PASS", "MISS", "INFO")}}


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = PRESETS[preset]
    sizes_zs = sizes if args.zs_reps is None else dataclasses.replace(sizes, zs_reps=args.zs_reps)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(ORDER))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; valid choices: {', '.join(ORDER)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    t_start = time.perf_counter()
    started = dt.datetime.now().astimezone()
    load_start = _loadavg()
    rows: dict[str, list[Row]] = {}
    t0 = time.perf_counter()
    bm = None
    if any(s in wanted for s in ("overhead", "memory", "calibration", "zeroshot", "batch")):
        bm = load_bench_model(args.model, args.device, args.layers)
    load_s = time.perf_counter() - t0
    device = bm.device if bm else torch.device(args.device)
    dtype = bm.dtype if bm else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    seconds = {"load": load_s}
    stats = None
    e2e_model = None
    e2e_why = None
    plan = [s for s in SECTIONS if s in wanted or (s == "calibration" and any(n in wanted for n in NEEDS_STATS))]
    for section in plan:
        t0 = time.perf_counter()
        with torch.no_grad():
            if section == "calibration":
                # the methods' own calibration rows only when the section was asked for; the
                # sample a method needs is otherwise collected when it is first built
                rows[section], stats = calibration.run(bm, sizes, None if section in wanted else [])
            elif section == "overhead":
                rows[section] = overhead.run(bm, sizes, stats)
            elif section == "zeroshot":
                rows[section] = shortseq.run(bm, sizes_zs, stats, shortseq.cases_named(_csv(args.zs_methods)))
            elif section == "batch":
                rows[section] = batch.run(bm, preset, stats)
            elif section == "allocation":
                rows[section] = allocation.run(sizes)
            elif section == "codecs":
                rows[section] = codec_speed.run(sizes, device, dtype)
            elif section == "memory":
                if stats is None:
                    from .common import calib_windows, model_stats

                    stats = model_stats(bm.model, calib_windows(bm, sizes.calib_seqlen, sizes.calib_windows))
                rows[section] = memory.run(bm, sizes, stats)
            elif section == "opcount":
                rows[section] = opcount.run(sizes, device, opcount.cases_named(_csv(args.ops_methods)))
            elif section == "e2e":
                e2e_dtype, e2e_why = bench_dtype(args.e2e_dtype, device)
                sizes_e2e = e2e_sizes(sizes, device, e2e_dtype)
                e2e_model = e2e.e2e_model(sizes_e2e, args.device, args.layers, e2e_dtype, tiny=args.model == "tiny")
                rows[section] = e2e.run(e2e_model, sizes_e2e, _csv(args.e2e_lengths, int), _csv(args.e2e_methods),
                                        args.e2e_new_tokens)
        seconds[section] = time.perf_counter() - t0
        log.info("section %s done in %.1f s", section, seconds[section])
    ordered = [r for s in ORDER for r in rows.get(s, [])]
    return {
        "schema": "kvbench.bench/1",
        "command": "python -m kvbench.bench" + ("" if not argv else " " + " ".join(argv)),
        "date": started.isoformat(timespec="seconds"),
        "preset": preset,
        "sizes": sizes.__dict__,
        "model": {"name": args.model, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                  "layers": int(bm.model.config.num_hidden_layers) if bm else None,
                  "note": bm.note if bm else None},
        "e2e_model": None if e2e_model is None else {
            "name": e2e_model.name, "dtype": dtype_name(e2e_model.dtype), "dtype_reason": e2e_why,
            "layers": int(e2e_model.model.config.num_hidden_layers), "note": e2e_model.note},
        "machine": machine(device),
        "load_avg": {"start": load_start, "end": _loadavg()},
        "seconds": {**seconds, "total": time.perf_counter() - t_start},
        "rows": [r.as_dict() for r in ordered],
        "summary": verdict_summary(ordered),
        "table_markdown": markdown_table(ordered),
        "_rows": ordered,
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args, argv)
    finally:
        torch.set_num_threads(threads)
    rows = report.pop("_rows")
    out = args.out or Path("runs") / "bench" / f"bench-{args.model}-{report['preset']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    title = (f"kvbench.bench ({report['preset']}) on {report['model']['name']} ({report['model']['device']}, "
             f"{report['model']['dtype']})")
    if report["e2e_model"]:
        m = report["e2e_model"]
        title += f"; e2e on {m['name']}, {m['layers']} layers, {m['dtype_reason'] or m['dtype']}"
    write_and_print(report, rows, out, title)
    return report


def write_and_print(report: dict, rows: list, out: Path, title: str) -> None:
    """Write ``report`` to ``out`` atomically (a per-process temporary name, then a rename) and
    print ``title`` with the date, load and time, the rows' table, the e2e table if any, and the
    PASS/MISS/INFO count (shared by ``python -m kvbench.bench`` and the device check)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out)
    print(f"\n{title}, {report['date']}, load avg {report['load_avg']['start']} -> "
          f"{report['load_avg']['end']}, {report['seconds']['total']:.0f} s")
    print(format_table(rows))
    e2e_rows = [r for r in rows if r.section == "e2e"]
    if e2e_rows:
        print("\ne2e (ratios to plain transformers at the same length):")
        print(e2e.format_e2e(e2e_rows))
    s = report["summary"]
    print(f"\n{s['pass']} PASS, {s['miss']} MISS, {s['info']} INFO of {s['rows']} rows; JSON: {out}")


if __name__ == "__main__":
    main()
