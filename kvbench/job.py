"""One job of a sweep, from a resolved config to a written ``result.json`` (DESIGN.md §4)."""

from __future__ import annotations

import gc
import hashlib
import logging
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from methods import REGISTRY, Regime, Unsupported, build_method

from .calibrate import CalibrationSpec, calibrate, with_sample
from .compressed_lm import CompressedLM, NotInPass, summarize_readings
from .identity import is_done, job_id
from .integrate import attach, model_shape
from .models import LoadedModel, load_model
from .results import RESULT_FILE, has_nonfinite, new_result, read_result, write_atomic
from .summary import print_summary
from .tracking import log_result

log = logging.getLogger("kvbench")

TASKS = ("ppl", "zeroshot", "longbench", "ruler")
PREDICTIONS_FILE = "predictions.json"
_MODELS: dict[tuple, LoadedModel] = {}


def get_model(mcfg, device: str) -> tuple[LoadedModel, float]:
    """Load a model once per process: the jobs of a sweep on the basic launcher share it."""
    key = (mcfg.name, mcfg.get("path"), device, mcfg.get("dtype", "auto"))
    if key in _MODELS:
        return _MODELS[key], 0.0
    t0 = time.perf_counter()
    _MODELS.clear()  # one model in memory at a time
    _MODELS[key] = load_model(
        mcfg.name,
        hf_id=mcfg.get("hf_id"),
        path=mcfg.get("path"),
        embedded=bool(mcfg.get("embedded", False)),
        device=device,
        dtype=mcfg.get("dtype", "auto"),
    )
    return _MODELS[key], time.perf_counter() - t0


def calibration_model_id(cfg: DictConfig, loaded: LoadedModel) -> str:
    """What the cached statistics belong to: the model's weights (by source) and dtype."""
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    digest = hashlib.sha256(loaded.source.encode()).hexdigest()[:8]
    return f"{cfg.model.name}-{digest}-{dtype}"


def method_options(cfg: DictConfig) -> tuple[str, dict]:
    opts = OmegaConf.to_container(cfg.method, resolve=True)
    name = opts.pop("name")
    return name, opts


def targets(cfg: DictConfig, method) -> tuple[float, float]:
    if method.name == "fp16":  # the baseline whatever bpd says (DESIGN.md §4)
        return 16.0, 16.0
    bpd = 16.0 if cfg.bpd is None else float(cfg.bpd)
    if cfg.v_bpd is not None:
        return bpd, float(cfg.v_bpd)
    return bpd, (bpd if method.evicts_tokens else 16.0)


def job_regime(cfg: DictConfig) -> Regime:
    """The scored positions the job's headline measured bpd is the mean over (METHODS.md §0 v3),
    for methods whose cost depends on the position (fp16 buffers, per-sequence bases, eviction):
    PPL's track when PPL runs (A: Q-all over seqlen positions; B: a ``context``-token prefill whose
    own prediction is the first of the seqlen - context targets, the others decoded),
    else a 2048-token prefill with 32 decoded positions (LongBench / RULER: prompt lengths vary per
    item), else Q-all over 2048. Other tasks report their own measured bpd beside it."""
    if "ppl" in cfg.tasks:
        p = cfg.task.ppl
        if p.track == "B":
            return Regime("prefill", int(p.context), int(p.seqlen) - int(p.context) - 1)
        return Regime("qall", int(p.seqlen))
    if "longbench" in cfg.tasks or "ruler" in cfg.tasks:
        return Regime("prefill", 2048, 32)
    return Regime("qall", 2048)


def _limit(cfg: DictConfig, task_cfg) -> int | None:
    return cfg.limit if cfg.limit is not None else task_cfg.get("limit")


def run_tasks(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    """Run every task of ``cfg.tasks``; a task the method cannot do is listed, not fatal."""
    unknown = [t for t in cfg.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; valid choices: {', '.join(TASKS)}")
    by_task = result["bpd"].setdefault("by_task", {})
    for task in cfg.tasks:
        mark = len(lm.readings)
        try:
            TASK_RUNNERS[task](cfg, lm, result)
        except NotInPass as err:
            result.setdefault("unsupported_tasks", {})[task] = str(err)
            log.warning("%s: unsupported for %s: %s", task, lm.method.name, err)
        summary = summarize_readings(lm.readings[mark:])
        if summary is not None:
            by_task[task] = summary
    if len(result.get("unsupported_tasks", {})) == len(cfg.tasks):
        raise Unsupported("; ".join(result["unsupported_tasks"].values()))
    headline = headline_bpd(by_task, cfg.tasks)
    if headline is not None:
        result["bpd"].update(headline)


def headline_bpd(by_task: dict, tasks) -> dict | None:
    """The result's top-level measured bpd: that of the first task run in the order of ``tasks``
    (PPL first by default), labelled with its task and convention (METHODS.md §0 v3: the mean over
    the task's scored positions; the end-of-prefill and end-of-sequence figures beside it)."""
    keep = ("measured_k", "measured_v", "end_k", "end_v", "prefill_end_k", "prefill_end_v", "convention")
    for task in tasks:
        if task in by_task:
            b = by_task[task]
            return {**{k: b[k] for k in keep if k in b}, "from_task": task}
    return None


def run_ppl(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    from .ppl import evaluate_ppl

    p = cfg.task.ppl
    out = evaluate_ppl(
        lm, list(p.datasets), p.seqlen, _limit(cfg, p), p.track, p.context,
        OmegaConf.to_container(p.data_dir, resolve=True) if p.get("data_dir") else {},
    )
    result["metrics"]["ppl"] = out["ppl"]
    result["counts"]["ppl_windows"] = out["windows"]
    result["counts"]["ppl_track"] = p.track


def run_zeroshot(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    from .evals.zeroshot import evaluate_zeroshot

    z = cfg.task.zeroshot
    result["metrics"]["zeroshot"] = evaluate_zeroshot(lm, list(z.tasks), _limit(cfg, z), cfg.seed)


def run_longbench(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    lb = cfg.task.longbench
    datasets = list(lb.datasets)
    real = [d for d in datasets if d != "longqa_squad"]
    if "longqa_squad" in datasets:
        from .evals.longqa_squad import evaluate_longqa_squad

        # the task's own item seed, never cfg.seed: every method and job seed gets the same items
        out = evaluate_longqa_squad(lm, n_items=_limit(cfg, lb) or 20,
                                    item_seed=int(lb.get("item_seed", 0)),
                                    query_aware=_query_aware(lb, "task.longbench", True))
        result["predictions"]["longqa_squad"] = out.pop("records")
        result["counts"]["longqa_squad_items"] = out["n"]
        result["metrics"]["longqa_squad"] = out
    if real:
        from .evals.longbench import evaluate_longbench

        out = evaluate_longbench(
            lm, real, lb.get("data_dir"), _limit(cfg, lb), lb.max_length, bool(cfg.model.chat),
            query_aware=_query_aware(lb, "task.longbench", True),
        )
        result["predictions"]["longbench"] = out.pop("records")
        result["counts"]["longbench_items"] = out.pop("counts")
        result["metrics"]["longbench"] = out


# RULER and the query-aware / query-agnostic switch (METHODS.md §9.4, §9.5)
def _query_aware(task_cfg, name: str, default: bool) -> bool:
    from .evals.query_split import as_bool

    value = task_cfg.get("query_aware", None) if task_cfg is not None else None
    return default if value is None else as_bool(value, f"{name}.query_aware")


def run_ruler(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    """RULER (``ruler``, or ``ruler_wiki`` on stand-in data); query-agnostic unless
    ``task.ruler.query_aware=true``; the task's own item seed, never cfg.seed."""
    from .evals.ruler import evaluate_ruler

    r = cfg.task.get("ruler") or {}
    tasks = r.get("tasks")
    out = evaluate_ruler(
        lm,
        tasks=None if tasks is None else list(tasks),
        lengths=list(r.get("lengths", [4096])),
        limit=_limit(cfg, r),
        query_aware=_query_aware(r, "task.ruler", False),
        essays=r.get("essays"),
        squad=r.get("squad"),
        hotpot=r.get("hotpot"),
        item_seed=r.get("item_seed"),
        chat=bool(cfg.model.chat) if r.get("chat") is None else bool(r.get("chat")),
    )
    name = out["benchmark"]
    result["predictions"][name] = out.pop("records")
    result["counts"][f"{name}_items"] = out["counts"]
    result["metrics"][name] = out


TASK_RUNNERS = {"ppl": run_ppl, "zeroshot": run_zeroshot, "longbench": run_longbench, "ruler": run_ruler}


def free_device_memory() -> None:
    """Release what a finished (or failed, e.g. CUDA out of memory) job held on the GPU before the
    next job of an in-process sweep starts: the compressed states and tracebacks are garbage by
    now, and the caching allocator gives their blocks back."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def redundant_seed(cfg: DictConfig) -> str | None:
    """Why this job would only repeat seed 0, or None (issue 6: a method with nothing random runs
    once per configuration and is reported with n=1).

    Nothing is random in a method whose class has ``seeded = False`` and
    ``needs_calibration = False`` (fp16, kivi, h2o, snapkv): seeds > 0 are skipped, no result.
    """
    seed, name = int(cfg.seed), cfg.method.get("name")
    cls = REGISTRY.get(name)
    if seed <= 0 or cls is None or cls.seeded or cls.needs_calibration:
        return None
    return f"seed {seed} skipped: {name} has nothing random"


def _calibration_spec(cfg: DictConfig, method) -> CalibrationSpec:
    """The job's calibration spec, made (and so checked: a calibration or selection split that is
    an evaluation split is an error, METHODS.md §1.2) for every job before the model loads."""
    spec = CalibrationSpec(**{**OmegaConf.to_container(cfg.calibration), "seed": int(cfg.seed)})
    return with_sample(spec, method)  # the key/value sample of the calibrated step (§1.1b), if asked


def _calibration(cfg: DictConfig, loaded: LoadedModel, method, spec, result: dict, timings: dict):
    """The job's calibration statistics (from the disk cache when present); None for a method
    that needs none."""
    if not method.needs_calibration:
        return None
    stats, timings["calibrate_s"], hit = calibrate(
        loaded.model, loaded.tokenizer, calibration_model_id(cfg, loaded), spec
    )
    result["counts"]["calibration_cache_hit"] = hit
    return stats


def _auto_split(cfg, loaded, name, options, stats, spec, result, timings) -> tuple[float, float]:
    """``bpd=β v_bpd=auto``: the K/V split of bpd_KV = β chosen on held-out calibration windows
    (METHODS.md §5.8, :mod:`kvbench.kv_split`); targets become that split."""
    from .kv_split import choose_split

    if cfg.bpd is None:
        raise ValueError("v_bpd=auto splits a total budget: give bpd=β, the bpd_KV to split")
    if stats is None:
        raise Unsupported(f"v_bpd=auto chooses a split by calibration PPL; {name} is not calibrated")
    beta = float(cfg.bpd)
    split = choose_split(loaded.model, loaded.tokenizer, name, options, beta, stats, spec,
                         int(cfg.seed), calibration_model_id(cfg, loaded))
    timings["split_s"] = 0.0 if split["cache_hit"] else split["seconds"]
    result["kv_split"] = split
    result["bpd"].update(target_k=split["bpd_k"], target_v=float(split["v_bpd"]), target_kv=beta)
    return split["bpd_k"], float(split["v_bpd"])


def run_job(cfg: DictConfig, out_dir: Path) -> dict | None:
    """Run one job into ``out_dir/result.json``; None for a skipped redundant seed."""
    path = Path(out_dir) / RESULT_FILE
    skip = redundant_seed(cfg)
    if skip:
        log.info(skip)
        return None
    jid = job_id(cfg)
    prior = read_result(path)
    if is_done(prior, jid) and not cfg.get("rerun", False):
        log.info("skipping %s: already %s (job %s; rerun=true to redo)", out_dir, prior["status"], jid)
        return prior
    log.info("job %s: running in %s%s", jid, out_dir,
             f" (replacing a {prior.get('status')} result)" if prior is not None else "")
    name, options = method_options(cfg)
    result = new_result(cfg.model.name, name, int(cfg.seed), None, None)
    result["job_id"] = jid
    result["config"] = OmegaConf.to_container(cfg, resolve=True)
    result["counts"] = {}
    result["predictions"] = {}  # per-item generations: written beside result.json, not in it
    timings = result["timings"]
    comp = None
    t_start = time.perf_counter()
    try:
        torch.manual_seed(int(cfg.seed))
        method = build_method(name, **options)
        spec = _calibration_spec(cfg, method)
        auto_split = cfg.v_bpd == "auto"
        if not auto_split:
            target_k, target_v = targets(cfg, method)
            result["bpd"].update(target_k=target_k, target_v=target_v)
        loaded, timings["load_s"] = get_model(cfg.model, cfg.device)
        shape = model_shape(loaded.model)
        bpd_k = None if cfg.bpd is None else float(cfg.bpd)
        bpd_v = None if cfg.v_bpd is None or auto_split else float(cfg.v_bpd)
        if name == "fp16":
            if (bpd_k, bpd_v, auto_split) not in ((None, None, False), (16.0, None, False), (16.0, 16.0, False)):
                log.info("fp16 is the uncompressed baseline: it stores 16 bits per element, "
                         "bpd=%s v_bpd=%s does not apply", cfg.bpd, cfg.v_bpd)
            bpd_k = bpd_v = None
            auto_split = False
            result["bpd"].update(target_k=16.0, target_v=16.0)
        timings["calibrate_s"] = 0.0
        stats = _calibration(cfg, loaded, method, spec, result, timings)
        if auto_split:
            bpd_k, bpd_v = _auto_split(cfg, loaded, name, options, stats, spec, result, timings)
        if cfg.get("select") is not None:  # cobra_plus's switches chosen on held-out windows (§13)
            from .cobra_plus_select import select_for_job

            method, stats, spec = select_for_job(cfg, loaded, name, options, stats, spec, result, timings, out_dir)
        method.set_regime(job_regime(cfg))
        # compose: the eviction/codec budget split chosen by calibration-corpus PPL
        if getattr(method, "wants_split_choice", lambda: False)() and bpd_k is not None:
            from .keep_fraction import split_for_job

            method = split_for_job(cfg, loaded, name, options, bpd_k, bpd_v, stats, result, timings)
        method.configure(shape, bpd_k, bpd_v)
        # cobra_plus: per-layer sensitivity measured on calibration windows
        if stats is not None and getattr(method, "wants_layer_sensitivity", lambda: False)():
            from .layer_sensitivity import sensitivity_for_job

            sensitivity_for_job(loaded, method, stats, spec, int(cfg.seed), calibration_model_id(cfg, loaded),
                                result, timings)
        if stats is not None:
            t0 = time.perf_counter()
            method.calibrate(stats, seed=int(cfg.seed))
            timings["allocate_s"] = time.perf_counter() - t0
        result["knobs"] = method.knobs()
        result["static_bytes"] = method.static_bytes()  # per-model constants, beside bpd (§0)
        if name != "fp16":
            comp = attach(loaded.model, method)
        lm = CompressedLM(loaded.model, loaded.tokenizer, comp)
        t0 = time.perf_counter()
        run_tasks(cfg, lm, result)
        timings["eval_s"] = time.perf_counter() - t0
        result["status"] = "diverged" if has_nonfinite(result["metrics"]) else "ok"
    except Unsupported as err:
        result["status"], result["error"] = "unsupported", str(err)
        log.warning("unsupported: %s", err)
    except Exception as err:  # noqa: BLE001 - one failed job must not stop a sweep
        result["status"] = "failed"
        result["error"] = "".join(traceback.format_exception(err))
        log.error("job failed: %s\n%s", err, result["error"])
    finally:
        if comp is not None:
            comp.detach()
        comp = lm = None
        free_device_memory()
    timings["total_s"] = time.perf_counter() - t_start
    predictions = result.pop("predictions")
    if predictions:
        write_atomic(Path(out_dir) / PREDICTIONS_FILE, predictions)
    write_atomic(path, result)
    print_summary(result, path)
    log_result(result, OmegaConf.to_container(cfg.wandb, resolve=True), Path(out_dir))
    return result
