"""A token eviction holding KIVI-stored tokens, KIVI's rules on arrival indices (the package
docstring), and compose(snapkv, kivi) with decode=keep as KIVI on the kept sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import LayerState
from ..groupquant import fake_quantize_groups, quantize_dequantize_groups
from ..kivi import KiviLayerState
from ..snapkv import SnapKVLayerState
from .view import ComposedState, kept_positions, state_token_bits


@dataclass
class KiviComposedState(ComposedState):
    """An eviction state holding KIVI-stored tokens, KIVI's rules on arrival indices (package
    docstring). Keys are post-RoPE (KIVI §2.2): ``k_pre``/``rope`` are not used.

    Codec-side edits of held tokens (a key group's flush, a value leaving the residual) are written
    into the eviction's storage (``kept_kv``/``replace_kept_kv``). Held tokens are in ascending
    arrival order in both evictions (H2O keeps ascending positions; SnapKV appends and its
    re-selections keep the held order). The job builds it for H2O and for SnapKV with
    decode=evict; SnapKV with decode=keep, which never evicts after its prefill, gets
    :class:`SnapKiviState` (KIVI's own state on the kept sequence, its one-pass chunk path
    included), and this class on SnapKV is the independent reference the tests hold it to."""

    evict: LayerState
    bits: int
    group: int
    residual: int
    v_bits: int | None
    v_group: int | None

    def __post_init__(self):
        self._arrived = 0  # tokens handed to the codec
        self._flushed = 0  # keys with arrival index below this are quantized (a multiple of R)
        self._prompt = None  # (P, C_0, rank [B, H, P]) after an exact prefill
        self._meta_bits = 32  # fp16 scale + fp16 minimum per group (read from the packed groups)

    # -- arrival indices ------------------------------------------------------------------------
    def arrivals(self) -> torch.Tensor:
        """Arrival index [B, H, C] of every held token, in the eviction's stored order."""
        pos = kept_positions(self.evict)
        if self._prompt is None:
            return pos
        p, c0, rank = self._prompt
        prompt = rank.gather(-1, pos.clamp(max=p - 1))
        return torch.where(pos >= p, pos - p + c0, prompt)

    def _value_group(self, d: int) -> int:
        return self.v_group or min(self.group, d)

    # -- KIVI's storage rule --------------------------------------------------------------------
    def _flush_keys(self, upto: int) -> None:
        """Quantize the held keys with arrival in [flushed, upto) in groups of G arrivals; a
        group's min/max come from its held members only."""
        a0, s = self._flushed, upto - self._flushed
        if s <= 0:
            return
        k, v = self.evict.kept_kv()
        arr = self.arrivals()
        sel = (arr >= a0) & (arr < upto)
        slot = torch.where(sel, arr - a0, s)  # slot s collects the tokens outside the range
        b, h, _, d = k.shape
        x = torch.full((b, h, s + 1, d), float("inf"), dtype=k.dtype, device=k.device)
        x.scatter_(2, slot[..., None].expand(*slot.shape, d), k)
        xg = x[:, :, :s].reshape(b, h, s // self.group, self.group, d)
        mn = xg.amin(dim=3, keepdim=True)
        mn = torch.where(torch.isinf(mn), torch.zeros_like(mn), mn)  # groups with no member
        filled = torch.where(torch.isinf(xg), mn, xg).reshape(b, h, s, d)  # holes take the min
        gp, hat = quantize_dequantize_groups(filled, self.bits, self.group, axis=2)
        self._meta_bits = 8 * (gp.scale.element_size() + gp.minimum.element_size())
        hat = torch.cat([hat, hat.new_zeros(b, h, 1, d)], dim=2)
        k_new = torch.where(sel[..., None], hat.gather(2, slot[..., None].expand(*slot.shape, d)), k)
        self.evict.replace_kept_kv(k_new, v)
        self._flushed = upto

    def _quantize_values(self, lo: int, hi: int) -> None:
        """Quantize the held values with arrival in [lo, hi) (per-token channel groups)."""
        if self.v_bits is None or hi <= lo:
            return
        k, v = self.evict.kept_kv()
        arr = self.arrivals()
        sel = (arr >= lo) & (arr < hi)
        hat = fake_quantize_groups(v, self.v_bits, self._value_group(v.shape[-1]), axis=3)
        self.evict.replace_kept_kv(k, torch.where(sel[..., None], hat, v))

    def _quantize_value(self, a: int) -> None:
        """Quantize the held value of arrival ``a`` (one decode step), in place in the cache."""
        if self.v_bits is None or a < 0:
            return
        _, v = self.evict.kept_kv()
        g = self._value_group(v.shape[-1])
        hit = self.arrivals() == a  # [B, H, C]: at most one held token per head
        j = hit.to(torch.int8).argmax(dim=-1)[..., None, None].expand(*hit.shape[:2], 1, v.shape[-1])
        x = v.gather(2, j)
        hat = fake_quantize_groups(x, self.v_bits, g, axis=3)
        v.scatter_(2, j, torch.where(hit.any(dim=-1)[..., None, None], hat, x))

    def held_bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) codec bits held now (0-dim float64 tensors), from the held tokens' arrivals."""
        n = self.evict.n_kept
        if n == 0:
            z = torch.zeros((), dtype=torch.float64)
            return z, z
        k, _ = self.evict.kept_kv()
        b, h, _, d = k.shape
        g_v = self._value_group(d)
        per_qv = self.v_bits * d + (d // g_v) * self._meta_bits if self.v_bits is not None else 16 * d
        r = self.residual
        arr = self.arrivals()
        qk = arr < self._flushed
        gid = torch.div(arr, self.group, rounding_mode="floor")
        first = torch.ones_like(qk)
        first[..., 1:] = gid[..., 1:] != gid[..., :-1]  # ascending arrivals: a group starts here
        n_all = float(arr.numel())
        n_qk = qk.sum().to(torch.float64)
        alive = (first & qk).sum().to(torch.float64)
        bits_k = n_qk * self.bits * d + (n_all - n_qk) * 16 * d + alive * self._meta_bits * d
        n_qv = (arr < self._arrived - r).sum().to(torch.float64)
        bits_v = n_qv * per_qv + (n_all - n_qv) * 16 * d
        return bits_k.cpu(), bits_v.cpu()

    # -- attention ------------------------------------------------------------------------------
    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            pos = kept_positions(self.evict)
            p, c0 = k.shape[2], pos.shape[-1]
            rank = pos.argsort(dim=-1).argsort(dim=-1)  # arrival = rank in position order
            rank_of = torch.zeros(*pos.shape[:2], p, dtype=torch.long, device=pos.device)
            rank_of.scatter_(-1, pos, rank)
            self._prompt = (p, c0, rank_of)
            self._arrived = c0
            self._flush_keys(self.residual * (c0 // self.residual))
            self._quantize_values(0, max(0, c0 - self.residual))
            self._reads = None
            return out
        outs, reads_k, reads_v = [], [], []
        new_tok = 16.0 * k.shape[0] * k.shape[1] * k.shape[3]  # a new token is read at fp16
        state = None
        r = self.residual
        for j in range(k.shape[2]):
            held_k, held_v = self.held_bits()
            count = self.evict.n_kept + 1  # every held token and the new one
            sl = slice(j, j + 1)
            qj, kj, vj = q[:, :, sl], k[:, :, sl], v[:, :, sl]
            outs.append(self.evict.attend(qj, kj, vj, scaling=scaling, prefill=False))
            if state is None:  # state bits per held token: constant for a layer
                state = state_token_bits(self.evict)
            reads_k.append(held_k + new_tok + count * state[0])
            reads_v.append(held_v + new_tok + count * state[1])
            self._arrived += 1
            self._flush_keys(r * (self._arrived // r))
            self._quantize_value(self._arrived - r - 1)
        self._reads = (torch.stack(reads_k), torch.stack(reads_v))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def stored_bits(self):
        if self.evict.n_kept == 0:
            return 0, 0
        hk, hv = self.held_bits()
        sk, sv = state_token_bits(self.evict)
        n = self.evict.n_kept
        return round(float(hk) + n * sk), round(float(hv) + n * sv)


class SnapKiviState(LayerState):
    """compose(snapkv, kivi) with decode=keep: SnapKV selects at the end of the exact prefill and
    never evicts after it, so the composition is KIVI on the kept sequence (arrival = index, package
    docstring). The kept prompt, in position order, is handed to KIVI's own layer state as its prompt
    (``KiviLayerState.store_prompt``); from there KIVI stores, attends and counts by its own rules,
    its one-pass form of a decode chunk included (PPL track B's 512 scored targets are one call,
    not 512). SnapKV keeps no state beyond the tokens, so the bits are KIVI's."""

    def __init__(self, evict: SnapKVLayerState, kivi: KiviLayerState):
        self.evict, self.kivi = evict, kivi
        self._dropped = 0  # prompt tokens SnapKV evicted

    def attend(self, q, k, v, *, scaling, prefill, k_pre=None, rope=None):
        if prefill:
            out = self.evict.attend(q, k, v, scaling=scaling, prefill=True)
            k_kept, v_kept = self.evict.kept_kv()
            self.kivi.store_prompt(k_kept, v_kept)
            self._dropped = k.shape[2] - k_kept.shape[2]
            self.evict = None  # its tokens now live in the KIVI state
            self._reads = None
            return out
        if self.evict is not None:  # nothing prefilled: SnapKV's own refusal (no one-pass form)
            return self.evict.attend(q, k, v, scaling=scaling, prefill=False)
        out = self.kivi.attend(q, k, v, scaling=scaling, prefill=False)
        self._reads = self.kivi.read_bits()
        return out

    def stored_bits(self):
        return self.kivi.stored_bits()

    @property
    def n_seen(self):
        return self._dropped + self.kivi.n_seen

    @property
    def n_kept(self) -> int:
        return self.kivi.n_seen
