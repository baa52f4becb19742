"""SnapKV: prompt compression from an observation window (docs/methods.md §7), with the decode policy
of §7.3 (append, or re-select every ``decode_interval`` steps)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .attention import causal_attention, causal_mask, expand_kv
from .base import KVMethod, Unsupported
from .buffers import Growing
from .codec_state import cumulative_bits
from .eviction import EvictionLayerState, top_and_recent
from .sparsifier import (
    grouped_logits,
    round_half_up,
    shared_target,
    window_probs,
)

#: the official code's default capacity (`init_snapkv`), used when neither a bpd target nor
#: ``capacity`` is given
DEFAULT_CAPACITY = 2048
#: decode policies of docs/methods.md §7.3
DECODE_POLICIES = ("keep", "evict")


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
    NeurIPS 2024, arXiv 2404.14469; code FasterDecoding/SnapKV), docs/methods.md §7.

    At the end of an exact prefill of T tokens, if T > C: A = softmax(Q_win K^T·scaling) for the
    last W queries (causal inside the window), s = Σ_window A[..., :T−W], s ← pool1d(s, kernel,
    stride 1, padding kernel//2), keep the top-(C−W) prefix tokens per head plus the W window
    tokens. Defaults are the LongBench configs (W = 32, kernel 7, max pooling).

    Decode policy (§7.3): ``decode="keep"`` (default, the paper's) appends and never evicts.
    ``decode="evict"`` holds the budget: after every ``decode_interval`` decode steps (default W)
    the same selection runs on the current cache, the observation window being the last W queries
    (kept in the state, [B, Hq, W, d]) over the held tokens, the window's own tokens being the last
    W held ones; the top-(C−W) older held tokens plus those W stay.

    Budget (§7.3): ``bpd`` and ``v_bpd`` are one budget spent on K and V (different values raise
    :class:`Unsupported`); ρ = target/16, or a fixed ``capacity`` (not both). 16 bits per kept
    element on each side. ``decode="keep"``: C = max(W+1, round(ρ·T_prompt)), so the decoded
    positions read a cache that grows past the budget (the §0 headline counts it).
    ``decode="evict"``: a selection made with t tokens seen is followed by the reads at t + j
    seen, j ∈ J, until the next one (J = 1..I, I = decode_interval, for a re-selection; J = 0..I
    for the prefill's, whose own prediction reads the compressed prompt, §0), each reading
    C_t + j held tokens. It keeps

        C_t = max(W+1, round(ρ·(t + j̄) − j̄)),  j̄ = mean J = (I+1)/2 (re-selection), I/2 (prefill),

    i.e. fewer than ρ·t, so that the mean held count over those reads, C_t + j̄, is ρ times their
    mean seen count: the headline (the mean over the scored positions of held/seen) is ρ up to
    O((I/t)²) and the rounding, where C_t = round(ρ t) would overshoot it by (1−ρ)(I+1)/(2t)
    (0.010 above ρ = 1/16 at t = 1536, I = 32: 16%). The end of the prefill then holds (1−ρ)·I/2
    tokens fewer than ρ·T_prompt (reported beside the headline, labelled). With a fixed
    ``capacity`` C the held count is centred the same way on C: C_t = max(W+1, round(C − j̄)).

    GQA (§7.2): ``gqa="mean"`` averages the pooled scores over the g query heads of a KV head,
    one kept set per KV head; ``gqa="repeat"`` is the official path (``repeat_kv`` before
    selection): each query head keeps its own C tokens, stored and counted g times.

    Decisions where docs/methods.md is silent:

    * gqa=mean pools each query head's scores, then averages (as kvpress and SnapKV issue #22).
    * gqa=repeat with a bpd target uses ρ = target/(16·g), so the measured bpd meets the target
      (an explicit ``capacity`` gives the official g× bpd). A prompt that is not compressed is
      stored once per KV head (the official code returns it unrepeated); under decode=evict the
      first re-selection that compresses repeats it.
    * Compression happens iff the held count exceeds C (T = C would keep everything anyway).
      Rounding: half up.
    * Ties (common under max pooling): the later token is kept.
    * No target and no capacity: the official default C = 2048.
    * decode=evict, the step boundary: a re-selection runs right after the attention of the
      decode step that completes an interval (the I-th, 2I-th, ... decoded token since the
      prefill), so the query of the next step reads the re-selected cache plus itself. A chunk of
      decoded tokens runs in blocks that end at those boundaries (one block of attention per
      interval, no loop over tokens), which gives what single steps give.
    * decode=evict pools over the held tokens in cache order (ascending positions, with the gaps
      of earlier evictions), as the prefill pools over positions; the window's attention is
      recomputed over the current cache (as kvpress's ``DecodingPress`` re-scores its buffer).
    * The W buffered queries are working memory of the selection, like the prefill's activations:
      neither K nor V, so not in the bpd (§0 counts the bits attributable to K or V);
      ``stored_bits`` counts exactly the held K and V.
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
    decode: str = "keep"
    decode_interval: int | None = None

    def __post_init__(self):
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv: pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.gqa not in ("mean", "repeat"):
            raise ValueError(f"snapkv: gqa must be 'mean' or 'repeat', got {self.gqa!r}")
        if self.decode not in DECODE_POLICIES:
            raise ValueError(
                f"snapkv: decode must be one of {', '.join(DECODE_POLICIES)}, got {self.decode!r}"
            )
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
        iv = self.decode_interval
        if iv is not None and (isinstance(iv, bool) or int(iv) != iv or iv < 1):
            raise ValueError(
                f"snapkv: decode_interval must be a positive integer or null (= window), got {iv!r}"
            )
        self._shape = None
        self._rho: float | None = None

    @property
    def interval(self) -> int | None:
        """Decode steps between two re-selections under decode=evict (None under decode=keep)."""
        if self.decode == "keep":
            return None
        return int(self.decode_interval if self.decode_interval is not None else self.window)

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

    def capacity_for(self, n_seen: int, reselect: bool = False) -> int:
        """C of a selection made with ``n_seen`` tokens seen (§7.3): the prefill's (n_seen =
        T_prompt) or, ``reselect``, a decode re-selection's. decode=keep: max(W+1, round(ρ·n_seen));
        decode=evict: centred on the reads until the next selection (class docstring). A fixed
        ``capacity`` or the official default replaces ρ·n_seen."""
        w = int(self.window)
        if self.capacity is not None:
            mean = float(self.capacity)
        elif self._rho is None:
            mean = float(DEFAULT_CAPACITY)
        else:
            mean = self._rho * n_seen
        if self.interval is None:
            return max(w + 1, round_half_up(mean))
        lag = (self.interval + 1) / 2 if reselect else self.interval / 2  # mean j of the reads
        if self._rho is not None:
            mean = self._rho * (n_seen + lag)
        return max(w + 1, round_half_up(mean - lag))

    def held_counts(self, n_prompt: int, n_decode: int) -> torch.Tensor:
        """Tokens each of ``n_decode`` decode queries after an ``n_prompt``-token prefill reads,
        itself included, per stored head (float64 [n_decode]): the layer state's storage rule as
        arithmetic, one step per interval. (The prefill's own prediction reads
        min(n_prompt, ``capacity_for(n_prompt)``).)"""
        held = min(n_prompt, self.capacity_for(n_prompt))
        out, done, iv = [], 0, self.interval
        while done < n_decode:
            m = n_decode - done if iv is None else min(iv, n_decode - done)
            out.append(held + torch.arange(1, m + 1, dtype=torch.float64))
            held, done = held + m, done + m
            if iv is not None:
                held = min(held, self.capacity_for(n_prompt + done, reselect=True))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def new_layer_state(self, layer):
        return SnapKVLayerState(
            int(self.window), int(self.kernel), self.pooling, self.gqa, self.capacity_for,
            self.interval, partial(self.capacity_for, reselect=True),
        )

    def knobs(self):
        return {
            "window": int(self.window),
            "kernel": int(self.kernel),
            "pooling": self.pooling,
            "gqa": self.gqa,
            "capacity": self.capacity,
            "rho": self._rho,
            "decode": self.decode,
            "decode_interval": self.interval,
        }

    def allocation(self):
        """``kept``: the fraction C/T of the prompt every KV head keeps at the end of a prefill of
        the regime's T tokens [L, H_kv] (one capacity for all heads: uniform by construction)."""
        if self._shape is None:
            return {}
        t = self.regime.tokens
        kept = min(1.0, self.capacity_for(t) / t)
        return {"kept": torch.full((self._shape.n_layers, self._shape.n_kv_heads), kept, dtype=torch.float64)}

    def nominal_bpd(self, n_tokens):
        """§7.3: 16·C/T at the end of prefill (×g under gqa=repeat; C of the decode policy); 16
        when T ≤ C."""
        c = self.capacity_for(n_tokens)
        bpd = 16.0 if n_tokens <= c else 16.0 * c * self._copies() / n_tokens
        return bpd, bpd


@dataclass
class SnapKVLayerState(EvictionLayerState):
    """Held K, V [B, Hs, n, d] with Hs = Hkv (gqa=mean, or no compression) or Hq (gqa=repeat).

    ``interval`` None: decode=keep; else the re-selection interval of decode=evict, which also
    keeps the last ``window`` queries [B, Hq, ≤ W, d] and takes C of a re-selection from
    ``reselect_capacity`` (tokens seen -> C; default ``capacity_for``)."""

    window: int
    kernel: int
    pooling: str
    gqa: str
    capacity_for: object  # callable: prompt length -> C of the prefill's selection
    interval: int | None = None
    reselect_capacity: object = None  # callable: tokens seen -> C of a re-selection

    label = "snapkv"

    def __post_init__(self):
        self._k = self._v = None
        self._idx = None  # prompt positions kept at the end of prefill [B, Hs, C] (diagnostics)
        self._base = None  # positions held after the last selection [B, Hs, c] (bookkeeping)
        self._base_seen = 0  # tokens seen at the last selection: later ones are all held
        self._queries = None  # the last W queries (decode=evict)
        self._since = 0  # decode steps since the last selection
        self._seen = 0

    # the kept K, V live in growing buffers: a decode step appends its token instead of copying
    # the cache; ``_k``/``_v`` read and replace their contents
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

    def select(self, rows: torch.Tensor, capacity: int) -> torch.Tensor:
        """Kept indices from the window's attention rows [B, H, g, W, T] -> [B, Hs, C]."""
        b, h, g, w, t = rows.shape
        s = rows[..., : t - w].sum(dim=-2)  # [B, H, g, T - W]
        s = pool1d(s, self.kernel, self.pooling)
        s = s.mean(dim=2) if self.gqa == "mean" else s.reshape(b, h * g, t - w)
        return top_and_recent(s, capacity - w, w)

    def _keep(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Hold the tokens ``idx`` [B, Hs, C] of k, v [B, Hs, n, d] at positions ``pos`` [B, Hs, n]."""
        self._gather(idx, k, v)
        self._base = pos.gather(-1, idx)
        self._base_seen = self._seen

    def _prefill(self, q, k, v, scaling):
        if self._seen:
            raise ValueError("snapkv: prefill must be the first call on a layer state")
        t = k.shape[2]
        c = self.capacity_for(t)
        self._reads = None
        out = causal_attention(q, k, v, scaling)
        self._seen = t
        pos = torch.arange(t, device=k.device).expand(k.shape[0], k.shape[1], t)
        if t <= c:
            self._k, self._v = k, v
            self._base, self._base_seen = pos, t
        else:
            idx = self.select(window_probs(q, k, scaling, self.window), c)
            if self.gqa == "repeat":
                g = q.shape[1] // k.shape[1]
                k, v = expand_kv(k, g), expand_kv(v, g)
                pos = pos[:, :1].expand(k.shape[0], k.shape[1], t)
            self._keep(idx, k, v, pos)
        self._idx = self._base
        if self.interval is not None:
            self._queries = q[:, :, -self.window :].clone()
        return out

    def _decode(self, q, k, v, scaling):
        if self._k is None:
            raise Unsupported(
                "snapkv compresses the prompt once, at the end of prefill: it needs the "
                "prefill-exact regime (PPL track B, LongBench/generation); decode-mode attention "
                "on an empty cache (Q-all, PPL track A, zero-shot in one pass) is not applicable"
            )
        if self.interval is None:
            return self._append_and_attend(q, k, v, scaling)
        outs, reads_k, reads_v = [], [], []
        i, n = 0, q.shape[2]
        while i < n:  # blocks ending at the re-selection boundaries
            m = min(n - i, self.interval - self._since)
            sl = slice(i, i + m)
            outs.append(self._append_and_attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling))
            reads_k.append(self._reads[0])
            reads_v.append(self._reads[1])
            self._remember(q[:, :, sl])
            self._since += m
            if self._since == self.interval:
                self._reselect(scaling)
                self._since = 0
            i += m
        self._reads = (torch.cat(reads_k), torch.cat(reads_v))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _append_and_attend(self, q, k, v, scaling):
        """Append the new tokens, attend over the held ones and them (causal among them)."""
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

    def _remember(self, q: torch.Tensor) -> None:
        """Keep the last ``window`` queries (the next re-selection's observation window)."""
        self._queries = torch.cat([self._queries, q], dim=2)[:, :, -self.window :]

    def _reselect(self, scaling: float) -> None:
        """§7.1 on the held tokens: the last W queries over them (causal inside the window, whose
        tokens are the last W held), pooled scores, top-(C−W) older held tokens + the window."""
        c = (self.reselect_capacity or self.capacity_for)(self._seen)
        n = self.n_kept
        if n <= c:
            return
        k, v, pos = self._k, self._v, self.kept_positions()
        hq = self._queries.shape[1]
        if self.gqa == "repeat" and k.shape[1] != hq:  # an uncompressed prompt, stored once
            g = hq // k.shape[1]
            k, v, pos = expand_kv(k, g), expand_kv(v, g), expand_kv(pos[..., None], g)[..., 0]
        w = self._queries.shape[2]
        logits = grouped_logits(self._queries, k, scaling)  # [B, Hs, g', W, n]
        causal = causal_mask(w, n, device=k.device)
        rows = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        self._keep(self.select(rows, c), k, v, pos)

    def kept_prompt_positions(self) -> torch.Tensor | None:
        """Prompt positions kept at the end of prefill [B, Hs, C] (ascending), for diagnostics."""
        return self._idx

    def kept_positions(self) -> torch.Tensor | None:
        """Positions [B, Hs, n] of the held tokens, in their stored (ascending) order: those held
        after the last selection, then every token seen since."""
        if self._base is None:
            return None
        n = self.n_kept - self._base.shape[-1]
        later = torch.arange(self._seen - n, self._seen, device=self._base.device)
        return torch.cat([self._base, later.expand(*self._base.shape[:-1], n)], dim=-1)
