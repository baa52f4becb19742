"""One record per scored RULER item, from lm-eval's logged samples and the generations of the HFLM
(:mod:`kvbench.tasks.hflm`), and what the result says about them: item counts and token lengths.

RULER sizes ``input + max new tokens`` to at most the length, so an item's ``length`` field (input
tokens + the task's generation budget) lies just below it; the model reads the input plus the chat
template and ``gen_prefix`` (``prompt_tokens``). Each record keeps the ``bpd_k``/``bpd_v`` its item
read.
"""

from __future__ import annotations

from .catalog import LM_EVAL_TO_TASK


def item_records(out: dict, hflm) -> list[dict]:
    gen = {(r["task"], r["doc_id"]): r for r in getattr(hflm, "generation_records", ())}
    records = []
    for lm_name, samples in (out.get("samples") or {}).items():
        task = LM_EVAL_TO_TASK.get(lm_name, lm_name)
        for s in samples:
            doc = s["doc"]
            g = gen.get((lm_name, s["doc_id"]), {})
            length = str(doc["max_length"])
            records.append({
                "task": task,
                "max_length": doc["max_length"],
                "doc_id": s["doc_id"],
                "index": doc.get("index"),
                "length": doc.get("length"),
                "prompt_tokens": g.get("prompt_tokens"),
                "context_tokens": g.get("context_tokens"),
                "new_tokens": g.get("new_tokens"),
                "protocol_used": g.get("protocol"),
                "prediction": g.get("prediction"),
                "answers": list(doc["outputs"]),
                "score": s.get(length),
                "bpd_k": g.get("bpd_k"),
                "bpd_v": g.get("bpd_v"),
            })
    return records


def item_counts(records: list[dict]) -> dict:
    """Per task and length: the number of items scored."""
    counts = {}
    for r in records:
        counts.setdefault(r["task"], {}).setdefault(str(r["max_length"]), 0)
        counts[r["task"]][str(r["max_length"])] += 1
    return counts


def token_stats(records: list[dict]) -> dict:
    """Per length: min/max of the RULER ``length`` field and of the prompt tokens the model read."""
    out: dict[str, dict] = {}
    for r in records:
        d = out.setdefault(str(r["max_length"]), {"length": [], "prompt_tokens": []})
        d["length"].append(r["length"])
        if r["prompt_tokens"] is not None:
            d["prompt_tokens"].append(r["prompt_tokens"])
    return {
        k: {f"{name}_{f.__name__}": f(v) for name, v in d.items() if v for f in (min, max)}
        for k, d in out.items()
    }
