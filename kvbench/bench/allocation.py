"""§2 of ``python -m kvbench.bench``: KV-COBRA's C1 + C2 allocation time.

The timed region is what :meth:`methods.cobra.Cobra._calibrate_keys` times as ``alloc_ms``, plus
the prefix tables it starts from: ``prefix_terms`` -> ``c2_allocate`` (seed C2, 5 damped
iterations, largest-remainder rounding) -> ``c1_batch`` at the final budgets, for N heads with
synthetic decaying spectra (d = 128) at 1 bpd. Shapes: 256 heads (Llama-3.1-8B, Mistral-7B) and
112 heads (Qwen2.5-7B). Median of ``alloc_reps`` after a warm-up, with torch's thread count as it
is and with one thread. Target: under 10 ms (the paper reports 100-200 ms).
"""

from __future__ import annotations

import logging

import torch

from methods.cobra_alloc import c1_batch, c2_allocate, prefix_terms

from .common import Row, Sizes, decaying_spectra, median_time

log = logging.getLogger(__name__)

SHAPES = [(256, 128, "Llama-3.1-8B / Mistral-7B"), (112, 128, "Qwen2.5-7B")]
BPD = 1.0


def allocate(w: torch.Tensor, total_bits: int):
    tail, head = prefix_terms(w)
    budgets = c2_allocate(w, total_bits, qsum=head)
    return budgets, c1_batch(tail, head, budgets.to(torch.float64))


def run(sizes: Sizes) -> list[Row]:
    rows = []
    threads = torch.get_num_threads()
    for n, d, label in SHAPES:
        w = decaying_spectra(n, d, seed=n)
        total = int(BPD * n * d)
        budgets, (rank, _, _) = allocate(w, total)
        assert int(budgets.sum()) == total
        for nt in dict.fromkeys((threads, 1)):  # as-is, then 1 (once if already 1)
            torch.set_num_threads(nt)
            try:
                med, times = median_time(lambda: allocate(w, total), torch.device("cpu"), sizes.alloc_reps)
            finally:
                torch.set_num_threads(threads)
            log.info("allocation: %d heads, %d thread(s): %.2f ms", n, nt, med * 1e3)
            rows.append(Row(
                "allocation", f"C1+C2 {n} heads x d={d}, {nt} thread{'s' if nt > 1 else ''}", "time",
                med * 1e3, " ms", "<", 10.0, shown=f"{med * 1e3:.2f} ms",
                note=f"{label}; bpd {BPD:g}; mean rank {float(rank.double().mean()):.1f}",
                detail={"heads": n, "head_dim": d, "bpd": BPD, "threads": nt, "times_ms": [t * 1e3 for t in times]},
            ))
    return rows
