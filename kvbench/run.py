"""Hydra entry point: ``python -m kvbench.run [-m] KEY=VALUE ...`` (docs/design.md §4).

One job = model × method × budget × seed (see :mod:`kvbench.job`); ``-m`` sweeps over
comma-separated values. Outputs go under ``runs/`` (sweeps: ``runs/<date>_<time>/<overrides>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .job import run_job
from .store.logs import quiet_libraries


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
