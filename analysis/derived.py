"""Per-run quantities computed from the stored metrics: the PPL means over chosen datasets."""

from __future__ import annotations

import math

import pandas as pd

from analysis.load import warn


def parse_datasets(text: str) -> list[str]:
    """``"wikitext2,ptb,c4"`` -> ``["wikitext2", "ptb", "c4"]`` (blanks dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _means(values: list[float]) -> tuple[float, float]:
    arith = math.fsum(values) / len(values)
    if all(v > 0 for v in values):
        geo = math.exp(math.fsum(math.log(v) for v in values) / len(values))
    else:
        geo = math.nan
    return arith, geo


def add_ppl_summaries(frame: pd.DataFrame, datasets: list[str], partial: bool = False
                      ) -> pd.DataFrame:
    """Add ``ppl_mean`` (arithmetic, the seed's convention), ``ppl_gmean`` and ``ppl_used``.

    Each run is averaged over ``datasets`` (columns ``ppl_<name>``). A run missing any of them
    gets NaN, unless ``partial``: then the mean is over the datasets it has and ``ppl_used`` lists
    them. A dataset that no run reports is named in a warning.
    """
    frame = frame.copy()
    absent = [d for d in datasets if f"ppl_{d}" not in frame.columns
              or frame[f"ppl_{d}"].isna().all()]
    if absent:
        have = sorted(c[4:] for c in frame.columns
                      if c.startswith("ppl_") and frame[c].notna().any())
        warn(f"no run reports ppl dataset(s) {', '.join(absent)} "
             f"(available: {', '.join(have) or 'none'}); choose with --ppl-datasets")
    arith, geo, used = [], [], []
    for _, row in frame.iterrows():
        present = [d for d in datasets
                   if f"ppl_{d}" in frame.columns and not math.isnan(row[f"ppl_{d}"])]
        if present and (partial or len(present) == len(datasets)):
            a, g = _means([row[f"ppl_{d}"] for d in present])
        else:
            a, g = math.nan, math.nan
        arith.append(a)
        geo.append(g)
        used.append(",".join(present))
    frame["ppl_mean"] = pd.Series(arith, index=frame.index, dtype=float)
    frame["ppl_gmean"] = pd.Series(geo, index=frame.index, dtype=float)
    frame["ppl_used"] = pd.Series(used, index=frame.index, dtype=object)
    return frame
