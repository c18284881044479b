"""Requests: the rules a request must meet to be queued, and the live sequences by id
and by request (with the union of their stop tokens, for the vectorized stop check)."""

from __future__ import annotations

from collections.abc import KeysView

from deepinfer_scheduler.config import EngineType, SchedulerConfig
from deepinfer_scheduler.sequence import Sequence
from deepinfer_scheduler.util import cdiv


def validate_request(config: SchedulerConfig, request_id: str, prompt: list[int],
                     max_tokens: int, *, outputs: list[int] | None = None, n: int = 1,
                     min_tokens: int = 0, max_live: int | None = None) -> None:
    """Raise ``ValueError`` naming the request and the rule it breaks if it is malformed
    or could never run. ``outputs``: tokens already sampled elsewhere (a prefilled
    sequence: at least one, fewer than ``max_tokens``), None for a new request.
    ``max_live``: state slots a request's ``n`` samples may take at most."""
    rid = request_id
    c = config
    if outputs is None:
        if c.engine_type is EngineType.COMPLETION:  # it would wait forever: never prefills
            raise ValueError(f"request {rid!r}: a COMPLETION engine only decodes sequences "
                             "prefilled elsewhere (add_prefilled), not new requests")
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt (prompt_token_ids has no tokens)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens={max_tokens!r} must be >= 1")
    else:
        if c.engine_type is EngineType.PROMPT:
            raise ValueError(f"request {rid!r}: a PROMPT engine only prefills; a prefilled "
                             "sequence would never be decoded (import it into a "
                             "COMPLETION or NORMAL engine)")
        if not prompt or not outputs:
            raise ValueError(f"request {rid!r}: add_prefilled needs a prompt and at least "
                             "one output token")
        if not isinstance(max_tokens, int) or len(outputs) >= max_tokens:
            raise ValueError(f"request {rid!r}: max_tokens={max_tokens!r} must exceed the "
                             f"{len(outputs)} output tokens already generated")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"request {rid!r}: n={n!r} must be >= 1")
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"request {rid!r}: min_tokens={min_tokens!r} must be >= 0")
    total = len(prompt) + max_tokens
    if total > c.max_model_len:
        raise ValueError(
            f"request {rid!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
            f"= {total} exceeds max_model_len={c.max_model_len}")
    prompt_blocks = cdiv(len(prompt), c.block_size)
    if prompt_blocks > c.num_blocks:
        raise ValueError(
            f"request {rid!r}: prompt needs {prompt_blocks} KV blocks, more than the "
            f"whole cache (num_blocks={c.num_blocks})")
    # The last sampled token is never fed back, so a sequence holds at most
    # prompt + max_tokens - 1 tokens of K/V; more than the cache could never run.
    seq_blocks = cdiv(total - 1, c.block_size)
    if seq_blocks > c.num_blocks:
        raise ValueError(
            f"request {rid!r}: prompt + max_tokens needs {seq_blocks} KV blocks, more "
            f"than the whole cache (num_blocks={c.num_blocks}); it could never finish")
    if max_live is not None and n > max_live:
        raise ValueError(
            f"request {rid!r}: n={n} samples need {n} state slots, more than "
            f"max_num_seqs={c.max_num_seqs} (or max_num_batched_tokens)")
    if n > 1 and c.engine_type is EngineType.PROMPT:
        # Forked children share their parent's blocks; handing a group off would need
        # shared-block transfers and COW bookkeeping across engines. Not supported.
        raise ValueError(
            f"request {rid!r}: n={n} is not supported with disaggregated prefill "
            "(a PROMPT engine hands off single sequences only); use n=1")


class SequenceRegistry:
    """Live (not finished) sequences: ``seqs`` by seq id, ``requests`` by request id
    (the request's live samples, in sample order). Guarded by the scheduler's lock."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self._next_id = 0
        self._stop_refs: dict[int, int] = {}  # stop token -> live sequences using it

    def __len__(self) -> int:
        return len(self.seqs)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def check_new(self, request_id: str) -> None:
        """Raise ``ValueError`` if a request of that id is still live."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: duplicate request id (still running)")

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.requests.setdefault(seq.request_id, []).append(seq)
        for t in seq.stop_token_ids:
            n = self._stop_refs.get(t, 0)
            self._stop_refs[t] = n + 1

    def remove(self, seq: Sequence) -> None:
        del self.seqs[seq.seq_id]
        group = self.requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self.requests[seq.request_id]
        for t in seq.stop_token_ids:
            n = self._stop_refs[t] - 1
            if n:
                self._stop_refs[t] = n
            else:
                del self._stop_refs[t]

    def stop_set(self) -> KeysView[int]:
        """Every stop token of a live sequence (a live view: kept up to date by ``add``
        and ``remove``)."""
        return self._stop_refs.keys()
