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


def _fit_lut(z: torch.Tensor, half: torch.Tensor, bits: int, fisher_scale: str) -> torch.Tensor:
    """The fp16 LUT of one layer and side: k-means over the inliers |z| <= 1 (the code masks
    z > 1 and z < -1), weighted by 1 (``"code"``) or the element's squared scale (``"paper"``)."""
    keep = (z.abs() <= 1) & torch.isfinite(z)
    weight = None
    if fisher_scale == "paper":
        weight = (half**2).expand_as(z)[keep]
    return kmeans_1d(z[keep], 2**bits, weight).half()


def key_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code"):
    """§14.2 for the keys of one layer: ``x`` [N, n] calibration keys (float64). Returns (u, l
    fp16 [n] per-channel thresholds, fp16 LUT [2^b], key outlier fraction of the sample under the
    quantizer's rule with the fp16 thresholds). The k-means normalization uses the unrounded
    thresholds, as the code (it rounds them to fp16 when it builds the quantized layer)."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 0)
    z, half = _normalized(x, upper[None], lower[None])
    lut = _fit_lut(z, half, bits, fisher_scale)
    u16, l16 = upper.half(), lower.half()
    frac = float(((x > u16.double()) | (x < l16.double())).double().mean())
    return u16, l16, lut, frac


def value_calibration(x: torch.Tensor, t: float, bits: int, fisher_scale: str = "code") -> torch.Tensor:
    """§14.2 for the values of one layer: ``x`` [N, n] calibration values (float64), thresholds per
    calibration token (the code's per-token ``np.percentile``). Returns the fp16 LUT [2^b]."""
    x = x.to(torch.float64)
    upper, lower = quantiles(x, t, 1)
    z, half = _normalized(x, upper[:, None], lower[:, None])
    return _fit_lut(z, half, bits, fisher_scale)



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
