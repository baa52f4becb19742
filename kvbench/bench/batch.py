"""§9 of ``python -m kvbench.bench``: items per second at the batches people run, beside plain
transformers on the same inputs and batch.

Three kinds of work, each at every batch of the preset (GPU: 1, 8, 32; ``--quick``: 1, 4):

* **ppl** — equal-length PPL windows, track A (:func:`kvbench.model.perplexity.batch_nll`) against
  the plain model's forward pass and cross-entropy on the same windows;
* **score** — zero-shot-style rows of 3/4 to all of ``score_tokens`` tokens, right-padded as lm-eval
  pads them (``CompressedLM.logits`` with each row's length and its last 8 positions scored)
  against the plain model's forward pass on the same padded batch;
* **generate** — ``gen_prompt`` -token prompts, ``gen_new`` greedy tokens each
  (``CompressedLM.generate_rows``) against a plain greedy loop over transformers' own cache.

A row's value is the method's items/s over plain transformers' at the same batch (median of paired
repetitions, :func:`kvbench.bench.common.paired_ratio`). Targets (docs/performance.md): kvbench's
FP16 >= 0.9x plain at every batch; on a GPU at batch >= 8 every codec >= 0.6x, H2O and SnapKV
>= 0.3x; elsewhere the method rows are INFO. ``fp16 gain`` rows give FP16's items/s at the largest
batch over batch 1 (on a CPU, generation: >= 1.5x at batch 4).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..model.compressed_lm import CompressedLM
from ..model.integrate import cache_argument, last_logits, model_shape, returned_cache
from ..model.perplexity import batch_nll
from .common import EVAL_CASES, BenchModel, Row, attached_around, budget_label, eval_windows, make_method, paired_ratio

log = logging.getLogger(__name__)

#: method rows' targets on a GPU at batch >= GPU_BATCH (items/s over plain transformers')
TARGETS = {"codec": 0.6, "baseline": 0.6, "evict": 0.3}
FP16_TARGET = 0.9
GPU_BATCH = 8
#: FP16's items/s at the largest batch over batch 1, generation, on a CPU (the --quick preset: 4)
CPU_GAIN_TARGET = 1.5
CASES = [*EVAL_CASES, ("snapkv", "snapkv", {}, 4.0, 4.0, "evict")]


@dataclass(frozen=True)
class BatchSizes:
    batches: tuple
    ppl_tokens: int
    score_tokens: int
    gen_prompt: int
    gen_new: int
    reps: int


PRESETS = {
    "full": BatchSizes((1, 8, 32), 2048, 128, 4096, 32, 3),
    "quick": BatchSizes((1, 4), 256, 128, 256, 8, 3),
    "smoke": BatchSizes((1, 2), 32, 16, 32, 2, 1),
    # the device check's batch part (kvbench.bench.gpu_check): on a GPU, and its CPU preset
    "check": BatchSizes((1, 8), 2048, 128, 4096, 16, 1),
    "check_quick": BatchSizes((1, 2), 64, 32, 64, 2, 1),
}


def _score_rows(n: int, tokens: int, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """n right-padded rows of 3/4 to all of ``tokens`` ids (lm-eval's layout), and their lengths."""
    g = torch.Generator().manual_seed(n)
    lengths = [int(x) for x in torch.randint(3 * tokens // 4, tokens + 1, (n,), generator=g)]
    ids = torch.randint(2, vocab, (n, tokens), generator=g)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
    return ids, lengths


def _plain_generate(model, prompts: torch.Tensor, new: int) -> None:
    """Plain transformers: prefill the batch, then ``new`` greedy steps over its own cache, the
    tokens read on the host at each step (as any greedy loop that checks for a stop token)."""
    name = cache_argument(model)
    out = model(input_ids=prompts, use_cache=True, **last_logits(model))
    for _ in range(new - 1):
        token = out.logits[:, -1:].argmax(-1)
        token.tolist()
        out = model(input_ids=token, use_cache=True, **{name: returned_cache(out)}, **last_logits(model))
    out.logits[:, -1].argmax(-1).tolist()


def _work(bm: BenchModel, sizes: BatchSizes, kind: str, batch: int):
    """(plain(), kvbench(lm)) of one kind of work at one batch, on the same inputs."""
    device, vocab = bm.device, bm.model.config.vocab_size
    if kind == "ppl":
        windows = eval_windows(bm, sizes.ppl_tokens, 1).repeat(batch, 1).to(device)

        def plain():
            logits = bm.model(input_ids=windows, use_cache=False).logits[:, :-1].float()
            for i in range(batch):
                float(torch.nn.functional.cross_entropy(logits[i], windows[i, 1:], reduction="sum"))

        return plain, lambda lm: batch_nll(lm, list(windows), "A", None)
    if kind == "score":
        ids, lengths = _score_rows(batch, sizes.score_tokens, vocab)
        ids = ids.to(device)
        return (lambda: bm.model(input_ids=ids, use_cache=False).logits,
                lambda lm: lm.logits(ids, scored=8, lengths=lengths))
    prompts = torch.randint(2, vocab, (batch, sizes.gen_prompt), generator=torch.Generator().manual_seed(7))
    prompts = prompts.to(device)
    return (lambda: _plain_generate(bm.model, prompts, sizes.gen_new),
            lambda lm: lm.generate_rows(list(prompts), sizes.gen_new, ()))


def _target(kind_of_method: str, batch: int, device: torch.device) -> tuple[str, float]:
    if kind_of_method == "fp16":
        return ">=", FP16_TARGET
    if device.type == "cuda" and batch >= GPU_BATCH:
        return ">=", TARGETS[kind_of_method]
    return "info", 0.0


def run(bm: BenchModel, preset: str, stats, cases=CASES) -> list[Row]:
    sizes = PRESETS[preset]
    shape = model_shape(bm.model)
    methods = [("fp16", None, None, None, "fp16")]
    for label, name, options, bpd, v_bpd, kind in cases:
        methods.append((label, make_method(name, options, shape, bpd, v_bpd, stats), bpd, v_bpd, kind))
    rows, rates = [], {}
    for task in ("ppl", "score", "generate"):
        for batch in sizes.batches:
            plain, ours = _work(bm, sizes, task, batch)
            for label, method, bpd, v_bpd, kind in methods:
                if method is not None and task != "generate" and not method.supports_in_pass:
                    continue
                lm = CompressedLM(bm.model, bm.tokenizer, None)
                setup, teardown = attached_around(lm, method) if method is not None else (None, None)
                log.info("batch: %s %s at batch %d", task, label, batch)
                res = paired_ratio(plain, lambda: ours(lm), bm.device, sizes.reps, setup=setup, teardown=teardown)
                rate, plain_rate = batch / res["method_s"], batch / res["base_s"]
                rates[(task, label, batch)] = rate
                op, target = _target(kind, batch, bm.device)
                rows.append(Row(
                    "batch", f"{task} b{batch} {label}" + ("" if method is None else f" ({budget_label(bpd, v_bpd)})"),
                    "items/s / plain", 1.0 / res["ratio"], "x", op, target,
                    note=f"{rate:.3g} vs {plain_rate:.3g} items/s",
                    detail={"task": task, "batch": batch, "method": label, "items_per_s": rate,
                            "plain_items_per_s": plain_rate, "kind": kind,
                            **{k: res[k] for k in ("base_s", "method_s", "ratios")}},
                ))
    top = max(sizes.batches)
    for task in ("ppl", "score", "generate"):
        gain = rates[(task, "fp16", top)] / rates[(task, "fp16", 1)]
        cpu_gen = bm.device.type == "cpu" and task == "generate"
        rows.append(Row("batch", f"{task} fp16 gain b{top}/b1", "items/s ratio", gain, "x",
                        ">=" if cpu_gen else "info", CPU_GAIN_TARGET if cpu_gen else 0.0,
                        note=f"{rates[(task, 'fp16', top)]:.3g} vs {rates[(task, 'fp16', 1)]:.3g} items/s"))
    return rows
