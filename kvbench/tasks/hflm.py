"""The lm-eval model of kvbench: an ``HFLM`` whose scoring and generation go through a
:class:`kvbench.model.compressed_lm.CompressedLM`, batch 1 (so that padding cannot interact with
compression), float32 log-softmax (see :mod:`kvbench.tasks.zeroshot`).

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
from .generation import stop_token_ids
from .query_protocol import protocol, cut_at_question
from .reporting import RunningBpd, bpd_since, mark

#: the most progress points one batch of scored requests makes
REPORTS = 200

log = logging.getLogger(__name__)


class CompressedHFLM(HFLM):
    """HFLM built from a loaded model (``pretrained=model``, batch 1, float32 log-softmax).

    ``_model_call`` → ``CompressedLM.logits`` (in-pass); when the method has no in-pass
    simulation, ``_loglikelihood_tokens`` scores each request through ``CompressedLM.score``.
    ``generate_until`` (RULER, :mod:`kvbench.tasks.ruler`) generates each request greedily
    through ``CompressedLM.generate`` / ``generate_query_agnostic`` (query-agnostic).
    """

    def __init__(self, clm, max_length=None, softmax_dtype=torch.float32):
        super().__init__(
            pretrained=clm.model, tokenizer=clm.tokenizer, batch_size=1, max_length=max_length,
            softmax_dtype=softmax_dtype,
        )
        self.clm = clm

    #: how many trailing positions of the next ``_model_call`` predict the continuation
    _scored = None
    #: the job's progress callback (set by the task) and the section prefix of generation
    progress = staticmethod(no_progress)
    progress_prefix = "generate"
    #: lm-eval task name -> the name its generation section is reported under
    progress_names: dict = {}
    _requests_done = 0

    def _model_call(self, inps, attn_mask=None, labels=None):
        return self.clm.logits(inps, scored=self._scored)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        """One request per pass, so that each pass knows its continuation's length: the
        measured bpd of a request is the mean over the positions that predict its
        continuation (docs/methods.md §0 v3), never over its context."""
        report = self._request_reporter(len(requests))
        if not _in_pass(self.clm):
            out = []
            for req in requests:
                out.append(self._score_request(req))
                report()
            return out
        out = []
        for req in tqdm(requests, desc="zero-shot requests", unit="req", disable=disable_tqdm):
            self._scored = len(req[2])
            try:
                out += super()._loglikelihood_tokens([req], True, override_bs)
            finally:
                self._scored = None
            report()
        return out

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

    def _score_request(self, req):
        request_str, context_enc, continuation_enc = req
        # lm-eval's left truncation: the model sees at most max_length tokens
        keep = self.max_length + 1 - len(continuation_enc)
        context = context_enc[-keep:] if len(context_enc) > keep else context_enc
        ctx = torch.tensor([context], dtype=torch.long)
        cont = torch.tensor([continuation_enc], dtype=torch.long)
        logprobs = self.clm.score(ctx, cont)
        # score() returns the continuation's log-probs only, so greedy-match is unknown;
        # it only feeds loglikelihood-type metrics, never acc/acc_norm of multiple choice
        answer = (float(logprobs.sum()), False)
        if request_str is not None:
            self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return answer

    # Generation (RULER through lm-eval)
    #: set by a generation task: ``request -> character index where its question starts``
    #: (or None); with ``query_aware = False`` the prompt is cut there (query_protocol.py)
    question_start = None
    query_aware = True
    #: one dict per generated request: task, doc_id, token counts, protocol, prediction
    generation_records: list | tuple = ()

    def generate_until(self, requests, disable_tqdm=False):
        """lm-eval's generation requests through ``CompressedLM``, one at a time, greedy:
        ``generate`` (query-aware) or ``generate_query_agnostic`` (query-agnostic), at most the
        task's ``max_gen_toks`` new tokens, stopping at the model's EOS ids; the text is cut
        at the task's ``until`` strings (and the EOS string) as lm-eval's HFLM does."""
        self.generation_records = []
        bar = tqdm(requests, desc="generate", unit="item", disable=disable_tqdm)
        out, done = [], {}
        for req in bar:
            task = getattr(req, "task_name", None) or "generate"
            bar.set_description(task)
            task = self.progress_names.get(task, task)
            out.append(self._generate_request(req))
            done[task] = done.get(task, 0) + 1
            rec = self.generation_records[-1]
            self.progress(f"{self.progress_prefix}/{task}", done[task], prompt_tokens=rec["prompt_tokens"],
                          new_tokens=rec["new_tokens"],
                          **{k: rec[k] for k in ("bpd_k", "bpd_v") if rec.get(k) is not None})
        return out

    def _add_special(self, text: str) -> bool:
        """``tok_encode``'s rule: the tokenizer's default unless ``add_bos_token`` says
        otherwise, and never when the text already starts with the BOS string."""
        kw = _add_special_kwargs(None, self.add_bos_token)
        if has_bos_prefix(text, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return bool(kw.get("add_special_tokens", True))

    def _generate_request(self, req):
        context, gen_kwargs = req.args[0], dict(req.args[1])
        until = handle_stop_sequences(gen_kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id))
        max_gen = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        char_pos = self.question_start(req) if self.question_start is not None else None
        ids, n_context = cut_at_question(self.tokenizer, context, char_pos, self._add_special(context))
        if ids != self.tok_encode(context):
            raise RuntimeError("generate_until: tokenization differs from lm-eval's tok_encode")
        if len(ids) + max_gen > self.max_length:
            log.warning("%s: prompt %d + %d new tokens exceed max_length %d",
                        getattr(req, "task_name", "?"), len(ids), max_gen, self.max_length)
        split = not self.query_aware and n_context < len(ids)
        prompt = torch.tensor([ids], dtype=torch.long)
        stops = stop_token_ids(self.clm.model, self.tokenizer)
        start = mark(self.clm)
        if split:
            new = self.clm.generate_query_agnostic(prompt, n_context, max_gen, stops)
        else:
            new = self.clm.generate(prompt, max_gen, stops)
        text = self.tok_decode(new)
        for term in until:
            if term:
                text = text.split(term)[0]
        self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        self.generation_records.append({
            "task": getattr(req, "task_name", None),
            "doc_id": getattr(req, "doc_id", None),
            "prompt_tokens": len(ids),
            "context_tokens": n_context,
            "new_tokens": len(new),
            "max_gen_toks": max_gen,
            "protocol": protocol(not split),
            "prediction": text,
            **bpd_since(self.clm, start),  # the bits this item read
        })
        return text


def _in_pass(lm) -> bool:
    if hasattr(lm, "supports_in_pass"):
        return bool(lm.supports_in_pass)
    method = getattr(lm, "method", None)
    return method is None or bool(getattr(method, "supports_in_pass", True))
