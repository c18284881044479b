"""Sequences: one sample of one request, from waiting to finished."""

from __future__ import annotations

import enum
from collections.abc import Sequence as _Seq


class SequenceStatus(enum.Enum):
    """``WAITING``: queued (or a prompt part-way through chunked prefill); ``RUNNING``:
    prompt done, decoding; ``TRANSFERRING``: on a PROMPT engine, prompt done and first
    token sampled, waiting to be handed to a COMPLETION engine (still holds its blocks
    and slot, never decoded here); ``FINISHED``: done, resources freed (a handed-off
    sequence ends with finish_reason ``"handoff"`` on the PROMPT side)."""

    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"
    FINISHED = "finished"


class Sequence:
    """One sequence (one of the ``n`` samples of a request).

    Public fields: ``seq_id``, ``request_id``, ``sample_index`` (0..n-1),
    ``prompt_token_ids``, ``output_token_ids``, ``status``, ``finish_reason``
    (``"length"`` | ``"stop"`` | ``"abort"`` | None), ``num_cached_tokens`` (prefix-cache
    hit tokens at its first admission), ``stop_token_ids``, ``max_tokens``, ``min_tokens``.

    Scheduler-owned fields: ``slot`` (state slot, -1 when none), ``blocks`` (KV block ids
    in order), the chain hashes of its full blocks and how many of them are registered in
    the prefix cache, and ``num_forks`` (children still to create when its prompt
    completes; their slots are reserved in ``reserved_slots`` from admission on).
    """

    __slots__ = (
        "seq_id", "request_id", "sample_index", "prompt_token_ids", "output_token_ids",
        "status", "finish_reason", "num_cached_tokens", "stop_token_ids", "max_tokens",
        "min_tokens", "slot", "blocks", "block_hashes", "num_registered", "num_forks",
        "reserved_slots", "admitted", "_computed",
    )

    def __init__(self, seq_id: int, request_id: str, sample_index: int,
                 prompt_token_ids: list[int], max_tokens: int, *, min_tokens: int = 0,
                 stop_token_ids: _Seq[int] = (), num_forks: int = 0) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.slot = -1
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self.num_registered = 0
        self.num_forks = num_forks
        self.reserved_slots: list[int] = []
        self.admitted = False
        self._computed = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V is in the cache (a running sequence: all but the last one)."""
        if self.status is SequenceStatus.RUNNING:
            return self.num_tokens - 1
        return self._computed

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + outputs, without concatenating the whole."""
        p = self.prompt_token_ids
        n = len(p)
        if stop <= n:
            return p[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return p[start:] + self.output_token_ids[:stop - n]

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
                f"sample_index={self.sample_index}, status={self.status.value}, "
                f"prompt_len={len(self.prompt_token_ids)}, "
                f"outputs={len(self.output_token_ids)}, finish_reason={self.finish_reason})")
