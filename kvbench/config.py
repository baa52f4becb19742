"""What a job is: one typed reading of the Hydra config, and the budget and regime it implies.

The Hydra config (conf/, docs/design.md §4) stays the public contract: its keys and defaults are the
YAML files'. :class:`JobConfig` reads the top level once, so that the harness reads attributes
instead of ``cfg.get(...)`` scattered over its modules; each task reads its own section
(:mod:`kvbench.tasks`), and the calibration section becomes a
:class:`kvbench.fit.statistics.CalibrationSpec`. The reading converts nothing that can fail:
a bad value (``bpd=abc``) fails inside the job, where it becomes a ``failed`` result.

Structured configs (dataclasses in Hydra's ConfigStore) were not used: they would reject the
extra keys experiments add (``+method.evict_options``) and change what a resolved config holds,
which is stored in every result and hashed into its job id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from methods import REGISTRY, Regime

log = logging.getLogger("kvbench")

#: the value budget ``v_bpd=auto``: the K/V split of ``bpd`` chosen on held-out windows
AUTO = "auto"


@dataclass(frozen=True)
class JobConfig:
    """The top level of a resolved job config, read once."""

    raw: DictConfig  # the whole config: stored in the result, hashed into the job id
    model: DictConfig  # the model section, as the loader reads it
    method: str
    options: dict  # the method's options (its config section without ``name``)
    bpd: Any  # as given: a number, or None for 16 bits
    v_bpd: Any  # as given: a number, None (values at 16 bits) or "auto"
    seed: int
    tasks: tuple[str, ...]
    limit: int | None
    device: str
    rerun: bool
    select: DictConfig | None  # cobra_plus's held-out selection (conf/experiment/cobra_plus_select)

    @classmethod
    def read(cls, cfg: DictConfig) -> "JobConfig":
        options = OmegaConf.to_container(cfg.method, resolve=True)
        name = options.pop("name")
        return cls(raw=cfg, model=cfg.model, method=name, options=options, bpd=cfg.bpd,
                   v_bpd=cfg.v_bpd, seed=int(cfg.seed), tasks=tuple(cfg.tasks), limit=cfg.limit,
                   device=cfg.device, rerun=bool(cfg.get("rerun", False)), select=cfg.get("select"))

    @property
    def task(self) -> DictConfig:
        """The task sections (``task.ppl``, ``task.longbench``, ...)."""
        return self.raw.task

    def calibration(self) -> dict:
        return {**OmegaConf.to_container(self.raw.calibration), "seed": self.seed}

    def wandb(self) -> dict:
        return OmegaConf.to_container(self.raw.wandb, resolve=True)


@dataclass(frozen=True)
class Budget:
    """The job's budget: ``bpd_k``/``bpd_v`` for ``configure`` (None: the method's default or 16
    bits), the recorded targets, and whether the K/V split is still to be chosen (``auto``)."""

    bpd_k: float | None
    bpd_v: float | None
    auto: bool
    target_k: float | None
    target_v: float | None


def budget(job: JobConfig, method) -> Budget:
    """``method=fp16`` is the baseline whatever ``bpd`` says (docs/design.md §4): 16/16 and no knobs.
    Otherwise ``bpd=x`` is the key budget, values at 16 bits unless ``v_bpd`` is given, except for
    token eviction, whose one budget covers keys and values alike (docs/design.md §3)."""
    auto = job.v_bpd == AUTO
    bpd_k = None if job.bpd is None else float(job.bpd)
    if method.name == "fp16":
        bpd_v = None if job.v_bpd is None or auto else float(job.v_bpd)
        if (bpd_k, bpd_v, auto) not in ((None, None, False), (16.0, None, False), (16.0, 16.0, False)):
            log.info("fp16 is the uncompressed baseline: it stores 16 bits per element, "
                     "bpd=%s v_bpd=%s does not apply", job.bpd, job.v_bpd)
        return Budget(None, None, False, 16.0, 16.0)
    if auto:
        return Budget(bpd_k, None, True, None, None)
    bpd_v = None if job.v_bpd is None else float(job.v_bpd)
    target_k = 16.0 if bpd_k is None else bpd_k
    if bpd_v is not None:
        return Budget(bpd_k, bpd_v, False, target_k, bpd_v)
    return Budget(bpd_k, None, False, target_k, target_k if method.evicts_tokens else 16.0)


def job_regime(job: JobConfig) -> Regime:
    """The scored positions the job's headline measured bpd is the mean over (docs/methods.md §0 v3),
    for methods whose cost depends on the position (fp16 buffers, per-sequence bases, eviction):
    PPL's track when PPL runs (A: Q-all over seqlen positions; B: a ``context``-token prefill whose
    own prediction is the first of the seqlen - context targets, the others decoded),
    else a prefill with 32 decoded positions (LongBench: 2048 tokens, prompt lengths vary per item;
    RULER alone: its longest length), else Q-all over 2048. Other tasks report their own measured
    bpd beside it."""
    if "ppl" in job.tasks:
        p = job.task.ppl
        if p.track == "B":
            return Regime("prefill", int(p.context), int(p.seqlen) - int(p.context) - 1)
        return Regime("qall", int(p.seqlen))
    if "ruler" in job.tasks and "longbench" not in job.tasks and job.task.get("ruler", {}).get("lengths"):
        return Regime("prefill", max(int(n) for n in job.task.ruler.lengths), 32)
    if "longbench" in job.tasks or "ruler" in job.tasks:
        return Regime("prefill", 2048, 32)
    return Regime("qall", 2048)


def redundant_seed(cfg: DictConfig) -> str | None:
    """Why this job would only repeat seed 0, or None: a method with nothing random runs once
    per configuration and is reported with n=1.

    Nothing is random in a method whose class has ``seeded = False`` and
    ``needs_calibration = False`` (fp16, kivi, h2o, snapkv): seeds > 0 are skipped, no result.
    """
    seed, name = int(cfg.seed), cfg.method.get("name")
    cls = REGISTRY.get(name)
    if seed <= 0 or cls is None or cls.seeded or cls.needs_calibration:
        return None
    return f"seed {seed} skipped: {name} has nothing random"
