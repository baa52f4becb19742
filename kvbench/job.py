"""One job of a sweep, from a resolved config to a written ``result.json`` (DESIGN.md §4)."""

from __future__ import annotations

import hashlib
import logging
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from methods import REGISTRY, Unsupported, build_method

from .calibrate import CalibrationSpec, calibrate
from .compressed_lm import CompressedLM, NotInPass
from .identity import is_done, job_id
from .integrate import attach, model_shape
from .models import LoadedModel, load_model
from .results import RESULT_FILE, has_nonfinite, new_result, read_result, write_atomic
from .summary import print_summary
from .tracking import log_result

log = logging.getLogger("kvbench")

TASKS = ("ppl", "zeroshot", "longbench")
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
    bpd = 16.0 if cfg.bpd is None else float(cfg.bpd)
    if cfg.v_bpd is not None:
        return bpd, float(cfg.v_bpd)
    return bpd, (bpd if method.evicts_tokens else 16.0)


def _limit(cfg: DictConfig, task_cfg) -> int | None:
    return cfg.limit if cfg.limit is not None else task_cfg.get("limit")


def run_tasks(cfg: DictConfig, lm: CompressedLM, result: dict) -> None:
    """Run every task of ``cfg.tasks``; a task the method cannot do is listed, not fatal."""
    unknown = [t for t in cfg.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; valid choices: {', '.join(TASKS)}")
    for task in cfg.tasks:
        try:
            TASK_RUNNERS[task](cfg, lm, result)
        except NotInPass as err:
            result.setdefault("unsupported_tasks", {})[task] = str(err)
            log.warning("%s: unsupported for %s: %s", task, lm.method.name, err)
    if len(result.get("unsupported_tasks", {})) == len(cfg.tasks):
        raise Unsupported("; ".join(result["unsupported_tasks"].values()))
    if lm.compressor is None:
        result["bpd"]["measured_k"], result["bpd"]["measured_v"] = 16.0, 16.0
    else:
        measured = result.pop("_ppl_bpd", None) or lm.measured_bpd
        result["bpd"]["measured_k"], result["bpd"]["measured_v"] = measured


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
    result["_ppl_bpd"] = out["measured_bpd"]


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

        out = evaluate_longqa_squad(lm, n_items=_limit(cfg, lb) or 20, seed=cfg.seed)
        result["predictions"]["longqa_squad"] = out.pop("records")
        result["metrics"]["longqa_squad"] = out
    if real:
        from .evals.longbench import evaluate_longbench

        out = evaluate_longbench(
            lm, real, lb.get("data_dir"), _limit(cfg, lb), lb.max_length, bool(cfg.model.chat)
        )
        result["predictions"]["longbench"] = out.pop("records")
        result["counts"]["longbench_items"] = out.pop("counts")
        result["metrics"]["longbench"] = out


TASK_RUNNERS = {"ppl": run_ppl, "zeroshot": run_zeroshot, "longbench": run_longbench}


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
        target_k, target_v = targets(cfg, method)
        result["bpd"].update(target_k=target_k, target_v=target_v)
        loaded, timings["load_s"] = get_model(cfg.model, cfg.device)
        shape = model_shape(loaded.model)
        method.configure(
            shape, None if cfg.bpd is None else float(cfg.bpd),
            None if cfg.v_bpd is None else float(cfg.v_bpd),
        )
        timings["calibrate_s"] = 0.0
        if method.needs_calibration:
            spec = CalibrationSpec(**{**OmegaConf.to_container(cfg.calibration), "seed": int(cfg.seed)})
            stats, timings["calibrate_s"], hit = calibrate(
                loaded.model, loaded.tokenizer, calibration_model_id(cfg, loaded), spec
            )
            result["counts"]["calibration_cache_hit"] = hit
            t0 = time.perf_counter()
            method.calibrate(stats, seed=int(cfg.seed))
            timings["allocate_s"] = time.perf_counter() - t0
        result["knobs"] = method.knobs()
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
    timings["total_s"] = time.perf_counter() - t_start
    predictions = result.pop("predictions")
    if predictions:
        write_atomic(Path(out_dir) / PREDICTIONS_FILE, predictions)
    write_atomic(path, result)
    print_summary(result, path)
    log_result(result, OmegaConf.to_container(cfg.wandb, resolve=True), Path(out_dir))
    return result
