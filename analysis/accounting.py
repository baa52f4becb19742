"""The second accounting beside the headline (docs/methods.md §0): end-of-sequence bits and
static bytes.

- **End-of-sequence bpd** (``bpd.end_k``/``end_v``; per task ``bpd.by_task.<task>.end_k/v``): what
  the cache holds after the last scored position, the task's peak cache memory. The headline, the
  mean over the scored positions (``measured_k``/``measured_v``), stays the ranking figure; the end
  figure is shown beside it, ``measured / end``.
- **Static bytes** (``static_bytes``): the per-model constants a method fitted (projections,
  steps, signs, means), which bpd does not count. Shown in MiB with the tokens × batch T·B from
  which they are under 1% of the cache: T·B > 100 · static / cache bytes per token, where a token
  of the cache holds (end_K + end_V) · L·H_kv·d / 8 bytes. Result files do not record the model's
  shape L·H_kv·d; it comes from ``naming.MODEL_SHAPES`` (the models of conf/model/).

Decisions where docs/methods.md is silent:

- a row's figures are means over its runs that record them (the seeds of a variant); the static
  bytes of one budget differ between seeds by a few percent (fitted ranks and steps);
- the T·B threshold uses the row's mean end-of-sequence bits, is rounded up to two significant
  digits (so the static bytes are under 1% at the figure shown) and reads "any" for a method with
  no static bytes;
- MiB are shown with two decimals, "< 0.01" below that (a few hundred bytes for TurboQuant's
  seeds).
"""

from __future__ import annotations

import math
import statistics

from analysis.cells import UNSUPPORTED, Cell, mean_cell, status_marker
from analysis.naming import kv_elements_per_token

MIB = 2 ** 20
#: the static bytes' share of the cache the threshold is about
STATIC_SHARE = 0.01
UNKNOWN = "?"


def present_mean(values) -> float:
    """Mean of the values that are numbers (NaN when none is)."""
    present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return statistics.fmean(present) if present else math.nan


def cache_bytes_per_token(model: str, bits_k: float, bits_v: float) -> float:
    """Bytes one token of the cache holds at ``bits_k`` + ``bits_v`` bits per element (NaN when
    the model's shape is not known)."""
    elements = kv_elements_per_token(model)
    if elements is None:
        return math.nan
    return (bits_k + bits_v) * elements / 8


def static_under_share(static_bytes: float, cache_bytes: float) -> float:
    """Tokens × batch from which ``static_bytes`` are under 1% of a cache of ``cache_bytes`` per
    token (0 without static bytes, NaN when either is unknown)."""
    if static_bytes == 0:
        return 0.0
    if not (math.isfinite(static_bytes) and math.isfinite(cache_bytes)) or cache_bytes <= 0:
        return math.nan
    return static_bytes / (STATIC_SHARE * cache_bytes)


def fmt_mib(static_bytes: float) -> str:
    """``"1.43"``, ``"< 0.01"``, ``"0"`` (MiB), ``"?"`` when not recorded."""
    if math.isnan(static_bytes):
        return UNKNOWN
    if static_bytes == 0:
        return "0"
    mib = static_bytes / MIB
    return f"{mib:.2f}" if mib >= 0.005 else "< 0.01"


def fmt_tokens(tokens: float) -> str:
    """A T·B threshold rounded up to two significant digits: ``"11k"``, ``"1.1M"``, ``"880"``,
    ``"any"`` (0), ``"?"`` (unknown)."""
    if math.isnan(tokens):
        return UNKNOWN
    if tokens == 0:
        return "any"
    digits = max(0, math.floor(math.log10(tokens)) - 1)
    up = math.ceil(tokens / 10 ** digits - 1e-9) * 10 ** digits
    for size, suffix in ((10 ** 6, "M"), (10 ** 3, "k")):
        if up >= size:
            return f"{up / size:.2g}{suffix}" if up < 10 * size else f"{up // size:.0f}{suffix}"
    return f"{up:.0f}"


def pair_cell(statuses: list[str], measured: list[float], end: list[float]) -> Cell:
    """``"4.86 / 3.00"``: the mean headline and end-of-sequence figures (``mean_cell``'s markers
    when there is no headline; ``"?"`` for an end figure no run records)."""
    cell = mean_cell(statuses, measured)
    if cell.mean is None:
        return cell
    last = present_mean(end)
    return Cell(f"{cell.text} / {UNKNOWN if math.isnan(last) else f'{last:.2f}'}", cell.mean,
                None, cell.n)


def static_cells(statuses: list[str], model: str, static: list[float], end_k: list[float],
                 end_v: list[float]) -> tuple[Cell, Cell]:
    """(static MiB, T·B from which they are under 1% of the cache) of one row."""
    if status_marker(statuses) == UNSUPPORTED:
        return Cell(UNSUPPORTED), Cell(UNSUPPORTED)
    size = present_mean(static)
    tokens = static_under_share(size, cache_bytes_per_token(model, present_mean(end_k),
                                                             present_mean(end_v)))
    return (Cell(fmt_mib(size), None if math.isnan(size) else size / MIB),
            Cell(fmt_tokens(tokens), None if math.isnan(tokens) else tokens))


def static_note(with_unknown: bool) -> str:
    """What the static columns say (and what "?" means in them when ``with_unknown``)."""
    note = ("static MiB = the per-model constants the method fitted (result field static_bytes: "
            "projections, steps, signs, means), not in bpd (docs/methods.md §0), mean over runs; "
            "static < 1% from T·B = the tokens × batch from which they are under 1% of the cache, "
            "T·B > 100 × static bytes / ((end bpd_K + end bpd_V) × L·H_kv·d / 8), rounded up "
            "(any = no static bytes).")
    if with_unknown:
        note += (" ? = not recorded in the result files (or a model whose L·H_kv·d "
                 "analysis/naming.py does not know).")
    return note
