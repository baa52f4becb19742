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

from .batching import Padded, pad
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
    """The model with its method. Every operation takes a batch of rows of any lengths (the
    ``*_rows`` forms; the single-sequence forms are their batch of one): the rows are padded as
    :mod:`kvbench.model.batching` says, each row gets its own layer states, and each row appends
    its own :class:`BpdReading`, in row order, equal to the one it appends alone."""

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

    def _record(self, regime: str, reads: list, positions: int, prefill_end=None,
                first_from_prefill: bool = True, row: int = 0) -> None:
        """Append one row's :class:`BpdReading`. ``reads``: the ``read_bpd`` tensors of the scored
        positions; for a prefill-exact call ``prefill_end`` is the end-of-prefill figure, which also
        stands for the one prediction the exact prefill makes (``first_from_prefill``; False when
        that prediction comes from a decode-semantics pass, whose read is in ``reads``).
        ``positions`` is the scored count of the plain model (16 bits everywhere)."""
        if self.compressor is None:
            full = (16.0, 16.0)
            self.readings.append(BpdReading(regime, full, full, max(positions, 1),
                                            full if regime == PREFILL else None))
            return
        self.measured_bpd = self.compressor.measured_bpd(row)
        if regime == PREFILL:
            mean, n = _scored_mean(reads, prefill_end if first_from_prefill else None)
            self.readings.append(BpdReading(regime, mean, self.measured_bpd, n, prefill_end))
        else:
            mean, n = _scored_mean(reads) if reads else (self.measured_bpd, 1)
            self.readings.append(BpdReading(regime, mean, self.measured_bpd, n))

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, scored=None, lengths: list[int] | None = None) -> torch.Tensor:
        """Q-all logits [B, T, V] of B rows. ``lengths``: each row's real tokens, the rest being
        right padding (lm-eval's layout; None: no padding); the logits of padding columns mean
        nothing. ``scored``: how many of each row's last real positions make the predictions the
        caller scores (zero-shot: the continuation's; an int for every row or one per row); the
        row's measured bpd is taken over those (default: every real position)."""
        if not self.supports_in_pass:
            raise NotInPass(
                f"{self.method.name} acts only at the end of a prefill; it has no single-pass "
                "simulation (use ppl track B or score())"
            )
        if input_ids.dim() != 2:
            raise ValueError(f"logits() takes token rows [B, T]; got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        padded = Padded(input_ids, lengths, "right")
        scored = [scored] * b if scored is None or isinstance(scored, int) else list(scored)
        for s, n in zip(scored, lengths):
            if s is not None and not 0 < s <= n:
                raise ValueError(f"scored={s} must be in 1..{n} (the row's length)")
        # right padding from position 0: the plain model's causality keeps padding out of every
        # real position (as lm-eval runs it); a method's rows see their real tokens only
        if self.compressor is None:
            out = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        else:
            with self.compressor.layout(padded if padded.ragged else None):
                out = self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        for i in range(b):
            reads = self.compressor.read_bpd(i) if self.compressor is not None else None
            if reads is not None and scored[i] is not None:
                reads = (reads[0][-scored[i]:], reads[1][-scored[i]:])
            self._record(QALL, [reads] if reads is not None else [],
                         lengths[i] if scored[i] is None else scored[i], row=i)
        return out

    @torch.no_grad()
    def score(self, context_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [1, Tt] of ``target_ids`` given ``context_ids`` (both [1, T])."""
        return self.score_rows([context_ids[0]], [target_ids[0]])[0][None]

    @torch.no_grad()
    def score_rows(self, contexts: list, targets: list) -> list[torch.Tensor]:
        """Per row, the log-probabilities [Tt_i] of ``targets[i]`` given ``contexts[i]`` (token
        rows of any lengths): the contexts prefilled exactly and compressed, the targets scored
        teacher-forced through the compressed cache with decode semantics."""
        contexts = [torch.as_tensor(c, dtype=torch.long).reshape(-1) for c in contexts]
        targets = [torch.as_tensor(c, dtype=torch.long).reshape(-1) for c in targets]
        if self.compressor is None:
            logits = self._plain_score_logits(contexts, targets)
        else:
            logits = self._compressed_score_logits(contexts, targets)
        out = []
        for lg, tgt in zip(logits, targets):
            logprobs = lg.float().log_softmax(-1)
            out.append(logprobs.gather(-1, tgt.to(lg.device)[:, None])[:, 0])
        return out

    def _plain_score_logits(self, contexts, targets) -> list[torch.Tensor]:
        """The plain model: context and target in one right-padded pass (causality keeps the
        padding out), the logits of the positions that predict the targets."""
        padded = pad([torch.cat([c, t]) for c, t in zip(contexts, targets)], "right", device=self.device)
        keep = padded.width - min(c.numel() for c in contexts) + 1
        out = self.model(input_ids=padded.ids, use_cache=False, **last_logits(self.model, keep)).logits
        first = padded.width - out.shape[1]  # the column of out's first row
        rows = []
        for i, (c, t) in enumerate(zip(contexts, targets)):
            rows.append(out[i, c.numel() - 1 - first : c.numel() - 1 - first + t.numel()])
            self._record(PREFILL, [], t.numel(), row=i)
        return rows

    def _compressed_score_logits(self, contexts, targets) -> list[torch.Tensor]:
        comp, b = self.compressor, len(contexts)
        # equal contexts and equal continuations: every pass carries all rows unpadded
        together = (comp.method.rows_in_one_state and len({c.numel() for c in contexts}) == 1
                    and len({t.numel() for t in targets}) == 1)
        with comp.session(b, together=together):
            ctx = pad(contexts, "left", device=self.device)
            first = comp.forward(ctx.ids, 0, prefill=True, last=1, padded=ctx)
            prefill_end = [comp.measured_bpd(i) for i in range(b)]
            parts = [[first[i]] for i in range(b)]
            reads = [[] for _ in range(b)]
            rest = [i for i in range(b) if targets[i].numel() > 1]
            if rest:
                tgt = pad([targets[i][:-1] for i in rest], "left", device=self.device)
                out = comp.forward(tgt.ids, [contexts[i].numel() for i in rest], prefill=False,
                                   padded=tgt, rows=rest)
                for j, i in enumerate(rest):
                    parts[i].append(out[j, tgt.valid(j)])
                    reads[i].append(comp.read_bpd(i))
            for i in range(b):
                self._record(PREFILL, reads[i], 0, prefill_end[i], row=i)
        return [torch.cat(p) for p in parts]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=()) -> list[int]:
        """Greedy decoding; stops after ``max_new_tokens`` or at a token in ``stop_ids``."""
        return self.generate_rows([_one_row(input_ids)], max_new_tokens, stop_ids)[0]

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
        return self.generate_rows([_one_row(input_ids)], max_new_tokens, stop_ids, [n_context])[0]

    @torch.no_grad()
    def generate_rows(self, prompts: list, max_new_tokens: int, stop_ids=(),
                      n_context: list | None = None) -> list[list[int]]:
        """Greedy decoding of B prompts (token rows of any lengths), each stopping on its own at
        ``max_new_tokens`` or a token in ``stop_ids``. ``n_context[i]`` (None or the prompt's
        length: query-aware) makes row i query-agnostic as :meth:`generate_query_agnostic`."""
        prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        n_context = list(n_context) if n_context is not None else [None] * len(prompts)
        cuts = []
        for p, n in zip(prompts, n_context):
            n = p.numel() if n is None else int(n)
            if not 0 < n <= p.numel():
                raise ValueError(f"n_context={n} must be in 1..{p.numel()} (the prompt's length)")
            cuts.append(n)
        contexts = [p[:n] for p, n in zip(prompts, cuts)]
        queries = [p[n:] for p, n in zip(prompts, cuts)]
        if self.compressor is None:
            return self._plain_generate(contexts, queries, max_new_tokens, stop_ids)
        return self._compressed_generate(contexts, queries, max_new_tokens, stop_ids)

    def _plain_generate(self, contexts, queries, max_new_tokens, stop_ids) -> list[list[int]]:
        """The plain model with its own cache: left-padded rows, a 2-D mask and per-row positions
        once any row is padded; finished rows ride along (their outputs are dropped)."""
        name, b = cache_argument(self.model), len(contexts)
        ctx = pad(contexts, "left", device=self.device)
        asked = [i for i in range(b) if queries[i].numel()]
        qry = pad(queries, "left", device=self.device) if asked else None
        ragged = ctx.ragged or (qry is not None and qry.ragged)
        state = {"mask": ctx.mask(), "cache": None}

        def run(ids, positions):
            extra = {name: state["cache"]} if state["cache"] is not None else {}
            if ragged:
                extra.update(attention_mask=state["mask"].long(), position_ids=positions)
            out = self.model(input_ids=ids, use_cache=True, **extra, **last_logits(self.model))
            state["cache"] = returned_cache(out)
            return out.logits[:, -1]

        logits = run(ctx.ids, ctx.positions())
        if qry is not None:
            state["mask"] = torch.cat([state["mask"], qry.mask()], 1)
            ql = run(qry.ids, qry.positions([c.numel() for c in contexts]))
            logits = logits.clone()
            logits[asked] = ql[asked]
        pos = [c.numel() + q.numel() for c, q in zip(contexts, queries)]

        def step(tokens, rows):
            ids = torch.tensor(tokens, device=self.device)[:, None]
            if len(rows) < b:  # finished rows ride along on a dummy token
                ids = torch.zeros(b, 1, dtype=torch.long, device=self.device).index_copy_(
                    0, torch.tensor(rows, device=self.device), ids)
            positions = None
            if ragged:
                state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(b, 1)], 1)
                positions = torch.tensor(pos, device=self.device)[:, None]
            for i in rows:
                pos[i] += 1
            out = run(ids, positions)
            return out if len(rows) == b else out[rows]

        new = _greedy_rows(logits, list(range(b)), step, max_new_tokens, stop_ids)
        for i in range(b):
            self._record(PREFILL, [], len(new[i]), row=i)
        return new

    def _compressed_generate(self, contexts, queries, max_new_tokens, stop_ids) -> list[list[int]]:
        comp, b = self.compressor, len(contexts)
        with comp.session(b):
            ctx = pad(contexts, "left", device=self.device)
            logits = comp.forward(ctx.ids, 0, prefill=True, last=1, padded=ctx)[:, -1]
            ends = [comp.measured_bpd(i) for i in range(b)]
            reads = [[] for _ in range(b)]
            asked = [i for i in range(b) if queries[i].numel()]
            if asked:
                # the first generated token is predicted by the query chunk's last position, which
                # read the compressed context: a decode position, not the prefill's prediction
                qry = pad([queries[i] for i in asked], "left", device=self.device)
                ql = comp.forward(qry.ids, [contexts[i].numel() for i in asked], prefill=False, last=1,
                                  padded=qry, rows=asked)[:, -1]
                logits = logits.clone()
                logits[asked] = ql
                for i in asked:
                    read = comp.read_bpd(i)
                    if read is not None:  # of the query chunk only the last position predicts
                        reads[i].append((read[0][-1:], read[1][-1:]))
            pos = [c.numel() + q.numel() for c, q in zip(contexts, queries)]

            def step(tokens, rows):
                ids = torch.tensor(tokens, device=self.device)[:, None]
                out = comp.forward(ids, [pos[i] for i in rows], prefill=False, last=1, rows=rows)[:, -1]
                for i in rows:
                    pos[i] += 1
                    read = comp.read_bpd(i)
                    if read is not None:
                        reads[i].append(read)
                return out

            new = _greedy_rows(logits, list(range(b)), step, max_new_tokens, stop_ids)
            for i in range(b):
                self._record(PREFILL, reads[i], 0, ends[i], first_from_prefill=i not in asked, row=i)
        return new


def _one_row(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"a single sequence is [1, T]; got shape {tuple(input_ids.shape)} "
                         "(batches go through the *_rows methods)")
    return input_ids[0]


def _greedy_rows(logits: torch.Tensor, rows: list[int], step, max_new_tokens: int, stop_ids) -> list[list[int]]:
    """Greedy decoding of several rows: ``logits`` [len(rows), V] predict each row's first token;
    ``step(tokens, rows) -> logits`` feeds one token to each row still running. A row stops at a
    token in ``stop_ids`` or after ``max_new_tokens``; one host sync per step for all rows."""
    stop = set(int(s) for s in stop_ids)
    new = {i: [] for i in rows}
    while rows and max_new_tokens > 0:
        tokens = logits.argmax(-1).tolist()
        running, feed = [], []
        for i, token in zip(rows, tokens):
            new[i].append(token)
            if token not in stop and len(new[i]) < max_new_tokens:
                running.append(i)
                feed.append(token)
        if not running:
            break
        logits = step(feed, running)
        rows = running
    return [new[i] for i in sorted(new)]
