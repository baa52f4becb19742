"""KV-COBRA bit/rank allocation: C1 (per head), C2 (across heads), the exact reference solver.

docs/methods.md §5.3-§5.5, seed-literal defaults, §5.11 fixes as switches. Every function is vectorized
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
    return solve_table(grid, table, total_bits)


# The exact solver on any table, KKT slope equalization (§5.11c)


def solve_table(grid: torch.Tensor, table: torch.Tensor, total_bits: int) -> torch.Tensor:
    """Integer budgets [H] (from ``grid`` [K]) minimizing sum_h table[h, B_h] with sum = total_bits:
    the solver of :func:`exact_allocate` on a given table. ``+inf`` entries are infeasible budgets
    (each row's finite entries must be one contiguous run: a head with its own [B_min, B_max], as
    the value heads of the joint K/V allocation, whose budgets start at d bits)."""
    n, k = table.shape
    finite = torch.isfinite(table)
    if not bool(finite.any(1).all()):
        raise ValueError("solve_table: every head needs at least one feasible budget")
    cols = torch.arange(k, device=table.device)
    first = torch.where(finite, cols, k).min(1).values
    last = torch.where(finite, cols, -1).max(1).values
    total_bits = int(total_bits)
    lo_sum, hi_sum = int(grid[first].sum()), int(grid[last].sum())
    if not lo_sum <= total_bits <= hi_sum:
        raise ValueError(f"total_bits={total_bits} outside [{lo_sum}, {hi_sum}] for {n} heads")
    gf = grid.to(torch.float64)
    rows = torch.arange(n, device=table.device)

    def pick(nu: float) -> torch.Tensor:
        return torch.argmin(table + nu * gf, dim=1)  # first minimum = smaller B

    t0 = table[rows, first][:, None]
    slope = torch.where(finite, (t0 - table).clamp(min=0), torch.zeros_like(table))
    slope = slope / (gf[None, :] - gf[first][:, None]).clamp(min=1)
    nu_lo, nu_hi = 0.0, float(slope.max()) + 1.0  # at nu_hi every head sits at its B_min
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
    rem = total_bits - int(grid[idx].sum())
    while rem > 0:  # greedy fill: best decrease per bit among moves that fit
        steps = torch.arange(1, min(rem, k - 1) + 1, device=table.device)
        tgt = idx[:, None] + steps[None, :]
        cur = table[rows, idx][:, None]
        new = table[rows[:, None], tgt.clamp(max=k - 1)]
        ok = (tgt < k) & torch.isfinite(new)
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


POLISH_MOVES = (1, 2, 4, 8, 16, 32)  # exchange sizes (bits) of kkt_allocate's final polish


def kkt_allocate(
    w: torch.Tensor,
    total_bits: int,
    iters: int = 30,
    eta: float = 0.7,
    *,
    b_min: int = B_MIN_BITS,
    b_max: int = B_MAX_BITS,
    rank_step: int = 2,
    q_model: str = "seed",
    qsum: torch.Tensor | None = None,
    polish: int | None = None,
) -> torch.Tensor:
    """C2 with KKT slope equalization (§5.11c): at the optimum of sum_h D*_h(B_h) with sum B_h = B_tot
    every unclamped head has the same marginal -dD*_h/dB, not the same D*_h (the seed's fixed
    point). Iterated like C2 (``iters`` damped updates from B_bar, clamped and renormalized), with
    the update of the exponential model D ~ 2^(-2B/r): log2 of the slope falls by 2/r per bit, so
    head h moves by eta (r_h/2) (log2 g_h - log2 g*), g* the r-weighted geometric mean (the moves
    sum to zero). Slopes are central differences of D* at B_h +- 1 (one-sided at the bounds).
    Then largest-remainder rounding and up to ``polish`` (default 4 H) exchanges of s bits
    (s in :data:`POLISH_MOVES`) from the head that loses least to the one that gains most, each
    from 2 |moves| + 1 C1 evaluations per head; the result is a local optimum under those moves
    (D* is not convex in B: rank switches make it a staircase, so slopes alone can stall).

    Decisions where docs/methods.md is silent: eta = 0.7 and 30 iterations (a Newton step of the
    exponential model converges in a few when the ranks settle); slopes floored at 1e-300."""
    tail, qs = _terms(w, qsum)
    n, d = w.shape
    lo, hi = budget_range(d, b_min, b_max, rank_step)
    total_bits = int(total_bits)
    if not n * lo <= total_bits <= n * hi:
        raise ValueError(f"total_bits={total_bits} outside [{n * lo}, {n * hi}] for {n} heads")
    kw = dict(b_min=b_min, b_max=b_max, rank_step=rank_step, q_model=q_model)
    b = torch.full((n,), total_bits / n, dtype=torch.float64, device=w.device)
    one = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64, device=w.device)
    for _ in range(iters):
        probe = (b[:, None] + one).clamp(lo, hi)
        rank, _, dist = c1_batch(tail, qs, probe, **kw)
        g = ((dist[:, 0] - dist[:, 2]) / (probe[:, 2] - probe[:, 0]).clamp(min=1e-9)).clamp(min=1e-300)
        r = rank[:, 1].to(torch.float64).clamp(min=rank_step)
        lg = torch.log2(g)
        free = (b > lo) | (lg > (r * lg).sum() / r.sum())  # a head at B_min only moves up
        free = free & ((b < hi) | (lg < (r * lg).sum() / r.sum()))
        if not bool(free.any()):
            break
        target = (r * lg)[free].sum() / r[free].sum()
        move = torch.where(free, eta * 0.5 * r * (lg - target), torch.zeros_like(b))
        b = renormalize(b + move, total_bits, lo, hi)
    idx = largest_remainder(b, total_bits, lo, hi)
    moves = torch.tensor(POLISH_MOVES, dtype=torch.float64, device=w.device)
    for _ in range(4 * n if polish is None else polish):
        cur = idx.to(torch.float64)
        probe = torch.cat([cur[:, None], cur[:, None] + moves, cur[:, None] - moves], 1)
        dist = c1_batch(tail, qs, probe.clamp(lo, hi), **kw)[2]
        m = moves.numel()
        inf = torch.full_like(dist[:, 1 : 1 + m], float("inf"))
        gain = torch.where(cur[:, None] + moves <= hi, dist[:, :1] - dist[:, 1 : 1 + m], -inf)  # [H, M]
        loss = torch.where(cur[:, None] - moves >= lo, dist[:, 1 + m :] - dist[:, :1], inf)
        g_best, up = gain.max(0)
        l_best, down = loss.min(0)
        net = torch.where(up != down, g_best - l_best, torch.full_like(g_best, -float("inf")))
        j = int(torch.argmax(net))
        if not net[j] > 1e-15 * float(dist[:, 0].sum().abs()):
            break
        idx[int(up[j])] += int(moves[j])
        idx[int(down[j])] -= int(moves[j])
    return idx


def split_bits(budget: int, rank: int) -> list[int]:
    """§5.5: of r coordinates, the first m = B - r floor(B/r) get floor(B/r) + 1 bits, the rest floor(B/r)."""
    if rank == 0:
        return []
    base, m = divmod(int(budget), int(rank))
    return [base + 1] * m + [base] * (rank - m)
