"""Weighted 1-D k-means for KVQuant's non-uniform signposts (Hooper et al., arXiv 2401.18079, §3.2
Eq. 7: centroids minimizing the Fisher-weighted squared error; the official code runs sklearn
``KMeans(n_clusters=2^b, random_state=0, n_init="auto", max_iter=50)`` with ``sample_weight``).
Our own Lloyd iteration in float64: docs/methods.md §14.2."""

from __future__ import annotations

import torch

KMEANS_ITERS = 50  # official KMeans(max_iter=50)
KMEANS_TOL = 1e-4  # sklearn's default tol, relative to the data variance


INIT_BINS = 2048  # histogram bins of the k-means initialization


def companding_init(xs: torch.Tensor, ws: torch.Tensor, k: int, bins: int = INIT_BINS) -> torch.Tensor:
    """k starting centroids for sorted points ``xs`` with weights ``ws``: the (i + 1/2)/k quantiles
    of the point density p^(1/3) (Bennett 1948 / Panter-Dite 1951: the high-resolution optimal
    quantizer's point density), from a weighted histogram of ``bins`` equal bins over [min, max],
    linear within a bin."""
    lo, hi = float(xs[0]), float(xs[-1])
    if not hi > lo:
        return xs.new_full((k,), lo)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    hist = torch.zeros(bins, dtype=torch.float64).index_add_(0, torch.bucketize(xs, edges[1:-1], right=True), ws)
    cum = torch.cat([hist.new_zeros(1), (hist.clamp(min=0) ** (1 / 3)).cumsum(0)])
    targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k * cum[-1]
    j = (torch.searchsorted(cum, targets, right=True) - 1).clamp_(0, bins - 1)
    frac = (targets - cum[j]) / (cum[j + 1] - cum[j]).clamp(min=1e-300)
    return edges[j] + frac.clamp(0, 1) * (edges[j + 1] - edges[j])


def kmeans_1d(x: torch.Tensor, k: int, weight: torch.Tensor | None = None,
              iters: int = KMEANS_ITERS, tol: float = KMEANS_TOL) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) of ``x`` [M] into ``k`` sorted centroids, float64.

    Points are sorted once; each iteration assigns the contiguous runs between centroid midpoints
    (a point on a midpoint goes to the lower centroid, as :func:`nearest_codes`) and moves each
    centroid to its run's weighted mean from prefix sums (an empty run keeps its centroid). Init:
    :func:`companding_init`. Stops when the assignment no longer changes or the summed squared
    centroid shift is <= tol * var(x) (sklearn's rule), after at most ``iters`` rounds."""
    if x.numel() == 0:
        raise ValueError("k-means needs at least one calibration element")
    xs, order = x.to(torch.float64).reshape(-1).sort()
    ws = torch.ones_like(xs) if weight is None else weight.to(torch.float64).reshape(-1)[order]
    if not bool(ws.sum() > 0):
        raise ValueError("k-means weights must have a positive sum")
    zero = xs.new_zeros(1)
    cw = torch.cat([zero, ws.cumsum(0)])
    cwx = torch.cat([zero, (ws * xs).cumsum(0)])
    centers = companding_init(xs, ws, k)
    bound = tol * float(xs.var(unbiased=False)) if xs.numel() > 1 else 0.0
    edges = None
    for _ in range(iters):
        mids = (centers[:-1] + centers[1:]) / 2
        cut = torch.searchsorted(xs, mids, right=True)
        new_edges = torch.cat([cut.new_zeros(1), cut, cut.new_full((1,), xs.numel())])
        if edges is not None and torch.equal(new_edges, edges):
            break
        edges = new_edges
        w = cw[edges[1:]] - cw[edges[:-1]]
        wx = cwx[edges[1:]] - cwx[edges[:-1]]
        moved = torch.where(w > 0, wx / torch.where(w > 0, w, 1.0), centers).sort().values
        shift = float(((moved - centers) ** 2).sum())
        centers = moved
        if shift <= bound:
            break
    return centers

