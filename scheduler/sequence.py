"""Sequences: one sample of one request, from waiting to finished."""

from __future__ import annotations

import enum
from collections.abc import Sequence as _Seq
from typing import Protocol


class BlockRows(Protocol):
    """Where a sequence's block ids live (``scheduler.kv_cache.KVCache``); a protocol so
    that this module does not import the one that imports it."""

    def blocks_of(self, slot: int) -> list[int]: ...


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

    Scheduler-owned fields: ``slot`` (state slot, -1 when none; written by the
    ``StateManager``), ``blocks`` (KV block ids in order, read-only: derived from the
    block-table row that ``kv_cache`` keeps for the slot), ``num_computed`` (prompt
    tokens prefill has scheduled so far), the chain hashes of its full blocks and how
    many of them are registered in the prefix cache, ``num_forks`` (children still to
    create when its prompt completes; their slots are reserved in ``reserved_slots``
    from admission on), and ``prompt_scored``: -1 when its prompt is not scored, else how
    many prompt positions have had their row scored (position p scores prompt token
    p + 1; ``scheduler.prompt_scores``). ``cache_salt``: 0, or an int that keys its
    prefix-cache blocks apart from those of other salts (a LoRA adapter's id: the same
    tokens give other K/V under another adapter).
    """

    __slots__ = (
        "seq_id", "request_id", "sample_index", "prompt_token_ids", "output_token_ids",
        "status", "finish_reason", "num_cached_tokens", "stop_token_ids", "max_tokens",
        "min_tokens", "slot", "kv_cache", "block_hashes", "num_registered", "num_forks",
        "reserved_slots", "admitted", "num_computed", "chain_tail", "chain_gen",
        "prompt_scored", "cache_salt",
    )

    def __init__(self, seq_id: int, request_id: str, sample_index: int,
                 prompt_token_ids: list[int], max_tokens: int, *, min_tokens: int = 0,
                 stop_token_ids: _Seq[int] = (), num_forks: int = 0,
                 kv_cache: BlockRows | None = None, score_prompt: bool = False,
                 cache_salt: int = 0) -> None:
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
        self.kv_cache = kv_cache
        self.block_hashes: list[int] = []
        self.num_registered = 0
        # The cached block its prefix chain continues from after its last registered
        # block, and that block's generation then (``KVCache.register``'s shortcut).
        self.chain_tail = -1
        self.chain_gen = -1
        self.num_forks = num_forks
        self.reserved_slots: list[int] = []
        self.admitted = False
        self.num_computed = 0
        self.prompt_scored = 0 if score_prompt else -1
        self.cache_salt = cache_salt

    @property
    def blocks(self) -> list[int]:
        """KV block ids in order (a fresh list; empty without a slot). The block-table row
        in ``kv_cache`` is the only place they are written."""
        if self.slot < 0 or self.kv_cache is None:
            return []
        return self.kv_cache.blocks_of(self.slot)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V is in the cache (a running sequence: all but the last one)."""
        if self.status is SequenceStatus.RUNNING:
            return self.num_tokens - 1
        return self.num_computed

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + outputs, without concatenating the whole."""
        p = self.prompt_token_ids
        n = len(p)
        if stop <= n:
            return p[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return p[start:] + self.output_token_ids[:stop - n]

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A running child of this sequence whose prompt just completed: same request,
        tokens, limits and prefix-cache progress. The caller gives it a slot and the
        parent's blocks."""
        child = Sequence(seq_id, self.request_id, sample_index, self.prompt_token_ids,
                         self.max_tokens, min_tokens=self.min_tokens,
                         stop_token_ids=self.stop_token_ids, kv_cache=self.kv_cache,
                         cache_salt=self.cache_salt)
        child.status = SequenceStatus.RUNNING
        child.block_hashes = list(self.block_hashes)
        child.num_registered = self.num_registered
        child.chain_tail = self.chain_tail
        child.chain_gen = self.chain_gen
        child.admitted = True
        child.num_cached_tokens = self.num_cached_tokens
        child.num_computed = self.num_computed
        return child

    def stop_reason(self, token: int) -> str | None:
        """Why the sequence ends now that ``token`` was appended (``"stop"`` or
        ``"length"``), or None if it goes on."""
        nout = len(self.output_token_ids)
        if token in self.stop_token_ids and nout > self.min_tokens:
            return "stop"
        if nout >= self.max_tokens:
            return "length"
        return None

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
                f"sample_index={self.sample_index}, status={self.status.value}, "
                f"prompt_len={len(self.prompt_token_ids)}, "
                f"outputs={len(self.output_token_ids)}, finish_reason={self.finish_reason})")
