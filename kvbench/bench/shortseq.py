"""zeroshot section of ``python -m kvbench.bench``: the cost of a method on short requests.

Zero-shot log-likelihood requests are tens of tokens long, so the fixed cost of a method's
per-layer ops shows there first (lm-eval's zero-shot with KV-COBRA-KL measured 1.36x FP16's time on
this CPU). The section times ``zs_requests`` (100) **real lm-eval requests** through
the compressed model and through FP16, one request at a time (batch 1, as docs/methods.md §9.2 has it:
batching is not the way out), interleaved request by request.

The requests: lm-eval builds them from its own task definitions (the default zero-shot tasks, the
offline copies of ``kvbench.tasks.zeroshot``) for a capturing model whose
``_loglikelihood_tokens`` records every ``(context, continuation)`` token pair instead of scoring
it; ``zs_requests`` of them, evenly spaced over the order lm-eval hands them over in (task by
task, document by document, choice by choice), are kept, so the sample spans every task. Capturing runs no model. Without a tokenizer (``--model
tiny``) the requests are random ids of 20-80 tokens (smoke runs only; the row says so).

The timed work per request is what ``HFLM`` does for it at batch 1: the model input
``(context + continuation)[:-1]`` (left-truncated to the model's length), ``CompressedLM.logits``
(the Q-all pass; FP16: the plain model), then the float32 log-softmax of the continuation's rows
and the gather of its tokens and the greedy check. The two sides are interleaved request by
request (:func:`interleaved_requests`; the order alternates), ``zs_reps`` times over the list,
after a short warm-up (10 requests each), and the ratio is the sum over requests of each side's
fastest repetition, method over FP16: on a shared machine load only adds time, and a slow stretch
of the machine hits both sides of a request alike (whole passes of 100 requests, timed one after
the other, differed by up to 40% on this VM). The pass-level ratios are given beside it. Targets: at most
1.15x for the codecs (KIVI, SVDq, KQ-SVD, KV-COBRA), at most 1.2x for the published competitors (KVQuant, GEAR at
4 bpd, TurboQuant), at most 2x for H2O. SnapKV (scored through
``CompressedLM.score``, prefill + compressed continuation) is not in the table.

Decisions where docs/methods.md is silent: the request sample (evenly spaced, above); lm-eval's
per-request Python overhead (request bookkeeping, metric code) is left out of both sides, since
it is the same for every method.
"""

from __future__ import annotations

import logging
import statistics

import torch

from ..model.compressed_lm import CompressedLM
from ..model.integrate import model_shape
from .common import EVAL_CASES, BenchModel, Row, Sizes, attached_around, budget_label, clock, clock_around, make_method

log = logging.getLogger(__name__)

TARGETS = {"codec": 1.15, "evict": 2.0, "baseline": 1.2}  # baseline: KVQuant, GEAR, TurboQuant
WARMUP_REQUESTS = 10
#: the default zero-shot tasks and how many documents each contributes to the capture
TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")


def capture_requests(bm: BenchModel, n: int, tasks=TASKS) -> list[tuple[list[int], list[int]]]:
    """``n`` lm-eval loglikelihood requests ``(context_tokens, continuation_tokens)``, evenly spaced
    over the order lm-eval hands them to the model; the document limit doubles until there are
    enough."""
    from ..tasks.zeroshot import compressed_hflm, quiet_lm_eval, resolve_offline, run_lm_eval

    captured: list = []

    class _Capture:
        model, tokenizer, supports_in_pass = bm.model, bm.tokenizer, True

    offline = resolve_offline("auto")
    limit = max(2, -(-n // (3 * len(tasks))) + 1)  # ~3 requests per document on average
    while True:
        captured.clear()
        with quiet_lm_eval():
            hflm = compressed_hflm(_Capture())

            def record(requests, disable_tqdm=False, override_bs=None):
                captured.extend((list(ctx), list(cont)) for _, ctx, cont in requests)
                return [(0.0, False)] * len(requests)

            hflm._loglikelihood_tokens = record
            run_lm_eval(hflm, list(tasks), limit, 0, offline)
        if len(captured) >= n:
            break
        limit *= 2
    idx = torch.linspace(0, len(captured) - 1, n).round().long().tolist()
    return [captured[i] for i in idx]


def synthetic_requests(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(20, 81, (1,), generator=g))
        c = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(0, vocab, (t,), generator=g).tolist()
        out.append((ids[:-c], ids[-c:]))
    return out


def score_request(lm: CompressedLM, context: list[int], continuation: list[int], max_length: int) -> tuple[float, bool]:
    """What lm-eval's HFLM does for one request at batch 1 (model call, float32 log-softmax of the
    continuation rows, gather, greedy check)."""
    whole = (context + continuation)[-(max_length + 1):]
    inp = torch.tensor([whole[:-1]], dtype=torch.long)
    logits = lm.logits(inp)
    rows = logits[0, -len(continuation):].float().log_softmax(-1)
    target = torch.tensor(continuation, device=rows.device)
    greedy = bool((rows.argmax(-1) == target).all())
    return float(rows.gather(-1, target[:, None]).sum()), greedy


def _max_length(bm: BenchModel) -> int:
    return int(getattr(bm.model.config, "max_position_embeddings", 2048) or 2048)


def cases_named(labels: list[str] | None) -> list[tuple]:
    """The :data:`EVAL_CASES` with these labels (None: all); an unknown label is an error naming
    the valid ones."""
    if labels is None:
        return EVAL_CASES
    unknown = sorted(set(labels) - {c[0] for c in EVAL_CASES})
    if unknown:
        raise SystemExit(f"--zs-methods: unknown {unknown}; valid choices: {', '.join(c[0] for c in EVAL_CASES)}")
    return [c for c in EVAL_CASES if c[0] in labels]


def interleaved_requests(fp16, lm, requests, max_len, setup, teardown, reps: int, device) -> dict:
    """Each request timed on FP16 and on the method back to back (the order alternating from one
    request to the next and from one repetition to the next), ``reps`` times over the list;
    ``setup``/``teardown`` attach and detach the method around each of its requests, untimed.

    The ratio is sum_i min_r t_method[r, i] / sum_i min_r t_fp16[r, i]: per request the fastest of
    its repetitions on each side (on a shared machine load only ever adds time), the two sides
    measured a fraction of a second apart, so a slow stretch of the machine hits both. Also returned: each
    repetition's pass-level ratio (sum over its requests) and their median."""
    n = len(requests)
    tb = [[0.0] * n for _ in range(max(1, reps))]
    tm = [[0.0] * n for _ in range(max(1, reps))]

    def method_request(ctx, cont):
        return clock_around(lambda: score_request(lm, ctx, cont, max_len), device, setup, teardown)

    for r in range(len(tb)):
        for i, (ctx, cont) in enumerate(requests):
            if (r + i) % 2 == 0:
                tb[r][i] = clock(lambda: score_request(fp16, ctx, cont, max_len), device)
                tm[r][i] = method_request(ctx, cont)
            else:
                tm[r][i] = method_request(ctx, cont)
                tb[r][i] = clock(lambda: score_request(fp16, ctx, cont, max_len), device)
    best_b = [min(t[i] for t in tb) for i in range(n)]
    best_m = [min(t[i] for t in tm) for i in range(n)]
    passes = [sum(m) / sum(b) for m, b in zip(tm, tb)]
    return {
        "ratio": sum(best_m) / sum(best_b),
        "base_s": sum(best_b), "method_s": sum(best_m),
        "pass_ratios": passes, "ratio_of_passes": statistics.median(passes),
        "base_times_s": [sum(t) for t in tb], "method_times_s": [sum(t) for t in tm],
    }


def run(bm: BenchModel, sizes: Sizes, stats, cases=EVAL_CASES) -> list[Row]:
    if bm.tokenizer is not None:
        log.info("zeroshot: capturing %d lm-eval requests (%s)", sizes.zs_requests, ", ".join(TASKS))
        requests, source = capture_requests(bm, sizes.zs_requests), "lm-eval " + "/".join(TASKS)
    else:
        requests, source = synthetic_requests(bm.vocab, sizes.zs_requests), "synthetic (no tokenizer)"
    max_len = _max_length(bm)
    lengths = [min(len(c) + len(t), max_len + 1) - 1 for c, t in requests]
    shape = model_shape(bm.model)
    fp16 = CompressedLM(bm.model, bm.tokenizer, None)

    def replay(lm, reqs):
        def go():
            for ctx, cont in reqs:
                score_request(lm, ctx, cont, max_len)
        return go

    replay(fp16, requests[:WARMUP_REQUESTS])()
    rows = []
    for label, name, options, bpd, v_bpd, kind in cases:
        method = make_method(name, options, shape, bpd, v_bpd, stats)
        lm = CompressedLM(bm.model, bm.tokenizer, None)
        setup, teardown = attached_around(lm, method)

        setup()
        try:
            replay(lm, requests[:WARMUP_REQUESTS])()
        finally:
            teardown()
        log.info("zeroshot: %s (%s), %d requests x %d", label, budget_label(bpd, v_bpd), len(requests), sizes.zs_reps)
        res = interleaved_requests(fp16, lm, requests, max_len, setup, teardown, sizes.zs_reps, bm.device)
        n = len(requests)
        rows.append(Row(
            "zeroshot", f"{label} ({budget_label(bpd, v_bpd)})", "time / fp16", res["ratio"], "x", "<=", TARGETS[kind],
            note=(f"{res['method_s'] / n * 1e3:.3g} ms vs {res['base_s'] / n * 1e3:.3g} ms per request "
                  f"(passes: median {res['ratio_of_passes']:.2f}x, {min(res['pass_ratios']):.2f}-"
                  f"{max(res['pass_ratios']):.2f}x); "
                  f"{n} requests, {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / n:.0f})"),
            detail={
                "method": name, "options": options, "bpd": bpd, "v_bpd": v_bpd, "kind": kind, "requests": n,
                "source": source, "input_tokens": lengths, **res,
            },
        ))
    return rows
