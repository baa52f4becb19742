"""A model plus a compression method, seen by the evaluations through three operations.

* ``logits(input_ids)`` — one teacher-forced pass in the Q-all regime (METHODS.md §1.3): every
  token's K/V compressed before any query reads it. Perplexity track A, zero-shot log-likelihoods.
* ``score(context_ids, target_ids)`` — prefill the context exactly, compress its cache, then score
  the targets teacher-forced through the compressed cache with decode semantics (PPL track B,
  SnapKV's zero-shot path). Returns the log-probabilities of the targets.
* ``generate(input_ids, max_new_tokens, stop_ids)`` — greedy decoding from a compressed cache
  (prefill exact, compress, decode per the method's rules). LongBench.

With no compressor (FP16, or ``method=None``) the plain, unpatched model runs. After each call
``measured_bpd`` holds the bpd_K, bpd_V of the cache it ended with (METHODS.md §0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from methods import Unsupported

from .integrate import Compressor, cache_argument, returned_cache


class NotInPass(Unsupported):
    """The method has no single-pass (Q-all) simulation (SnapKV: METHODS.md §7.4)."""


@dataclass
class CompressedLM:
    model: torch.nn.Module
    tokenizer: object
    compressor: Compressor | None = None
    measured_bpd: tuple = field(default=(16.0, 16.0))

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

    def _record(self) -> None:
        if self.compressor is not None:
            self.measured_bpd = self.compressor.measured_bpd()

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
        self._record()
        return out

    @torch.no_grad()
    def score(self, context_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [1, Tt] of ``target_ids`` given ``context_ids`` (both [1, T])."""
        context_ids, target_ids = context_ids.to(self.device), target_ids.to(self.device)
        tc = context_ids.shape[1]
        if self.compressor is None:
            ids = torch.cat([context_ids, target_ids], dim=1)
            logits = self.model(input_ids=ids, use_cache=False).logits[:, tc - 1 : -1]
        else:
            self._check_batch(context_ids)
            comp = self.compressor
            with comp.session():
                first = comp.forward(context_ids, 0, prefill=True)[:, -1:]
                parts = [first]
                if target_ids.shape[1] > 1:
                    parts.append(comp.forward(target_ids[:, :-1], tc, prefill=False))
                self._record()
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
                out = self.model(input_ids=ids, use_cache=True, **extra)
                state["cache"] = returned_cache(out)
                return out.logits[:, -1]

            return _greedy(step, input_ids, max_new_tokens, stop_ids)
        comp = self.compressor
        with comp.session():
            new = _greedy(
                lambda ids, pos: comp.forward(ids, pos, prefill=pos == 0)[:, -1],
                input_ids, max_new_tokens, stop_ids,
            )
            self._record()
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
