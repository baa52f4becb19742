"""Token-wise codecs shared by KV-COBRA and KQ-SVD (docs/methods.md §4.2, §5.7, §5.8).

* :class:`LatentKeyCodec` (pre-RoPE keys): per KV head ``c = E (k - mu)`` (E = encoder rows
  [r_h, d]), fixed-step quantization of coordinate j with its own step and bit width (§1.1),
  ``k_hat = mu + D^T c_hat`` (D = decoder rows; D = E for KV-COBRA, B^T for KQ-SVD). Heads of one
  layer have different ranks; the parameters are zero-padded to the layer's largest rank and the
  padded coordinates carry 0 bits.
* :class:`RotatedValueCodec` (§5.8): ``v' = H_d D_s (v - mu)`` (normalized Hadamard, random signs),
  one global integer width b_V with step s*(b_V) sigma_V per head (``step="gauss"``), or m_h times
  that with the calibrated multiplier m_h of §1.1b (``step="calibrated"``).
* :class:`KiviValueCodec` (§5.8 ablation): KIVI per-token groups of G channels, asymmetric min-max,
  fp16 scale and minimum (:mod:`methods.groupquant`); bpd_V = b + 32/G.

Packing (what ``bits`` counts): the codes of one encode call form one bit stream, row-major over
tokens (batch, then position), then heads, then coordinates, each code with exactly its width
(:func:`methods.gaussquant.pack_codes`). A token of a layer therefore costs exactly
``sum_h B_h`` bits and is addressable at offset ``t * sum_h B_h`` without per-token alignment; the
only padding is the last partial byte of each call's stream (< 8 bits per layer and call: 0 in one
teacher-forced pass whenever ``T * sum_h B_h`` is a multiple of 8, at most 7 bits per decoded token
and layer otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import LayerStats, Unsupported
from .codec_state import Codec, ExactCodec, head_matmul
from .gaussquant import (
    calibrated_multipliers, dequantize, optimal_step, pack_codes, prepare_layout, quantize, rows_per_byte_boundary,
    unpack_calls, unpack_codes,
)
from .groupquant import GroupPacked, dequantize_groups, quantize_groups
from .hadamard import haar_orthogonal, hadamard, random_signs


STEP_MODES = ("gauss", "calibrated")  # §1.1 Gaussian-optimal step | §1.1b calibrated step
SAMPLE_TOKENS = 4096  # §1.1b: calibration tokens per head the calibrated step asks for


def sample_tokens_for(step: str, configured: bool, keys_quantized: bool, v_bits, v_quant: str) -> int:
    """Calibration tokens per head a codec with ``step`` wants (§1.1b), 0 if none. Before
    ``configure`` (the harness calibrates first) any ``step="calibrated"`` asks; once configured,
    only if keys or rotated values are quantized."""
    if step != "calibrated":
        return 0
    if not configured:
        return SAMPLE_TOKENS
    return SAMPLE_TOKENS if keys_quantized or (v_bits is not None and v_quant == "hadamard") else 0


def check_step(name: str, step: str) -> None:
    if step not in STEP_MODES:
        raise ValueError(f"{name}: step={step!r} not in {STEP_MODES}")


def centered_samples(stats: list[LayerStats], side: str, mu: torch.Tensor) -> list[torch.Tensor] | None:
    """Per KV head (layer-major, N = L H) the calibration sample of keys (``side="k"``) or values
    (``"v"``) minus ``mu`` [N, d], float64 [n, d] each; None when the statistics hold no sample."""
    samples = [getattr(st, f"{side}_sample") for st in stats]
    if any(x is None for x in samples):
        return None
    mu = mu.cpu().to(torch.float64).reshape(len(stats), -1, mu.shape[-1])  # [L, H, d]
    out = []
    for st, x, m in zip(stats, samples, mu):  # stored centered at the statistics' own mean
        shift = getattr(st, f"mu_{side}").cpu().to(torch.float64) - m
        out += list((x.to(torch.float64) + shift[:, None, :]).unbind(0))
    return out


def step_multipliers(step: str, groups, bits, n_tokens: int, prefix: str = "") -> tuple[torch.Tensor | None, dict]:
    """§1.1b multipliers m_g (Delta / (s*(b) sigma)) of normalized sample groups, with their knobs;
    (None, knobs) for ``step="gauss"``, or for "calibrated" when ``groups`` is None (statistics
    without a sample: the Gaussian step is used and the knobs say so)."""
    if step == "gauss":
        return None, {f"{prefix}step": "gauss"}
    if groups is None:
        return None, {f"{prefix}step": "gauss", f"{prefix}step_fallback": "calibrated step asked for, but the calibration statistics hold no sample"}
    if not groups:  # nothing quantized (every head at rank 0)
        return torch.zeros(0, dtype=torch.float64), {f"{prefix}step": "calibrated", f"{prefix}step_sample_tokens": int(n_tokens)}
    mult, _ = calibrated_multipliers(groups, bits)
    return mult, {
        f"{prefix}step": "calibrated",
        f"{prefix}step_multiplier_range": [float(mult.min()), float(mult.max())],
        f"{prefix}step_multiplier_median": float(mult.median()),
        f"{prefix}step_sample_tokens": int(n_tokens),
    }


def sub_seed(seed: int, layer: int, head: int, salt: int) -> int:
    """A deterministic per-(layer, head, use) seed derived from the run seed."""
    return (int(seed) * 1_000_003 + layer * 10_007 + head * 101 + salt) % (2**62)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _on(cache: dict, tensors: tuple, device, dtype) -> tuple:
    """``tensors`` moved to ``device`` (floating ones cast to ``dtype``), cached per (device, dtype)."""
    key = (str(device), dtype)
    if key not in cache:
        cache[key] = tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in tensors)
    return cache[key]


@dataclass
class PackedCodes:
    """One encode call: ``data`` the uint8 stream (or float latents when not quantizing)."""

    data: torch.Tensor
    shape: tuple  # (B, H, T, d) of the encoded block
    dtype: torch.dtype  # arithmetic dtype (float64 for float64 inputs, else float32)
    raw: bool = False


class LatentKeyCodec(Codec):
    """Projection + per-coordinate fixed-step quantization of pre-RoPE keys (see module doc).

    mu [H, d]; enc, dec [H, r, d]; step [H, r]; width [H, r] (0 = padding). ``quantize=False``
    stores the float latents (a test mode, counted at 32 bits per latent).

    Decisions where docs/methods.md is silent (a few batched ops per call, for the
    GPU's launch cost): every slot of the padded [H, r_max] layout is quantized, packed and decoded
    together, with per-slot constants prepared once per (device, dtype) (:meth:`_params`); a slot of
    width 0 (padding, or a coordinate given no bits) packs no bits and decodes to exactly 0, so the
    stream, the bits and the decoded keys are those of the active slots alone. :meth:`encode_decode`
    (what a cache layer calls on arrival) dequantizes the codes it has just packed instead of
    unpacking them again: the same codes (:func:`methods.gaussquant.unpack_codes` inverts
    :func:`~methods.gaussquant.pack_codes` exactly), one pass fewer."""

    pre_rope = True

    def __init__(self, mu, enc, dec, step, width, quantize: bool = True):
        self.mu = mu.to(torch.float64)
        self.enc = enc.to(torch.float64)
        self.dec = dec.to(torch.float64)
        self.step = step.to(torch.float64)
        self.width = width.long()
        self.slots = self.width.numel()  # H * r_max latent slots, padded ones have 0 bits
        self.active = torch.nonzero(self.width.reshape(-1) > 0).reshape(-1)  # index: no device sync
        self.widths = self.width.reshape(-1)[self.active]
        self.padded = self.active.numel() < self.slots  # some slots carry 0 bits (ragged ranks)
        self.steps = self.step.reshape(-1)[self.active]
        self.slot_widths = tuple(self.width.reshape(-1).tolist())  # the packing layout, all slots
        on = self.width > 0
        w = self.width.to(torch.float64)
        half = torch.where(on, torch.exp2(w - 1), 0.0)
        self._slot = tuple(x[:, None, :] for x in (  # float64 [H, 1, r] per slot: quantizer step,
            torch.where(on, self.step, 1.0), half, torch.exp2(w) - 1, torch.zeros_like(half),  # half,
            0.5 - half, torch.where(on, self.step, 0.0),  # top code, 0, offset, decoder step
        ))
        self.quantize = quantize
        self._cache: dict = {}

    def static_bits(self) -> int:
        """fp16 mean [H, d], the active projection rows (encoder, and the decoder when it differs
        from the encoder) and steps at fp16, and a 4-bit width per slot (widths <= 8 bits)."""
        d = self.mu.shape[-1]
        rows = int(self.active.numel())
        same = self.enc.shape == self.dec.shape and torch.equal(self.enc, self.dec)
        return 16 * (self.mu.numel() + rows * d * (1 if same else 2) + rows) + 4 * self.slots

    @classmethod
    def from_heads(cls, mu, heads, quantize: bool = True) -> "LatentKeyCodec":
        """One layer from per-head (P [r_h, d], steps [r_h], widths [r_h]) with P both encoder and
        decoder (orthonormal rows), zero-padded to the largest r_h."""
        d = mu.shape[-1]
        rmax = max(p.shape[0] for p, _, _ in heads)
        enc = torch.zeros(len(heads), rmax, d, dtype=torch.float64)
        step = torch.ones(len(heads), rmax, dtype=torch.float64)
        width = torch.zeros(len(heads), rmax, dtype=torch.long)
        for j, (p, s, w) in enumerate(heads):
            r = p.shape[0]
            enc[j, :r], step[j, :r], width[j, :r] = p, s, w
        return cls(mu, enc, enc, step, width, quantize=quantize)

    def _params(self, device, dtype):
        """(mu, enc, dec, active, quantizer step, half, top, zeros, offset, decoder step) on
        ``device`` (the per-slot ones [H, 1, r]: :attr:`_slot`); the packing layout is prepared
        with them, so that no later call builds one."""
        key = (str(device), dtype)
        if key not in self._cache:
            prepare_layout(self.slot_widths, device)
        return _on(self._cache, (self.mu, self.enc, self.dec, self.active, *self._slot), device, dtype)

    def _latents(self, x):
        """(c [B, H, T, r] latents of every slot, params): one bmm over the heads, whose output
        is already in this layout (no copy)."""
        p = self._params(x.device, _compute_dtype(x))
        mu, enc = p[0], p[1]
        return torch.einsum("bhtd,hrd->bhtr", x.to(enc.dtype) - mu[None, :, None, :], enc), p

    @staticmethod
    def _codes(c, p):
        """§1.1 codes of every slot as exact integers in c's dtype: clamp(floor(c / step) + half,
        0, 2^b - 1) (:func:`methods.gaussquant.quantize`; 0 in a width-0 slot)."""
        step, half, top, zero = p[4], p[5], p[6], p[7]
        return torch.clamp(torch.floor(c / step) + half, zero, top)

    @staticmethod
    def _reconstruct(codes, p):
        """k_hat [B, H, T, d] = mu + D^T c_hat from the codes [B, H, T, r]
        (:func:`methods.gaussquant.dequantize`: (code - 2^(b-1) + 1/2) step, 0 in a width-0 slot)."""
        mu, dec, offset, dstep = p[0], p[2], p[8], p[9]
        c = (codes.to(offset.dtype) + offset) * dstep
        return mu[None, :, None, :] + torch.einsum("bhtr,hrd->bhtd", c, dec)

    def encode(self, x):
        return self.encode_decode(x, decode=False)[0]

    def encode_decode(self, x, decode: bool = True):
        b, h, t, d = x.shape
        c, p = self._latents(x)
        if not self.quantize:
            flat = c.transpose(1, 2).reshape(b * t, -1)
            packed = PackedCodes(flat.index_select(1, p[3]) if self.padded else flat, (b, h, t, d), p[0].dtype, raw=True)
            return packed, (self.decode(packed) if decode else None)
        codes = self._codes(c, p)
        rows = torch.empty(b, t, h, c.shape[-1], dtype=torch.uint8, device=x.device)
        rows.copy_(codes.transpose(1, 2))  # token-major rows (the stream's order), cast in one op
        packed = PackedCodes(pack_codes(rows.view(b * t, -1), self.slot_widths), (b, h, t, d), p[0].dtype)
        return packed, (self._reconstruct(codes, p) if decode else None)

    def _unflatten(self, flat, shape):
        """[B*T, S] (token-major) -> [B, H, T, r]."""
        b, h, t, d = shape
        return flat.reshape(b, t, h, self.slots // h).transpose(1, 2)

    def decode(self, packed):
        b, h, t, d = packed.shape
        p = self._params(packed.data.device, packed.dtype)
        if not packed.raw:
            codes = unpack_codes(packed.data, self.slot_widths, b * t)
            return self._reconstruct(self._unflatten(codes, packed.shape), p)
        c = packed.data
        if self.padded:
            c = torch.zeros(b * t, self.slots, dtype=packed.dtype, device=packed.data.device)
            c.scatter_(1, p[3].expand(b * t, -1), packed.data)
        mu, dec = p[0], p[2]
        return mu[None, :, None, :] + torch.einsum("bhtr,hrd->bhtd", self._unflatten(c, packed.shape), dec)

    def bits(self, packed):
        return packed.data.numel() * (32 if packed.raw else 8)

    def parts(self, packed):
        return (packed.shape, packed.dtype, packed.raw), {"data": packed.data}, {}

    def decode_stored(self, store):
        """Every stored call: its codes unpacked and dequantized (all calls in one pass when each
        call's stream ends on a whole row group, the usual case: a token's bits fill whole bytes;
        else one pass per run), then one product per run and head
        (:func:`methods.codec_state.head_matmul`) and the mean."""
        runs = store.runs()
        if any(raw for (_, _, raw), *_ in runs):
            return super().decode_stored(store)
        dtype = runs[0][0][1]
        data = store.flat("data")
        p = self._params(data.device, dtype)
        mu, dec, offset, dstep = p[0], p[2], p[8], p[9]
        h = offset.shape[0]
        g = rows_per_byte_boundary(self.slot_widths)
        whole = [calls * shape[0] * shape[2] for (shape, _, _), calls, _, _ in runs]
        if all((shape[0] * shape[2]) % g == 0 for (shape, _, _), *_ in runs):
            codes = [unpack_codes(data, self.slot_widths, sum(whole), dtype=offset.dtype)]
        else:
            codes = [unpack_calls(parts["data"], self.slot_widths, shape[0] * shape[2], dtype=offset.dtype)
                     for (shape, _, _), _, parts, _ in runs]
        codes = [(c.view(c.shape[0], h, -1) + offset[:, 0]) * dstep[:, 0] for c in codes]
        b, d = runs[0][0][0][0], dec.shape[-1]
        out = torch.empty(b, h, sum(calls * shape[2] for (shape, _, _), calls, _, _ in runs), d,
                          dtype=codes[0].dtype, device=data.device)
        rows = pos = 0
        for i, (((b, _, t, _), _, _), calls, _, _) in enumerate(runs):
            c = codes[0][rows : rows + whole[i]] if len(codes) == 1 else codes[i]
            y = head_matmul(c.view(calls, b, t, h, -1).transpose(2, 3), dec)  # [S, B, H, t, d]
            # + the mean, written in place: the runs laid end to end without a copy of the layer
            torch.add(mu[None, :, None, None, :], y.permute(1, 2, 0, 3, 4),
                      out=out[:, :, pos : pos + calls * t].view(b, h, calls, t, d))
            rows, pos = rows + whole[i], pos + calls * t
        return out

    def decode_calls(self, layout, calls, parts, ragged):
        """The calls' codes unpacked together, then :meth:`_reconstruct`'s arithmetic with one
        product per call and head (:func:`methods.codec_state.head_matmul`)."""
        shape, dtype, raw = layout
        data = parts["data"]
        if calls == 1:
            return self.decode(PackedCodes(data[0], shape, dtype, raw))[None]
        b, h, t, d = shape
        p = self._params(data.device, dtype)
        mu, dec, offset, dstep = p[0], p[2], p[8], p[9]
        if raw:  # float latents of the active slots, [calls, B T, active]
            c = data.reshape(calls * b * t, -1)
            if self.padded:
                full = torch.zeros(c.shape[0], self.slots, dtype=dtype, device=data.device)
                c = full.scatter_(1, p[3].expand(c.shape[0], -1), c)
            c = c.reshape(calls, b, t, h, -1).transpose(2, 3)
        else:
            codes = unpack_calls(data, self.slot_widths, b * t).reshape(calls, b, t, h, -1).transpose(2, 3)
            c = (codes.to(offset.dtype) + offset) * dstep
        return mu[None, None, :, None, :] + head_matmul(c, dec)


class RotatedValueCodec(Codec):
    """§5.8: v' = rot_h (v - mu_h) with rot_h = H_d D_s / sqrt(d); b bits, step step_h per head."""

    def __init__(self, rot, step, bits: int, mu):
        self.rot = rot.to(torch.float64)  # [H, d, d]
        self.step = step.to(torch.float64)  # [H]
        self.nbits = int(bits)
        self.mu = mu.to(torch.float64)  # [H, d]
        self._cache: dict = {}

    def _params(self, device, dtype):
        return _on(self._cache, (self.rot, self.step, self.mu), device, dtype)

    def static_bits(self) -> int:
        """The rotation H_d D_s / sqrt(d) is a fixed Hadamard and d random signs per head (1 bit
        each; a Haar rotation, where no Hadamard order d exists, is d x d fp16); the step and the
        mean at fp16."""
        h, d = self.mu.shape
        signs = bool(torch.allclose(self.rot.abs(), torch.full_like(self.rot, d ** -0.5)))
        rotation = h * d if signs else 16 * self.rot.numel()
        return rotation + 16 * (self.step.numel() + self.mu.numel())

    def _widths(self, d: int) -> tuple[int, ...]:
        """The packing layout of one token's d codes (a tuple: no tensor per call)."""
        return (self.nbits,) * d

    def encode(self, x):
        return self.encode_decode(x, decode=False)[0]

    def encode_decode(self, x, decode: bool = True):
        """(packed, decoded): the decoded values are dequantized from the codes just packed
        (:meth:`decode` of the stored bytes gives the same tensor)."""
        b, h, t, d = x.shape
        dt = _compute_dtype(x)
        rot, step, mu = self._params(x.device, dt)
        y = torch.einsum("bhtd,hed->bhte", x.to(dt) - mu[None, :, None, :], rot)
        codes = quantize(y, step[None, :, None, None], self.nbits)
        packed = PackedCodes(pack_codes(codes.reshape(-1, d), self._widths(d)), (b, h, t, d), dt)
        return packed, (self._reconstruct(codes, step, mu, rot) if decode else None)

    def _reconstruct(self, codes, step, mu, rot):
        y = dequantize(codes, step[None, :, None, None], self.nbits)
        return mu[None, :, None, :] + torch.einsum("bhte,hed->bhtd", y, rot)

    def decode(self, packed):
        b, h, t, d = packed.shape
        rot, step, mu = self._params(packed.data.device, packed.dtype)
        codes = unpack_codes(packed.data, self._widths(d), b * h * t).reshape(b, h, t, d)
        return self._reconstruct(codes, step, mu, rot)

    def bits(self, packed):
        return packed.data.numel() * 8

    def parts(self, packed):
        return (packed.shape, packed.dtype), {"data": packed.data}, {}

    def decode_calls(self, layout, calls, parts, ragged):
        """The calls' codes unpacked together, then :meth:`_reconstruct` with one product per call
        and head (:func:`methods.codec_state.head_matmul`)."""
        shape, dtype = layout
        data = parts["data"]
        if calls == 1:
            return self.decode(PackedCodes(data[0], shape, dtype))[None]
        b, h, t, d = shape
        rot, step, mu = self._params(data.device, dtype)
        codes = unpack_calls(data, self._widths(d), b * h * t).reshape(calls, b, h, t, d)
        y = dequantize(codes, step[None, None, :, None, None], self.nbits)
        return mu[None, None, :, None, :] + head_matmul(y, rot)


class KiviValueCodec(Codec):
    """KIVI's per-token value quantizer without a residual window (every token on arrival)."""

    def __init__(self, bits: int, group: int):
        self.nbits, self.group = int(bits), int(group)

    def encode(self, x):
        return quantize_groups(x, self.nbits, self.group, axis=-1)

    def decode(self, packed):
        return dequantize_groups(packed)

    def bits(self, packed):
        return packed.bits()

    def parts(self, packed):
        layout = (packed.nbits, packed.group, packed.axis, packed.shape, packed.dtype)
        return layout, {"codes": packed.codes, "scale": packed.scale, "minimum": packed.minimum}, {}

    def decode_calls(self, layout, calls, parts, ragged):
        """Elementwise: the calls stacked into the batch axis and dequantized at once."""
        nbits, group, axis, shape, dtype = layout
        b, h, t, d = shape
        merged = {k: v.reshape(calls * b, *v.shape[2:]) for k, v in parts.items()}
        gp = GroupPacked(merged["codes"], merged["scale"], merged["minimum"], nbits, group, axis,
                         (calls * b, h, t, d), dtype)
        return dequantize_groups(gp).reshape(calls, b, h, t, d)


def orthogonal_mixer(d: int, seed: int) -> tuple[torch.Tensor, str]:
    """H_d D_s / sqrt(d) when a Hadamard order d exists, else a seeded Haar-orthogonal matrix."""
    h = hadamard(d)
    if h is None:
        return haar_orthogonal(d, seed), "haar"
    return h / math.sqrt(d) * random_signs(d, seed)[None, :], "hadamard"


def value_plan(bpd_v: float | None, v_quant: str, v_group: int, head_dim: int) -> tuple[int | None, float]:
    """(b_V or None for 16-bit exact values, nominal bpd_V) for a value target; Unsupported if the
    target is not reachable exactly (§5.8: one global integer b_V; KIVI: b + 32/G)."""
    if bpd_v is None or bpd_v == 16:
        return None, 16.0
    if v_quant == "hadamard":
        if float(bpd_v) != int(bpd_v) or not 1 <= int(bpd_v) <= 8:
            raise Unsupported(f"values need an integer b_V in 1..8 (§5.8); got v_bpd={bpd_v}")
        return int(bpd_v), float(int(bpd_v))
    if v_quant == "kivi":
        if head_dim % v_group:
            raise Unsupported(f"KIVI value groups G={v_group} must divide head_dim={head_dim}")
        b = float(bpd_v) - 32.0 / v_group
        if abs(b - round(b)) > 1e-9 or not 1 <= round(b) <= 8:
            raise Unsupported(f"KIVI values store b + 32/G = b + {32 / v_group:g} bits; v_bpd={bpd_v} has no integer b in 1..8")
        return int(round(b)), float(bpd_v)
    raise ValueError(f"v_quant must be 'hadamard' or 'kivi', got {v_quant!r}")


def values_reachable(bpd_v: float | None, v_quant: str, v_group: int, head_dim: int) -> bool:
    """Whether :func:`value_plan` has a plan for ``bpd_v`` (a method's knob search offers nothing
    when its values cannot meet their budget: ``configure`` says why)."""
    try:
        value_plan(bpd_v, v_quant, v_group, head_dim)
    except Unsupported:
        return False
    return True


def build_value_codecs(
    stats: list[LayerStats], bits: int | None, v_quant: str, v_group: int, seed: int, centered: bool,
    step: str = "gauss",
) -> tuple[list[Codec], dict]:
    """One value codec per layer. Hadamard: sigma_V^2 = E||v - mu||^2 / d (mu = 0 unless centered),
    step s*(b_V) sigma_V, times the per-head multiplier of §1.1b with ``step="calibrated"`` (the
    rotated coordinates of a head share sigma_V, so one multiplier per head)."""
    if bits is None:
        return [ExactCodec() for _ in stats], {"v_codec": "exact16"}
    if v_quant == "kivi":
        return [KiviValueCodec(bits, v_group) for _ in stats], {"v_codec": f"kivi(b={bits},G={v_group})"}
    check_step("values", step)
    layers, branches = [], set()
    for layer, st in enumerate(stats):
        mu_v, cov_v = st.mu_v.cpu().to(torch.float64), st.cov_v.cpu().to(torch.float64)
        n_heads, d = mu_v.shape
        energy = torch.diagonal(cov_v, dim1=-2, dim2=-1).sum(-1)
        if centered:
            mu = mu_v
        else:
            mu = torch.zeros_like(mu_v)
            energy = energy + (mu_v**2).sum(-1)
        sigma = torch.sqrt(energy / d).clamp(min=1e-30)
        rots = []
        for h in range(n_heads):
            rot, branch = orthogonal_mixer(d, sub_seed(seed, layer, h, 1))
            rots.append(rot)
            branches.add(branch)
        layers.append((torch.stack(rots), sigma, mu))
    samples = None if step == "gauss" else centered_samples(stats, "v", torch.cat([mu for _, _, mu in layers]))
    groups = None
    if samples is not None:  # y = rot (v - mu) / sigma per head
        heads = [(rot[h], sigma[h]) for rot, sigma, _ in layers for h in range(rot.shape[0])]
        groups = [((x @ rot.T) / sig).float() for x, (rot, sig) in zip(samples, heads)]
    mult, knobs = step_multipliers(step, groups, [bits] * (len(groups) if groups else 0),
                                   samples[0].shape[0] if samples else 0, prefix="v_")
    codecs = []
    for layer, (rot, sigma, mu) in enumerate(layers):
        scale = 1.0 if mult is None else mult[layer * rot.shape[0] : (layer + 1) * rot.shape[0]]
        codecs.append(RotatedValueCodec(rot, optimal_step(bits) * sigma * scale, bits, mu))
    name = f"rotated(b={bits},{'/'.join(sorted(branches))},{'centered' if centered else 'uncentered'})"
    return codecs, {"v_codec": name, **knobs}
