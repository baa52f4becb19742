"""Schema adapters for the offline zero-shot copies (used through ``!function`` in their YAMLs)."""


def boolq_answer_to_label(dataset):
    """google/boolq (``answer: bool``) → super_glue/boolq (``label``: 0 = no, 1 = yes)."""
    return dataset.map(lambda doc: {"label": int(bool(doc["answer"]))})
