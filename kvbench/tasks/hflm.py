"""The lm-eval model of kvbench: an ``HFLM`` whose scoring and generation go through a
:class:`kvbench.model.compressed_lm.CompressedLM`, in batches whose rows give what they give alone
(docs/design.md §2.1), float32 log-softmax (see :mod:`kvbench.tasks.zeroshot`).

A module of its own because importing lm-eval takes seconds: :mod:`.zeroshot` and :mod:`.ruler`
import it when they evaluate, not when the task registry is filled.

Progress (``progress``, the job's :data:`kvbench.context.Progress`, set by the task): scoring
reports at most :data:`REPORTS` points of ``zeroshot/requests`` (requests done, the running measured
bpd); generation reports every request under ``<progress_prefix>/<task>`` (items done, prompt and
new tokens, the bits that item read), and each generation record keeps that item's ``bpd_k`` and
``bpd_v``.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import _add_special_kwargs, handle_stop_sequences, has_bos_prefix
from tqdm.auto import tqdm

from ..context import no_progress
from ..model.batching import chunks, longest_first, pad
from .batch_size import generation_probe, resolve_batch_size, scoring_probe
from .generation import ProtocolPrompt, generate_prompts, stop_token_ids
from .query_protocol import protocol, cut_at_question
from .reporting import RunningBpd, readings_in_order

#: the most progress points one batch of scored requests makes
REPORTS = 200

log = logging.getLogger(__name__)


class CompressedHFLM(HFLM):
    """HFLM built from a loaded model (``pretrained=model``, float32 log-softmax) whose requests
    run ``batch_size`` at a time (``"auto"``: :func:`kvbench.tasks.batch_size.resolve_batch_size`
    on the longest request), longest first as lm-eval orders them.

    Scoring: each batch of requests is one Q-all pass, ``CompressedLM.logits`` on right-padded
    rows (lm-eval's layout); when the method has no in-pass simulation, ``CompressedLM.score_rows``.
    ``generate_until`` (RULER, :mod:`kvbench.tasks.ruler`) generates greedily through
    ``CompressedLM.generate_rows``, query-aware or query-agnostic. A batch gives what its rows give
    alone, and ``lm``'s readings are left in the requests' order.
    """

    def __init__(self, clm, max_length=None, softmax_dtype=torch.float32, batch_size: int | str = 1):
        super().__init__(
            pretrained=clm.model, tokenizer=clm.tokenizer, batch_size=1, max_length=max_length,
            softmax_dtype=softmax_dtype,
        )
        self.clm = clm
        self.rows_setting = batch_size
        #: the batch the last requests ran at
        self.rows_used = None

    #: the job's progress callback (set by the task) and the section prefix of generation
    progress = staticmethod(no_progress)
    progress_prefix = "generate"
    #: lm-eval task name -> the name its generation section is reported under
    progress_names: dict = {}
    _requests_done = 0

    def _model_call(self, inps, attn_mask=None, labels=None):
        return self.clm.logits(inps)

    def _rows(self, probe, task: str) -> int:
        self.rows_used = resolve_batch_size(self.rows_setting, self.clm, probe, task)
        return self.rows_used

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        """Each request's log-likelihood and greedy match, a batch of requests per pass; the
        measured bpd of a request is the mean over the positions that predict its continuation
        (docs/methods.md §0 v3), never over its context."""
        if not requests:
            return []
        report = self._request_reporter(len(requests))
        in_pass = _in_pass(self.clm)
        rows = [self._scoring_row(req, in_pass) for req in requests]
        longest = max(len(a) + len(b) for a, b in rows)
        probe = scoring_probe(self.clm, longest, None if in_pass else max(len(b) for _, b in rows))
        size = self._rows(probe, "zeroshot")
        score = self._score_in_pass if in_pass else self._score_prefill
        out = [None] * len(requests)
        with readings_in_order(self.clm, len(requests)) as place:
            batches = chunks(longest_first([len(a) + len(b) for a, b in rows]), size)
            for batch in tqdm(batches, desc="zero-shot requests", unit="batch", disable=disable_tqdm):
                for i, answer in zip(batch, score([rows[i] for i in batch])):
                    out[i] = answer
                    place(i)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    report()
        return out

    def _scoring_row(self, req, in_pass: bool) -> tuple[list[int], list[int]]:
        """(what the model reads, the continuation): in-pass, lm-eval's causal input (context and
        continuation, left-truncated to ``max_length + 1`` tokens, the last one dropped);
        otherwise the context (left-truncated so that context and continuation fit) and the
        continuation."""
        _, context, continuation = req
        if in_pass:
            return (context + continuation)[-(self.max_length + 1):][:-1], continuation
        keep = self.max_length + 1 - len(continuation)
        return (context[-keep:] if len(context) > keep else context), continuation

    def _score_in_pass(self, rows) -> list[tuple[float, bool]]:
        """lm-eval's log-likelihood and greedy match of each row, one Q-all pass for the batch."""
        lengths = [len(inp) for inp, _ in rows]
        ids = pad([inp for inp, _ in rows], "right").ids
        logits = torch.nn.functional.log_softmax(
            self.clm.logits(ids, scored=[len(c) for _, c in rows], lengths=lengths), dim=-1,
            dtype=self.softmax_dtype)
        sums, greedy = [], []
        for i, (_, cont) in enumerate(rows):
            lg = logits[i, lengths[i] - len(cont) : lengths[i]]
            target = torch.tensor(cont, dtype=torch.long, device=lg.device)
            greedy.append((lg.argmax(dim=-1) == target).all())
            sums.append(lg.gather(1, target[:, None]).sum())
        # one host read for the batch
        return list(zip(torch.stack(sums).tolist(), torch.stack(greedy).tolist()))

    def _score_prefill(self, rows) -> list[tuple[float, bool]]:
        """Methods without a single-pass form: each context prefilled exactly and compressed, the
        continuation scored through the compressed cache. ``score_rows`` returns the
        continuation's log-probs only, so greedy-match is unknown (False): it only feeds
        loglikelihood-type metrics, never acc/acc_norm of multiple choice."""
        logprobs = self.clm.score_rows([c for c, _ in rows], [t for _, t in rows])
        return [(float(lp.sum()), False) for lp in logprobs]

    def _request_reporter(self, total: int):
        """A callable run after each scored request: every ``total / REPORTS`` requests (and at
        the last) a point of ``zeroshot/requests`` with the requests done so far in this
        evaluation, the batch's size and the running measured bpd."""
        if self.progress is no_progress:
            return lambda: None
        every, bpd, start = max(1, -(-total // REPORTS)), RunningBpd(self.clm), self._requests_done
        state = {"i": 0}

        def report():
            state["i"] += 1
            self._requests_done = start + state["i"]
            if state["i"] % every == 0 or state["i"] == total:
                self.progress("zeroshot/requests", self._requests_done, done=state["i"], total=total,
                              **bpd.values())

        return report

    # Generation (RULER through lm-eval)
    #: set by a generation task: ``request -> character index where its question starts``
    #: (or None); with ``query_aware = False`` the prompt is cut there (query_protocol.py)
    question_start = None
    query_aware = True
    #: one dict per generated request: task, doc_id, token counts, protocol, prediction
    generation_records: list | tuple = ()

    def generate_until(self, requests, disable_tqdm=False):
        """lm-eval's generation requests through ``CompressedLM.generate_rows``, greedy, a batch at
        a time (requests with the same ``max_gen_toks`` together): query-aware, or query-agnostic
        (the prompt cut where its question starts), at most the task's ``max_gen_toks`` new
        tokens, stopping at the model's EOS ids; the text is cut at the task's ``until`` strings
        (and the EOS string) as lm-eval's HFLM does."""
        if not requests:
            self.generation_records = []
            return []
        asked = [self._generation_request(req) for req in requests]
        size = self._rows(generation_probe(self.clm, max(len(a["prompt"].ids) for a in asked)), "generate")
        stops = stop_token_ids(self.clm.model, self.tokenizer)
        out, records, done = [None] * len(requests), [None] * len(requests), {}
        bar = tqdm(total=len(requests), desc="generate", unit="item", disable=disable_tqdm)

        def each(group, place):
            def answered(j, new, bpd):
                i, a = group[j], asked[group[j]]
                text = self.tok_decode(new)
                for term in a["until"]:
                    if term:
                        text = text.split(term)[0]
                self.cache_hook.add_partial("generate_until", (requests[i].args[0], requests[i].args[1]), text)
                out[i] = text
                place(i)
                records[i] = {"task": a["task"], "doc_id": getattr(requests[i], "doc_id", None),
                              "prompt_tokens": len(a["prompt"].ids), "context_tokens": a["prompt"].how["context_tokens"],
                              "new_tokens": len(new), "max_gen_toks": a["max_gen"],
                              "protocol": a["prompt"].how["protocol_used"], "prediction": text, **bpd}
                name = self.progress_names.get(a["task"] or "generate", a["task"] or "generate")
                done[name] = done.get(name, 0) + 1
                bar.set_description(a["task"] or "generate")
                bar.update(1)
                self.progress(f"{self.progress_prefix}/{name}", done[name], prompt_tokens=records[i]["prompt_tokens"],
                              new_tokens=len(new), **bpd)
            return answered

        with readings_in_order(self.clm, len(requests)) as place:
            for max_gen in dict.fromkeys(a["max_gen"] for a in asked):
                group = [i for i, a in enumerate(asked) if a["max_gen"] == max_gen]
                generate_prompts(self.clm, [asked[i]["prompt"] for i in group], max_gen, stops, size,
                                 each(group, place))
        bar.close()
        self.generation_records = records
        return out

    def _add_special(self, text: str) -> bool:
        """``tok_encode``'s rule: the tokenizer's default unless ``add_bos_token`` says
        otherwise, and never when the text already starts with the BOS string."""
        kw = _add_special_kwargs(None, self.add_bos_token)
        if has_bos_prefix(text, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return bool(kw.get("add_special_tokens", True))

    def _generation_request(self, req) -> dict:
        """What one request asks: its prompt under the protocol, ``max_gen`` new tokens at most,
        the ``until`` strings, its task."""
        context, gen_kwargs = req.args[0], dict(req.args[1])
        until = handle_stop_sequences(gen_kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id))
        max_gen = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        char_pos = self.question_start(req) if self.question_start is not None else None
        ids, n_context = cut_at_question(self.tokenizer, context, char_pos, self._add_special(context))
        if ids != self.tok_encode(context):
            raise RuntimeError("generate_until: tokenization differs from lm-eval's tok_encode")
        task = getattr(req, "task_name", None)
        if len(ids) + max_gen > self.max_length:
            log.warning("%s: prompt %d + %d new tokens exceed max_length %d", task or "?", len(ids), max_gen,
                        self.max_length)
        split = not self.query_aware and n_context < len(ids)
        prompt = ProtocolPrompt(ids, n_context if split else None,
                                {"protocol_used": protocol(not split), "context_tokens": n_context if split else len(ids)})
        return {"prompt": prompt, "max_gen": max_gen, "until": until, "task": task}


def _in_pass(lm) -> bool:
    if hasattr(lm, "supports_in_pass"):
        return bool(lm.supports_in_pass)
    method = getattr(lm, "method", None)
    return method is None or bool(getattr(method, "supports_in_pass", True))
