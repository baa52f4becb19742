"""LongBench v1, the seven English F1 subsets and multifieldqa_zh (docs/methods.md §9.3).

Follows THUDM/LongBench ``pred.py`` and ``eval.py``:

* prompt = ``dataset2prompt[name].format(**item)``;
* middle truncation: tokenize the prompt (the tokenizer's default special tokens, as pred.py); if
  longer than ``max_length``, keep the first and the last ``int(max_length / 2)`` tokens, each half
  decoded with ``skip_special_tokens=True`` and the two strings concatenated;
* chat template for instruct models (``chat=True``) except on trec, triviaqa, samsum, lsht, lcc,
  repobench-p. pred.py hand-writes each model's chat format; here the tokenizer's own chat template
  (one user turn, generation prompt) plays that role, and the templated text is tokenized without
  adding special tokens again (the template already carries BOS where the model wants one);
* greedy decoding of ``dataset2maxlen[name]`` new tokens at most through ``CompressedLM.generate``
  (prefill exact, compress, decode), stopping at the model's EOS token(s); the prediction is the
  new tokens decoded with ``skip_special_tokens=True``;
* scoring: first line only for trec/triviaqa/samsum/lsht; an item scores the max of
  ``qa_f1_score`` (``qa_f1_zh_score``, jieba words, on multifieldqa_zh) over its answers; a dataset
  scores ``round(100 * mean, 2)``; ``avg`` is the mean of the English F1 scores (over all seven:
  "LongBench F1") and, when multifieldqa_zh was run, ``avg8`` the mean over the English sets and
  multifieldqa_zh (all eight: the "8-set mean"). Decisions where docs/methods.md is silent: both means
  are over the sets that were run (``avg_sets``/``avg8_sets`` name them); ``avg`` never includes
  multifieldqa_zh, so "LongBench F1" keeps its meaning whichever sets are added.

Items: the first ``limit`` records of each subset's file, in file order (pred.py takes them all):
no seed is involved, so every method and every job seed scores the same items.

Progress: each item is a point of the section ``longbench/<subset>`` (the running F1 and the
item's, in percent; its prompt tokens; the running measured bpd); each record keeps the
``bpd_k``/``bpd_v`` its item read.

Data: ``data_dir`` holding LongBench's official ``<name>.jsonl`` files (the members of the hub's
``data.zip``: ``data_dir/<name>.jsonl`` or ``data_dir/data/<name>.jsonl``), or the hub
(``datasets.load_dataset("THUDM/LongBench", name, split="test")``, then ``data.zip``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import zipfile
from pathlib import Path

from ..context import Progress, no_progress
from .f1 import best_f1, best_f1_zh, dataset_score
from .generation import answer_items, apply_chat, context_window, protocol_prompt, stop_token_ids
from .longqa_squad import evaluate_longqa_squad
from .query_protocol import protocol, query_aware_setting, template_tail
from .batch_size import generation_batch_size
from .registry import register_task, task_limit
from .reporting import item_progress
from .longbench_prompts import (
    CHINESE_F1,
    DATASET2MAXLEN,
    DATASET2PROMPT,
    ENGLISH_F1,
    FIRST_LINE,
    NO_CHAT,
)

log = logging.getLogger(__name__)

HUB_REPO = "THUDM/LongBench"


class LongBenchDataMissing(FileNotFoundError):
    """A LongBench subset is neither in ``data_dir`` nor reachable on the hub."""


# ---------------------------------------------------------------------------------- data


def _read_jsonl(path: Path, limit: int | None) -> list[dict]:
    items = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                items.append(json.loads(line))
                if limit is not None and len(items) >= limit:
                    break
    return items


def local_candidates(name: str, data_dir: str | os.PathLike) -> list[Path]:
    root = Path(data_dir).expanduser()
    return [root / f"{name}.jsonl", root / "data" / f"{name}.jsonl"]


def _offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    return any(f.lower() in ("1", "true", "yes", "on") for f in flags)


def _from_hub(name: str, limit: int | None) -> list[dict]:
    """pred.py's ``load_dataset('THUDM/LongBench', name, split='test')``; ``data.zip`` as fallback
    (recent ``datasets`` releases no longer run the dataset's loading script)."""
    errors = []
    try:
        import datasets

        ds = datasets.load_dataset(HUB_REPO, name, split="test")
        n = len(ds) if limit is None else min(limit, len(ds))
        return [ds[i] for i in range(n)]
    except Exception as err:  # noqa: BLE001 - try the archive next
        errors.append(f"load_dataset: {err}")
    try:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(HUB_REPO, "data.zip", repo_type="dataset")
        with zipfile.ZipFile(archive) as zf:
            lines = zf.read(f"data/{name}.jsonl").decode("utf-8").splitlines()
        items = [json.loads(line) for line in lines if line.strip()]
        return items if limit is None else items[:limit]
    except Exception as err:  # noqa: BLE001 - reported below with what to do
        errors.append(f"data.zip: {err}")
    raise LongBenchDataMissing(
        f"LongBench subset {name!r} could not be loaded from the hub ({'; '.join(errors)}). "
        f"Download data.zip from https://huggingface.co/datasets/{HUB_REPO}, unzip it and pass "
        f"data_dir=DIR (task.longbench.data_dir=DIR) holding {name}.jsonl"
    )


def load_longbench(name: str, data_dir=None, limit: int | None = None) -> list[dict]:
    """The first ``limit`` items of a LongBench subset, as dicts with the official fields
    (``input``, ``context``, ``answers``, ``length``, ``dataset``, ``language``, ``all_classes``,
    ``_id``)."""
    if data_dir:
        tried = local_candidates(name, data_dir)
        for path in tried:
            if path.exists():
                return _read_jsonl(path, limit)
        raise LongBenchDataMissing(
            f"LongBench subset {name!r} not found: looked for "
            f"{', '.join(str(p) for p in tried)}. Pass data_dir=DIR (task.longbench.data_dir=DIR) "
            f"holding the official {name}.jsonl (unzip data.zip from the hub dataset {HUB_REPO})"
        )
    if _offline():
        raise LongBenchDataMissing(
            f"LongBench subset {name!r}: no data_dir given and the hub is off "
            "(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE). Pass data_dir=DIR (task.longbench.data_dir=DIR) "
            f"holding the official {name}.jsonl files (data.zip of the hub dataset {HUB_REPO})"
        )
    return _from_hub(name, limit)


# ------------------------------------------------------------------------------- prompts


def truncate_middle(prompt: str, tokenizer, max_length: int) -> tuple[str, bool]:
    """pred.py's middle truncation: first and last ``int(max_length/2)`` tokens, decoded."""
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt, False
    half = int(max_length / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, True


def uses_chat(dataset: str, chat: bool) -> bool:
    return bool(chat) and dataset not in NO_CHAT


def build_prompt(item: dict, dataset: str, tokenizer, max_length: int, chat: bool) -> dict:
    """The model input for one item: ``{"text", "input_ids" (list), "truncated", "chat"}``."""
    if dataset not in DATASET2PROMPT:
        raise ValueError(
            f"unknown LongBench subset {dataset!r}; supported: {', '.join(DATASET2PROMPT)}"
        )
    prompt = DATASET2PROMPT[dataset].format(**item)
    prompt, truncated = truncate_middle(prompt, tokenizer, max_length)
    with_chat = uses_chat(dataset, chat)
    if with_chat:
        prompt = apply_chat(tokenizer, prompt)
    ids = tokenizer(prompt, truncation=False, add_special_tokens=not with_chat)["input_ids"]
    return {"text": prompt, "input_ids": ids, "truncated": truncated, "chat": with_chat}


# ------------------------------------------------------------------------------- scoring


def postprocess(dataset: str, prediction: str) -> str:
    """eval.py: only the first line counts on trec/triviaqa/samsum/lsht."""
    if dataset in FIRST_LINE:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_item(dataset: str, prediction: str, answers: list[str]) -> float:
    """eval.py's ``dataset2metric``: ``qa_f1_zh_score`` on multifieldqa_zh, else ``qa_f1_score``."""
    scorer = best_f1_zh if dataset in CHINESE_F1 else best_f1
    return scorer(postprocess(dataset, prediction), answers)


def mean_score(scores: dict[str, float], sets) -> tuple[float, list[str]]:
    """round(mean, 2) of the scores of ``sets`` that were run, and which those are."""
    present = [name for name in sets if name in scores]
    if not present:
        return float("nan"), present
    return round(sum(scores[name] for name in present) / len(present), 2), present


def summary_means(scores: dict[str, float]) -> dict:
    """``avg`` (English F1 sets) and, with multifieldqa_zh, ``avg8`` (the 8-set mean)."""
    avg, avg_sets = mean_score(scores, ENGLISH_F1)
    out = {"avg": avg, "avg_sets": avg_sets}
    if any(name in scores for name in CHINESE_F1):
        out["avg8"], out["avg8_sets"] = mean_score(scores, ENGLISH_F1 + CHINESE_F1)
    return out


# ---------------------------------------------------------------------------- evaluation


def fit_context(max_length: int, max_new_tokens: int, window: int | None, dataset: str = "") -> int:
    """``max_length`` lowered so that prompt + answer fit the model's window.

    pred.py takes ``max_length`` per model (model2maxlen.json: 3500 for 4k models, 31500 for 32k
    ones); a prompt longer than the positions a model was trained for measures RoPE extrapolation,
    not the cache, so a smaller model gets ``window - max_new_tokens`` and a log line."""
    if window is None or max_length + max_new_tokens <= window:
        return max_length
    fitted = window - max_new_tokens
    log.info("longbench %s: max_length %d -> %d (model window %d, %d new tokens)",
             dataset, max_length, fitted, window, max_new_tokens)
    return fitted


def evaluate_dataset(
    lm, dataset: str, items: list[dict], max_length: int, chat: bool, query_aware: bool = True,
    progress: Progress = no_progress, batch_size: int = 1,
) -> list[dict]:
    stop_ids = stop_token_ids(lm.model, lm.tokenizer)
    max_length = fit_context(max_length, DATASET2MAXLEN[dataset], context_window(lm.model), dataset)
    built = [build_prompt(item, dataset, lm.tokenizer, max_length, chat) for item in items]
    prompts = [protocol_prompt(lm.tokenizer, b["text"], b["input_ids"], template_tail(DATASET2PROMPT[dataset], item),
                               not b["chat"], query_aware) for b, item in zip(built, items)]

    def make_record(i: int, pred: str) -> dict:
        item = items[i]
        return {"_id": item.get("_id"), "prediction": pred, "answers": list(item["answers"]),
                "f1": score_item(dataset, pred, item["answers"]), "length": item.get("length"),
                "prompt_tokens": len(built[i]["input_ids"]), "truncated": built[i]["truncated"],
                "max_length": max_length}

    return answer_items(lm, prompts, DATASET2MAXLEN[dataset], stop_ids, batch_size, make_record,
                        item_progress(lm, f"longbench/{dataset}", progress), f"longbench {dataset}")


def evaluate_longbench(
    lm,
    datasets=ENGLISH_F1,
    data_dir=None,
    limit: int | None = None,
    max_length: int = 31500,
    chat: bool = False,
    query_aware: bool = True,
    progress: Progress = no_progress,
    batch_size: int = 1,
) -> dict:
    """LongBench F1 of ``lm`` (a CompressedLM) on ``datasets`` (docs/methods.md §9.3).

    ``query_aware`` (default, the paper's protocol) prefills the whole prompt; ``False`` is the
    query-agnostic protocol of docs/methods.md §9.5 (:func:`kvbench.tasks.generation.protocol_prompt`). The result's
    ``protocol`` says which.

    Returns ``{name: score (0-100), "avg": mean of the English scores, "avg_sets", ["avg8": the
    8-set mean, "avg8_sets" when multifieldqa_zh ran], "counts": {name: items},
    "records": {name: [{_id, prediction, answers, f1, length, prompt_tokens, truncated, max_length}]},
    "max_length" (as asked; each record holds the one used), "chat", "protocol", "eval_s"}``; the
    caller stores the records (each with ``protocol_used`` and ``context_tokens``).
    """
    datasets = list(datasets)
    unknown = [d for d in datasets if d not in DATASET2PROMPT]
    if unknown:
        raise ValueError(
            f"unknown LongBench subset(s) {unknown}; supported: {', '.join(DATASET2PROMPT)}"
        )
    t0 = time.perf_counter()
    loaded = {name: load_longbench(name, data_dir, limit) for name in datasets}  # fail early
    scores, counts, records = {}, {}, {}
    for name in datasets:
        recs = evaluate_dataset(lm, name, loaded[name], max_length, chat, query_aware, progress, batch_size)
        records[name], counts[name] = recs, len(recs)
        scores[name] = dataset_score([r["f1"] for r in recs])
        log.info("longbench %s: %.2f over %d items", name, scores[name], len(recs))
    return {
        **scores,
        **summary_means(scores),
        "counts": counts,
        "records": records,
        "max_length": max_length,
        "chat": bool(chat),
        "protocol": protocol(bool(query_aware)),
        "eval_s": round(time.perf_counter() - t0, 2),
    }


@register_task("longbench")
def run_longbench(job, lm, result: dict, progress: Progress = no_progress) -> None:
    """``task.longbench.datasets``: LongBench subsets, and ``longqa_squad`` (the embedded stand-in),
    query-aware unless ``task.longbench.query_aware=false``."""
    lb = job.task.longbench
    datasets = list(lb.datasets)
    real = [d for d in datasets if d != "longqa_squad"]
    query_aware = query_aware_setting(lb, "task.longbench", True)
    # the longest prompt: LongBench's max_length, or longqa_squad's 4000 tokens and its template
    longest = min(int(lb.max_length) if real else 4096, context_window(lm.model) or int(lb.max_length))
    batch = generation_batch_size(job, lm, "longbench", result, longest)
    if "longqa_squad" in datasets:
        # the task's own item seed, never the job's: every method and job seed gets the same items
        out = evaluate_longqa_squad(lm, n_items=task_limit(job, lb) or 20,
                                    item_seed=int(lb.get("item_seed", 0)), query_aware=query_aware,
                                    progress=progress, batch_size=batch)
        result["predictions"]["longqa_squad"] = out.pop("records")
        result["counts"]["longqa_squad_items"] = out["n"]
        result["metrics"]["longqa_squad"] = out
    if real:
        out = evaluate_longbench(lm, real, lb.get("data_dir"), task_limit(job, lb), lb.max_length,
                                 bool(job.model.chat), query_aware=query_aware, progress=progress,
                                 batch_size=batch)
        result["predictions"]["longbench"] = out.pop("records")
        result["counts"]["longbench_items"] = out.pop("counts")
        result["metrics"]["longbench"] = out
