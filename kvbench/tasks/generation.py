"""Greedy generation under the query protocol, shared by the generation tasks (LongBench,
longqa_squad, RULER through :mod:`.hflm`): the chat template, the stop ids, the answer generated
query-aware or query-agnostic (docs/methods.md §9.5), the model's trained window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..model.batching import chunks, longest_first
from .query_protocol import protocol, cut_at_question, tail_start
from .reporting import reading_bpd, readings_in_order

log = logging.getLogger(__name__)


def apply_chat(tokenizer, prompt: str) -> str:
    """One user turn through the tokenizer's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "chat=True but the tokenizer has no chat template; set the model's `chat: false`"
        )
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The EOS ids ``model.generate`` would stop at (generation config, then tokenizer)."""
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


@dataclass
class ProtocolPrompt:
    """One prompt under docs/methods.md §9.5's protocol: its token ids, where its compressed
    context ends (``n_context``; None: the whole prompt is prefilled, query-aware) and the record
    fields ``{"protocol_used", "context_tokens"}``."""

    ids: list[int]
    n_context: int | None
    how: dict


def protocol_prompt(
    tokenizer, text: str, input_ids: list[int], tail: str, add_special_tokens: bool, query_aware: bool,
) -> ProtocolPrompt:
    """The prompt as the protocol generates it. Query-aware: the ids as they are. Query-agnostic:
    the same ids cut where ``tail`` (the template's text after ``{context}``, filled) starts in
    ``text``; the context is prefilled and compressed alone, the tail goes through the compressed
    cache with decode semantics (``CompressedLM.generate_query_agnostic``). A tail not found in
    ``text`` (truncation cut into it) is generated query-aware, and the record says so."""
    aware = ProtocolPrompt(list(input_ids), None, {"protocol_used": protocol(True),
                                                   "context_tokens": len(input_ids)})
    if query_aware:
        return aware
    ids, n_context = cut_at_question(tokenizer, text, tail_start(text, tail), add_special_tokens)
    if ids != list(input_ids):
        raise RuntimeError("query-agnostic split: the prompt tokenizes differently with offsets")
    if n_context >= len(ids):
        log.warning("question not found in the prompt: generated query-aware")
        return aware
    return ProtocolPrompt(ids, n_context, {"protocol_used": protocol(False), "context_tokens": n_context})


def generate_prompts(lm, prompts: list[ProtocolPrompt], max_new_tokens: int, stop_ids: list[int],
                     batch_size: int = 1, each=None) -> None:
    """Greedy answers to ``prompts``, ``batch_size`` at a time (longest first, as lm-eval orders
    its requests, so that rows of similar length share a batch; one at a time in the prompts'
    order): ``each(i, new_ids, bpd)`` runs as prompt ``i`` is answered, ``bpd`` being
    ``{"bpd_k", "bpd_v"}`` (the bits it read). ``lm``'s readings are left in the prompts' order,
    as if they had run one by one."""
    order = longest_first([len(p.ids) for p in prompts]) if batch_size > 1 else list(range(len(prompts)))
    with readings_in_order(lm, len(prompts)) as place:
        for batch in chunks(order, batch_size):
            new = lm.generate_rows([prompts[i].ids for i in batch], max_new_tokens, stop_ids,
                                   [prompts[i].n_context for i in batch])
            got = getattr(lm, "readings", None)
            for j, i in enumerate(batch):
                place(i)
                each(i, new[j], reading_bpd(got[len(got) - len(batch) + j] if got else None))


def answer_items(lm, prompts: list[ProtocolPrompt], max_new_tokens: int, stop_ids: list[int],
                 batch_size: int, make_record, report, desc: str) -> list[dict]:
    """One record per prompt, in the prompts' order: ``make_record(i, answer_text)``, then the
    prompt's protocol fields and the bits it read; ``report(records done so far)`` after each
    answer (a task's progress), a progress bar over the items."""
    records, done = [None] * len(prompts), []
    bar = tqdm(total=len(prompts), desc=desc, unit="item")

    def each(i, new, bpd):
        text = lm.tokenizer.decode(new, skip_special_tokens=True)
        records[i] = {**make_record(i, text), **prompts[i].how, **bpd}
        done.append(records[i])
        report(done)
        bar.update(1)

    generate_prompts(lm, prompts, max_new_tokens, stop_ids, batch_size, each)
    bar.close()
    return records


def context_window(model) -> int | None:
    """The positions the model was trained for (``max_position_embeddings``), if it says."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)
