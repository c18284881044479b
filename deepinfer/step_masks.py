"""The host-made part of a step's logit masks: grammar bitmasks (``StructuredOutputs``)
and bans of multi-token bad words, and the check that what a row may draw is not empty.

Everything that is the same at every step (``logit_bias``, ``allowed_token_ids``,
single-token bad words) is applied on the device from the per-slot steering table
(``deepinfer.sampling.steering``). Only two things need the host each step, and only
for the requests that have them:

- a bad word of several tokens: its last token is banned when the others end the
  sample's output (which the host knows once the previous step landed: the mask is built
  in the same deferred callable as the grammar's);
- a row that may end up with nothing to draw: a grammar whose allowed tokens the
  request's ``allowed_token_ids`` or bad words all exclude, or allowed tokens all banned
  by bad words. Such a sample is ended with ``"abort"`` and its request fails with an
  error naming the fields (``take_error``), the others run on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from deepinfer.sampling.steering import Steering, bad_word_bans
from deepinfer.structured.bitmask import TokenMask
from deepinfer.structured.matchers import StructuredOutputs
from deepinfer_scheduler import Sequence


def _bitmask_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 ids whose bit is set in one bitmask row (int32 ``[ceil(V / 32)]``)."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class StepMasks:
    """The masks one engine builds on the host: ``structured``'s grammars plus the
    steering that needs the host (see the module docstring)."""

    def __init__(self, structured: StructuredOutputs, vocab_size: int) -> None:
        self.structured = structured
        self.vocab_size = vocab_size
        self._watched: dict[str, Steering] = {}  # request id -> its steering
        self._starved: dict[int, tuple[str, str]] = {}  # seq id -> (request id, why)
        self._errors: dict[str, str] = {}

    @property
    def live(self) -> bool:
        """Whether some request needs a host mask (a grammar or watched steering)."""
        return self.structured.live or bool(self._watched)

    def watch(self, request_id: str, steering: Steering | None, constrained: bool) -> None:
        """Register a request's steering when it needs the host: multi-token bad words,
        or, under a grammar, allowed ids or bans that could exclude all it allows."""
        if steering is None:
            return
        if steering.bad_sequences or (constrained and (
                steering.allowed_ids is not None or steering.banned_ids.size)):
            self._watched[request_id] = steering

    def forget(self, request_id: str) -> None:
        """Drop a request (finished, aborted, handed off)."""
        self.structured.forget(request_id)
        self._watched.pop(request_id, None)
        self._errors.pop(request_id, None)
        if self._starved:
            self._starved = {k: v for k, v in self._starved.items() if v[0] != request_id}

    def take_error(self, request_id: str) -> str | None:
        """Why a request failed while running (nothing left to sample), once."""
        return self._errors.pop(request_id, None)

    def logits_mask(self, sample_seqs: list[Sequence]
                    ) -> Callable[[], TokenMask | None] | None:
        """For a launched step whose sample rows are ``sample_seqs``: None when no row
        needs a host mask, else the callable that builds it (the runner calls it between
        the forward and the sampling)."""
        grammar = self.structured.logits_mask(sample_seqs) if self.structured.live else None
        rows = [(i, s, self._watched[s.request_id]) for i, s in enumerate(sample_seqs)
                if s.request_id in self._watched]
        if grammar is None and not rows:
            return None
        return lambda: self._build(grammar, rows)

    def _build(self, grammar: Callable[[], TokenMask | None] | None,
               rows: list[tuple[int, Sequence, Steering]]) -> TokenMask | None:
        mask = grammar() if grammar is not None else None
        constrained = set(mask.rows) if mask is not None else set()
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, seq, st in rows:
            if seq.finish_reason is not None:
                continue  # ended after the launch (overlap): its token is dropped
            bans = bad_word_bans(st.bad_sequences, seq.output_token_ids)
            ban_rows += [i] * len(bans)
            ban_ids += bans
            if i in constrained:
                left = _bitmask_ids(mask.bitmask[i].numpy(), self.vocab_size)
                if st.allowed_ids is not None:
                    left = np.intersect1d(left, st.allowed_ids, assume_unique=True)
                why = "the grammar allows no token that allowed_token_ids and bad_words permit"
            elif st.allowed_ids is not None and bans:
                left, why = st.allowed_ids, "bad_words ban every token of allowed_token_ids"
            else:
                continue
            left = np.setdiff1d(left, np.concatenate([st.banned_ids,
                                                      np.asarray(bans, np.int64)]))
            if not left.size:
                self._starved[seq.seq_id] = (
                    seq.request_id, f"request {seq.request_id!r}: nothing left to sample "
                    f"at output token {len(seq.output_token_ids)}: {why}")
        if ban_rows:
            return TokenMask(None if mask is None else mask.bitmask,
                             [] if mask is None else mask.rows, (ban_rows, ban_ids))
        return mask

    def after_update(self, sample_seqs: list[Sequence],
                     finish: Callable[[int, str], object]) -> list[Sequence]:
        """After ``Scheduler.update``: end the samples that had nothing to draw
        (``"abort"``, their request's error kept for ``take_error``), then the grammars'
        ``after_update``. Returns the sequences ended here."""
        ended: list[Sequence] = []
        if self._starved:
            for seq in sample_seqs:
                entry = self._starved.pop(seq.seq_id, None)
                if entry is None:
                    continue
                self._errors.setdefault(seq.request_id, entry[1])
                if seq.finish_reason is None:
                    finish(seq.seq_id, "abort")
                    ended.append(seq)
        if self.structured.live:
            ended += self.structured.after_update(sample_seqs, finish)
        return ended
