"""Token steering: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``.

A request's steering is resolved once, at submission (``resolve_steering``): its ids
checked against the vocabulary, its bad words tokenized. What is the same at every step
lives on the device in ``SteeringTable``, one row per state slot written when a sample
gets its slot, so a step gathers its rows there by slot (no host loop over requests):

- ``logit_bias`` and the single-token bad words (a bias of -inf) as a sparse row of
  ``(column, value)`` pairs, added with one ``scatter_add_``;
- ``allowed_token_ids`` as a sparse row of columns: the rows that have one are filled
  with -inf but for those columns (their values read before and put back).

A bad word of several tokens depends on the tokens before it, so it is matched on the
host, only for the requests that have one (``bad_word_bans``); the engine applies those
bans with the step's other host-made masks (``deepinfer.step_masks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.host_copy import to_device
from deepinfer.sampling.params import SamplingParams


@dataclass(frozen=True)
class Steering:
    """One request's steering, resolved against the vocabulary.

    bias_ids / bias_values  int64 / float32 [B]  added to those logits (-inf: banned)
    allowed_ids             int64 [A] or None    sorted; only these may be sampled
    bad_sequences           the bad words of two tokens or more, as token id tuples
    """

    bias_ids: np.ndarray
    bias_values: np.ndarray
    allowed_ids: np.ndarray | None
    bad_sequences: tuple[tuple[int, ...], ...]

    @property
    def banned_ids(self) -> np.ndarray:
        """int64 ``[K]``: the ids never sampled (single-token bad words)."""
        return self.bias_ids[np.isneginf(self.bias_values)]


def _bad_word_variants(tokenizer: Any, word: str) -> list[tuple[int, ...]]:
    """The token sequences of ``word`` at the start of a text and after a space (where
    they differ), without special tokens."""
    core = word.strip()
    out: list[tuple[int, ...]] = []
    for text in (core, " " + core):
        ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        if ids and ids not in out:
            out.append(ids)
    return out


def resolve_steering(request_id: str, params: SamplingParams, tokenizer: Any,
                     vocab_size: int) -> Steering | None:
    """The steering of a request (None when it asks for none). ``ValueError`` naming
    the request and the field for an id outside ``[0, vocab_size)`` and for
    ``allowed_token_ids`` that the bad words leave empty."""
    if not params.steered:
        return None

    def check(field: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: {field}: token ids {bad[:5]} "
                             f"outside the vocabulary [0, {vocab_size})")

    bias = dict(params.logit_bias or {})
    check("logit_bias", list(bias))
    sequences: list[tuple[int, ...]] = []
    for word in params.bad_words or ():
        for ids in _bad_word_variants(tokenizer, word):
            if len(ids) == 1:
                bias[ids[0]] = float("-inf")  # a ban wins over any bias
            elif ids not in sequences:
                sequences.append(ids)
    allowed = None
    if params.allowed_token_ids is not None:
        check("allowed_token_ids", params.allowed_token_ids)
        allowed = np.unique(np.asarray(params.allowed_token_ids, np.int64))
        banned = [t for t, v in bias.items() if v == float("-inf")]
        if not np.setdiff1d(allowed, np.asarray(banned, np.int64)).size:
            raise ValueError(f"request {request_id!r}: allowed_token_ids: every allowed "
                             "token is one of the bad_words: nothing could be sampled")
    return Steering(np.fromiter(bias, np.int64, len(bias)),
                    np.fromiter(bias.values(), np.float32, len(bias)),
                    allowed, tuple(sequences))


def bad_word_bans(sequences: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The ids to ban next after ``output`` (a sample's tokens so far): the last token
    of each bad word whose other tokens end ``output``."""
    bans = []
    for seq in sequences:
        k = len(seq) - 1
        if len(output) >= k and tuple(output[len(output) - k:]) == seq[:-1]:
            bans.append(seq[-1])
    return bans


@dataclass
class StepSteering:
    """The steering rows of one step's samples, on the device (gathered by slot).

    bias_cols / bias_values  int64 / float32 [N, K]  (column 0 with 0.0 where unused)
    allowed_rows             int64 [M]               the rows restricted to some columns
    allowed_cols             int64 [M, A]            theirs, padded with the first one
    """

    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_rows: torch.Tensor | None
    allowed_cols: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> None:
        """Add the biases and drop the tokens not allowed (-inf), in place on
        ``logits`` (float32 ``[N, V]``). Device ops only."""
        if self.bias_cols is not None:
            logits.scatter_add_(1, self.bias_cols, self.bias_values)
        if self.allowed_rows is not None:
            # One fill pass over those rows, then their allowed values put back.
            at = (self.allowed_rows.unsqueeze(1), self.allowed_cols)
            kept = logits[at]
            logits.index_fill_(0, self.allowed_rows, float("-inf"))
            logits.index_put_(at, kept)


class SteeringTable:
    """Per-slot steering rows on the device (``num_slots`` rows), widened as requests
    with more entries arrive; host flags say which slots have any."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.has_bias = np.zeros(num_slots, bool)
        self.has_allowed = np.zeros(num_slots, bool)
        self.bias_cols = torch.zeros(num_slots, 0, dtype=torch.int64, device=self.device)
        self.bias_values = torch.zeros(num_slots, 0, dtype=torch.float32, device=self.device)
        self.allowed_cols = torch.zeros(num_slots, 0, dtype=torch.int64, device=self.device)
        self.version = 0  # bumped by every write that changes a row

    @staticmethod
    def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
        if t.shape[1] >= width:
            return t
        grown = torch.zeros(t.shape[0], max(width, 2 * t.shape[1]), dtype=t.dtype,
                            device=t.device)
        grown[:, : t.shape[1]] = t
        return grown

    def write(self, slot: int, steering: Steering | None) -> None:
        """Give ``slot`` the rows of ``steering`` (None: none)."""
        nb = 0 if steering is None else steering.bias_ids.size
        if nb or self.has_bias[slot]:
            self.bias_cols = self._widen(self.bias_cols, nb)
            self.bias_values = self._widen(self.bias_values, nb)
            cols = np.zeros(self.bias_cols.shape[1], np.int64)
            vals = np.zeros(self.bias_cols.shape[1], np.float32)
            if nb:
                cols[:nb], vals[:nb] = steering.bias_ids, steering.bias_values
            self.bias_cols[slot] = torch.from_numpy(cols).to(self.device)
            self.bias_values[slot] = torch.from_numpy(vals).to(self.device)
            self.version += 1
        self.has_bias[slot] = nb > 0
        allowed = None if steering is None else steering.allowed_ids
        if allowed is not None:
            self.allowed_cols = self._widen(self.allowed_cols, allowed.size)
            cols = np.full(self.allowed_cols.shape[1], allowed[0], np.int64)
            cols[: allowed.size] = allowed
            self.allowed_cols[slot] = torch.from_numpy(cols).to(self.device)
        if allowed is not None or self.has_allowed[slot]:
            self.version += 1
        self.has_allowed[slot] = allowed is not None

    def gather(self, slots: np.ndarray, slots_on_device: torch.Tensor) -> StepSteering | None:
        """The rows of a step's samples in ``slots`` (int64 ``[N]``, host and device
        copies); None when none of them is steered (the common case: nothing runs)."""
        bias = bool(self.has_bias[slots].any())
        allowed = np.flatnonzero(self.has_allowed[slots])
        if not (bias or allowed.size):
            return None
        idx = slots_on_device.long()
        rows = cols = None
        if allowed.size:
            rows = to_device(torch.from_numpy(allowed), self.device)
            cols = self.allowed_cols[idx[rows]]
        return StepSteering(self.bias_cols[idx] if bias else None,
                            self.bias_values[idx] if bias else None, rows, cols)
