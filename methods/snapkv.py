"""SnapKV: one-shot prompt compression from an observation window (METHODS.md §7)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import causal_attention, expand_kv
from .base import KVMethod, LayerState, Unsupported
from .codec_state import cumulative_bits
from .kivi import Growing
from .sparsifier import (
    round_half_up,
    shared_target,
    top_k_latest,
    window_probs,
)

#: the official code's default capacity (`init_snapkv`), used when neither a bpd target nor
#: ``capacity`` is given
DEFAULT_CAPACITY = 2048


def pool1d(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Stride-1 pooling over the last axis with padding kernel//2, as F.max_pool1d (pads -inf)
    and F.avg_pool1d (zero padding counted, i.e. divide by ``kernel``) do for odd kernels."""
    pad = kernel // 2
    fill = float("-inf") if mode == "max" else 0.0
    win = F.pad(x, (pad, pad), value=fill).unfold(-1, kernel, 1)
    return win.amax(dim=-1) if mode == "max" else win.sum(dim=-1) / kernel


@dataclass
class SnapKV(KVMethod):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
    NeurIPS 2024, arXiv 2404.14469; code FasterDecoding/SnapKV), METHODS.md §7.

    At the end of an exact prefill of T tokens, if T > C: A = softmax(Q_win K^T·scaling) for the
    last W queries (causal inside the window), s = Σ_window A[..., :T−W], s ← pool1d(s, kernel,
    stride 1, padding kernel//2), keep the top-(C−W) prefix tokens per head plus the W window
    tokens. Decode appends and never evicts. Defaults are the LongBench configs (W = 32,
    kernel 7, max pooling).

    Budget (§7.3): ``bpd`` and ``v_bpd`` are one budget spent on K and V (different values raise
    :class:`Unsupported`); C = max(W+1, round(ρ·T_prompt)), ρ = target/16; or a fixed
    ``capacity`` (not both). 16 bits per kept element on each side.

    GQA (§7.2): ``gqa="mean"`` averages the pooled scores over the g query heads of a KV head,
    one kept set per KV head; ``gqa="repeat"`` is the official path (``repeat_kv`` before
    selection): each query head keeps its own C tokens, stored and counted g times.

    Decisions where METHODS.md is silent:

    * gqa=mean pools each query head's scores, then averages (as kvpress and SnapKV issue #22).
    * gqa=repeat with a bpd target uses ρ = target/(16·g), so the measured bpd meets the target
      (an explicit ``capacity`` gives the official g× bpd). A prompt that is not compressed is
      stored once per KV head (the official code returns it unrepeated).
    * Compression happens iff T > C (T = C would keep everything anyway). Rounding: half up.
    * Ties (common under max pooling): the later token is kept.
    * No target and no capacity: the official default C = 2048.
    * Prefill and decode outputs use ``attention.causal_attention`` (the FP16 baseline's kernel);
      only the W window rows are computed explicitly (float32) for the selection.
    * ``supports_in_pass = False``: a decode-mode call on an empty cache (Q-all, PPL track A)
      raises :class:`Unsupported`; SnapKV needs the prefill-exact regime (track B, generation).
    """

    name = "snapkv"
    supports_in_pass = False
    evicts_tokens = True

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    capacity: int | None = None

    def __post_init__(self):
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv: pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.gqa not in ("mean", "repeat"):
            raise ValueError(f"snapkv: gqa must be 'mean' or 'repeat', got {self.gqa!r}")
        if int(self.window) != self.window or self.window < 1:
            raise ValueError(f"snapkv: window must be a positive integer, got {self.window!r}")
        if int(self.kernel) != self.kernel or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"snapkv: kernel must be a positive odd integer, got {self.kernel!r}")
        if self.capacity is not None and (
            int(self.capacity) != self.capacity or self.capacity <= self.window
        ):
            raise ValueError(
                f"snapkv: capacity must be an integer > window={self.window}, got {self.capacity!r}"
            )
        self._shape = None
        self._rho: float | None = None

    def _copies(self) -> int:
        """How many times each kept token is stored per KV head (g under gqa=repeat)."""
        if self.gqa == "mean":
            return 1
        if self._shape is None:
            raise RuntimeError("snapkv: gqa='repeat' needs configure() first")
        return self._shape.group_size

    def configure(self, shape, bpd_k, bpd_v):
        self._shape = shape
        target = shared_target("snapkv", bpd_k, bpd_v)
        self._rho = None
        if target is None:
            return
        if self.capacity is not None:
            raise ValueError(
                f"snapkv: give either a bpd target or capacity, not both "
                f"(bpd={target}, capacity={self.capacity})"
            )
        if not 0.0 < target <= 16.0:
            raise Unsupported(f"snapkv: bpd={target} unreachable; targets lie in (0, 16]")
        self._rho = target / (16.0 * self._copies())

    def capacity_for(self, n_prompt: int) -> int:
        """C for a prompt of ``n_prompt`` tokens (§7.3)."""
        if self.capacity is not None:
            return int(self.capacity)
        if self._rho is None:
            return DEFAULT_CAPACITY
        return max(self.window + 1, round_half_up(self._rho * n_prompt))

    def new_layer_state(self, layer):
        return SnapKVLayerState(
            int(self.window), int(self.kernel), self.pooling, self.gqa, self.capacity_for
        )

    def knobs(self):
        return {
            "window": int(self.window),
            "kernel": int(self.kernel),
            "pooling": self.pooling,
            "gqa": self.gqa,
            "capacity": self.capacity,
            "rho": self._rho,
        }

    def nominal_bpd(self, n_tokens):
        """§7.3: 16·C/T at the end of prefill (×g under gqa=repeat); 16 when T ≤ C."""
        c = self.capacity_for(n_tokens)
        bpd = 16.0 if n_tokens <= c else 16.0 * c * self._copies() / n_tokens
        return bpd, bpd


@dataclass
class SnapKVLayerState(LayerState):
    """Kept K, V [B, Hs, C, d] with Hs = Hkv (gqa=mean, or no compression) or Hq (gqa=repeat)."""

    window: int
    kernel: int
    pooling: str
    gqa: str
    capacity_for: object  # callable: prompt length -> C

    def __post_init__(self):
        self._k = self._v = None
        self._idx = None  # prompt positions kept [B, Hs, C] (diagnostics; not part of the cache)
        self._seen = 0

    # the kept K, V live in growing buffers: a decode step appends its token instead of copying
    # the cache (issue 15, finding 4); ``_k``/``_v`` read and replace their contents
    @property
    def _k(self) -> torch.Tensor | None:
        return self._kb.data

    @_k.setter
    def _k(self, x: torch.Tensor | None) -> None:
        self._kb = Growing()
        if x is not None:
            self._kb.append(x)

    @property
    def _v(self) -> torch.Tensor | None:
        return self._vb.data

    @_v.setter
    def _v(self, x: torch.Tensor | None) -> None:
        self._vb = Growing()
        if x is not None:
            self._vb.append(x)

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"snapkv: {q.shape[1]} query heads for {k.shape[1]} KV heads")
        if prefill:
            return self._prefill(q, k, v, scaling)
        return self._decode(q, k, v, scaling)

    def select(self, rows: torch.Tensor, capacity: int) -> torch.Tensor:
        """Kept indices from the window's attention rows [B, H, g, W, T] -> [B, Hs, C]."""
        b, h, g, w, t = rows.shape
        s = rows[..., : t - w].sum(dim=-2)  # [B, H, g, T - W]
        s = pool1d(s, self.kernel, self.pooling)
        s = s.mean(dim=2) if self.gqa == "mean" else s.reshape(b, h * g, t - w)
        heavy = top_k_latest(s, capacity - w)
        win = torch.arange(t - w, t, device=rows.device).expand(*heavy.shape[:-1], w)
        return torch.cat([heavy, win], dim=-1)

    def _prefill(self, q, k, v, scaling):
        if self._seen:
            raise ValueError("snapkv: prefill must be the first call on a layer state")
        t = k.shape[2]
        c = self.capacity_for(t)
        self._reads = None
        out = causal_attention(q, k, v, scaling)
        if t <= c:
            self._k, self._v = k, v
            self._idx = torch.arange(t, device=k.device).expand(k.shape[0], k.shape[1], t)
        else:
            idx = self.select(window_probs(q, k, scaling, self.window), c)
            if self.gqa == "repeat":
                g = q.shape[1] // k.shape[1]
                k, v = expand_kv(k, g), expand_kv(v, g)
            self._k = k.gather(2, idx[..., None].expand(*idx.shape, k.shape[-1]))
            self._v = v.gather(2, idx[..., None].expand(*idx.shape, v.shape[-1]))
            self._idx = idx
        self._seen = t
        return out

    def _decode(self, q, k, v, scaling):
        if self._k is None:
            raise Unsupported(
                "snapkv compresses the prompt once, at the end of prefill: it needs the "
                "prefill-exact regime (PPL track B, LongBench/generation); decode-mode attention "
                "on an empty cache (Q-all, PPL track A, zero-shot in one pass) is not applicable"
            )
        hs = self._k.shape[1]
        if hs != k.shape[1]:
            k, v = expand_kv(k, hs // k.shape[1]), expand_kv(v, hs // v.shape[1])
        prior_k, prior_v = self.stored_bits()
        self._kb.append(k.to(self._kb.data.dtype))
        self._vb.append(v.to(self._vb.data.dtype))
        self._seen += q.shape[2]
        t = k.shape[2]
        self._reads = (cumulative_bits(prior_k, [(t, 16.0 * k.numel())]),
                       cumulative_bits(prior_v, [(t, 16.0 * v.numel())]))
        # the FP16 baseline's own kernel: kept tokens first, then the new ones, causal among them
        return causal_attention(q, self._k, self._v, scaling)

    def stored_bits(self):
        """16 bits per kept element, keys and values separately."""
        if self._k is None:
            return 0, 0
        return self._k.numel() * 16, self._v.numel() * 16

    @property
    def n_seen(self):
        return self._seen

    @property
    def n_kept(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def kept_prompt_positions(self) -> torch.Tensor | None:
        """Prompt positions kept at the end of prefill [B, Hs, C] (ascending), for diagnostics."""
        return self._idx

    # compose: a codec hands the eviction the decoded form of its tokens
    def kept_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stored K, V [B, Hs, n, d]: the kept prompt (``kept_prompt_positions`` order), then
        every decoded token in arrival order; the tensors themselves (a codec may overwrite
        entries in place with their decoded form)."""
        return self._k, self._v

    def replace_kept_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the stored K, V by same-shaped tensors (the decoded form a codec stores them
        in, METHODS.md §12); the kept set is unchanged."""
        if self._k is None or k.shape != self._k.shape or v.shape != self._v.shape:
            raise ValueError("snapkv: replace_kept_kv needs tensors shaped like the kept cache")
        self._k, self._v = k, v
