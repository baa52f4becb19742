"""Read run results (result.json files, docs/design.md §4) into one pandas DataFrame, one row per run.

Columns of the frame:

- ``source`` (the file, or ``wandb:ENTITY/PROJECT/ID``), ``status``, ``error``, ``model``,
  ``method``, ``seed``, ``not_applicable`` (comma-joined tasks of the result's
  ``unsupported_tasks``: an ok run where the method cannot run that task, e.g. SnapKV's PPL in
  track A);
- ``target_k``, ``target_v``, ``measured_k``, ``measured_v`` (bits per element; a missing value
  budget means 16), ``bpd_k`` (= measured K) and ``bpd_kv`` (= mean of measured K and V). The
  measured figures are the result's headline figure (docs/methods.md §0);
- the rest of the ``bpd`` block flattened with dots: ``bpd.end_k``, ``bpd.convention``,
  ``bpd.by_task.ppl.measured_k``, ... (absent in result files older than convention v2);
- ``zeroshot.split.<task>``, ``zeroshot.metric.<task>``, ``zeroshot.source`` (the text fields of
  the zero-shot block) and the result's ``counts`` as ``counts.*`` (``counts.ppl_track``, ...);
- one column per numeric metric, named ``GROUP_KEY``: ``ppl_wikitext2``, ``zeroshot_avg``,
  ``zeroshot_acc_norm_piqa``, ``longbench_avg``, ``longbench_qasper``, ``longqa_squad_f1``, ...;
- the resolved config flattened with dots (``config.method.c2``, ``config.v_bpd``,
  ``config.experiment``) and the timings (``timings.eval_s``).

Malformed files (invalid or truncated JSON, a wrong top-level type, missing required keys, an
unknown status) are skipped with a warning on stderr that names the file.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from analysis.naming import FP16_BITS

RESULT_FILE = "result.json"
STATUSES = ("ok", "unsupported", "diverged", "failed")
REQUIRED_KEYS = ("status", "model", "method")
BUDGET_COLUMNS = ["target_k", "target_v", "measured_k", "measured_v", "bpd_k", "bpd_kv"]
BASE_COLUMNS = {"source", "status", "error", "model", "method", "seed", "not_applicable",
                *BUDGET_COLUMNS}


class NoResultsError(Exception):
    """Raised when a source holds no usable run result."""


def warn(message: str) -> None:
    """Print a warning line on stderr (the CLI's only channel besides its output)."""
    print(f"warning: {message}", file=sys.stderr)


def find_result_files(runs_dir: Path) -> list[Path]:
    """All ``result.json`` files below ``runs_dir``, recursively, in sorted path order.

    Hydra output directories are named by date and time, so sorted order is chronological.
    """
    return sorted(p for p in Path(runs_dir).rglob(RESULT_FILE) if p.is_file())


def read_result(path: Path) -> dict | None:
    """Parse and validate one result file; on any problem warn (naming the file) and return None."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        warn(f"skipping {path}: not UTF-8 text")
        return None
    except OSError as exc:
        warn(f"skipping {path}: cannot read ({exc.strerror or exc})")
        return None
    if not text.strip():
        warn(f"skipping {path}: empty file")
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        warn(f"skipping {path}: invalid or truncated JSON ({exc.msg}; line {exc.lineno}, "
             f"column {exc.colno})")
        return None
    problem = validate_record(record)
    if problem:
        warn(f"skipping {path}: {problem}")
        return None
    return record


def validate_record(record: Any) -> str | None:
    """Why ``record`` is not a usable result (a short phrase), or None when it is."""
    if not isinstance(record, dict):
        return f"top level is a JSON {type(record).__name__}, expected an object"
    missing = [k for k in REQUIRED_KEYS if record.get(k) in (None, "")]
    if missing:
        return "missing " + ", ".join(f"'{k}'" for k in missing)
    if record["status"] not in STATUSES:
        return f"unknown status {record['status']!r} (expected one of {', '.join(STATUSES)})"
    for key in ("metrics", "bpd", "config"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"'{key}' is not an object"
    return None


def is_number(value: Any) -> bool:
    """True for int/float values (booleans excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of the metrics dict as ``group_key`` columns; other leaves are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten_metrics(value, name))
        elif is_number(value):
            out[name] = float(value)
    return out


def flatten_dotted(tree: dict, prefix: str) -> dict[str, Any]:
    """Nested dict -> ``prefix.a.b`` columns; lists become JSON text so every value is hashable."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.update(flatten_dotted(value, name))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def _number_or_nan(value: Any) -> float:
    return float(value) if is_number(value) else math.nan


def budget_columns(record: dict) -> dict[str, float]:
    """Target and measured bits per element (targets fall back to config.bpd / config.v_bpd)."""
    bpd = record.get("bpd") or {}
    config = record.get("config") or {}
    target_k = bpd.get("target_k", config.get("bpd"))
    target_v = bpd.get("target_v", config.get("v_bpd"))
    if target_k is None and record.get("method") == "fp16":
        target_k = FP16_BITS
    measured_k = _number_or_nan(bpd.get("measured_k"))
    measured_v = _number_or_nan(bpd.get("measured_v"))
    return {
        "target_k": _number_or_nan(target_k),
        "target_v": FP16_BITS if target_v is None else _number_or_nan(target_v),
        "measured_k": measured_k,
        "measured_v": measured_v,
        "bpd_k": measured_k,
        "bpd_kv": (measured_k + measured_v) / 2,
    }


def bpd_detail_columns(record: dict) -> dict[str, Any]:
    """The ``bpd`` block beyond the four budget columns, as ``bpd.*`` columns.

    ``bpd.end_k``/``bpd.end_v`` (end-of-sequence figure), ``bpd.convention`` and, per task,
    ``bpd.by_task.<task>.{measured_k,measured_v,end_k,end_v,convention}``. Old result files have
    none of them; readers fall back to ``measured_k``/``measured_v`` (see analysis.budget).
    """
    bpd = record.get("bpd") or {}
    extra = {k: v for k, v in bpd.items() if k not in ("target_k", "target_v", "measured_k",
                                                        "measured_v")}
    flat = flatten_dotted(extra, "bpd")
    return {k: float(v) if is_number(v) else v for k, v in flat.items()}


def zeroshot_text_columns(metrics: dict) -> dict[str, Any]:
    """The zero-shot block's text fields (split and headline metric per task, data source).

    flatten_metrics keeps numbers only; the table notes need these (docs/methods.md §9.2).
    """
    zeroshot = metrics.get("zeroshot")
    if not isinstance(zeroshot, dict):
        return {}
    out: dict[str, Any] = {}
    for key in ("split", "metric"):
        if isinstance(zeroshot.get(key), dict):
            out.update({f"zeroshot.{key}.{task}": value for task, value in zeroshot[key].items()
                        if isinstance(value, str)})
    if isinstance(zeroshot.get("source"), str):
        out["zeroshot.source"] = zeroshot["source"]
    return out


# The generation protocol of each long-context block (docs/methods.md §9.5)
def protocol_columns(metrics: dict) -> dict[str, Any]:
    """``<block>.protocol`` (query_aware / query_agnostic) of each metric block that records one."""
    return {f"{name}.protocol": block["protocol"] for name, block in metrics.items()
            if isinstance(block, dict) and isinstance(block.get("protocol"), str)}


def flatten_record(record: dict, source: str) -> dict[str, Any]:
    """One validated record -> one flat row (see the module docstring for the columns)."""
    config = record.get("config") or {}
    seed = record.get("seed", config.get("seed"))
    row: dict[str, Any] = {
        "source": source,
        "status": record["status"],
        "error": record.get("error"),
        "model": str(record["model"]),
        "method": str(record["method"]),
        "seed": seed,
        "not_applicable": ",".join(sorted(record.get("unsupported_tasks") or {})),
    }
    row.update(budget_columns(record))
    row.update(bpd_detail_columns(record))
    row["static_bytes"] = _number_or_nan(record.get("static_bytes"))
    metrics = record.get("metrics") or {}
    row.update(flatten_metrics(metrics))
    row.update(zeroshot_text_columns(metrics))
    row.update(protocol_columns(metrics))
    counts = record.get("counts")
    if isinstance(counts, dict):
        row.update(flatten_dotted(counts, "counts"))
    row.update(flatten_dotted(config, "config"))
    timings = record.get("timings") or {}
    if isinstance(timings, dict):
        row.update({f"timings.{k}": float(v) for k, v in timings.items() if is_number(v)})
    return row


def records_to_frame(records: Iterable[tuple[str, dict]]) -> pd.DataFrame:
    """``(source, record)`` pairs -> the runs DataFrame (columns in first-seen order)."""
    rows = [flatten_record(record, source) for source, record in records]
    if not rows:
        raise NoResultsError("no usable run results")
    # object dtype keeps config values as Python objects (None stays None, no string dtype);
    # budgets, metrics and timings are then made float (missing -> NaN).
    frame = pd.DataFrame(rows, dtype=object)
    numeric = BUDGET_COLUMNS + metric_columns(frame) + [
        c for c in frame.columns if c.startswith("timings.") or is_bpd_number_column(frame, c)]
    return frame.astype({c: float for c in numeric})


def is_bpd_number_column(frame: pd.DataFrame, column: str) -> bool:
    """``bpd.end_k``, ``bpd.by_task.ppl.measured_v``, ...: bpd-block columns holding only numbers
    (a field a writer sets to null in some runs counts; text fields such as the convention not)."""
    if not column.startswith("bpd."):
        return False
    present = [v for v in frame[column] if v is not None]
    return bool(present) and all(is_number(v) for v in present)


def metric_columns(frame: pd.DataFrame) -> list[str]:
    """The metric columns of a runs frame (flattened metric names never contain a dot)."""
    return [c for c in frame.columns if "." not in c and c not in BASE_COLUMNS]


def load_runs_dir(runs_dir: str | Path) -> pd.DataFrame:
    """Every valid ``result.json`` below ``runs_dir`` as the runs DataFrame.

    Raises FileNotFoundError / NotADirectoryError for a bad path and NoResultsError when the
    directory holds no result file or none that parses.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.exists():
        raise FileNotFoundError(f"runs directory '{runs_dir}' does not exist")
    if not runs_dir.is_dir():
        raise NotADirectoryError(f"'{runs_dir}' is not a directory")
    paths = find_result_files(runs_dir)
    if not paths:
        raise NoResultsError(f"no {RESULT_FILE} found under '{runs_dir}'")
    records = [(str(p), r) for p in paths if (r := read_result(p)) is not None]
    if not records:
        raise NoResultsError(f"none of the {len(paths)} {RESULT_FILE} files under '{runs_dir}' "
                             "could be read (see the warnings above)")
    return records_to_frame(records)
