"""KVQuant: per-channel pre-RoPE keys, per-token values, non-uniform datatypes, dense-and-sparse.

Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, "KVQuant: Towards 10 Million Context
Length LLM Inference with KV Cache Quantization", NeurIPS 2024, arXiv 2401.18079; code
SqueezeAILab/KVQuant (``quant/kvquant/simquant_module_quantizer.py``, ``quant/llama_simquant.py``,
``gradients/run-fisher.py``). Specification and the decisions where the paper and code are silent:
docs/methods.md §14 (budget §0.1, §8; regimes §1.3).

One job per module: :mod:`.codec` (thresholds, nearest signpost, key/value codecs),
:mod:`.kmeans` (weighted 1-D k-means), :mod:`.calibration` (thresholds and signpost tables from
the calibration sample), :mod:`.budget` (bit count, predicted headline), :mod:`.state` (the layer
state), :mod:`.method` (the method: options, budget fit, calibration).
"""

from .budget import headline, sink_share, token_cost
from .calibration import FISHER_SCALES, key_calibration, value_calibration
from .codec import (BITS, KeyCodec, KVQuantPacked, ValueCodec, bracket_pairs, nearest_codes, outlier_level,
                    quantiles, value_outlier_count)
from .kmeans import companding_init, kmeans_1d
from .method import BUDGETS, KVQuant
from .state import KVQuantLayerState, held_per_token

__all__ = [
    "BITS", "BUDGETS", "FISHER_SCALES", "KVQuant", "KVQuantLayerState", "KVQuantPacked", "KeyCodec", "ValueCodec",
    "bracket_pairs", "companding_init", "headline", "held_per_token", "key_calibration", "kmeans_1d",
    "nearest_codes", "outlier_level", "quantiles", "sink_share", "token_cost", "value_calibration",
    "value_outlier_count",
]
