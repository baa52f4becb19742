"""Which runs form one table row (a "variant"), duplicate seeds, and the main/ablation split.

A variant is everything that makes two runs comparable seeds of one configuration: model,
method, target K/V budget, the method's options (``config.method.*``) and the protocol settings
in EXTRA_OPTION_COLUMNS (limit, PPL track/seqlen/limit, calibration set). Runs of one variant
differ only by seed; a row label names the settings that tell its variants apart. Options a run
does not record take the method's default (naming.DEFAULT_OPTIONS) when one is known.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from analysis.load import warn
from analysis.naming import DEFAULT_OPTIONS, FP16_BITS, SPLIT_ABLATION_METHODS, method_name

METHOD_PREFIX = "config.method."
IGNORED_METHOD_KEYS = {"name", "_target_"}
# Protocol settings outside config.method that make runs incomparable (short label on the right).
EXTRA_OPTION_COLUMNS = {
    "config.limit": "limit",
    "config.task.ppl.track": "ppl_track",
    "config.task.ppl.seqlen": "seqlen",
    "config.task.ppl.limit": "ppl_limit",
    "config.calibration.dataset": "calib",
    # the long-context protocol (docs/methods.md §9.5): query-aware and query-agnostic rows differ
    "config.task.ruler.query_aware": "ruler_query_aware",
    "config.task.longbench.query_aware": "longbench_query_aware",
}


def is_missing(value: Any) -> bool:
    """None or a float NaN (how pandas fills a column a run does not have)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def option_columns(frame: pd.DataFrame) -> dict[str, str]:
    """Frame column -> short option name, for every column that distinguishes variants."""
    cols = {c: c[len(METHOD_PREFIX):] for c in frame.columns
            if c.startswith(METHOD_PREFIX) and c[len(METHOD_PREFIX):] not in IGNORED_METHOD_KEYS}
    cols.update({c: name for c, name in EXTRA_OPTION_COLUMNS.items() if c in frame.columns})
    return cols


def run_options(row: pd.Series, columns: dict[str, str]) -> dict[str, Any]:
    """The options of one run, missing ones replaced by the method's known default (else None)."""
    defaults = DEFAULT_OPTIONS.get(row["method"], {})
    return {name: (defaults.get(name) if is_missing(row[col]) else row[col])
            for col, name in columns.items()}


def deviations(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options whose values differ from the method's ablation defaults (c2, rotation)."""
    defaults = DEFAULT_OPTIONS.get(method, {})
    return {k: options.get(k, v) for k, v in defaults.items() if options.get(k, v) != v}


def add_variants(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``options`` (dict per run) and ``variant`` (a string id) columns to a copy of frame."""
    frame = frame.copy()
    columns = option_columns(frame)
    options = [run_options(row, columns) for _, row in frame.iterrows()]
    frame["options"] = pd.Series(options, index=frame.index, dtype=object)
    frame["variant"] = [
        json.dumps([row.model, row.method, row.target_k, row.target_v, opts],
                   sort_keys=True, default=str)
        for row, opts in zip(frame.itertuples(), options)
    ]
    return frame


def drop_duplicate_seeds(frame: pd.DataFrame) -> pd.DataFrame:
    """Keep one run per (variant, seed): the last in source order (the newest Hydra directory).

    Each dropped run is named in a warning. Runs without a seed are never merged.
    """
    keep = []
    last: dict[tuple, int] = {}
    for pos, row in enumerate(frame.itertuples()):
        if is_missing(row.seed):
            keep.append(pos)
            continue
        key = (row.variant, str(row.seed))
        if key in last:
            warn(f"duplicate run ({row.model}, {row.method}, seed {row.seed}): using "
                 f"{row.source}, ignoring {frame.iloc[last[key]].source}")
        last[key] = pos
    keep.extend(last.values())
    return frame.iloc[sorted(keep)]


def is_split(target_v: float) -> bool:
    """True when the run sets its own value budget (a K/V split), False for K-only (V at 16)."""
    return not (is_missing(target_v) or target_v == FP16_BITS)


def experiment_of(frame: pd.DataFrame) -> pd.Series:
    """``config.experiment`` per run (None where absent)."""
    if "config.experiment" not in frame.columns:
        return pd.Series([None] * len(frame), index=frame.index, dtype=object)
    return frame["config.experiment"].map(lambda v: None if is_missing(v) else v)


def has_deviation(frame: pd.DataFrame) -> pd.Series:
    """Per run: does it change an ablation option (c2, rotation) from its default?"""
    return pd.Series([bool(deviations(m, o)) for m, o in zip(frame["method"], frame["options"])],
                     index=frame.index, dtype=bool)


def select_main(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Runs for the main table: not tagged ``experiment=ablation``, default c2/rotation.

    Returns the selection and the number of runs left out.
    """
    keep = (experiment_of(frame) != "ablation") & ~has_deviation(frame)
    return frame[keep], int((~keep).sum())


def select_ablation(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs for the ablation table.

    Taken: runs tagged ``experiment=ablation``; K/V splits of KV-COBRA and KQ-SVD; runs with a
    non-default c2/rotation; and, as the reference, default runs of the same model, method and
    budget as such an ablated run.
    """
    split = frame["method"].isin(SPLIT_ABLATION_METHODS) & frame["target_v"].map(is_split)
    deviated = has_deviation(frame)
    ablated_budgets = {(r.model, r.method, r.target_k, r.target_v)
                       for r in frame[deviated].itertuples()}
    reference = pd.Series([(r.model, r.method, r.target_k, r.target_v) in ablated_budgets
                           for r in frame.itertuples()], index=frame.index, dtype=bool)
    keep = (experiment_of(frame) == "ablation") | split | deviated | reference
    return frame[keep]


def distinguishing_options(option_dicts: list[dict[str, Any]]) -> list[str]:
    """Option names whose values differ among the given variants, sorted."""
    keys = sorted({k for opts in option_dicts for k in opts})
    return [k for k in keys if len({json.dumps(o.get(k), default=str) for o in option_dicts}) > 1]


def options_sort_key(options: dict[str, Any]) -> tuple:
    """Order variants by option values, numbers numerically (R=32 before R=128)."""
    def value_key(value: Any) -> tuple:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (0, float(value), "")
        return (1, 0.0, json.dumps(value, default=str))
    return tuple((k, value_key(options[k])) for k in sorted(options))


def describe_options(options: dict[str, Any], keys: list[str]) -> str:
    """``"R=32, limit=8"`` for the given option names."""
    return ", ".join(f"{k}={options.get(k)}" for k in keys)


def line_label(method: str, options: dict, keys: list[str]) -> str:
    """A line's legend label: the method's name and the options that tell its variants apart;
    a composition is named by its parts, ``SnapKV∘KIVI`` (docs/methods.md §12)."""
    if method == "compose" and options.get("evict") and options.get("codec"):
        name = f"{method_name(options['evict'])}∘{method_name(options['codec'])}"
        # an option a composition does not set tells it apart from nothing: the label skips it
        keys = [k for k in keys if k not in ("evict", "codec") and options.get(k) is not None]
    else:
        name = method_name(method)
    return name + (f" ({describe_options(options, keys)})" if keys else "")
