"""Compression methods as pure tensor code (docs/design.md §1: torch and numpy only).

``REGISTRY`` maps the public method names of the command line (docs/design.md §4) to their classes;
``build_method(name, **options)`` constructs one and names the valid choices on a typo.
"""

from __future__ import annotations

import dataclasses

from .base import KVMethod, LayerState, LayerStats, ModelShape, Regime, Rope, Unsupported
from .cobra import CobraKL, CobraMSE
from .cobra_plus import CobraPlus
from .compose import Compose
from .fp16 import Fp16
from .gear import Gear
from .h2o import H2O
from .kivi import Kivi
from .kqsvd import KQSVD
from .kvquant import KVQuant
from .snapkv import SnapKV
from .svdq import SVDq
from .turboquant import TurboQuant

REGISTRY: dict[str, type[KVMethod]] = {
    "fp16": Fp16,
    "kivi": Kivi,
    "svdq": SVDq,
    "kqsvd": KQSVD,
    "cobra_mse": CobraMSE,
    "cobra_kl": CobraKL,
    "cobra_plus": CobraPlus,  # KV-COBRA repaired (docs/methods.md §13)
    "h2o": H2O,
    "snapkv": SnapKV,
    "compose": Compose,  # eviction x codec (docs/methods.md §12)
    "turboquant": TurboQuant,  # docs/methods.md §16
    "gear": Gear,  # docs/methods.md §15
    "kvquant": KVQuant,  # docs/methods.md §14
}


def build_method(name: str, **options) -> KVMethod:
    """Construct a registered method; unknown names and options fail with the valid choices."""
    if name not in REGISTRY:
        raise KeyError(f"unknown method {name!r}; valid choices: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise TypeError(
            f"method {name!r} has no option(s) {unknown}; valid options: {sorted(fields) or 'none'}"
        )
    return cls(**options)


__all__ = [
    "REGISTRY",
    "build_method",
    "KVMethod",
    "LayerState",
    "LayerStats",
    "ModelShape",
    "Regime",
    "Rope",
    "Unsupported",
]
