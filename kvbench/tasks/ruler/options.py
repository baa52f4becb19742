"""Checks of the ``task.ruler`` options: the tasks (the 13 of :mod:`.catalog`), the lengths (any
list; a length above the model's window, ``max_position_embeddings``, is refused) and the item seed
(null or an integer)."""

from __future__ import annotations

from .catalog import RULER_TASKS


def check_tasks(tasks) -> list[str]:
    names = list(RULER_TASKS) if tasks is None else [str(t) for t in tasks]
    unknown = [t for t in names if t not in RULER_TASKS]
    if unknown or not names:
        raise ValueError(
            f"unknown RULER task(s) {unknown or names}; the 13 tasks: {', '.join(RULER_TASKS)}"
        )
    return list(dict.fromkeys(names))


def check_lengths(lengths, window: int | None) -> list[int]:
    values = [int(x) for x in ([lengths] if isinstance(lengths, (int, str)) else lengths)]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"task.ruler.lengths={lengths!r}: need a list of positive token counts")
    if window is not None:
        over = [v for v in values if v > window]
        if over:
            raise ValueError(
                f"task.ruler.lengths {over} exceed the model's window of {window} tokens "
                f"(max_position_embeddings); RULER at those lengths would measure RoPE "
                f"extrapolation, not the cache. Use lengths <= {window}"
            )
    return list(dict.fromkeys(values))


def check_item_seed(item_seed) -> int | None:
    """``task.ruler.item_seed``: None (lm-eval's own items) or an integer."""
    if item_seed is None:
        return None
    if isinstance(item_seed, bool) or not isinstance(item_seed, int):
        raise ValueError(f"task.ruler.item_seed={item_seed!r}: null (lm-eval's own items) or an integer")
    return int(item_seed)
