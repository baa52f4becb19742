"""Job identity: a stable hash of what a job computes.

A job's identity is the SHA-256 of its resolved config with the keys that cannot change its
result removed: where it writes (``hydra.*``, output paths), whether to redo it (``rerun``), how it
is tracked (``wandb.*``), how many items run at a time (``task.batch_size``: a batch gives what its
rows give alone, docs/design.md §2.1), which kernel runs H2O's recursion (``method.fused``: the
Triton form gives the torch loop's kept sets and outputs, tests/test_h2o_fused.py) and pure labels (``experiment``, ``main_row``, ``ablation_row``,
``frontier_row``, ``ruler_row``, ``baseline_row``: the rows of conf/experiment/* only select other
keys, which are hashed themselves). Everything else —
model, method and its options, budgets, seed, tasks, limits, protocol and calibration settings,
input data paths, device — is part of it. The hash is stored in ``result.json`` as ``job_id``; a
rerun of a sweep skips a job whose result is finished (``ok``, ``unsupported``, ``diverged``) *and*
carries the same ``job_id``, so a job whose config changed since (a new method default, another
limit) is redone rather than silently reused.

Numbers are normalized before hashing (``bpd=1`` on the command line and ``bpd: 1.0`` in a YAML
are the same job); key order never matters.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .results import FINISHED

#: top-level keys left out of the identity (they do not change what the job computes)
EXCLUDED_KEYS = frozenset({"hydra", "rerun", "wandb", "experiment", "main_row", "ablation_row",
                           "frontier_row", "ruler_row", "baseline_row"})
#: keys inside a section left out of the identity (section, key)
EXCLUDED_NESTED = (("task", "batch_size"), ("method", "fused"))
ID_LENGTH = 16


def _normalize(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _normalize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_normalize(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float)):
        return float(obj)  # 1 == 1.0: the same budget whether typed or read from YAML
    return str(obj)


def identity_config(cfg: DictConfig | Mapping) -> dict:
    """The part of a (resolved) config that determines the job's result."""
    out = {}
    for key in cfg:
        if key in EXCLUDED_KEYS:  # dropped before resolving: hydra.* may not resolve outside a run
            continue
        value = cfg[key]
        out[key] = _normalize(OmegaConf.to_container(value, resolve=True)
                              if OmegaConf.is_config(value) else value)
    for section, key in EXCLUDED_NESTED:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def job_id(cfg: DictConfig | Mapping) -> str:
    """A 16-hex-digit hash of :func:`identity_config`; equal configs give equal ids."""
    blob = json.dumps(identity_config(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:ID_LENGTH]


def is_done(prior: Mapping | None, jid: str) -> bool:
    """Is ``prior`` (a parsed result.json or None) a finished result of this very job?"""
    return (
        isinstance(prior, Mapping)
        and prior.get("status") in FINISHED
        and prior.get("job_id") == jid
    )
