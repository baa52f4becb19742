"""The contract between compression methods (tensors) and the harness (models).

docs/design.md §1-§2, docs/methods.md §0-§1. A method is a small dataclass with three duties:

1. **Budget** — ``configure(shape, bpd_k, bpd_v)`` maps the targets (bits per K / V element,
   metadata included, docs/methods.md §0) to the method's knobs, or raises :class:`Unsupported` naming
   the reachable range. ``bpd_v=None`` means values stay at 16 bits (the K-track).
2. **Calibration** — methods with ``needs_calibration = True`` receive one :class:`LayerStats` per
   layer (float64 per-KV-head moments collected by the harness on pre-RoPE ``k_proj``/``v_proj``/
   ``q_proj`` outputs, docs/methods.md §1.2) through ``calibrate(stats)``. ``seed`` selects random signs.
3. **Attention over a compressed cache** — ``new_layer_state(layer)`` returns a :class:`LayerState`
   that owns the stored (packed) representation of one layer's cache and computes attention from
   it. Both simulation regimes of docs/methods.md §1.3 come from the same object:

   * ``prefill=True``: exact attention over the new tokens, then the cache is compressed
     (LongBench, PPL track B).
   * ``prefill=False`` (decode semantics): new tokens are compressed on arrival by the method's
     decode rules, then attend. A chunk of T tokens must give exactly what T single-token steps
     give, so one teacher-forced pass from an empty state *is* the Q-all simulation (PPL track A,
     zero-shot log-likelihoods).

Tensors: queries ``[B, Hq, T, d]`` and keys/values ``[B, Hkv, T, d]`` post-RoPE, exactly what the
model's attention sees; ``k_pre`` is the same keys before RoPE (``k_proj`` output, bias included)
and ``rope = (cos, sin)`` with shape ``[B, T, d]`` lets a pre-RoPE codec re-apply the rotation to
its decoded keys (HF ``rotate_half`` convention). Nothing here imports transformers.

Batches: a layer state holds one sequence. The harness gives each row of a batch its own states
and only that row's real tokens (docs/design.md §2.1), so a state never sees padding and B is 1 in
every call it gets from the harness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


class Unsupported(ValueError):
    """A budget the method cannot reach. The harness records status ``unsupported``."""


@dataclass(frozen=True)
class ModelShape:
    """What a method may know about a model: its attention geometry and nothing else."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        return self.n_q_heads // self.n_kv_heads

    @property
    def n_heads_total(self) -> int:
        """N = L * H_kv, the number of KV heads in the model (docs/methods.md §0)."""
        return self.n_layers * self.n_kv_heads


@dataclass
class LayerStats:
    """Calibration moments of one layer, float64, one entry per KV head (docs/methods.md §1.2).

    mu_k, mu_v: [H, d] means of pre-RoPE keys / values.
    cov_k, cov_v: [H, d, d] centered covariances.
    m_q: [H, d, d] uncentered query second moment averaged over the g query heads of each group.
    n_tokens: tokens the moments were computed from.
    k_sample, v_sample: optional [H, n, d] float16 samples of the same calibration tokens, centered
        (k - mu_k, v - mu_v), for the calibrated step of §1.1b; ``None`` unless a method asked for
        them (``calibration_sample_tokens()``). The n tokens are shared by all heads of all layers.
    k_fisher, v_fisher: optional [H, n, d] Fisher information (squared gradients of the calibration
        loss w.r.t. the ``k_proj``/``v_proj`` outputs, float32 or float64) at the sample's tokens;
        ``None`` unless a method asked for it (``calibration_fisher()``).
    """

    mu_k: torch.Tensor
    cov_k: torch.Tensor
    mu_v: torch.Tensor
    cov_v: torch.Tensor
    m_q: torch.Tensor
    n_tokens: int
    k_sample: torch.Tensor | None = None
    v_sample: torch.Tensor | None = None
    k_fisher: torch.Tensor | None = None
    v_fisher: torch.Tensor | None = None


@dataclass(frozen=True)
class Regime:
    """The scored positions a job's headline bpd is the mean over (docs/methods.md §0), for methods
    whose storage depends on the sequence length (fp16 buffers, per-sequence bases, eviction):
    ``"qall"`` = the ``tokens`` query positions of one pass from an empty cache (PPL track A,
    zero-shot); ``"prefill"`` = an exact prefill of ``tokens`` prompt tokens whose own prediction
    reads the compressed prompt, then ``decode`` decoded positions (PPL track B: the 512 targets
    are that prediction and 511 decoded ones; LongBench, RULER)."""

    kind: str = "qall"
    tokens: int = 2048
    decode: int = 0

    def __post_init__(self):
        if self.kind not in ("qall", "prefill"):
            raise ValueError(f"regime kind must be 'qall' or 'prefill', got {self.kind!r}")
        if self.tokens < 1 or self.decode < 0:
            raise ValueError(f"regime needs tokens >= 1 and decode >= 0, got {self.tokens}, {self.decode}")


@dataclass
class Rope:
    """cos/sin of the positions of the tokens passed to ``attend``, each ``[B, T, d]``."""

    cos: torch.Tensor
    sin: torch.Tensor


def held_bits(n_read: torch.Tensor, n_quant: torch.Tensor, quant_bits: float, full_bits: float,
              fixed: float = 0.0) -> torch.Tensor:
    """Bits of one side of a cache that holds ``n_read`` tokens of which ``n_quant`` are stored
    compressed at ``quant_bits`` per token, the rest at ``full_bits`` per token, plus ``fixed``
    (per-sequence bases). Elementwise over query positions (float64 CPU tensors)."""
    return n_quant * quant_bits + (n_read - n_quant) * full_bits + fixed


def query_positions(n0: int, t: int) -> torch.Tensor:
    """Positions n0..n0+t-1 of a chunk's queries as float64 CPU values (for :func:`held_bits`)."""
    return torch.arange(n0, n0 + t, dtype=torch.float64)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF RoPE pairing: dimension i goes with i + d/2 (docs/methods.md §0)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, d] by the positions in ``rope`` (same arithmetic as HF Llama)."""
    cos = rope.cos.unsqueeze(1)
    sin = rope.sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class LayerState:
    """One layer's compressed cache. Subclasses store real packed bytes and attend from them."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float,
        prefill: bool,
        k_pre: torch.Tensor | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Store the new tokens per the method's rules and return attention output [B, Hq, T, d]."""
        raise NotImplementedError

    def stored_bits(self) -> tuple[int, int]:
        """Bits held for keys and for values right now, from the stored representation."""
        raise NotImplementedError

    def read_bits(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the cache held, (bits_K, bits_V) as float64 CPU tensors [T], when each of the T
        queries of the last ``attend`` call read it (docs/methods.md §0); None after a
        ``prefill=True`` call, whose queries read the exact prompt.

        Subclasses set ``self._reads`` in ``attend`` from their stored representation and their
        storage rule (for a chunk of T queries in decode semantics, query i reads what T
        single-token steps would hold at step i), without a device synchronization."""
        return getattr(self, "_reads", None)

    @property
    def n_seen(self) -> int:
        """Tokens that have entered this layer (kept or evicted)."""
        raise NotImplementedError


@dataclass
class KVMethod:
    """Base of every method. Subclasses are dataclasses whose fields are the method's options."""

    name: ClassVar[str] = "base"
    needs_calibration: ClassVar[bool] = False
    #: whether a single teacher-forced pass (Q-all) is meaningful for this method (SnapKV: no)
    supports_in_pass: ClassVar[bool] = True
    #: whether anything about the method depends on the seed (calibration windows aside)
    seeded: ClassVar[bool] = False
    #: token eviction keeps whole tokens, so one budget covers K and V alike (docs/design.md §3)
    evicts_tokens: ClassVar[bool] = False
    #: whether one layer state can take B rows of equal length in one ``attend`` call and give each
    #: row what it gives alone: every operation carries the batch dimension (no group, statistic,
    #: score or kept set pools over rows) and the bits held and read are the same for every row
    #: (they depend on the positions, not the data), so a row's are the state's / B. The harness
    #: then runs a Q-all pass of equal-length rows through one state per layer, not one per row
    #: (docs/design.md §2.1); tests/test_batch_equality.py checks both forms for every method.
    rows_in_one_state: ClassVar[bool] = False
    #: whether, after a Q-all pass, the cache holds exactly what its last query read (a per-token
    #: codec; not one that compresses a window or evicts after the read): then rows of different
    #: lengths, right-padded, can share one state too, each row's end figure being its last read
    holds_last_read: ClassVar[bool] = False

    def configure(self, shape: ModelShape, bpd_k: float | None, bpd_v: float | None) -> None:
        """Choose knobs for the targets; raise :class:`Unsupported` if they cannot be met."""
        raise NotImplementedError

    def set_regime(self, regime: Regime) -> None:
        """Tell the method what its measured bpd will be taken over (before ``configure``). Only
        methods whose cost per token depends on the position use it (SVDq); the default
        :class:`Regime` (Q-all over 2048 positions) applies when the harness says nothing."""
        self._regime = regime

    @property
    def regime(self) -> Regime:
        return getattr(self, "_regime", None) or Regime()

    def calibrate(self, stats: list[LayerStats], seed: int = 0) -> None:
        """Fit per-layer parameters from calibration statistics (calibrated methods only)."""
        if self.needs_calibration:
            raise NotImplementedError

    def new_layer_state(self, layer: int) -> LayerState:
        raise NotImplementedError

    def searches(self) -> tuple[str, ...]:
        """What the harness should choose or measure for this method on calibration-corpus
        windows, by name, each asked at one step of the fit (``kvbench.job.fit``):

        * before ``configure``: ``"select"`` (the method's defaults can be chosen by the job's
          ``select`` search, kvbench/fit/cobra_plus_select.py; run only when the job gives one),
          ``"budget_share"`` (the share of the budget given to a part, compose's ``split``,
          kvbench/fit/budget_share.py), ``"knobs"`` (the configuration among the admissible ones
          at the budget, ``knob_candidates``, chosen by held-out perplexity and handed back through
          ``use_knobs``, kvbench/fit/knob_search.py; docs/methods.md §0.1);
        * after ``configure``: ``"layer_sensitivity"`` (a per-layer measurement handed back
          through the method's ``sensitivity_*`` methods, kvbench/fit/layer_sensitivity.py);
        * after ``calibrate``: ``"measured_keep"`` (the kept fraction refitted to the measured
          headline, through ``set_kept_fraction``/``rho_for``, kvbench/fit/measured_keep.py).

        Data, so the harness never probes a method for capabilities; most methods want nothing."""
        return ()

    def knob_candidates(self, shape: ModelShape, bpd_k: float | None, bpd_v: float | None,
                        limit: int | None = None) -> list[dict]:
        """The configurations admissible at the targets in the method's regime (docs/methods.md
        §0.1: predicted bpd at most 1.02 x each target), each a dict ``use_knobs`` takes, at most
        ``limit`` of them in the method's stated order (the paper setting first when admissible);
        ``[]`` when the method fits nothing here. Asked after ``set_regime``, for a method that
        declares ``"knobs"`` in ``searches()``."""
        return []

    def use_knobs(self, knobs: dict | None) -> None:
        """Make the next ``configure`` take ``knobs`` (one of ``knob_candidates``) instead of the
        method's own preference among the admissible configurations; None: its preference."""
        self._chosen_knobs = None if knobs is None else dict(knobs)

    @property
    def chosen_knobs(self) -> dict | None:
        return getattr(self, "_chosen_knobs", None)

    def calibration_sample_tokens(self) -> int:
        """Calibration tokens per head of the key/value sample ``calibrate`` needs
        (``LayerStats.k_sample``/``v_sample``), asked before ``configure``; 0 (the default) for
        the plain moments."""
        return 0

    def calibration_fisher(self) -> bool:
        """Whether ``calibrate`` needs the Fisher information at the sample's tokens
        (``LayerStats.k_fisher``/``v_fisher``, one backward pass per calibration window,
        kvbench/fit/fisher.py), asked with ``calibration_sample_tokens``; False (the default)."""
        return False

    def knobs(self) -> dict:
        """The knobs chosen by ``configure``/``calibrate`` (logged into result.json)."""
        return {}

    def allocation(self) -> dict[str, torch.Tensor]:
        """How the budget is spread over the model, for a figure: float tensors ``[n_layers,
        n_kv_heads]`` by name, each one number per KV head. Names: ``k_rank`` (latent rank kept),
        ``k_bits`` (mean bits per kept key coordinate), ``k_bpd`` / ``v_bpd`` (the head's bits per
        key / value element), ``kept`` (fraction of the tokens kept). Available after
        ``configure``/``calibrate``; ``{}`` for a method that spreads nothing (the default)."""
        return {}

    def static_bytes(self) -> int:
        """Bytes of the per-model constants fitted by ``calibrate`` (projections, steps, signs,
        means, codebooks): docs/methods.md §0 reports them beside bpd, never in it. 0 for methods that
        store nothing per model."""
        return 0

    def nominal_bpd(self, n_tokens: int) -> tuple[float, float]:
        """The formula's bpd_K, bpd_V for a cache of ``n_tokens`` (docs/methods.md §8), for comparison
        with the measured value."""
        raise NotImplementedError
