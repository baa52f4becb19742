"""KV-COBRA bit/rank allocation: C1 (per head), C2 (across heads), the exact reference solver.

METHODS.md §5.3-§5.5, seed-literal defaults, §5.11 fixes as switches. Every function is vectorized
over heads: a head is described by two prefix tables over the rank r = 0..d,

* ``tail[h, r] = sum_{i > r} w_i`` (truncation term; w sorted descending), and
* ``qsum[h, r]`` the factor of q(b) in the quantization term: ``sum_{i <= r} w_i`` as written in the
  seed, or (``kl_term="rotated"``, §5.11b) ``sigma_bar^2(r) * sum_{i <= r} sigma_Q,i^2``,

so that D(r, B) = tail[r] + q(B / r) qsum[r] (§5.3). ``q_model="seed"``: q(b) = 2^(-2b)/12;
``"gauss"`` (§5.11a): the MSE column of §1.1, linearly interpolated between integer bits, which is
exactly the realized mean_j e(b_j) of the §5.5 split (a fraction f = b - floor(b) of the coordinates
gets floor(b) + 1 bits).
"""

from __future__ import annotations

import torch

from .gaussquant import MAX_BITS, gaussian_mse

B_MIN_BITS = 2
B_MAX_BITS = 8


def q_seed(b: torch.Tensor) -> torch.Tensor:
    """The seed's quantization-noise model q(b) = 2^(-2b) / 12 (per unit weight)."""
    return torch.exp2(-2.0 * b) / 12.0


def q_gauss(b: torch.Tensor) -> torch.Tensor:
    """§1.1 Gaussian MSE per unit variance, linear between integer bits (= realized §5.5 split)."""
    table = torch.tensor([gaussian_mse(k) for k in range(MAX_BITS + 2)], dtype=torch.float64, device=b.device)
    b = b.to(torch.float64).clamp(0, MAX_BITS)
    lo = torch.floor(b).long()
    frac = b - lo
    return (1.0 - frac) * table[lo] + frac * table[lo + 1]


Q_MODELS = {"seed": q_seed, "gauss": q_gauss}


def prefix_terms(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tail, head) [H, d+1] of weights [H, d] (sorted descending): sum_{i>r} w_i, sum_{i<=r} w_i."""
    w = w.to(torch.float64)
    head = torch.nn.functional.pad(torch.cumsum(w, -1), (1, 0))
    return head[..., -1:] - head, head


def rank_grid(d: int, rank_step: int = 2, device=None) -> torch.Tensor:
    """Candidate ranks {step, 2 step, ...} <= d."""
    return torch.arange(rank_step, d + 1, rank_step, device=device)


def budget_range(d: int, b_min: int = B_MIN_BITS, b_max: int = B_MAX_BITS, rank_step: int = 2) -> tuple[int, int]:
    """(B_min, B_max) per head: rank_step * b_min = 4 and r_max * b_max = d * 8 at the defaults."""
    return rank_step * b_min, int(rank_grid(d, rank_step)[-1]) * b_max


def c1_batch(
    tail: torch.Tensor,
    qsum: torch.Tensor,
    budget: torch.Tensor,
    *,
    b_min: int = B_MIN_BITS,
    b_max: int = B_MAX_BITS,
    rank_step: int = 2,
    q_model: str = "seed",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C1 for every head at once. ``tail``/``qsum`` [H, d+1]; ``budget`` [H] or [H, K] (real bits).

    Returns (rank, mean_bits, distortion) shaped like ``budget``: brute force over even r with
    B/b_max <= r <= min(d, B/b_min); ties go to the smaller r; B < rank_step*b_min gives r = 0,
    D = sum_i w_i."""
    d = tail.shape[-1] - 1
    ranks = rank_grid(d, rank_step, tail.device)
    squeeze = budget.dim() == 1
    bud = budget.to(torch.float64)
    bud = bud[:, None] if squeeze else bud  # [H, K]
    rf = ranks.to(torch.float64)
    bbar = bud[..., None] / rf  # [H, K, R]
    q = Q_MODELS[q_model](bbar)
    dist = tail[:, None, ranks] + q * qsum[:, None, ranks]
    feasible = (bbar >= b_min) & (bbar <= b_max)
    dist = torch.where(feasible, dist, torch.full_like(dist, float("inf")))
    best, idx = dist.min(-1)  # first minimum = smaller r on ties
    rank = ranks[idx]
    zero = ~feasible.any(-1)
    rank = torch.where(zero, torch.zeros_like(rank), rank)
    best = torch.where(zero, tail[:, :1].expand_as(best), best)
    mean_bits = torch.where(zero, torch.zeros_like(best), bud / rank.clamp(min=1))
    if squeeze:
        return rank[:, 0], mean_bits[:, 0], best[:, 0]
    return rank, mean_bits, best


def c1_search(
    w: torch.Tensor,
    budget_bits: float,
    b_min: int = B_MIN_BITS,
    b_max: int = B_MAX_BITS,
    rank_step: int = 2,
    q_model: str = "seed",
) -> tuple[int, float, float]:
    """C1 for one head: weights ``w`` [d] (non-negative, descending), budget B -> (r*, B/r*, D*)."""
    tail, head = prefix_terms(torch.as_tensor(w, dtype=torch.float64)[None])
    r, b, dist = c1_batch(
        tail, head, torch.tensor([float(budget_bits)], dtype=torch.float64),
        b_min=b_min, b_max=b_max, rank_step=rank_step, q_model=q_model,
    )
    return int(r[0]), float(b[0]), float(dist[0])


def _terms(w: torch.Tensor, qsum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    tail, head = prefix_terms(w)
    return tail, (head if qsum is None else qsum.to(torch.float64))


def renormalize(b: torch.Tensor, total: float, lo: float, hi: float) -> torch.Tensor:
    """Scale the unclamped entries so that sum = total, clamp to [lo, hi]; repeat until feasible."""
    b = b.clamp(lo, hi)
    for _ in range(4 * b.numel() + 10):
        free = (b > lo) & (b < hi)
        fixed = b[~free].sum()
        s_free = b[free].sum()
        if abs(float(b.sum()) - total) <= 1e-9 * max(total, 1.0) or not bool(free.any()) or s_free <= 0:
            break
        b = torch.where(free, b * (total - fixed) / s_free, b).clamp(lo, hi)
    if abs(float(b.sum()) - total) > 1e-6 * max(total, 1.0):
        # every head clamped (or scaling stuck): spread the rest in proportion to each head's room
        room = torch.where(b.sum() < total, hi - b, b - lo)
        b = b + torch.sign(total - b.sum()) * room * abs(total - float(b.sum())) / room.sum().clamp(min=1e-300)
    return b


def largest_remainder(b: torch.Tensor, total: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Round to integers in [lo, hi] keeping the sum: floors, then +1 to the largest remainders
    (lower index first on ties), or -1 to the smallest when float error made the floors overshoot."""
    hi = int(torch.ceil(b.max())) if hi is None else hi
    base = torch.floor(b + 1e-9).long().clamp(lo, hi)
    rem = b - base.to(b.dtype)
    short = int(total - base.sum())
    if short > 0:
        order = torch.sort(torch.where(base < hi, -rem, torch.full_like(rem, float("inf"))), stable=True).indices
        base[order[:short]] += 1
    elif short < 0:
        order = torch.sort(torch.where(base > lo, rem, torch.full_like(rem, float("inf"))), stable=True).indices
        base[order[:-short]] -= 1
    return base


def uniform_allocate(n_heads: int, total_bits: int, device=None) -> torch.Tensor:
    """'w/o C2': B_h = B_tot / N, rounded by largest remainder."""
    return largest_remainder(torch.full((n_heads,), total_bits / n_heads, dtype=torch.float64, device=device), total_bits)


def c2_allocate(
    w: torch.Tensor,
    total_bits: int,
    eta: float = 0.3,
    iters: int = 5,
    *,
    b_min: int = B_MIN_BITS,
    b_max: int = B_MAX_BITS,
    rank_step: int = 2,
    q_model: str = "seed",
    qsum: torch.Tensor | None = None,
) -> torch.Tensor:
    """C2 (§5.4): damped proportional updates B_h += eta B_bar (sqrt(D*_h / D_bar) - 1), clamped to
    [B_min, B_max] and renormalized to sum B_tot, ``iters`` times; then largest-remainder rounding.

    ``w`` [H, d] weights (descending per row); ``qsum`` overrides the quantization factor (§5.11b).
    Returns per-head integer budgets (LongTensor) summing exactly to ``total_bits``."""
    tail, qs = _terms(w, qsum)
    n, d = w.shape
    lo, hi = budget_range(d, b_min, b_max, rank_step)
    total_bits = int(total_bits)
    if not n * lo <= total_bits <= n * hi:
        raise ValueError(f"total_bits={total_bits} outside [{n * lo}, {n * hi}] for {n} heads")
    bbar = total_bits / n
    b = torch.full((n,), bbar, dtype=torch.float64, device=w.device)
    kw = dict(b_min=b_min, b_max=b_max, rank_step=rank_step, q_model=q_model)
    for _ in range(iters):
        dist = c1_batch(tail, qs, b, **kw)[2]
        dmean = dist.mean()
        if not dmean > 0:
            break
        b = torch.clamp(b + eta * bbar * (torch.sqrt(dist / dmean) - 1.0), min=lo)
        b = renormalize(b, total_bits, lo, hi)
    return largest_remainder(b, total_bits, lo, hi)


def distortion_table(
    w: torch.Tensor, *, b_min=B_MIN_BITS, b_max=B_MAX_BITS, rank_step=2, q_model="seed", qsum=None, chunk=32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(budgets [K], D*_h(B) [H, K]) for every integer B in [B_min, B_max]."""
    tail, qs = _terms(w, qsum)
    lo, hi = budget_range(w.shape[1], b_min, b_max, rank_step)
    grid = torch.arange(lo, hi + 1, device=w.device)
    out = []
    for s in range(0, w.shape[0], chunk):
        bud = grid.to(torch.float64).expand(min(chunk, w.shape[0] - s), -1)
        out.append(c1_batch(tail[s : s + chunk], qs[s : s + chunk], bud, b_min=b_min, b_max=b_max,
                            rank_step=rank_step, q_model=q_model)[2])
    return grid, torch.cat(out)


def exact_allocate(
    w: torch.Tensor,
    total_bits: int,
    *,
    b_min: int = B_MIN_BITS,
    b_max: int = B_MAX_BITS,
    rank_step: int = 2,
    q_model: str = "seed",
    qsum: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference solver (§5.4 ``--c2 exact``): minimize sum_h D*_h(B_h) over integers B_h in
    [B_min, B_max] with sum B_h = B_tot. Lagrangian bisection (each head takes argmin D_h(B) + nu B,
    i.e. a vertex of its lower convex hull), then greedy fill of the remaining bits by the best
    distortion decrease per bit, then single-bit exchanges while they lower the total."""
    grid, table = distortion_table(w, b_min=b_min, b_max=b_max, rank_step=rank_step, q_model=q_model, qsum=qsum)
    n, k = table.shape
    lo = int(grid[0])
    total_bits = int(total_bits)
    if not n * lo <= total_bits <= n * int(grid[-1]):
        raise ValueError(f"total_bits={total_bits} outside [{n * lo}, {n * int(grid[-1])}] for {n} heads")
    gf = grid.to(torch.float64)

    def pick(nu: float) -> torch.Tensor:
        return torch.argmin(table + nu * gf, dim=1)  # first minimum = smaller B

    slope = (table[:, :1] - table).clamp(min=0) / (gf - gf[0]).clamp(min=1)
    nu_lo, nu_hi = 0.0, float(slope.max()) + 1.0  # at nu_hi every head sits at B_min
    if int(grid[pick(nu_lo)].sum()) <= total_bits:
        nu_hi = nu_lo
    for _ in range(200):
        mid = 0.5 * (nu_lo + nu_hi)
        if int(grid[pick(mid)].sum()) <= total_bits:
            nu_hi = mid
        else:
            nu_lo = mid
        if nu_hi - nu_lo <= 1e-15 * max(nu_hi, 1e-300):
            break
    idx = pick(nu_hi)
    rows = torch.arange(n, device=w.device)
    rem = total_bits - int(grid[idx].sum())
    while rem > 0:  # greedy fill: best decrease per bit among moves that fit
        steps = torch.arange(1, min(rem, k - 1) + 1, device=w.device)
        tgt = idx[:, None] + steps[None, :]
        ok = tgt < k
        cur = table[rows, idx][:, None]
        new = table[rows[:, None], tgt.clamp(max=k - 1)]
        ratio = torch.where(ok, (cur - new) / steps.to(torch.float64), torch.full_like(new, -float("inf")))
        flat = int(torch.argmax(ratio))
        h, s = divmod(flat, steps.numel())
        idx[h] += s + 1
        rem -= s + 1
    for _ in range(10 * n):  # single-bit exchanges
        cur = table[rows, idx]
        gain = torch.where(idx + 1 < k, cur - table[rows, (idx + 1).clamp(max=k - 1)], torch.full_like(cur, -float("inf")))
        loss = torch.where(idx > 0, table[rows, (idx - 1).clamp(min=0)] - cur, torch.full_like(cur, float("inf")))
        up, down = int(torch.argmax(gain)), int(torch.argmin(loss))
        if up == down or not gain[up] - loss[down] > 1e-15 * float(cur.sum().abs()):
            break
        idx[up] += 1
        idx[down] -= 1
    return grid[idx]


def split_bits(budget: int, rank: int) -> list[int]:
    """§5.5: of r coordinates, the first m = B - r floor(B/r) get floor(B/r) + 1 bits, the rest floor(B/r)."""
    if rank == 0:
        return []
    base, m = divmod(int(budget), int(rank))
    return [base + 1] * m + [base] * (rank - m)
