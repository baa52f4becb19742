"""The seed's sparsifier functions (seeds/000 §3-§4) and the shared eviction helpers."""

import numpy as np
import pytest
import torch

from methods.base import Unsupported
from methods.sparsifier import (
    attention_column_sums,
    compression_ratio,
    cumulative_attention_scores,
    keep_recent_and_heavy_hitters,
    round_half_up,
    shared_target,
    snapkv_select,
    top_k_latest,
    window_probs,
)


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


def naive_select(scores, budget, recent):
    """Last `recent` tokens + best older ones, ties to the later token (Python lists)."""
    t = len(scores)
    start = max(0, t - recent)
    older = sorted(range(start), key=lambda j: (scores[j], j), reverse=True)
    heavy = older[: max(0, budget - (t - start))]
    return sorted(set(heavy) | set(range(start, t)))


def test_cumulative_scores_numpy_and_torch():
    hist = np.arange(12, dtype=np.float64).reshape(3, 4)
    out = cumulative_attention_scores(hist)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [12, 15, 18, 21])
    out_t = cumulative_attention_scores(torch.tensor(hist, dtype=torch.float16))
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float32
    assert out_t.tolist() == [12, 15, 18, 21]
    for bad in (np.zeros(4), np.zeros((2, 3, 4)), torch.zeros(5)):
        with pytest.raises(ValueError, match="rank-2"):
            cumulative_attention_scores(bad)


def test_keep_recent_and_heavy_hitters_matches_naive():
    rng = np.random.default_rng(0)
    for trial in range(40):
        steps, t = rng.integers(1, 6), rng.integers(1, 40)
        hist = rng.integers(0, 4, size=(steps, t)).astype(np.float32)  # many ties
        budget, recent = int(rng.integers(0, t + 3)), int(rng.integers(0, t + 3))
        got = keep_recent_and_heavy_hitters(hist, budget, recent)
        assert isinstance(got, np.ndarray) and got.dtype == np.int32
        assert got.tolist() == naive_select(hist.sum(0).tolist(), budget, recent)
        got_t = keep_recent_and_heavy_hitters(torch.from_numpy(hist), budget, recent)
        assert got_t.dtype == torch.int64 and got_t.tolist() == got.tolist()


def test_seed_example_and_recent_window_kept_whole():
    hist = np.array([[0.1, 0.5, 0.2, 0.1, 0.1], [0.1, 0.3, 0.2, 0.2, 0.2]])
    assert keep_recent_and_heavy_hitters(hist, 3, 2).tolist() == [1, 3, 4]
    # budget below the recent window: the window is kept whole (seed semantics)
    assert keep_recent_and_heavy_hitters(hist, 1, 3).tolist() == [2, 3, 4]
    assert keep_recent_and_heavy_hitters(hist, 10, 2).tolist() == [0, 1, 2, 3, 4]


def test_snapkv_select_vector_and_batched():
    scores = np.array([3.0, 1.0, 3.0, 2.0, 0.0, 9.0])
    # ties between positions 0 and 2: the later one wins
    assert snapkv_select(scores, 3, 2).tolist() == [2, 4, 5]
    batch = torch.tensor([[3.0, 1.0, 3.0, 2.0, 0.0, 9.0], [0.0, 5.0, 1.0, 1.0, 0.0, 0.0]])
    assert snapkv_select(batch, 4, 2).tolist() == [[0, 2, 4, 5], [1, 3, 4, 5]]
    with pytest.raises(ValueError):
        snapkv_select(np.float32(1.0), 1, 0)
    with pytest.raises(ValueError):
        snapkv_select(scores, -1, 0)
    with pytest.raises(ValueError):
        snapkv_select(scores, 2, 1.5)


def test_top_k_latest_ties_and_bounds():
    s = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert top_k_latest(s, 2).tolist() == [[2, 4]]
    assert top_k_latest(s, 0).shape == (1, 0)
    assert top_k_latest(s, 9).tolist() == [[0, 1, 2, 3, 4]]


def test_compression_ratio():
    assert compression_ratio(1024, 64) == 16.0
    for total, kept in ((0, 1), (4, 0), (4, 5), (-1, -1)):
        with pytest.raises(ValueError):
            compression_ratio(total, kept)


def test_round_half_up_and_shared_target():
    assert [round_half_up(x) for x in (0.5, 1.5, 2.5, 2.49)] == [1, 2, 3, 2]
    assert shared_target("m", 1.0, None) == 1.0
    assert shared_target("m", None, 2.0) == 2.0
    assert shared_target("m", 2.0, 2.0) == 2.0
    assert shared_target("m", None, None) is None
    with pytest.raises(Unsupported, match="share one budget"):
        shared_target("m", 1.0, 4.0)


@pytest.mark.parametrize("g", [2, 3])
def test_column_sums_and_window_probs_equal_naive(g):
    torch.manual_seed(0)
    b, h, t, d = 2, 2, 37, 16
    q = torch.randn(b, h * g, t, d, dtype=torch.float64)
    k = torch.randn(b, h, t, d, dtype=torch.float64)
    logits = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * 0.3
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    ref_col = p.sum(-2).reshape(b, h, g, t)
    for block in (1 << 20, 2220, 1):  # one block, several blocks, one row per block
        col = attention_column_sums(q, k, 0.3, block_elems=block)
        assert (col - ref_col).abs().max() < 1e-12
    assert (window_probs(q, k, 0.3, 5) - p[:, :, -5:].reshape(b, h, g, 5, t)).abs().max() < 1e-12
    assert window_probs(q, k, 0.3, 99).shape == (b, h, g, t, t)
