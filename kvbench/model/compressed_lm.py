"""A model plus a compression method, seen by the evaluations through three operations.

* ``logits(input_ids)`` — one teacher-forced pass in the Q-all regime (docs/methods.md §1.3): every
  token's K/V compressed before any query reads it. Perplexity track A, zero-shot log-likelihoods.
* ``score(context_ids, target_ids)`` — prefill the context exactly, compress its cache, then score
  the targets teacher-forced through the compressed cache with decode semantics (PPL track B,
  SnapKV's zero-shot path). Returns the log-probabilities of the targets.
* ``generate(input_ids, max_new_tokens, stop_ids)`` — greedy decoding from a compressed cache
  (prefill exact, compress, decode per the method's rules). LongBench.
* ``generate_query_agnostic(input_ids, n_context, max_new_tokens, stop_ids)`` — the query-agnostic variant
  (docs/methods.md §9.5): the first ``n_context`` tokens are prefilled exactly and compressed alone, the
  rest of the prompt goes through the compressed cache with decode semantics, then greedy decoding.

With no compressor (FP16, or ``method=None``) the plain, unpatched model runs.

Forward passes that need only their last rows ask the model for those (``logits_to_keep``,
:func:`kvbench.model.integrate.last_logits`): a 31.5k-token prefill keeps one row, not 8-10 GB of
bf16 logits.

Measured bpd (docs/methods.md §0, convention v3: one headline rule for every task): each call appends a
:class:`BpdReading` whose ``mean`` is the mean, over the positions whose predictions are scored, of
the bits the cache held when that prediction was made, divided by (t·N·d). Scored positions:
``logits`` — every query position, or the last ``scored`` ones (zero-shot: the continuation);
``score`` — the targets; ``generate``/``generate_query_agnostic`` — the generated tokens. The prediction
that the exact prefill itself makes (the first target, the first generated token) is counted at
the end-of-prefill figure: the protocol's prefill attention is exact (§1.3) and the method's cache
from then on is what it compressed the prompt to. Beside the headline each prefill-exact reading
keeps ``prefill_end`` (the cache at the end of the exact prefill, labelled) and every reading
``end`` (the end of the sequence); ``measured_bpd`` is that of the last call.
:func:`summarize_readings` pools the readings of one evaluation, weighting each by its scored
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from methods import Unsupported

from .integrate import Compressor, cache_argument, last_logits, returned_cache


class NotInPass(Unsupported):
    """The method has no single-pass (Q-all) simulation (SnapKV: docs/methods.md §7.4)."""


QALL = "Q-all: mean over the scored query positions of the cache each one read"
PREFILL = ("prefill-exact: mean over the scored/generated positions of the cache each one read "
           "(prefill_end: the cache at the end of the exact prefill)")


@dataclass
class BpdReading:
    """Measured bpd_K, bpd_V of one call: ``mean`` (the headline: the mean over the ``positions``
    scored predictions of what the cache held when each was made), ``end`` (end of sequence) and,
    for prefill-exact calls, ``prefill_end`` (the cache at the end of the exact prefill)."""

    regime: str
    mean: tuple
    end: tuple
    positions: int
    prefill_end: tuple | None = None


def _scored_mean(reads: list[torch.Tensor | tuple], first: tuple | None = None) -> tuple[tuple, int]:
    """Mean bpd_K, bpd_V over scored positions: ``first`` (one position at a fixed figure, the
    prediction the exact prefill makes) and ``reads`` (per-pass ``read_bpd`` tensors [T])."""
    reads = [r for r in reads if r is not None]
    ks = [r[0].double().reshape(-1) for r in reads]
    vs = [r[1].double().reshape(-1) for r in reads]
    if first is not None:
        ks.append(torch.tensor([first[0]], dtype=torch.float64))
        vs.append(torch.tensor([first[1]], dtype=torch.float64))
    k, v = torch.cat(ks), torch.cat(vs)
    return (float(k.mean()), float(v.mean())), k.numel()


def summarize_readings(readings: list[BpdReading]) -> dict | None:
    """One evaluation's measured bpd: the headline pooled over every scored position of its calls,
    the mean end-of-sequence and end-of-prefill figures per call, the convention, the call count
    and the number of scored positions."""
    if not readings:
        return None
    n = sum(r.positions for r in readings)
    out = {
        "measured_k": sum(r.mean[0] * r.positions for r in readings) / n,
        "measured_v": sum(r.mean[1] * r.positions for r in readings) / n,
        "end_k": sum(r.end[0] for r in readings) / len(readings),
        "end_v": sum(r.end[1] for r in readings) / len(readings),
        "convention": " + ".join(sorted({r.regime for r in readings})),
        "calls": len(readings),
        "scored_positions": n,
    }
    pre = [r for r in readings if r.prefill_end is not None]
    if pre:
        out["prefill_end_k"] = sum(r.prefill_end[0] for r in pre) / len(pre)
        out["prefill_end_v"] = sum(r.prefill_end[1] for r in pre) / len(pre)
    return out


@dataclass
class CompressedLM:
    model: torch.nn.Module
    tokenizer: object
    compressor: Compressor | None = None
    measured_bpd: tuple = field(default=(16.0, 16.0))
    readings: list = field(default_factory=list)

    @property
    def method(self):
        return self.compressor.method if self.compressor is not None else None

    @property
    def supports_in_pass(self) -> bool:
        return self.compressor is None or self.compressor.method.supports_in_pass

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @staticmethod
    def _check_batch(ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                f"compressed evaluation runs one sequence at a time (batch 1, no padding, so "
                f"padding cannot interact with compression); got input of shape {tuple(ids.shape)}"
            )

    def _record(self, regime: str, reads: list, positions: int, prefill_end=None,
                first_from_prefill: bool = True) -> None:
        """Append the call's :class:`BpdReading`. ``reads``: the ``read_bpd`` tensors of the scored
        positions; for a prefill-exact call ``prefill_end`` is the end-of-prefill figure, which also
        stands for the one prediction the exact prefill makes (``first_from_prefill``; False when
        that prediction comes from a decode-semantics pass, whose read is in ``reads``).
        ``positions`` is the scored count of the plain model (16 bits everywhere)."""
        if self.compressor is None:
            full = (16.0, 16.0)
            self.readings.append(BpdReading(regime, full, full, max(positions, 1),
                                            full if regime == PREFILL else None))
            return
        self.measured_bpd = self.compressor.measured_bpd()
        if regime == PREFILL:
            mean, n = _scored_mean(reads, prefill_end if first_from_prefill else None)
            self.readings.append(BpdReading(regime, mean, self.measured_bpd, n, prefill_end))
        else:
            mean, n = _scored_mean(reads) if reads else (self.measured_bpd, 1)
            self.readings.append(BpdReading(regime, mean, self.measured_bpd, n))

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, scored: int | None = None) -> torch.Tensor:
        """Q-all logits [1, T, V]. ``scored``: how many of the last positions make the predictions
        the caller scores (zero-shot: the continuation's); the measured bpd is taken over those
        (default: every position)."""
        if not self.supports_in_pass:
            raise NotInPass(
                f"{self.method.name} acts only at the end of a prefill; it has no single-pass "
                "simulation (use ppl track B or score())"
            )
        if self.compressor is not None:
            self._check_batch(input_ids)
        t = input_ids.shape[-1]
        if scored is not None and not 0 < scored <= t:
            raise ValueError(f"scored={scored} must be in 1..{t} (the input's length)")
        out = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        reads = self.compressor.read_bpd() if self.compressor is not None else None
        if reads is not None and scored is not None:
            reads = (reads[0][-scored:], reads[1][-scored:])
        self._record(QALL, [reads] if reads is not None else [], t if scored is None else scored)
        return out

    @torch.no_grad()
    def score(self, context_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [1, Tt] of ``target_ids`` given ``context_ids`` (both [1, T])."""
        context_ids, target_ids = context_ids.to(self.device), target_ids.to(self.device)
        tc = context_ids.shape[1]
        if self.compressor is None:
            ids = torch.cat([context_ids, target_ids], dim=1)
            tt = target_ids.shape[1]  # positions tc-1 .. end-1 predict the targets
            out = self.model(input_ids=ids, use_cache=False, **last_logits(self.model, tt + 1)).logits
            logits = out[:, -(tt + 1) : -1]
            self._record(PREFILL, [], tt)
        else:
            self._check_batch(context_ids)
            comp = self.compressor
            with comp.session():
                first = comp.forward(context_ids, 0, prefill=True, last=1)
                prefill_end = comp.measured_bpd()
                parts, reads = [first], []
                if target_ids.shape[1] > 1:
                    parts.append(comp.forward(target_ids[:, :-1], tc, prefill=False))
                    reads.append(comp.read_bpd())
                self._record(PREFILL, reads, 0, prefill_end)
            logits = torch.cat(parts, dim=1)
        logprobs = logits.float().log_softmax(-1)
        return logprobs.gather(-1, target_ids[..., None])[..., 0]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=()) -> list[int]:
        """Greedy decoding; stops after ``max_new_tokens`` or at a token in ``stop_ids``."""
        input_ids = input_ids.to(self.device)
        self._check_batch(input_ids)
        if self.compressor is None:
            name, state = cache_argument(self.model), {}

            def step(ids, pos):
                extra = {name: state["cache"]} if "cache" in state else {}
                out = self.model(input_ids=ids, use_cache=True, **extra, **last_logits(self.model))
                state["cache"] = returned_cache(out)
                return out.logits[:, -1]

            new = _greedy(step, input_ids, max_new_tokens, stop_ids)
            self._record(PREFILL, [], len(new))
            return new
        comp = self.compressor
        with comp.session():
            ends, reads = [], []

            def step(ids, pos):
                logits = comp.forward(ids, pos, prefill=pos == 0, last=1)[:, -1]
                if pos == 0:
                    ends.append(comp.measured_bpd())
                else:
                    reads.append(comp.read_bpd())
                return logits

            new = _greedy(step, input_ids, max_new_tokens, stop_ids)
            self._record(PREFILL, reads, 0, ends[0])
        return new

    @torch.no_grad()
    def generate_query_agnostic(
        self, input_ids: torch.Tensor, n_context: int, max_new_tokens: int, stop_ids=()
    ) -> list[int]:
        """Query-agnostic greedy decoding (docs/methods.md §9.5): the first ``n_context`` tokens are
        prefilled exactly and compressed alone; the rest of the prompt (question, answer prefix,
        chat-template tail) is fed through the compressed cache with decode semantics (one
        multi-token pass: a chunk of T tokens gives what T single-token steps give, methods/base.py),
        then greedy decoding as :meth:`generate`.

        With ``n_context`` covering the whole prompt this is :meth:`generate`. Measured bpd: the
        headline is the mean over the generated tokens of what each prediction read (the first one
        is made by the query chunk's last position through the compressed context);
        ``prefill_end`` is the cache at the end of the exact (context) prefill.
        """
        input_ids = input_ids.to(self.device)
        self._check_batch(input_ids)
        t = input_ids.shape[1]
        if not 0 < n_context <= t:
            raise ValueError(f"n_context={n_context} must be in 1..{t} (the prompt's length)")
        if n_context == t:
            return self.generate(input_ids, max_new_tokens, stop_ids)
        context, query = input_ids[:, :n_context], input_ids[:, n_context:]
        if self.compressor is None:
            name, state = cache_argument(self.model), {}

            def run(ids):
                extra = {name: state["cache"]} if "cache" in state else {}
                out = self.model(input_ids=ids, use_cache=True, **extra, **last_logits(self.model))
                state["cache"] = returned_cache(out)
                return out.logits[:, -1]

            def step(ids, pos):
                if pos == 0:
                    run(context)
                    return run(query)
                return run(ids)

            new = _greedy(step, input_ids, max_new_tokens, stop_ids)
            self._record(PREFILL, [], len(new))
            return new
        comp = self.compressor
        with comp.session():
            ends, reads = [], []

            def step(ids, pos):
                if pos == 0:
                    comp.forward(context, 0, prefill=True, last=1)
                    ends.append(comp.measured_bpd())
                    logits = comp.forward(query, n_context, prefill=False, last=1)[:, -1]
                else:
                    logits = comp.forward(ids, pos, prefill=False, last=1)[:, -1]
                read = comp.read_bpd()
                if read is not None:  # of the query chunk (pos 0) only the last position predicts
                    reads.append((read[0][-1:], read[1][-1:]) if pos == 0 else read)
                return logits

            new = _greedy(step, input_ids, max_new_tokens, stop_ids)
            # the first generated token is predicted by the query chunk's last position, which read
            # the compressed context: it is a decode position here, not the prefill's prediction
            self._record(PREFILL, reads, 0, ends[0], first_from_prefill=False)
        return new


def _greedy(step, input_ids: torch.Tensor, max_new_tokens: int, stop_ids) -> list[int]:
    """Greedy loop over ``step(ids, start_position) -> last logits``: the prompt first, then one
    token at a time."""
    stop = set(int(s) for s in stop_ids)
    logits = step(input_ids, 0)
    pos, new = input_ids.shape[1], []
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        new.append(token)
        if token in stop or len(new) == max_new_tokens:
            break
        logits = step(torch.tensor([[token]], device=input_ids.device), pos)
        pos += 1
    return new
