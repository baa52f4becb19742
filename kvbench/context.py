"""JobContext: what every step after loading reads, passed as one object.

The fitting steps (:mod:`kvbench.fit`: the K/V split, compose's budget share, cobra_plus's
selection, the layer sensitivity) all need the same things: the model and its tokenizer, the
identity its cached statistics belong to, the calibration spec and its statistics, the seed and
the regime the measured bpd is taken over. They read them here, never from the job, so that
nothing below :mod:`kvbench.job` depends on it.

The context also carries the job's :data:`Progress` callback, the one way a step below the job
tells the outside world how far it is (the W&B run's live history, :mod:`kvbench.store.tracking`):
tasks and fits call it and never import a tracker; with tracking off it is :func:`no_progress`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Callable

from methods import ModelShape, Regime

from .model.integrate import model_shape
from .model.loading import LoadedModel


#: ``progress(section, step, **values)``: one point of the curves of ``section`` (``"ppl/ptb"``,
#: ``"zeroshot"``, ``"longqa_squad"``...) at that section's own ``step`` (windows, items or tasks
#: done, from 1). ``values`` are numbers in the job's display units: scores in percent (0-100),
#: perplexity as is, NLL in nats per token, bpd in bits per element, times in seconds.
Progress = Callable[..., None]


def no_progress(section: str, step: int, **values: float) -> None:
    """The :data:`Progress` of a job that is not tracked: does nothing."""


def model_id(loaded: LoadedModel, name: str) -> str:
    """What cached statistics and held-out choices belong to: the model's weights (by source) and
    dtype."""
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    digest = hashlib.sha256(loaded.source.encode()).hexdigest()[:8]
    return f"{name}-{digest}-{dtype}"


@dataclass(frozen=True)
class JobContext:
    loaded: LoadedModel
    model_id: str
    spec: Any  # kvbench.fit.statistics.CalibrationSpec
    seed: int
    regime: Regime
    stats: list | None = None  # per-layer LayerStats; None for a method that needs none
    progress: Progress = no_progress  # where the steps report how far they are
    batch: int | str = 1  # held-out windows per pass in the fit's searches: a number or "auto"

    @classmethod
    def of(cls, loaded: LoadedModel, name: str, spec, seed: int, regime: Regime,
           progress: Progress = no_progress, batch: int | str = 1) -> "JobContext":
        return cls(loaded, model_id(loaded, name), spec, seed, regime, progress=progress, batch=batch)

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def shape(self) -> ModelShape:
        return model_shape(self.loaded.model)

    def with_stats(self, stats: list | None, spec=None) -> "JobContext":
        return replace(self, stats=stats, spec=self.spec if spec is None else spec)
