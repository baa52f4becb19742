"""One job of a sweep, from a resolved config to a written ``result.json`` (docs/design.md §4).

The job's data flow, in order: the config read once (:mod:`kvbench.config`) → the model, loaded
once per process (:mod:`kvbench.model.loading`) → the :class:`~kvbench.context.JobContext` →
calibration statistics and the free parameters fitted on held-out windows (:mod:`kvbench.fit`) →
the method attached (``with attached(...)``) → the tasks (:mod:`kvbench.tasks`) → the result, its
summary, its allocation figure and its W&B run (:mod:`kvbench.store`). This module only orders
those steps; what each one does is in its own module.

The W&B run (:mod:`kvbench.store.tracking`) lives as long as the job: it starts before the model
loads, every step reports through the context's progress callback, and it closes after
result.json is written, with the job's status; an interrupted job closes it as failed.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from methods import Unsupported, build_method

from .config import Budget, JobConfig, budget, job_regime, redundant_seed
from .context import JobContext, no_progress
from .fit.budget_share import choose_budget_share
from .fit.cobra_plus_select import select_for_job
from .fit.fisher import fisher_stats
from .fit.knob_search import choose_for_job as choose_knobs_for_job
from .fit.kv_split import choose_kv_split
from .fit.layer_sensitivity import measure_for
from .fit.measured_keep import refit_kept
from .fit.statistics import CalibrationSpec, statistics, with_sample
from .model.compressed_lm import CompressedLM
from .model.integrate import attached
from .model.loading import free_device_memory, load_once
from .store.figures import allocation_png
from .store.identity import is_done, job_id
from .store.results import RESULT_FILE, has_nonfinite, new_result, read_result, write_result
from .store.summary import print_summary
from .store.tracking import Tracker, start_tracking
from .tasks import check_tasks, run_tasks
from .tasks.batch_size import batch_setting

log = logging.getLogger("kvbench")


def run_job(cfg: DictConfig, out_dir: Path) -> dict | None:
    """Run one job into ``out_dir/result.json``; None for a skipped redundant seed."""
    skip = redundant_seed(cfg)
    if skip:
        log.info(skip)
        return None
    jid, prior = job_id(cfg), read_result(Path(out_dir) / RESULT_FILE)
    job = JobConfig.read(cfg)
    if is_done(prior, jid) and not job.rerun:
        log.info("skipping %s: already %s (job %s; rerun=true to redo)", out_dir, prior["status"], jid)
        return prior
    log.info("job %s: running in %s%s", jid, out_dir,
             f" (replacing a {prior.get('status')} result)" if prior is not None else "")
    result = new_result(job.model.name, job.method, job.seed, None, None)
    result.update(job_id=jid, config=OmegaConf.to_container(cfg, resolve=True), counts={}, predictions={})
    timings, method = result["timings"], None
    tracker = start_tracking(job.wandb(), result, Path(out_dir))
    progress = tracker.progress if tracker.enabled else no_progress
    t_start = time.perf_counter()
    try:
        torch.manual_seed(job.seed)
        check_tasks(job.tasks)  # a wrong name fails now, not after loading and calibrating
        method = build_method(job.method, **job.options)
        spec = with_sample(CalibrationSpec(**job.calibration()), method)  # checked before loading
        bud = budget(job, method)
        if not bud.auto:
            result["bpd"].update(target_k=bud.target_k, target_v=bud.target_v)
        loaded, timings["load_s"] = load_once(job.model, job.device)
        progress("job", 1, load_s=timings["load_s"])
        ctx = JobContext.of(loaded, job.model.name, spec, job.seed, job_regime(job), progress,
                            batch=batch_setting(job, loaded.model))
        method = fit(job, method, ctx, bud, result, Path(out_dir))
        progress("job", 2, calibrate_s=timings["calibrate_s"], elapsed_s=time.perf_counter() - t_start)
        evaluate(job, ctx, method, result)
    except Unsupported as err:
        result["status"], result["error"] = "unsupported", str(err)
        log.warning("unsupported: %s", err)
    except Exception as err:  # noqa: BLE001 - one failed job must not stop a sweep
        result["status"] = "failed"
        result["error"] = "".join(traceback.format_exception(err))
        log.error("job failed: %s\n%s", err, result["error"])
    except BaseException:  # Ctrl-C, SystemExit: no result; the W&B run ends as failed
        tracker.abort(1)
        raise
    finally:
        free_device_memory()
    timings["total_s"] = time.perf_counter() - t_start
    predictions = result.get("predictions") or {}  # write_result moves them to predictions.json
    path = write_result(result, Path(out_dir))
    print_summary(result, path)
    tracker.finish(result, predictions, figures(tracker, method, result, Path(out_dir)), Path(out_dir))
    return result


def figures(tracker: Tracker, method, result: dict, out_dir: Path) -> list[Path]:
    """The allocation figure beside result.json (``allocation.png``) for a tracked job whose
    method spreads its budget (``KVMethod.allocation()``); a figure that fails is logged, never
    fatal."""
    if not tracker.enabled or method is None or result["status"] != "ok":
        return []
    try:
        b = result["bpd"]
        title = (f"{result['model']} / {result['method']}: target bpd K {b.get('target_k')}, "
                 f"V {b.get('target_v')}; measured {b.get('measured_k') or 0:.3g} / {b.get('measured_v') or 0:.3g}")
        path = allocation_png(method.allocation(), out_dir, title)
        return [] if path is None else [path]
    except Exception as err:  # noqa: BLE001 - a figure must not fail a finished job
        log.warning("allocation figure not drawn: %s", err)
        return []


def fit(job: JobConfig, method, ctx: JobContext, bud: Budget, result: dict, out_dir: Path):
    """Statistics, then every free parameter in the order each depends on the previous: the K/V
    split (``v_bpd=auto``), then the searches the method declares (``KVMethod.searches()``), each
    at its step: the method's switches (``"select"``, when the job gives a ``select`` search), the
    budget share (``"budget_share"``), the knobs among the admissible configurations (``"knobs"``),
    the configuration at the budget, the layer sensitivity
    (``"layer_sensitivity"``), the method's own calibration, the kept fraction refitted to the
    measured figure (``"measured_keep"``). Returns the method, configured and calibrated."""
    timings = result["timings"]
    timings["calibrate_s"] = 0.0
    if method.needs_calibration:
        stats, timings["calibrate_s"], hit = statistics(ctx.model, ctx.tokenizer, ctx.model_id, ctx.spec)
        result["counts"]["calibration_cache_hit"] = hit
        if method.calibration_fisher():
            stats, timings["fisher_s"], hit = fisher_stats(ctx.model, ctx.tokenizer, ctx.model_id, ctx.spec, stats)
            result["counts"]["fisher_cache_hit"] = hit
        ctx = ctx.with_stats(stats)
    bpd_k, bpd_v = bud.bpd_k, bud.bpd_v
    if bud.auto:
        bpd_k, bpd_v = kv_split(job, ctx, result)
    if job.select is not None:  # the method's switches chosen on held-out windows
        method, ctx = select_for_job(ctx, job.select, method, job.options, result, timings, out_dir)
    method.set_regime(ctx.regime)
    if "budget_share" in method.searches() and bpd_k is not None:
        choice = choose_budget_share(ctx, job.options, bpd_k, bpd_v)
        timings["split_s"] = 0.0 if choice["cache_hit"] else choice["seconds"]
        result["keep_fraction"] = choice
        method = build_method(job.method, **{**job.options, "split": choice["split"]})
        method.set_regime(ctx.regime)
    if "knobs" in method.searches() and bpd_k is not None:
        choose_knobs_for_job(ctx, job.method, job.options, method, bpd_k, bpd_v, result)
    method.configure(ctx.shape, bpd_k, bpd_v)
    if ctx.stats is not None and "layer_sensitivity" in method.searches():
        measure_for(ctx, method, result, timings)
    if ctx.stats is not None:
        t0 = time.perf_counter()
        method.calibrate(ctx.stats, seed=ctx.seed)
        timings["allocate_s"] = time.perf_counter() - t0
    if bpd_k is not None and "measured_keep" in method.searches():
        refit = refit_kept(ctx, method, job.options, bpd_k, bpd_v)
        timings["measured_fit_s"] = 0.0 if refit["cache_hit"] else refit["seconds"]
        result["measured_fit"] = refit
    return method


def kv_split(job: JobConfig, ctx: JobContext, result: dict) -> tuple[float, float]:
    """``bpd=β v_bpd=auto``: the K/V split of bpd_KV = β chosen on held-out calibration windows
    (docs/methods.md §5.8); the targets become that split."""
    if job.bpd is None:
        raise ValueError("v_bpd=auto splits a total budget: give bpd=β, the bpd_KV to split")
    if ctx.stats is None:
        raise Unsupported(f"v_bpd=auto chooses a split by calibration PPL; {job.method} is not calibrated")
    beta = float(job.bpd)
    split = choose_kv_split(ctx, job.method, job.options, beta)
    result["timings"]["split_s"] = 0.0 if split["cache_hit"] else split["seconds"]
    result["kv_split"] = split
    result["bpd"].update(target_k=split["bpd_k"], target_v=float(split["v_bpd"]), target_kv=beta)
    return split["bpd_k"], float(split["v_bpd"])


def evaluate(job: JobConfig, ctx: JobContext, method, result: dict) -> None:
    """The tasks through the model with ``method`` attached (the FP16 baseline: the plain model)."""
    result["knobs"] = method.knobs()
    result["static_bytes"] = method.static_bytes()  # per-model constants, beside bpd (§0)
    with attached(ctx.model, None if job.method == "fp16" else method) as comp:
        lm = CompressedLM(ctx.model, ctx.tokenizer, comp)
        t0 = time.perf_counter()
        run_tasks(job, lm, result, ctx.progress)
        result["timings"]["eval_s"] = time.perf_counter() - t0
    result["status"] = "diverged" if has_nonfinite(result["metrics"]) else "ok"
