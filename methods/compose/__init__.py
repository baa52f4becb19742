"""compose(evict, codec): token eviction x KV codec in one cache (docs/methods.md §12).

The eviction method (H2O §6, SnapKV §7) decides which tokens stay; the codec (KIVI §2, KQ-SVD §4,
KV-COBRA §5, FP16, later ones) stores the kept tokens' keys and values. Both are registered methods,
built with their own options and used through their own layer states; compose adds only the
wiring and the bit count (a wrapper in the spirit of kvpress's ``ComposedPress``, never a copy).

**Order: evict, then encode** [§12 decision]. Why: eviction decisions are made from what a
deployed compressed cache would hold and compute (H2O's scores from attention over decoded keys),
and a token about to be dropped is never encoded (after an exact prefill it costs no codec work and
does not widen a KIVI group's range). The eviction state holds the *decoded* form of the kept
tokens, so it attends, scores and evicts from what the compressed cache really holds:

* ``prefill=True`` (prefill-exact: PPL track B, LongBench): the eviction attends exactly and selects
  as it does alone (H2O: column sums of the exact prefill attention; SnapKV: the observation
  window); then only the kept tokens are encoded (a token about to be dropped is never encoded),
  with their own RoPE positions, and their decoded form replaces the exact one in the eviction
  state (``replace_kept_kv``). Decoding continues per the two methods' rules.
* ``prefill=False`` (decode semantics: Q-all, PPL track A; decode steps): each new token is encoded
  on arrival and handed decoded to the eviction state, which attends over the decoded cache, adds
  *that* attention to H2O's scores and evicts; an evicted token's stored form is dropped. A chunk of
  T tokens gives what T single steps give (token-wise codecs: the chunk goes to H2O at once, and
  H2O's own chunk = steps property carries over; KIVI: steps, below).

**Token-wise codecs** (``CodecLayerState``: FP16, KQ-SVD, KV-COBRA-MSE/KL, any later one): every
token is encoded on its own, so they compose per token. Bits: each encode call's packed size
(measured from the codec's packed objects) spread evenly over the tokens it encoded; a kept token
costs that, an evicted one nothing.

**KIVI** (``KiviLayerState``): its rules act on the **arrival index** a of a token in the stream the
codec receives (the kept prompt in position order after an exact prefill, then every decoded
token; in Q-all the position itself). After n arrivals, key a is stored quantized iff
a < R*floor(n/R) and value a iff a < n - R (§2.3); key groups are G consecutive arrivals; with
nothing evicted this is KIVI on the kept sequence (SnapKV: exactly; keep=1: exactly KIVI). Under
H2O's decode eviction:

* a token evicted while in the fp16 residual is simply dropped (16 bits per element saved); it never
  joins a quantization group, and a key group formed at a flush has only its kept members (their
  min/max set the group's scale and zero point);
* a token evicted from a quantized key group loses its b-bit codes (the group's codes are compacted,
  which needs no requantization: the scale and minimum stay valid), but the group's fp16 scale and
  minimum (32 bits per channel) stay stored and counted until every member of the group is evicted;
  the remaining members keep their decoded values. A quantized value (per-token groups) goes with
  its token.

The reads (what each query held, docs/methods.md §0) are exact per head from these rules. Under
H2O, KIVI's per-query mix of exact and quantized versions changes with the query position and
eviction, so a decode chunk runs token by token through the eviction state (one pass = decoding
by construction). SnapKV with ``decode="keep"`` never evicts after its prefill, so compose(snapkv,
kivi) hands the kept prompt to KIVI's own layer state (:class:`SnapKiviState`) and a chunk takes
KIVI's one-pass path: PPL track B's 512 targets in one call instead of 512. With ``decode="evict"``
(``evict_options={decode: evict}``, §7.3) SnapKV re-selects while decoding, and the arrival-index
state above runs it as it runs H2O: an evicted token's codes are dropped, its key group's scale and
minimum stay until the group is empty.

**Positions of kept tokens** (§12.3). A post-RoPE codec (KIVI, FP16) stores keys already rotated:
the eviction needs no positions. A pre-RoPE codec (:data:`PRE_ROPE_CODECS`) stores keys before
rotation, and each held key is rotated at its original position when read; once a token is evicted
the slot no longer implies it, so the token-wise state stores the held positions
(:class:`KeptPositions`), per KV head, packed, as the cheaper of two exact encodings: fixed-width
positions of w = ⌈log₂ n_seen⌉ bits each (every held position is below the n_seen tokens seen so
far; the width grows by one bit when n_seen passes a power of two, and is at most the spec's 16 for
n_seen ≤ 65,536), or a kept mask of one bit per seen position (cheaper when more than about 1/w of
the tokens are held). Nothing evicted: nothing stored (the slots are the positions). The rotation
of the kept prompt after an exact prefill reads its positions from that stored form, and the bits
count on the key side (values are not rotated), in ``stored_bits``, in the reads and in the fit.

**Budget** (§12): bpd = kept share x codec bits per kept element + eviction state (H2O: an fp32
score per kept token and KV head, 16/d per element and side; SnapKV: none) + the positions of a
pre-RoPE codec (key side). Without ``v_bpd`` the target applies to K and V alike (as for H2O). The
kept share is measured over the job's regime (``set_regime``) by the headline rule of docs/methods.md §0, the mean over the scored positions of what each one read: in Q-all every query position; in
prefill-exact regimes the decoded positions after the P-token prefill (H2O evicts back to its
prefill budget; SnapKV with decode=keep keeps every decoded token, with decode=evict re-selects),
or the cache at the end of the prefill when the regime decodes nothing.
``keep=rho`` fixes the eviction's kept fraction (H2O: heavy_ratio + recent_ratio = rho, SnapKV:
C = round(rho * P)); the codec then gets
target / (predicted kept share) - state bits per kept element, each side, lowered to the nearest
value its own ``configure`` accepts. Otherwise a *split* rho_0 (``split``; by default chosen from
{1/2, 1/4, 1/8} by the harness on the calibration corpus, ``kvbench/fit/budget_share.py``;
:data:`DEFAULT_SPLIT` when nothing chooses) sets the codec's budget the same way, and the kept
fraction rho is then fitted (bisection) so that the predicted measured bpd_KV equals the target:
the codec's grid and its fp16 residual (KIVI) are paid for by keeping fewer tokens. Where no rho
reaches the target at the split's codec budget, the codec's budget steps down its own grid until
one does (logged in the knobs' ``note``); a target no rho reaches even at the codec's lowest budget
is :class:`Unsupported` with the reachable range. Example (SmolLM2, PPL track B, split 1/4,
SnapKV with decode=evict): KIVI (R = 128) stores the last 128 arrived values at fp16, so bpd_KV = 1
keeps rho ~ 0.10 (about 160 tokens at the end of the prefill) at 3-bit codes (G = 64); with
decode=keep the 511 appended targets alone put the reachable range at bpd_KV >= 0.96 (split 1/8).

Decisions where docs/methods.md is silent:

* Codec choices: every registered method that does not evict, except compose itself and
  :data:`UNSUPPORTED_CODECS`, whose layer states are neither token-wise nor KIVI's layout: SVDq
  (token groups in a per-sequence latent basis with their own fp16 buffer), GEAR (blocks with a
  per-block low-rank factor and an fp16 buffer) and KVQuant (an exact first token and per-token
  outlier lists).
* SnapKV's ``gqa="repeat"`` (g copies per KV head, §7.2) and an explicit ``capacity`` are refused:
  compose sets the capacity from rho, one kept set per KV head.
* The prediction that fits rho uses the codec's ``nominal_bpd(n)`` on the kept count n: exact for
  token-wise codecs and for KIVI under SnapKV with decode=keep (KIVI on the kept sequence); for
  KIVI under an eviction that evicts while decoding it ignores which kept tokens sit in the fp16
  residual and the partly evicted groups' metadata (``Compose.prediction_exact`` is False). There
  the harness refits rho, at the codec's budgets, to the headline measured on calibration-corpus
  windows of the job's regime (``kvbench/fit/measured_keep.py``): compose(h2o, kivi) on SmolLM2,
  PPL track B, target 0.5: 0.344 measured at the predicted rho 0.0345, 0.5005 at the refitted
  0.0525 after four measurements, 0.501 on the evaluation window. The reported figure is always
  the evaluation's own measurement.
* Stored positions (pre-RoPE codecs): the width grows with the tokens seen instead of being fixed
  at ⌈log₂ T_max⌉ for a model's whole window, the cheapest fixed-width exact code for what the
  cache holds at that moment; the mask alternative makes the cost at most one bit per seen token
  and KV head (1/d bpd_K). H2O's own ``count_indices`` would count a second copy, so it is refused
  with a pre-RoPE codec. The working copy holds each key rotated once, at encode time, from these
  positions (the prefill's kept keys) or its arrival position (a decoded key); a fused kernel would
  rotate on every read from the same stored positions.
* The fit targets bpd_KV, the mean of the two sides (the KV-track axis, §0): a codec whose sides
  land on different grid points (integer b_V of KV-COBRA, KIVI's full value residual) ends with one
  side above and one below its own target; both are reported.
* Per-token codec bits are measured per encode call; the only non-uniformity, < 8 padding bits per
  call of a bit-packed codec, is spread over the call's tokens. Packed streams are not retained
  after encoding (the eviction would have to compact them): the eviction state holds the decoded
  tokens and attention reads them, so a composed cache's resident bytes exceed its stored bytes
  (the other layer states hold their stored form alone, docs/design.md §2).
* The eviction state's own accounting gives its state bits: its stored bits minus 16 per kept
  element (H2O: the score, plus positions with ``count_indices``).
* The eviction is configured through its own bpd mapping at rho (H2O with ``budget="nominal"``,
  since compose fits rho to the measured figure itself); the codec is not told the job's regime
  (it stores a kept sequence; its per-kept-element budget is nominal).
* KIVI's decode steps quantize one value per step in place in the eviction's storage; a flush
  replaces the kept keys (every R arrivals).

Files: :mod:`.method` (the options, the codec's share and the fit of the kept fraction),
:mod:`.tokenwise` and :mod:`.kivi_state` (the two composed layer states), :mod:`.view` (what they
read from the eviction state), :mod:`.positions` (the stored positions of §12.3).
"""

from __future__ import annotations

from .kivi_state import KiviComposedState, SnapKiviState
from .method import (
    DEFAULT_SPLIT,
    EVICTIONS,
    PRE_ROPE_CODECS,
    RHO_MIN,
    SPLITS,
    UNSUPPORTED_CODECS,
    Compose,
    codec_choices,
)
from .positions import KeptPositions, position_bits, position_width
from .tokenwise import TokenwiseComposedState

__all__ = [
    "Compose",
    "DEFAULT_SPLIT",
    "EVICTIONS",
    "KeptPositions",
    "KiviComposedState",
    "PRE_ROPE_CODECS",
    "RHO_MIN",
    "SPLITS",
    "SnapKiviState",
    "TokenwiseComposedState",
    "UNSUPPORTED_CODECS",
    "codec_choices",
    "position_bits",
    "position_width",
]
