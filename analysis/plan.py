"""``python -m analysis plan EXPERIMENT DEVICE_DIR``: the GPU-hours of a sweep, from measured rates.

The sweep's jobs come from the experiment's YAML (``conf/experiment/*.yaml``: the Hydra sweeper's
``model``, ``main_row`` and ``seed`` lists, the rows' methods from ``conf/main_row/``); a seed > 0
of a method with nothing random (``seeded`` and ``needs_calibration`` both False) is skipped, as
the job skips it. Each job's time is its items per task (:data:`PAPER_ITEMS`, the paper protocol's
public dataset sizes) over the measured rates in ``DEVICE_DIR``:

* ``anchor_batch.json`` — plain transformers on the model shape (prefill seconds and decode step
  milliseconds at 4k and 32k prompt tokens, scored 128-token requests per second), per batch;
* ``e2e32k.json`` — each method's prefill and decode rate over plain transformers
  (``python -m kvbench.bench --sections e2e``) at batch 1;
* any ``python -m kvbench.bench --sections batch`` JSON there: a method's measured items/s over
  plain transformers' at a batch (PPL windows, scoring, generation) replaces its e2e ratio for
  that kind of work at that batch.

Every figure is an estimate with its assumptions printed beside it; none is a measurement of the
sweep itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from methods import REGISTRY

#: items per job under task=paper (public dataset sizes; the printed assumptions say so)
PAPER_ITEMS = {
    # PPL windows of 2048 tokens: WikiText-2 and PTB test with the Llama-3 tokenizer (about 290k
    # and 82k tokens), C4 the GPTQ convention's 256 validation windows
    "ppl": {"wikitext2": 141, "ptb": 40, "c4": 256},
    # lm-eval loglikelihood requests: documents x choices (piqa 1838x2, arc_easy 2376x4,
    # arc_challenge 1172x4, hellaswag 10042x4, winogrande 1267x2)
    "zeroshot": {"piqa": 3676, "arc_easy": 9504, "arc_challenge": 4688, "hellaswag": 40168, "winogrande": 2534},
    # LongBench: (items, mean prompt tokens: the LongBench paper's average length x 1.3 tokens per
    # word, capped at 31.5k, max new tokens: dataset2maxlen)
    "longbench": {"narrativeqa": (200, 23932, 128), "qasper": (200, 4705, 128),
                  "multifieldqa_en": (150, 5927, 64), "multifieldqa_zh": (200, 6701, 64),
                  "hotpotqa": (200, 11896, 32), "2wikimqa": (200, 6353, 32),
                  "musique": (200, 14578, 32), "triviaqa": (200, 10672, 32)},
}
#: methods without a single-pass form score PPL track A as n/a (no job time)
NO_IN_PASS = ("snapkv",)


@dataclass
class Rates:
    """Plain transformers' rates on one model shape and one device, and each method's ratios."""

    score_per_s: dict  # batch -> 128-token requests per second
    prefill: dict  # (prompt tokens, batch) -> seconds for the batch
    step_ms: dict  # (prompt tokens, batch) -> one decode step for the batch
    prefill_ratio: dict = field(default_factory=dict)  # method -> time / plain
    decode_ratio: dict = field(default_factory=dict)  # method -> time / plain
    #: (kind of work: ppl | score | generate, method, batch) -> time / plain, from a batch section
    batch_ratio: dict = field(default_factory=dict)
    source: list = field(default_factory=list)

    def batch_at(self, table: dict, tokens: int, batch: int) -> tuple[int, int]:
        """The measured (length, batch) that stands for ``tokens`` at ``batch``: the shortest
        measured length >= tokens (else the longest), the largest measured batch <= ``batch``."""
        lengths = sorted({length for length, _ in table})
        length = next((x for x in lengths if x >= tokens), lengths[-1])
        batches = sorted(b for x, b in table if x == length)
        return length, max([b for b in batches if b <= batch] or [batches[0]])

    def measured(self, work: str, method: str, batch: int) -> float | None:
        """A method's time over plain's for ``work`` at the largest batch <= ``batch`` that a batch
        section measured, or None."""
        batches = sorted(b for w, m, b in self.batch_ratio if w == work and m == method and b <= batch)
        return self.batch_ratio[(work, method, batches[-1])] if batches else None


def read_rates(device_dir: Path) -> Rates:
    anchor = json.loads((device_dir / "anchor_batch.json").read_text())
    rates = Rates({}, {}, {}, source=[str(device_dir / "anchor_batch.json")])
    for key, value in anchor.items():
        parts = key.split()
        if parts[0] == "gen":  # "gen bs8 4096"
            batch, tokens = int(parts[1][2:]), int(parts[2])
            rates.prefill[(tokens, batch)] = value["prefill_s"]
            rates.step_ms[(tokens, batch)] = value["step_ms"]
        elif parts[0] == "score":  # "score req/s bs8 L128"
            rates.score_per_s[int(parts[2][2:])] = value
    e2e = device_dir / "e2e32k.json"
    if e2e.is_file():
        rates.source.append(str(e2e))
        for row in json.loads(e2e.read_text())["rows"]:
            ratios = row.get("detail", {}).get("ratios") or {}
            if ratios.get("prefill") and ratios.get("decode_tok_s"):
                method = row["detail"]["method"]
                rates.prefill_ratio[method] = ratios["prefill"]
                rates.decode_ratio[method] = 1.0 / ratios["decode_tok_s"]
    for path in sorted(device_dir.glob("*.json")):
        rows = [r for r in json.loads(path.read_text()).get("rows", []) if r.get("section") == "batch"]
        for row in rows:
            d = row.get("detail") or {}
            if d.get("items_per_s") and d.get("plain_items_per_s"):
                rates.batch_ratio[(d["task"], d["method"], d["batch"])] = d["plain_items_per_s"] / d["items_per_s"]
        if rows:
            rates.source.append(str(path))
    return rates


@dataclass
class Job:
    model: str
    row: str
    method: str
    seed: int


def sweep_jobs(experiment: Path) -> tuple[list[Job], list[str], int]:
    """The jobs of an experiment YAML (seeds a method would skip left out), its tasks, and the
    number of skipped seeds."""
    cfg = yaml.safe_load(experiment.read_text())
    params = cfg["hydra"]["sweeper"]["params"]
    conf = experiment.parent.parent
    jobs, skipped = [], 0
    for model in str(params["model"]).split(","):
        for row in str(params["main_row"]).split(","):
            row_cfg = yaml.safe_load((conf / "main_row" / f"{row}.yaml").read_text())
            method = next(d["override /method"] for d in row_cfg["defaults"] if "override /method" in d)
            cls = REGISTRY[method]
            for seed in (int(s) for s in str(params.get("seed", 0)).split(",")):
                if seed > 0 and not (cls.seeded or cls.needs_calibration):
                    skipped += 1
                    continue
                jobs.append(Job(model, row, method, seed))
    return jobs, list(cfg.get("tasks") or ["ppl", "zeroshot", "longbench"]), skipped


def job_seconds(job: Job, tasks: list[str], rates: Rates, batch: int) -> dict:
    """Seconds of each task of one job at ``batch``."""
    method, out = job.method, {}
    if "ppl" in tasks and job.method not in NO_IN_PASS:
        length, b = rates.batch_at(rates.prefill, 2048, batch)
        per_token = rates.prefill[(length, b)] / (length * b)  # a window is one forward pass
        pre = rates.measured("ppl", method, batch) or rates.prefill_ratio.get(method, 1.0)
        out["ppl"] = sum(PAPER_ITEMS["ppl"].values()) * 2048 * per_token * pre
    if "zeroshot" in tasks:
        b = max([x for x in rates.score_per_s if x <= batch] or [min(rates.score_per_s)])
        pre = rates.measured("score", method, batch) or rates.prefill_ratio.get(method, 1.0)
        out["zeroshot"] = sum(PAPER_ITEMS["zeroshot"].values()) / rates.score_per_s[b] * pre
    if "longbench" in tasks:
        total = 0.0
        gen = rates.measured("generate", method, batch)
        pre = gen or rates.prefill_ratio.get(method, 1.0)
        dec = gen or rates.decode_ratio.get(method, 1.0)
        for items, tokens, new in PAPER_ITEMS["longbench"].values():
            length, b = rates.batch_at(rates.prefill, tokens, batch)
            per_batch = rates.prefill[(length, b)] * tokens / length * pre + new * rates.step_ms[(length, b)] / 1e3 * dec
            total += math.ceil(items / b) * per_batch
        out["longbench"] = total
    return out


ASSUMPTIONS = [
    "items per job: the paper protocol's public dataset sizes (analysis/plan.py PAPER_ITEMS): PPL {ppl} windows "
    "of 2048 tokens, {zs} zero-shot requests, {lb} LongBench items at their mean prompt length",
    "every model of the sweep runs at the rates measured on the model shape of the device files "
    "(Llama-3.1-8B's for the committed H200 files)",
    "plain transformers' rates: anchor_batch.json at the largest measured batch <= the batch asked and the "
    "shortest measured prompt length >= the item's (a PPL window is a 2048-token prefill at the 4k rate per token)",
    "a method's time is plain's x its items/s ratio of the batch section at the batch (where a batch JSON is "
    "in the folder), else x its prefill ratio (prefill, PPL, scoring) and x its decode ratio (decode steps) "
    "measured at batch 1 by the e2e section (32k tokens); a method without figures counts as plain",
    "every LongBench answer runs to its maximum new tokens (an upper bound); SnapKV's PPL track A is n/a",
]


def plan(experiment: Path, device_dir: Path, batch: int = 32, gpus_per_node: int = 8) -> str:
    """The plan as Markdown: per row (summed over models and seeds) and in total."""
    rates = read_rates(device_dir)
    jobs, tasks, skipped = sweep_jobs(experiment)
    by_row: dict = {}
    for job in jobs:
        secs = job_seconds(job, tasks, rates, batch)
        row = by_row.setdefault(job.row, {"jobs": 0, **{t: 0.0 for t in tasks}})
        row["jobs"] += 1
        for task, s in secs.items():
            row[task] += s
    lines = [f"# GPU-hours of `{experiment.name}` at batch {batch}", "",
             f"{len(jobs)} jobs ({skipped} seeds skipped: nothing random), tasks {', '.join(tasks)}; "
             f"rates from {', '.join(rates.source)}", "",
             "| row | jobs | " + " | ".join(f"{t} h" for t in tasks) + " | GPU-h |",
             "|---|---|" + "---|" * len(tasks) + "---|"]
    total = 0.0
    for row, r in by_row.items():
        hours = {t: r[t] / 3600 for t in tasks}
        total += sum(hours.values())
        lines.append(f"| {row} | {r['jobs']} | " + " | ".join(f"{hours[t]:.2f}" for t in tasks)
                     + f" | {sum(hours.values()):.1f} |")
    lines += ["", f"**Total: {total:.1f} GPU-hours; {total / gpus_per_node:.1f} hours on one "
                  f"{gpus_per_node}-GPU node** (goal: <= 8).", "", "Assumptions:"]
    counts = {"ppl": sum(PAPER_ITEMS["ppl"].values()), "zs": sum(PAPER_ITEMS["zeroshot"].values()),
              "lb": sum(v[0] for v in PAPER_ITEMS["longbench"].values())}
    lines += [f"- {a.format(**counts)}" for a in ASSUMPTIONS]
    return "\n".join(lines) + "\n"
