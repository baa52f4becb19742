"""KVQuant's calibration (Hooper et al., arXiv 2401.18079, §3.2 and App. E; official
``SimQuant.quantize``): per-channel key thresholds, per-token value thresholds, and one signpost
table per layer and side by weighted k-means over the normalized inliers. docs/methods.md §14.2."""

from __future__ import annotations

import torch

from .codec import quantiles
from .kmeans import kmeans_1d

FISHER_SCALES = ("code", "paper")


def _normalized(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor):
    """(z, half-range) of §14.2(c): z = (x - (u + l)/2) / ((u - l)/2) (broadcast)."""
    zero = (upper + lower) / 2
    half = (upper - lower) / 2
    return (x - zero) / half, half


def lut_weights(z: torch.Tensor, half: torch.Tensor, fisher: torch.Tensor | None, fisher_scale: str):
    """The k-means weight of every element of ``z`` (§14.2(d)): its Fisher information F (1 when
    ``fisher`` is None), times the squared scale s² of its vector (the key channel's or value
    token's half-range) for ``"paper"``. Paper Eq. 7 weights the error in the activation x, where
    x − Q(x) = s (z − Q(z)): F s² is the Fisher information of the normalized element z
    (∂L/∂z = s ∂L/∂x). The official code passes F alone (``"code"``). None: unweighted."""
    if fisher is None and fisher_scale == "code":
        return None
    weight = torch.ones_like(z) if fisher is None else fisher.to(torch.float64).expand_as(z)
    if fisher_scale == "paper":
        weight = weight * (half**2).expand_as(z)
    return weight


def _fit_lut(z: torch.Tensor, half: torch.Tensor, bits: int, fisher_scale: str,
             fisher: torch.Tensor | None = None) -> torch.Tensor:
    """The fp16 LUT of one layer and side: k-means over the inliers |z| <= 1 (the code masks
    z > 1 and z < -1), weighted by :func:`lut_weights`."""
    keep = (z.abs() <= 1) & torch.isfinite(z)
    weight = lut_weights(z, half, fisher, fisher_scale)
    return kmeans_1d(z[keep], 2**bits, None if weight is None else weight[keep]).half()


def key_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code",
                    fisher: torch.Tensor | None = None):
    """§14.2 for the keys of one layer: ``x`` [N, n] calibration keys (float64), ``fisher`` [N, n]
    their Fisher information (None: F = 1). Returns (u, l fp16 [n] per-channel thresholds, fp16 LUT
    [2^b], key outlier fraction of the sample under the quantizer's rule with the fp16
    thresholds). The k-means normalization uses the unrounded thresholds, as the code (it rounds
    them to fp16 when it builds the quantized layer)."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 0)
    z, half = _normalized(x, upper[None], lower[None])
    lut = _fit_lut(z, half, bits, fisher_scale, fisher)
    u16, l16 = upper.half(), lower.half()
    frac = float(((x > u16.double()) | (x < l16.double())).double().mean())
    return u16, l16, lut, frac


def value_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code",
                      fisher: torch.Tensor | None = None) -> torch.Tensor:
    """§14.2 for the values of one layer: ``x`` [N, n] calibration values (float64), thresholds per
    calibration token (the code's per-token ``np.percentile``); ``fisher`` as for
    :func:`key_calibration`. Returns the fp16 LUT [2^b]."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 1)
    z, half = _normalized(x, upper[:, None], lower[:, None])
    return _fit_lut(z, half, bits, fisher_scale, fisher)


def _sample(st, side: str, layer: int) -> torch.Tensor:
    """The layer's calibration keys or values [N, H*d] (float64, uncentered, channels in projection
    order) from the harness's sample (stored centered at the statistics' mean)."""
    sample = getattr(st, f"{side}_sample")
    if sample is None:
        raise ValueError(
            f"kvquant: layer {layer} has no calibration {'key' if side == 'k' else 'value'} sample; "
            "collect the statistics with sample_tokens > 0 (the harness does: calibration_sample_tokens())")
    mu = getattr(st, f"mu_{side}").to(torch.float64)
    x = sample.to(torch.float64) + mu[:, None, :]  # [H, N, d]
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def _fisher(st, side: str, layer: int) -> torch.Tensor:
    """The layer's Fisher information [N, H*d] (float64), laid out as :func:`_sample`."""
    fisher = getattr(st, f"{side}_fisher")
    if fisher is None:
        raise ValueError(
            f"kvquant: layer {layer} has no Fisher information for its calibration "
            f"{'keys' if side == 'k' else 'values'}; collect it (kvbench/fit/fisher.py; the harness does "
            "when calibration_fisher() is true) or set fisher=false (F = 1)")
    f = fisher.to(torch.float64)
    return f.permute(1, 0, 2).reshape(f.shape[1], -1)
