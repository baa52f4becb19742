"""The selection of ``cobra_plus``'s defaults on held-out calibration windows (docs/methods.md §13, §1.2).

``python -m kvbench.run -m experiment=cobra_plus_select`` runs it (the search is stated in
conf/experiment/cobra_plus_select.yaml, key ``select``); the job then evaluates the chosen
configuration on its tasks like any other job. ``python -m kvbench.fit.cobra_plus_select RUNS_DIR``
rebuilds the table (Markdown + JSON) from the run's ``result.json``.

The search is **coordinate descent in a stated order**, not a full factorial: a stage starts from a
point (the switches of its ``start``), and for each part of its ``order`` in turn scores every value
of that part with the other switches at their current values, then moves to the value with the
lowest held-out perplexity (the current value kept on a tie). A pass over every part is repeated
until a pass changes nothing, or ``max_passes`` is reached (the table says which). Stages run in
order, each starting from the previous stage's choice; each has its own budget, so a switch that
acts in one track only (``joint_kv``: the KV-track) is searched in a stage at a KV-track budget.

A candidate is scored as a job would use it: built from the job's method options with the
candidate's switches, configured at the stage's budget, its layer sensitivity (or K/V exchange
rate) measured on calibration windows when it asks for one (:mod:`kvbench.fit.layer_sensitivity`),
calibrated from the job's statistics, and then scored by Q-all perplexity (track A) through the
compressed model on ``heldout_windows`` held-out windows of the calibration corpus
(:mod:`kvbench.fit.heldout`, scored window by window through the protocol of
:mod:`kvbench.fit.search`: they overlap no calibration window; never an evaluation set).

Decisions where docs/methods.md is silent:

* Resuming: each candidate's score is cached in ``$KVBENCH_CACHE/cobra_plus_select`` as soon as it
  is known (keyed by model, method options, budget, seed, calibration spec, windows and
  :data:`VERSION`), so an interrupted job, run again, loses at most the candidate it was scoring;
  a candidate met twice (the current point of every part) is scored once.
* The perplexity of a candidate is exp of the mean per-window log-perplexity (every window has the
  same number of targets, so this is the perplexity of all windows together); the per-window
  figures are kept, and the table shows on how many windows a value beats the current one.
* A candidate the method cannot reach (``Unsupported``) is listed and never chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from methods import REGISTRY, Regime, build_method

from ..context import JobContext
from ..store.cache import cached_json
from .heldout import heldout
from .layer_sensitivity import measure_for
from .search import fit_candidate, heldout_window_ppl
from .statistics import sample_request, statistics

log = logging.getLogger(__name__)

#: part of the cache key: bump when a candidate's score changes meaning
VERSION = 1
METHOD = "cobra_plus"
TABLE_FILE = "cobra_plus_select"  # .md and .json beside result.json


@dataclass(frozen=True)
class Stage:
    """One stage of the search: a budget, the switches it starts from, the parts in order with
    their values (each value a dict of method options)."""

    name: str
    bpd_k: float
    bpd_v: float | None
    start: dict
    order: dict  # part -> [dict of options, ...]


def _as_options(part: str, value) -> dict:
    """A value of ``part``: a dict of options as is, a scalar the option named like the part."""
    return dict(value) if isinstance(value, dict) else {part: value}


def stages_from_config(select_cfg) -> list[Stage]:
    """The stages of ``select.stages`` (a list of {name, bpd, v_bpd, start, order}), validated:
    every option must be a field of :class:`methods.cobra_plus.CobraPlus`."""
    cfg = OmegaConf.to_container(select_cfg, resolve=True) if OmegaConf.is_config(select_cfg) else select_cfg
    fields = {f.name for f in dataclasses.fields(REGISTRY[METHOD]) if f.init}
    stages = []
    for raw in cfg["stages"]:
        order = {part: [_as_options(part, v) for v in values] for part, values in raw["order"].items()}
        start = dict(raw.get("start") or {})
        used = set(start) | {k for values in order.values() for v in values for k in v}
        unknown = sorted(used - fields)
        if unknown:
            raise ValueError(f"select stage {raw['name']!r}: {unknown} are not {METHOD} options; valid: {sorted(fields)}")
        if any(not values for values in order.values()):
            raise ValueError(f"select stage {raw['name']!r}: every part needs at least one value")
        v_bpd = raw.get("v_bpd")
        stages.append(Stage(raw["name"], float(raw["bpd"]), None if v_bpd is None else float(v_bpd), start, order))
    if not stages:
        raise ValueError("select.stages is empty: give at least one stage")
    return stages


def _same(a, b) -> bool:
    """Equal option values; ``True`` is not ``1`` (``c2=true`` is the seed's C2, not a number)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _is_current(point: dict, value: dict) -> bool:
    return all(k in point and _same(point[k], v) for k, v in value.items())


def descend(stage: Stage, point: dict, score: Callable[[dict, Stage], dict], max_passes: int) -> tuple[dict, list, bool]:
    """Coordinate descent of ``stage`` from ``point`` (updated by ``stage.start``): (chosen point,
    steps, converged). ``score(options, stage)`` -> {"ppl": float | None, "window_ppl": [...], ...}.
    A step = one part in one pass: its candidates (the current one marked) and the value moved to."""
    point = {**point, **stage.start}
    steps = []

    def ask(options: dict) -> dict:
        return score(options, stage)

    for n in range(1, max_passes + 1):
        changed = False
        for part, values in stage.order.items():
            rows = [_candidate(part, v, point, ask) for v in values]
            current = next((r for r in rows if r["current"]), None)
            if current is None:  # the point's value is not listed: score it too, as the reference
                current = _candidate(part, {}, point, ask)
                rows.insert(0, current)
            for r in rows:
                r["wins"] = _wins(r, current)
            ok = [r for r in rows if r["ppl"] is not None and math.isfinite(r["ppl"])]
            best = min(ok, key=lambda r: (r["ppl"], not r["current"])) if ok else current
            for r in rows:
                r["chosen"] = r is best
            if not best["current"]:
                point, changed = {**point, **best["set"]}, True
            steps.append({"stage": stage.name, "pass": n, "part": part, "candidates": rows, "moved": not best["current"]})
        if not changed:
            return point, steps, True
    return point, steps, False


def _candidate(part: str, value: dict, point: dict, score: Callable[[dict], dict]) -> dict:
    """One row of a step: ``value`` of ``part`` set on ``point`` (``{}``: the point itself), scored."""
    options = point | value
    rec = score(options)
    if not value:
        label = "(start)"
    else:
        label = str(value[part]) if set(value) == {part} else ", ".join(f"{k}={v}" for k, v in value.items())
    return {"value": label, "set": value, "current": _is_current(point, value), "options": options,
            "ppl": rec.get("ppl"), "window_ppl": rec.get("window_ppl"), "seconds": rec.get("seconds"),
            "unsupported": rec.get("unsupported")}


def _wins(row: dict, current: dict) -> int | None:
    """Windows on which ``row`` has the lower perplexity than the current value (None for itself)."""
    if row is current or not row.get("window_ppl") or not current.get("window_ppl"):
        return None
    return sum(a < b for a, b in zip(row["window_ppl"], current["window_ppl"]))


# ---- scoring through the model --------------------------------------------------------------------


@dataclass
class Scorer:
    """Scores candidates on the held-out windows, each once (cache file + memory)."""

    ctx: JobContext
    windows: object  # torch.Tensor [n, seqlen]
    scored: int = 0
    memo: dict = field(default_factory=dict)

    def __call__(self, options: dict, stage: Stage) -> dict:
        key = {"model": self.ctx.model_id, "method": METHOD, "version": VERSION, "options": options,
               "bpd": [stage.bpd_k, stage.bpd_v], "seed": self.ctx.seed, "calibration": asdict(self.ctx.spec),
               "windows": list(self.windows.shape)}
        memo_key = json.dumps(key, sort_keys=True, default=str)
        if memo_key not in self.memo:
            out = cached_json("cobra_plus_select", key, lambda: self._score(options, stage))
            self.scored += not out["cache_hit"]
            self.memo[memo_key] = out
        return self.memo[memo_key]

    def _score(self, options: dict, stage: Stage) -> dict:
        t0 = time.perf_counter()
        method = build_method(METHOD, **options)
        method.set_regime(Regime("qall", int(self.windows.shape[1])))
        scratch: dict = {}

        def sensitivity(m) -> None:
            if "layer_sensitivity" in m.searches():
                measure_for(self.ctx, m, None, scratch)

        unsupported = fit_candidate(self.ctx, method, stage.bpd_k, stage.bpd_v, sensitivity)
        if unsupported is not None:
            return {"ppl": None, "unsupported": unsupported, "seconds": time.perf_counter() - t0}
        window_ppl = heldout_window_ppl(self.ctx, method, self.windows)
        ppl = math.exp(sum(math.log(p) for p in window_ppl) / len(window_ppl))
        shown = {k: options.get(k) for k in searched_options([stage])}
        log.info("cobra_plus select [%s] %s -> held-out PPL %.3f", stage.name, shown, ppl)
        return {"ppl": ppl, "window_ppl": window_ppl, "seconds": time.perf_counter() - t0,
                "sensitivity_s": scratch.get("sensitivity_s", 0.0)}


def searched_options(stages: list[Stage]) -> list[str]:
    """The options the stages set, in order of first appearance."""
    keys = [k for s in stages for k in s.start] + [k for s in stages for vals in s.order.values() for v in vals for k in v]
    return list(dict.fromkeys(keys))


def stats_with_sample(ctx: JobContext, options: dict, stages: list[Stage]) -> JobContext:
    """The job's context, its statistics recomputed (cached) with a larger key/value sample when a
    candidate asks for more than the job's own method did (e.g. ``step=calibrated`` from a
    ``gauss`` job)."""
    need = 0
    for stage in stages:
        for values in stage.order.values():
            for v in values:
                need = max(need, sample_request(build_method(METHOD, **{**options, **stage.start, **v})))
    if need <= ctx.spec.sample_tokens:
        return ctx
    spec = replace(ctx.spec, sample_tokens=need)
    stats, _, _ = statistics(ctx.model, ctx.tokenizer, ctx.model_id, spec)
    return ctx.with_stats(stats, spec)


def select(ctx: JobContext, options: dict, select_cfg) -> dict:
    """Run the stated search from the job's method ``options``; the table: {"chosen", "steps",
    "converged", "search", ...}. ``ctx.stats`` must carry the key/value sample every candidate
    asks for (:func:`stats_with_sample`)."""
    t0 = time.perf_counter()
    stages = stages_from_config(select_cfg)
    max_passes = int(select_cfg.get("max_passes", 3))
    n = int(select_cfg.get("heldout_windows", 8))
    windows = heldout(ctx.tokenizer, ctx.spec, n=n)
    scorer = Scorer(ctx, windows)
    point, steps, converged = dict(options), [], {}
    for stage in stages:
        point, stage_steps, converged[stage.name] = descend(stage, point, scorer, max_passes)
        steps += stage_steps
    keys = searched_options(stages)
    for step in steps:  # the table keeps the searched options per row, the others once
        for row in step["candidates"]:
            row["options"] = {k: row["options"][k] for k in keys}
    return {
        "method": METHOD,
        "chosen": {k: point[k] for k in keys},
        "other_options": {k: v for k, v in options.items() if k not in keys},
        "search": {"kind": "coordinate descent in the stated order", "max_passes": max_passes,
                   "stages": [asdict(s) for s in stages]},
        "converged": converged,
        "steps": steps,
        "heldout_windows": list(windows.shape),
        "calibration": asdict(ctx.spec),
        "seed": ctx.seed,
        "model_id": ctx.model_id,
        "candidates": len(scorer.memo),
        "scored_now": scorer.scored,
        "seconds": time.perf_counter() - t0,
    }


def select_for_job(ctx: JobContext, select_cfg, method, options: dict, result: dict, timings: dict,
                   out_dir: Path):
    """(the job's method with the selected switches, not yet configured; the context with the
    statistics and spec it is calibrated with), for a method that declares ``"select"`` in its
    ``searches()``. The table goes into the result (``cobra_plus_select``) and beside it
    (``cobra_plus_select.md`` / ``.json``)."""
    name = method.name
    if "select" not in method.searches():
        raise ValueError(f"select: chooses {METHOD}'s defaults; the job's method is {name!r} (use method={METHOD})")
    if ctx.stats is None:
        raise ValueError(f"select: {METHOD} needs calibration statistics")
    ctx = stats_with_sample(ctx, options, stages_from_config(select_cfg))
    table = select(ctx, options, select_cfg)
    timings["select_s"] = table["seconds"]
    result["cobra_plus_select"] = table
    write_table(table, Path(out_dir))
    return build_method(name, **{**options, **table["chosen"]}), ctx


# ---- the table ------------------------------------------------------------------------------------


def _fmt(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def render(table: dict) -> str:
    """The Markdown table of a selection: one row per candidate, step by step."""
    n, seqlen = table["heldout_windows"]
    cal = table["calibration"]
    lines = [
        f"Selection of {table['method']}'s defaults: {table['search']['kind']} "
        f"(at most {table['search']['max_passes']} passes per stage), held-out Q-all PPL on {n} x {seqlen} "
        f"tokens of {cal['dataset']}/{cal['split']} overlapping no calibration window "
        f"({cal['n_windows']} x {cal['seqlen']}, seed {table['seed']}).",
        "",
        "| stage (bpd_K, bpd_V) | pass | part | value | held-out PPL | vs current | windows better | |",
        "|:--|--:|:--|:--|--:|--:|--:|:--|",
    ]
    budgets = {s["name"]: (s["bpd_k"], s["bpd_v"]) for s in table["search"]["stages"]}
    for step in table["steps"]:
        cur = next(r for r in step["candidates"] if r["current"])
        bk, bv = budgets[step["stage"]]
        for i, r in enumerate(step["candidates"]):
            head = (f"{step['stage']} ({bk:g}, {16 if bv is None else bv:g})", str(step["pass"]), step["part"]) if i == 0 else ("", "", "")
            rel = None if r["ppl"] is None or r["current"] else 100 * (r["ppl"] / cur["ppl"] - 1)
            ppl = _fmt(r["ppl"]) if r["ppl"] is not None else f"unsupported: {r['unsupported']}"
            wins = "" if r["wins"] is None else f"{r['wins']}/{len(r['window_ppl'])}"
            mark = ("**chosen**" if r["chosen"] else "") + (" (current)" if r["current"] else "")
            lines.append(f"| {' | '.join(head)} | {r['value']} | {ppl} | "
                         f"{'' if rel is None else format(rel, '+.1f') + '%'} | {wins} | {mark.strip()} |")
    conv = ", ".join(f"{k}: {'converged' if v else 'stopped at max_passes'}" for k, v in table["converged"].items())
    lines += ["", f"Chosen: {', '.join(f'{k}={v}' for k, v in table['chosen'].items())}.",
              f"{table['candidates']} candidates scored in {scoring_seconds(table):.0f} s (the selection job: "
              f"{table['seconds']:.0f} s, candidates from the cache included; {conv})."]
    return "\n".join(lines) + "\n"


def scoring_seconds(table: dict) -> float:
    """Seconds spent scoring the table's distinct candidates, whenever each was scored."""
    seen = {}
    for step in table["steps"]:
        for r in step["candidates"]:
            seen[json.dumps(r["options"], sort_keys=True, default=str)] = r["seconds"] or 0.0
    return sum(seen.values())


def write_table(table: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{TABLE_FILE}.json").write_text(json.dumps(table, indent=1, default=str) + "\n")
    (out_dir / f"{TABLE_FILE}.md").write_text(render(table))


def tables_in(runs_dir: Path) -> list[tuple[Path, dict]]:
    """Every selection table in the ``result.json`` files under ``runs_dir``."""
    out = []
    for path in sorted(Path(runs_dir).rglob("result.json")):
        result = json.loads(path.read_text())
        if result.get("cobra_plus_select"):
            out.append((path, result["cobra_plus_select"]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.fit.cobra_plus_select", description=__doc__.split("\n")[0])
    parser.add_argument("runs_dir", help="a run (or sweep) directory of experiment=cobra_plus_select")
    parser.add_argument("--out", metavar="STEM", help="also write STEM.md and STEM.json (e.g. docs/cobra_plus_select)")
    args = parser.parse_args(argv)
    found = tables_in(Path(args.runs_dir))
    if not found:
        print(f"no result.json with a cobra_plus_select table under {args.runs_dir}", file=sys.stderr)
        return 1
    for path, table in found:
        print(f"{path}:\n")
        sys.stdout.write(render(table))
    if args.out:
        if len(found) > 1:
            parser.error(f"--out takes one table; {len(found)} found")
        stem = Path(args.out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(found[0][1], indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(render(found[0][1]))
        print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
