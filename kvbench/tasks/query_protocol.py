"""Query-aware vs query-agnostic generation: where a prompt's context ends (docs/methods.md §9.5).

* **query-aware** (the SnapKV/KIVI/LongBench papers; kvbench's default for LongBench and
  ``longqa_squad``): the whole prompt, question included, is prefilled exactly, then compressed;
* **query-agnostic** (kvpress's protocol; kvbench's default for RULER): the context alone is
  prefilled exactly and compressed, then the question, the answer prefix and the chat template's
  tail are fed through the compressed cache with decode semantics, then greedy generation
  (:meth:`kvbench.model.compressed_lm.CompressedLM.generate_query_agnostic`).

Both protocols see the same token ids: the prompt is tokenized once, as the query-aware path
always did, and the query-agnostic path cuts those ids at the first token that ends after the
character where the question starts (:func:`cut_at_question`). So for FP16 the two differ by float
noise only (docs/methods.md §9.5: "for FP16 the two are identical").

Where the question starts (the "tail" of a prompt, found with :func:`tail_start`):

* LongBench and ``longqa_squad``: the part of the dataset's prompt template after ``{context}``
  (``dataset2prompt.json``), formatted with the item, e.g. multifieldqa_en's
  ``"\\n\\nNow, answer the following question ... Question: {input}\\nAnswer:"``;
* RULER: the last match of the task family's question pattern in lm-eval's ``input`` field, the
  split kvpress uses to build its RULER dataset (``QUESTION_PATTERNS`` of its
  ``create_huggingface_dataset.py``, from RULER's templates): ``What (is|are all) the special
  magic`` (niah), ``Question: Find all variables`` (vt), ``Question: What are the 10 most common
  words`` (cwe), ``Question: Do not provide any explanation.`` (fwe), ``Answer the question based
  on the given documents.`` (qa: its second, post-context occurrence).

Decisions where docs/methods.md is silent: the tail is located in the final text (chat template
applied, truncation done) by its *last* occurrence; a token that straddles the boundary goes to
the question (the compressed context never holds a question character); a prompt whose tail cannot
be found (LongBench middle truncation cutting into a question longer than half the window) is
generated query-aware and the record says so (``protocol_used``).
"""

from __future__ import annotations

import re

QUERY_AWARE = "query_aware"
QUERY_AGNOSTIC = "query_agnostic"

#: kvpress / RULER: the start of the question in each RULER task family's prompt
RULER_QUESTION = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}


def protocol(query_aware: bool) -> str:
    return QUERY_AWARE if query_aware else QUERY_AGNOSTIC


def as_bool(value, name: str) -> bool:
    """A config flag (``task.<name>.query_aware``) as a bool; a clear error otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}={value!r}; valid choices: true (query-aware), false (query-agnostic)")


def query_aware_setting(section, name: str, default: bool) -> bool:
    """The protocol a task section asks for (``task.<name>.query_aware``; absent or null: the
    task's default)."""
    value = section.get("query_aware", None) if section is not None else None
    return default if value is None else as_bool(value, f"{name}.query_aware")


def ruler_family(task: str) -> str:
    """``niah_single_2`` -> ``niah``; ``ruler_vt``/``vt`` -> ``vt``; ``ruler_qa_squad`` -> ``qa``."""
    name = task[len("ruler_"):] if task.startswith("ruler_") else task
    family = name.split("_")[0]
    if family not in RULER_QUESTION:
        raise ValueError(f"no question pattern for RULER task {task!r}; families: {', '.join(RULER_QUESTION)}")
    return family


def ruler_question(task: str, text: str) -> str:
    """The question part of a RULER ``input`` (from the last match of its family's pattern)."""
    matches = list(RULER_QUESTION[ruler_family(task)].finditer(text))
    if not matches:
        raise ValueError(f"RULER {task}: no question found in the input (pattern changed?)")
    return text[matches[-1].start():]


def template_tail(template: str, item: dict) -> str:
    """What follows ``{context}`` in a LongBench-style prompt template, filled from ``item``."""
    if "{context}" not in template:
        raise ValueError("the prompt template has no {context} field")
    return template.split("{context}", 1)[1].format(**item)


def tail_start(text: str, tail: str) -> int | None:
    """Character index of the last occurrence of ``tail`` in ``text`` (None if absent)."""
    if not tail:
        return None
    pos = text.rfind(tail)
    return None if pos < 0 else pos


def cut_at_question(tokenizer, text: str, char_pos: int | None, add_special_tokens: bool) -> tuple[list[int], int]:
    """``text`` tokenized once, and how many leading tokens are context: those that end at or
    before ``char_pos`` (a token straddling it counts as question). ``char_pos=None``: all."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if char_pos is None:
        return ids, len(ids)
    offsets = enc["offset_mapping"]
    first_query = next(
        (i for i, (start, end) in enumerate(offsets) if end > char_pos and end > start), len(ids)
    )
    return ids, first_query
