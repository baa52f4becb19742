"""Greedy generation under the query protocol, shared by the generation tasks (LongBench,
longqa_squad, RULER through :mod:`.hflm`): the chat template, the stop ids, the answer generated
query-aware or query-agnostic (docs/methods.md §9.5), the model's trained window.
"""

from __future__ import annotations

import logging

import torch

from .query_protocol import protocol, cut_at_question, tail_start

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


def generate_answer(lm, input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> str:
    ids = torch.tensor([input_ids], dtype=torch.long)
    new = lm.generate(ids, max_new_tokens, stop_ids)
    return lm.tokenizer.decode(new, skip_special_tokens=True)


def generate_with_protocol(
    lm, text: str, input_ids: list[int], tail: str, add_special_tokens: bool,
    max_new_tokens: int, stop_ids: list[int], query_aware: bool,
) -> tuple[str, dict]:
    """The answer under docs/methods.md §9.5's protocol, and ``{"protocol_used", "context_tokens"}``.

    Query-aware: :func:`generate_answer` (unchanged). Query-agnostic: the same ids cut where
    ``tail`` (the template's text after ``{context}``, filled) starts in ``text``; the context is
    prefilled and compressed alone, the tail goes through the compressed cache with decode
    semantics (``CompressedLM.generate_query_agnostic``). A tail not found in ``text`` (truncation cut into
    it) is generated query-aware, and the record says so."""
    if query_aware:
        return generate_answer(lm, input_ids, max_new_tokens, stop_ids), {
            "protocol_used": protocol(True), "context_tokens": len(input_ids)}
    ids, n_context = cut_at_question(lm.tokenizer, text, tail_start(text, tail), add_special_tokens)
    if ids != list(input_ids):
        raise RuntimeError("query-agnostic split: the prompt tokenizes differently with offsets")
    if n_context >= len(ids):
        log.warning("question not found in the prompt: generated query-aware")
        return generate_answer(lm, input_ids, max_new_tokens, stop_ids), {
            "protocol_used": protocol(True), "context_tokens": len(input_ids)}
    new = lm.generate_query_agnostic(torch.tensor([ids], dtype=torch.long), n_context, max_new_tokens, stop_ids)
    text_out = lm.tokenizer.decode(new, skip_special_tokens=True)
    return text_out, {"protocol_used": protocol(False), "context_tokens": n_context}


def context_window(model) -> int | None:
    """The positions the model was trained for (``max_position_embeddings``), if it says."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)
