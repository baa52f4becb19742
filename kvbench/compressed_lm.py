"""A model plus a compression method, seen by the evaluations through three operations.

* ``logits(input_ids)`` — one teacher-forced pass in the Q-all regime (METHODS.md §1.3): every
  token's K/V compressed before any query reads it. Perplexity track A, zero-shot log-likelihoods.
* ``score(context_ids, target_ids)`` — prefill the context exactly, compress its cache, then score
  the targets teacher-forced through the compressed cache with decode semantics (PPL track B,
  SnapKV's zero-shot path). Returns the log-probabilities of the targets.
* ``generate(input_ids, max_new_tokens, stop_ids)`` — greedy decoding from a compressed cache
  (prefill exact, compress, decode per the method's rules). LongBench.
* ``generate_split(input_ids, n_context, max_new_tokens, stop_ids)`` — the query-agnostic variant
  (METHODS.md §9.5): the first ``n_context`` tokens are prefilled exactly and compressed alone, the
  rest of the prompt goes through the compressed cache with decode semantics, then greedy decoding.

With no compressor (FP16, or ``method=None``) the plain, unpatched model runs.

Forward passes that need only their last rows ask the model for those (``logits_to_keep``,
:func:`kvbench.integrate.last_logits`): a 31.5k-token prefill keeps one row, not 8-10 GB of
bf16 logits (issue 15, finding 3).

Measured bpd (METHODS.md §0, convention v2): each call appends a :class:`BpdReading` to
``readings`` — in ``logits`` the mean over query positions of what the cache held when each query
read it (the reported figure of PPL track A and zero-shot); in ``score``/``generate`` the cache at
the end of the exact prefill (the reported figure: what the method compressed the prompt to) and,
beside it, the mean over the scored/decoded positions of what each of them read (decoded tokens are
appended per the method's rules, so it can lie above the prefill figure). Every reading also keeps
the end-of-sequence figure; ``measured_bpd`` is that of the last call. :func:`summarize_readings`
pools the readings of one evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from methods import Unsupported

from .integrate import Compressor, cache_argument, last_logits, returned_cache


class NotInPass(Unsupported):
    """The method has no single-pass (Q-all) simulation (SnapKV: METHODS.md §7.4)."""


QALL = "Q-all: mean over query positions of the cache each query read"
PREFILL = "prefill-exact: cache at the end of prefill (decode_mean: what the scored/decoded positions read)"


@dataclass
class BpdReading:
    """Measured bpd_K, bpd_V of one call: ``mean`` (the convention's figure: the mean over the
    ``positions`` queries of a Q-all pass, or the end of prefill), ``end`` (end of sequence) and, for
    prefill-exact calls, ``decode_mean`` (mean over the ``positions`` scored/decoded queries)."""

    regime: str
    mean: tuple
    end: tuple
    positions: int
    decode_mean: tuple | None = None


def _mean_over(reads: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[tuple, int]:
    k = torch.cat([r[0] for r in reads])
    v = torch.cat([r[1] for r in reads])
    return (float(k.mean()), float(v.mean())), k.numel()


def summarize_readings(readings: list[BpdReading]) -> dict | None:
    """One evaluation's measured bpd: the position-weighted mean of the readings' figures, the
    mean end-of-sequence (and end-of-prefill) figures, the convention, and the call count."""
    if not readings:
        return None
    weight = [r.positions if r.regime == QALL else 1 for r in readings]  # prefill: per call
    n = sum(weight)
    out = {
        "measured_k": sum(r.mean[0] * w for r, w in zip(readings, weight)) / n,
        "measured_v": sum(r.mean[1] * w for r, w in zip(readings, weight)) / n,
        "end_k": sum(r.end[0] for r in readings) / len(readings),
        "end_v": sum(r.end[1] for r in readings) / len(readings),
        "convention": " + ".join(sorted({r.regime for r in readings})),
        "calls": len(readings),
    }
    dec = [r for r in readings if r.decode_mean is not None and r.positions]
    if dec:
        m = sum(r.positions for r in dec)
        out["decode_mean_k"] = sum(r.decode_mean[0] * r.positions for r in dec) / m
        out["decode_mean_v"] = sum(r.decode_mean[1] * r.positions for r in dec) / m
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

    def _record(self, regime: str, reads: list, positions: int, prefill_end=None) -> None:
        """Append the call's :class:`BpdReading` (``reads``: per-pass ``read_bpd`` tensors; for a
        prefill-exact call, ``prefill_end`` is the headline and ``reads`` the decoded positions)."""
        if self.compressor is None:
            full = (16.0, 16.0)
            self.readings.append(BpdReading(regime, full, full, positions, full if regime == PREFILL else None))
            return
        self.measured_bpd = self.compressor.measured_bpd()
        mean, n = _mean_over(reads) if reads else (None, 0)
        if regime == PREFILL:
            self.readings.append(BpdReading(regime, prefill_end, self.measured_bpd, n, mean))
        else:
            self.readings.append(BpdReading(regime, mean or self.measured_bpd, self.measured_bpd, max(n, 1)))

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.supports_in_pass:
            raise NotInPass(
                f"{self.method.name} acts only at the end of a prefill; it has no single-pass "
                "simulation (use ppl track B or score())"
            )
        if self.compressor is not None:
            self._check_batch(input_ids)
        out = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        reads = self.compressor.read_bpd() if self.compressor is not None else None
        self._record(QALL, [reads] if reads is not None else [], input_ids.shape[-1])
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
            self._record(PREFILL, [], tt - 1)
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
            self._record(PREFILL, [], len(new) - 1)
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
    def generate_split(
        self, input_ids: torch.Tensor, n_context: int, max_new_tokens: int, stop_ids=()
    ) -> list[int]:
        """Query-agnostic greedy decoding (METHODS.md §9.5): the first ``n_context`` tokens are
        prefilled exactly and compressed alone; the rest of the prompt (question, answer prefix,
        chat-template tail) is fed through the compressed cache with decode semantics (one
        multi-token pass: a chunk of T tokens gives what T single-token steps give, methods/base.py),
        then greedy decoding as :meth:`generate`.

        With ``n_context`` covering the whole prompt this is :meth:`generate`. Measured bpd keeps
        the prefill-exact convention: the headline is the cache at the end of the exact (context)
        prefill; ``decode_mean`` covers the question tokens and the decoded ones.
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
            self._record(PREFILL, [], query.shape[1] + len(new) - 1)
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
                reads.append(comp.read_bpd())
                return logits

            new = _greedy(step, input_ids, max_new_tokens, stop_ids)
            self._record(PREFILL, [r for r in reads if r is not None], 0, ends[0])
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
