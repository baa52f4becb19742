"""TurboQuant's codec (arXiv 2504.19874, Alg. 1-2; QJL, arXiv 2406.03482, amirzandieh/QJL): the
rotation Pi, the QJL sketch S, the outlier channel sets, and the instances that encode a side's
vectors into packed codes, sign bits and fp16 norms and decode them (docs/methods.md §16.1-16.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codec_state import Codec, head_matmul, join_calls
from .gaussquant import pack_codes, prepare_layout, rows_per_byte_boundary, unpack_calls, unpack_codes
from .hadamard import haar_orthogonal
from .packing import pack_bits, unpack_bits
from .turboquant_budget import InstancePlan
from .turboquant_codebook import lloyd_max

SKETCHES = ("gaussian", "orthogonal")
QJL_SCALE = math.sqrt(math.pi / 2.0)  # x_hat = gamma sqrt(pi/2)/m S^T z (QJL's scl)


def rotation(d: int, seed: int) -> torch.Tensor:
    """Pi: Haar orthogonal d x d (QR of a Gaussian, columns sign-corrected), float64 (§16.1)."""
    return haar_orthogonal(d, seed)


def sketch_matrix(d: int, seed: int, kind: str = "gaussian") -> torch.Tensor:
    """S [m = d, d] float64 (§16.2): i.i.d. N(0, 1), or QJL's ``rot=True`` orthogonalized sketch
    (``init_rot_dir``: S^T = sqrt(d) Q, Q the reduced QR factor of a Gaussian d x d)."""
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    if kind == "gaussian":
        return g
    if kind == "orthogonal":
        q, _ = torch.linalg.qr(g, mode="reduced")
        return (q * math.sqrt(d)).T.contiguous()
    raise ValueError(f"sketch={kind!r} not in {SKETCHES}")


def outlier_channels(energy: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(outlier, rest) channel indices [H, n_out], [H, d - n_out] (ascending) from per-channel
    energies [H, d]: the n_out / 2 RoPE pairs (i, i + d/2) with the largest E[x_i^2 + x_{i+d/2}^2]."""
    h, d = energy.shape
    half = d // 2
    pair = energy[:, :half] + energy[:, half:]
    top = torch.topk(pair, n_out // 2, dim=-1).indices
    mask = torch.zeros(h, half, dtype=torch.bool)
    mask.scatter_(1, top, True)
    mask = torch.cat([mask, mask], 1)
    idx = torch.arange(d).expand(h, d)
    return idx[mask].reshape(h, n_out), idx[~mask].reshape(h, d - n_out)


# ---- the codec --------------------------------------------------------------------------------------


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("bhte,hed->bhtd")`` of x [B, H, T, e] or, for stored calls stacked [S, B, H, T, e],
    of each call (:func:`methods.codec_state.head_matmul`: the bits of each call alone)."""
    return torch.einsum("bhte,hed->bhtd", x, w) if x.dim() == 4 else head_matmul(x, w)


@dataclass
class InstancePacked:
    """What one instance stores for a block of vectors [B, H, T]: the code stream (uint8), QJL sign
    bytes [B, H, T, ceil(d_i/8)] or None, nu and gamma (fp16 [B, H, T]; gamma None unless stored)."""

    codes: torch.Tensor
    signs: torch.Tensor | None
    norm: torch.Tensor
    gamma: torch.Tensor | None

    def bits(self) -> int:
        """The bytes held, times 8 (codes and signs uint8, norms fp16)."""
        held = (self.codes, self.signs, self.norm, self.gamma)
        return sum(8 * x.numel() * x.element_size() for x in held if x is not None)


@dataclass
class TurboPacked:
    parts: list
    shape: tuple  # (B, H, T, d)
    dtype: torch.dtype  # arithmetic dtype


class TurboInstance:
    """One instance of one layer and side, all KV heads: plan, Pi [H, d_i, d_i], S [H, d_i, d_i] or
    None, channels [H, d_i] (None: all, in order), and the output scale (debias, else 1)."""

    def __init__(self, plan: InstancePlan, rot: torch.Tensor, sketch: torch.Tensor | None,
                 channels: torch.Tensor | None, scale: float = 1.0):
        self.plan = plan
        self.rot = rot.to(torch.float64)
        self.sketch = None if sketch is None else sketch.to(torch.float64)
        self.channels = channels
        self.scale = float(scale)
        self.blocks = []  # (start, stop, codebook) of runs of equal width
        start = 0
        for b in sorted(set(plan.widths), reverse=True):
            n = plan.widths.count(b)
            self.blocks.append((start, start + n, lloyd_max(b, plan.dim)))
            start += n
        self._cache: dict = {}

    def _params(self, device, dtype):
        """(Pi, S, channels, [(start, stop, boundaries, centroids)]) on ``device``, cached."""
        key = (str(device), dtype)
        if key not in self._cache:
            prepare_layout(self.plan.widths, device)
            blocks = [(s, e, torch.tensor(cb.boundaries, dtype=dtype, device=device),
                       torch.tensor(cb.centroids, dtype=dtype, device=device)) for s, e, cb in self.blocks]
            self._cache[key] = (
                self.rot.to(device, dtype), None if self.sketch is None else self.sketch.to(device, dtype),
                None if self.channels is None else self.channels.to(device), blocks,
            )
        return self._cache[key]

    def _take(self, x, ch):
        if ch is None:
            return x
        b, h, t, _ = x.shape
        return x.gather(-1, ch[None, :, None, :].expand(b, h, t, -1))

    def encode(self, x: torch.Tensor):
        """(packed, decoded subvector [B, H, T, d_i]) of x [B, H, T, d] in the arithmetic dtype."""
        rot, sketch, ch, blocks = self._params(x.device, x.dtype)
        xs = self._take(x, ch)
        nu = torch.linalg.vector_norm(xs, dim=-1)
        u = xs / torch.where(nu > 0, nu, 1.0)[..., None]
        y = torch.einsum("bhtd,hed->bhte", u, rot)
        codes = torch.cat([torch.bucketize(y[..., s:e].contiguous(), bnd) for s, e, bnd, _ in blocks], -1)
        u_hat = self._rotate_back(codes, rot, blocks)
        norm = nu.half()
        signs = gamma = None
        z = None
        if sketch is not None:
            rho = u - u_hat
            proj = torch.einsum("bhtd,hmd->bhtm", rho, sketch)
            z = proj > 0
            signs = pack_bits(z.to(torch.uint8), 1)
            if self.plan.code_bits:
                gamma = torch.linalg.vector_norm(rho, dim=-1).half()
        stream = self._pack(codes)
        packed = InstancePacked(stream, signs, norm, gamma)
        return packed, self._reconstruct(u_hat, z, norm, gamma, sketch)

    def _pack(self, codes):
        if not self.plan.code_bits:
            return torch.zeros(0, dtype=torch.uint8, device=codes.device)
        return pack_codes(codes.reshape(-1, self.plan.dim), self.plan.widths)

    def _rotate_back(self, codes, rot, blocks):
        """u_hat = Pi^T c[code] [B, H, T, d_i]: one gather from the blocks' centroids laid end to
        end, each coordinate's code offset to its block's table (the same values as a gather per
        block and a cat, one launch instead of one per block and the cat)."""
        table, offsets = self._table(rot.device, rot.dtype, blocks)
        c = table[codes if offsets is None else codes + offsets]
        return _per_head(c, rot)

    def _table(self, device, dtype, blocks):
        """(the blocks' centroids concatenated, per-coordinate offsets into it or None for one
        block), cached."""
        key = ("table", str(device), dtype)
        if key not in self._cache:
            table = torch.cat([cent for _, _, _, cent in blocks])
            offsets = None
            if len(blocks) > 1:
                firsts, at = [], 0
                for s, e, _, cent in blocks:
                    firsts.append(torch.full((e - s,), at, dtype=torch.long, device=device))
                    at += cent.numel()
                offsets = torch.cat(firsts)
            self._cache[key] = (table, offsets)
        return self._cache[key]

    def _reconstruct(self, u_hat, z, norm, gamma, sketch):
        """nu (u_hat + gamma sqrt(pi/2)/d_i S^T z) (prod) or scale nu u_hat (mse), from stored values."""
        nu = norm.to(u_hat.dtype)[..., None]
        if z is None:
            return u_hat * (nu * self.scale) if self.scale != 1.0 else u_hat * nu
        zpm = z.to(u_hat.dtype) * 2 - 1
        g = 1.0 if gamma is None else gamma.to(u_hat.dtype)[..., None]
        qjl = _per_head(zpm, sketch) * (QJL_SCALE / self.plan.dim)
        return nu * (u_hat + g * qjl)

    def decode(self, packed: InstancePacked, shape, dtype) -> torch.Tensor:
        """The decoded subvector [B, H, T, d_i] from the stored bytes alone (arithmetic ``dtype``)."""
        b, h, t, _ = shape
        device = packed.norm.device
        rot, sketch, _, blocks = self._params(device, dtype)
        if self.plan.code_bits:
            codes = unpack_codes(packed.codes, self.plan.widths, b * h * t).reshape(b, h, t, self.plan.dim)
        else:
            codes = torch.zeros(b, h, t, self.plan.dim, dtype=torch.long, device=device)
        u_hat = self._rotate_back(codes, rot, blocks)
        z = None if packed.signs is None else unpack_bits(packed.signs, 1, self.plan.dim).bool()
        return self._reconstruct(u_hat, z, packed.norm, packed.gamma, sketch)

    def decode_calls(self, calls: int, parts: dict, shape, dtype) -> torch.Tensor:
        """:meth:`decode` of ``calls`` stored calls at once ([calls, ...] parts -> [calls, B, H, T,
        d_i]), each with the bits decoding it alone gives (:func:`_per_head`)."""
        b, h, t, _ = shape
        norm = parts["norm"]
        rot, sketch, _, blocks = self._params(norm.device, dtype)
        if self.plan.code_bits:
            codes = unpack_calls(parts["codes"], self.plan.widths, b * h * t).reshape(calls, b, h, t, self.plan.dim)
        else:
            codes = torch.zeros(calls, b, h, t, self.plan.dim, dtype=torch.long, device=norm.device)
        u_hat = self._rotate_back(codes, rot, blocks)
        signs = parts.get("signs")
        z = None if signs is None else unpack_bits(signs, 1, self.plan.dim).bool()
        return self._reconstruct(u_hat, z, norm, parts.get("gamma"), sketch)

    def put(self, out: torch.Tensor, xs_hat: torch.Tensor) -> None:
        """Write the decoded subvector into its channels of ``out`` [..., B, H, T, d]."""
        _, _, ch, _ = self._params(out.device, out.dtype)
        if ch is None:
            out.copy_(xs_hat)
            return
        h, n = ch.shape
        index = ch.reshape(*[1] * (out.dim() - 3), h, 1, n).expand(*out.shape[:-1], n)
        out.scatter_(-1, index, xs_hat)


class TurboCodec(Codec):
    """One side of one layer: the instances over disjoint channel sets (:class:`TurboInstance`)."""

    def __init__(self, instances: list[TurboInstance], pre_rope: bool = False):
        self.instances = instances
        self.pre_rope = pre_rope

    def encode(self, x):
        return self.encode_decode(x)[0]

    def encode_decode(self, x):
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(dtype)
        encoded = [inst.encode(x) for inst in self.instances]
        packed = TurboPacked([p for p, _ in encoded], tuple(x.shape), dtype)
        if len(encoded) == 1:
            return packed, encoded[0][1]
        out = torch.empty_like(x)
        for inst, (_, xs_hat) in zip(self.instances, encoded):
            inst.put(out, xs_hat)
        return packed, out

    def decode(self, packed: TurboPacked) -> torch.Tensor:
        decoded = [inst.decode(part, packed.shape, packed.dtype) for inst, part in zip(self.instances, packed.parts)]
        if len(decoded) == 1:
            return decoded[0]
        out = torch.empty(packed.shape, dtype=packed.dtype, device=decoded[0].device)
        for inst, xs_hat in zip(self.instances, decoded):
            inst.put(out, xs_hat)
        return out

    def bits(self, packed: TurboPacked) -> int:
        return sum(p.bits() for p in packed.parts)

    def parts(self, packed: TurboPacked):
        parts = {}
        for i, p in enumerate(packed.parts):
            parts.update({f"{i}.codes": p.codes, f"{i}.signs": p.signs, f"{i}.norm": p.norm, f"{i}.gamma": p.gamma})
        return (packed.shape, packed.dtype), parts, {}

    def decode_stored(self, store):
        """One instance without QJL (the mse stage alone) and calls whose code streams end on
        whole row groups: every stored code looked up in one pass, one product per run and head
        (:func:`methods.codec_state.head_matmul`), the norms applied once; else run by run."""
        runs = store.runs()
        inst = self.instances[0]
        g = rows_per_byte_boundary(inst.plan.widths)
        if (len(self.instances) > 1 or inst.sketch is not None or not inst.plan.code_bits
                or any((s[0] * s[1] * s[2]) % g for (s, _), *_ in runs)):
            return super().decode_stored(store)
        dtype = runs[0][0][1]
        data = store.flat("0.codes")
        rot, _, _, blocks = inst._params(data.device, dtype)
        table, offsets = inst._table(rot.device, rot.dtype, blocks)
        whole = [calls * b * h * t for ((b, h, t, _), _), calls, _, _ in runs]
        codes = unpack_codes(data, inst.plan.widths, sum(whole))
        c = table[codes if offsets is None else codes + offsets]
        u_hat, at = [], 0
        for i, (((b, h, t, _), _), calls, _, _) in enumerate(runs):
            u_hat.append(head_matmul(c[at : at + whole[i]].view(calls, b, h, t, -1), rot))
            at += whole[i]
        norm = join_calls([parts["0.norm"][..., None] for _, _, parts, _ in runs])[..., 0]
        return inst._reconstruct(join_calls(u_hat), None, norm, None, None)

    def decode_calls(self, layout, calls, parts, ragged):
        shape, dtype = layout
        mine = [{k.split(".", 1)[1]: v for k, v in parts.items() if k.startswith(f"{i}.")}
                for i in range(len(self.instances))]
        if calls == 1:
            one = [InstancePacked(p["codes"][0], p["signs"][0] if "signs" in p else None, p["norm"][0],
                                  p["gamma"][0] if "gamma" in p else None) for p in mine]
            return self.decode(TurboPacked(one, shape, dtype))[None]
        decoded = [inst.decode_calls(calls, p, shape, dtype) for inst, p in zip(self.instances, mine)]
        if len(decoded) == 1:
            return decoded[0]
        out = torch.empty((calls, *shape), dtype=dtype, device=decoded[0].device)
        for inst, xs_hat in zip(self.instances, decoded):
            inst.put(out, xs_hat)
        return out
