"""What a task reports while it runs: the measured bpd of its calls so far, for the job's
:data:`~kvbench.context.Progress` callback, and the bits each generated item read, for its record.

Both pool ``lm.readings`` with :func:`kvbench.model.compressed_lm.summarize_readings`, the rule a
task's own measured bpd follows (docs/methods.md §0: weighted by scored positions). Stand-in
models of the tests have no ``readings``: nothing is reported for them.
"""

from __future__ import annotations

import contextlib
import math

from ..context import Progress, no_progress
from ..model.compressed_lm import summarize_readings


def mark(lm) -> int:
    """Where the readings of the calls to come start."""
    return len(getattr(lm, "readings", None) or ())


def bpd_since(lm, start: int) -> dict:
    """``{"bpd_k", "bpd_v"}``: the measured bpd pooled over ``lm``'s readings from ``start`` on
    (bits per element); ``{}`` when there are none."""
    readings = getattr(lm, "readings", None)
    return _bpd(summarize_readings(readings[start:]) if readings else None)


@contextlib.contextmanager
def readings_in_order(lm, n: int):
    """``with readings_in_order(lm, n) as place:`` — ``place(i)`` marks the next of ``lm``'s
    readings appended since the block began (in the order they were appended) as item ``i``'s;
    on the way out the readings of the ``n`` items are put in item order, as if the items had run
    one by one (a batch runs them in another order)."""
    readings = getattr(lm, "readings", None)
    start, placed = mark(lm), {}

    def place(i: int) -> None:
        if readings is not None:
            placed[i] = readings[start + len(placed)]

    yield place
    if readings is not None and len(placed) == n == len(readings) - start:
        readings[start:] = [placed[i] for i in range(n)]


def reading_bpd(reading) -> dict:
    """``{"bpd_k", "bpd_v"}`` of one call's reading (``{}`` for None)."""
    return _bpd(summarize_readings([reading]) if reading is not None else None)


def _bpd(pooled: dict | None) -> dict:
    return {} if pooled is None else {"bpd_k": pooled["measured_k"], "bpd_v": pooled["measured_v"]}


class RunningBpd:
    """The measured bpd pooled over ``lm``'s readings since this object was made, updated from the
    readings added since the last call (so that a report per request stays O(1))."""

    def __init__(self, lm):
        self.lm, self.seen = lm, mark(lm)
        self.bits_k = self.bits_v = 0.0
        self.positions = 0

    def values(self) -> dict:
        """``{"bpd_k", "bpd_v"}`` so far, or ``{}`` before the first reading."""
        readings = getattr(self.lm, "readings", None)
        if readings and len(readings) > self.seen:
            new = summarize_readings(readings[self.seen:])
            self.seen = len(readings)
            self.bits_k += new["measured_k"] * new["scored_positions"]
            self.bits_v += new["measured_v"] * new["scored_positions"]
            self.positions += new["scored_positions"]
        if not self.positions:
            return {}
        return {"bpd_k": self.bits_k / self.positions, "bpd_v": self.bits_v / self.positions}


def percent(fraction: float | None) -> float | None:
    """A score in [0, 1] on the progress scale (percent, 0-100)."""
    return None if fraction is None else 100.0 * float(fraction)


def exp(x: float) -> float:
    """``math.exp`` that gives inf rather than raising on overflow (a diverged method's NLL must
    not fail the job through its progress report)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def item_progress(lm, section: str, progress: Progress):
    """``report(records)`` after each generated item: a point of ``section`` at the items done,
    with the running F1 and the item's (percent), its prompt tokens and the running measured bpd
    (the generation tasks' records carry ``f1`` in [0, 1] and ``prompt_tokens``)."""
    if progress is no_progress:
        return lambda records: None
    bpd = RunningBpd(lm)

    def report(records: list[dict]) -> None:
        last = records[-1]
        progress(section, len(records), f1=100.0 * sum(r["f1"] for r in records) / len(records),
                 item_f1=100.0 * last["f1"], prompt_tokens=last["prompt_tokens"], **bpd.values())

    return report
