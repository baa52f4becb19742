"""The rows of a job's W&B tables, as plain lists (no wandb import): its metrics, one row per task
evaluated, and the per-item predictions of the generation tasks (docs/sweeps.md).

Every row starts with the job's model, method, target budgets and seed, so that W&B's table panel,
which concatenates the tables of the runs it shows, compares jobs row by row. Scores are in
percent (:data:`kvbench.store.wandb_keys.UNITS`).
"""

from __future__ import annotations

from .wandb_keys import is_number, wandb_value

JOB_COLUMNS = ["model", "method", "target_bpd_k", "target_bpd_v", "seed"]
METRIC_COLUMNS = [*JOB_COLUMNS, "task", "name", "metric", "value", "unit", "n", "bpd_k", "bpd_v"]
PREDICTION_COLUMNS = [*JOB_COLUMNS, "task", "id", "prompt_tokens", "context_tokens", "protocol",
                      "prediction", "answers", "score", "bpd_k", "bpd_v"]
#: group keys that are not a task's score
NOT_SCORES = frozenset({"eval_s", "n", "item_seed", "limit", "max_length"})


def job_cells(result: dict) -> list:
    b = result.get("bpd") or {}
    return [result.get("model"), result.get("method"), b.get("target_k"), b.get("target_v"),
            result.get("seed")]


def _count(counts, name):
    """Items behind one score: an int, or the sum of a per-length dict (RULER)."""
    n = (counts or {}).get(name)
    if isinstance(n, dict):
        return sum(v for v in n.values() if is_number(v))
    return n if is_number(n) else None


def _group_rows(group: str, values: dict, result: dict) -> list[tuple]:
    """(name, metric, value, unit, n) of one metrics group."""
    counts = result.get("counts") or {}
    if group == "ppl":
        windows = counts.get("ppl_windows") or {}
        return [(name, "ppl", v, "perplexity", windows.get(name)) for name, v in values.items()
                if is_number(v)]
    if group == "zeroshot":
        metric, n = values.get("metric") or {}, values.get("counts") or {}
        return [(name, metric.get(name, "avg of headline metrics"), wandb_value(f"metrics/{group}/{name}", v),
                 "percent", n.get(name)) for name, v in values.items() if is_number(v) and name not in NOT_SCORES]
    if group.startswith("ruler"):
        n = values.get("counts") or {}
        rows = [(name, "string match", v, "percent", _count(n, name))
                for name, v in values.items() if is_number(v) and name not in NOT_SCORES]
        for length, scores in (values.get("by_length") or {}).items():
            rows += [(f"{name}@{length}", "string match", v, "percent",
                      (n.get(name) or {}).get(length) if isinstance(n.get(name), dict) else None)
                     for name, v in scores.items() if is_number(v)]
        return rows
    n = counts.get(f"{group}_items")
    return [(group if name == "f1" else name, "f1", v, "percent",
             values.get("n") if name == "f1" else _count(n, name))
            for name, v in values.items() if is_number(v) and name not in NOT_SCORES]


def metric_rows(result: dict) -> list[list]:
    """One row per task evaluated (PPL dataset, zero-shot task, LongBench subset, RULER task and
    task at each length, the averages), with the task's measured bpd (:data:`METRIC_COLUMNS`)."""
    by_task = (result.get("bpd") or {}).get("by_task") or {}
    task_of = {"longqa_squad": "longbench", "ruler_wiki": "ruler"}
    rows = []
    for group, values in (result.get("metrics") or {}).items():
        if not isinstance(values, dict):
            continue
        bpd = by_task.get(task_of.get(group, group)) or {}
        for name, metric, value, unit, n in _group_rows(group, values, result):
            rows.append([*job_cells(result), group, name, metric, value, unit, n,
                         bpd.get("measured_k"), bpd.get("measured_v")])
    return rows


def _prediction_row(result: dict, task: str, rec: dict, score_key: str) -> list:
    score = rec.get(score_key)
    answers = rec.get("answers") or []
    return [*job_cells(result), task, str(rec.get("id", rec.get("_id", rec.get("doc_id")))),
            rec.get("prompt_tokens"), rec.get("context_tokens"), rec.get("protocol_used"),
            rec.get("prediction"), " | ".join(str(a) for a in answers),
            100.0 * score if is_number(score) else None, rec.get("bpd_k"), rec.get("bpd_v")]


def prediction_rows(result: dict, predictions: dict) -> dict[str, list[list]]:
    """Per prediction source (``longqa_squad``, ``longbench``, ``ruler``/``ruler_wiki``) its rows
    (:data:`PREDICTION_COLUMNS`): one per item, the score in percent."""
    tables = {}
    for source, recs in (predictions or {}).items():
        rows = []
        if isinstance(recs, dict):  # LongBench: per subset
            for subset, items in recs.items():
                rows += [_prediction_row(result, subset, r, "f1") for r in items]
        elif source.startswith("ruler"):
            rows = [_prediction_row(result, f"{r.get('task')}@{r.get('max_length')}", r, "score")
                    for r in recs]
        else:
            rows = [_prediction_row(result, source, r, "f1") for r in recs]
        if rows:
            tables[source] = rows
    return tables
