"""Launch tensors of one step, written with numpy into host buffers reused across steps.

Each ``BatchBuffers`` owns one set of host tensors at their maximum sizes (pinned when
the engine runs on CUDA, so that ``.to(device, non_blocking=True)`` is a real async copy)
and numpy views of the same memory. ``BatchBuilder`` fills the views for a prompt or a
decode step and hands out ``LaunchBatch`` slices of the tensors: no allocation per step.
It alternates between two buffer sets, so a step's tensors are not overwritten by the
very next ``schedule()`` even if the runner's async copies are still in flight; the
contract the scheduler publishes is still "valid until the next ``schedule()``".

A buffer set is not rewritten while an earlier step's asynchronous host-to-device copy
from it may still be pending: the consumer records an event after enqueuing its copies
(``LaunchBatch.mark_copied``) and the builder waits on it before writing that set again
(a run of prefill chunks with no samples, or an overlapped engine loop, would otherwise
recycle a set with no sync in between).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.sequence import Sequence

#: The ``score_rows`` of a step that scores none (size 0: a borrower cannot change it).
NO_ROWS = torch.zeros(0, dtype=torch.int64)


@dataclass
class LaunchBatch:
    """Host tensors for one kernel launch (all contiguous CPU tensors).

    T = tokens in the step, B = scheduled sequences, S = samples, W = widest block table.

    input_ids          int64 [T]    packed token ids (decode: row i is seq i's last token)
    positions          int64 [T]    position of each token in its sequence
    slot_mapping       int64 [T]    KV slot (block * block_size + offset) of each token
    block_tables       int32 [B, W] block ids of each sequence, padded with 0
    seq_lens           int32 [B]    cached prefix + new tokens (decode: full length)
    query_start_loc    int32 [B+1]  start row of each sequence in the packed tokens
    logits_indices     int64 [S]    rows whose logits are sampled, in sample order
    state_slots        int64 [B]    state slot of each scheduled sequence
    sample_state_slots int64 [S]    state slot of the sequence each sample belongs to
    score_rows         int64 [R]    prompt step: rows whose logits are scored against the
                                    next prompt token (``prompt_scores``); usually empty
    score_targets      int64 [R]    the prompt token each scored row scores
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    state_slots: torch.Tensor
    sample_state_slots: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    buffers: BatchBuffers | None = field(default=None, repr=False, compare=False)
    score_rows: torch.Tensor = field(default_factory=lambda: NO_ROWS)
    score_targets: torch.Tensor = field(default_factory=lambda: NO_ROWS)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def mark_copied(self) -> None:
        """Called by the consumer once every copy from these host tensors is enqueued on
        the current CUDA stream: the builder waits for them before reusing the memory.
        Nothing to do on CPU (copies there are synchronous)."""
        if self.buffers is not None and self.buffers.pinned:
            event = torch.cuda.Event()
            event.record()
            self.buffers.copied = event


class BatchBuffers:
    """Host buffers at maximum size plus their numpy views (``*_np``)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, pin: bool) -> None:
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.input_ids = buf(max_tokens, torch.int64)
        self.positions = buf(max_tokens, torch.int64)
        self.slot_mapping = buf(max_tokens, torch.int64)
        self.block_tables = buf(max_seqs * max_blocks, torch.int32)
        self.seq_lens = buf(max_seqs, torch.int32)
        self.query_start_loc = buf(max_seqs + 1, torch.int32)
        self.logits_indices = buf(max_seqs, torch.int64)
        self.state_slots = buf(max_seqs, torch.int64)
        self.sample_state_slots = buf(max_seqs, torch.int64)
        self.input_ids_np = self.input_ids.numpy()
        self.positions_np = self.positions.numpy()
        self.slot_mapping_np = self.slot_mapping.numpy()
        self.block_tables_np = self.block_tables.numpy()
        self.seq_lens_np = self.seq_lens.numpy()
        self.query_start_loc_np = self.query_start_loc.numpy()
        self.logits_indices_np = self.logits_indices.numpy()
        self.state_slots_np = self.state_slots.numpy()
        self.sample_state_slots_np = self.sample_state_slots.numpy()
        self.pinned = pin  # the engine runs on CUDA: copies from here are asynchronous
        # An event (anything with ``synchronize()``) recorded after the consumer's copies.
        self.copied: Any = None
        self._batches: dict[tuple[int, int, int, int], LaunchBatch] = {}
        # The ``RunningRows`` whose row-only fields the buffers hold (``decode``).
        self.rows: object = None

    def wait_until_copied(self) -> None:
        """Block until the last consumer's copies out of these buffers have completed."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def block_tables_view(self, b: int, w: int) -> np.ndarray:
        """Writable contiguous ``[b, w]`` numpy view for the block tables."""
        return self.block_tables_np[: b * w].reshape(b, w)

    def make(self, t: int, b: int, w: int, s: int, max_query_len: int,
             max_seq_len: int, score_rows: torch.Tensor = NO_ROWS,
             score_targets: torch.Tensor = NO_ROWS) -> LaunchBatch:
        """Tensors over the first t tokens / b sequences / s samples of the buffers. The
        batch of a size seen before is reused, its two lengths updated (same memory;
        nine slices and the dataclass cost ~20 us, and decode steps repeat their sizes):
        a batch of this buffer set is only valid until the set is written again."""
        key = (t, b, w, s)
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= 64:  # prompt steps vary: keep the cache small
                self._batches.clear()
            batch = self._batches[key] = LaunchBatch(
                self.input_ids[:t], self.positions[:t], self.slot_mapping[:t],
                self.block_tables[: b * w].view(b, w), self.seq_lens[:b],
                self.query_start_loc[: b + 1], self.logits_indices[:s],
                self.state_slots[:b], self.sample_state_slots[:s],
                max_query_len=max_query_len, max_seq_len=max_seq_len, num_tokens=t,
                buffers=self)
        else:
            batch.max_query_len = max_query_len
            batch.max_seq_len = max_seq_len
        batch.score_rows, batch.score_targets = score_rows, score_targets
        return batch


class BatchBuilder:
    """Fills the launch batch of a prompt or a decode step from the block-table rows of
    ``kv`` (read only) and what the scheduler passes in."""

    def __init__(self, kv: KVCache, max_tokens: int, max_seqs: int, pin: bool) -> None:
        self._kv = kv
        mb = kv.tables.shape[1]
        self._bufs = (BatchBuffers(max_tokens, max_seqs, mb, pin),
                      BatchBuffers(max_tokens, max_seqs, mb, pin))
        self._index = 0
        self._arange = np.arange(max_tokens + 1, dtype=np.int64)

    def _next(self) -> BatchBuffers:
        self._index ^= 1
        buf = self._bufs[self._index]
        buf.wait_until_copied()
        return buf

    def _block_tables(self, buf: BatchBuffers, slots: np.ndarray, w: int) -> None:
        """Copy the first ``w`` blocks of the rows of ``slots`` (int64 [B])."""
        # A fancy-index copy: np.take with ``out`` into a strided view is ~4x slower.
        buf.block_tables_view(slots.shape[0], w)[...] = self._kv.tables[slots, :w]

    def empty(self) -> LaunchBatch:
        """A batch of nothing (an empty prompt step, or a decode step with no sequence)."""
        buf = self._next()
        buf.rows = None
        buf.query_start_loc_np[0] = 0
        return buf.make(0, 0, 0, 0, 0, 0)

    def prefill(self, sched: list[tuple[Sequence, int, int]], slots: np.ndarray,
                sample_rows: list[int], sample_slots: list[int],
                scores: Any = None) -> LaunchBatch:
        """Prompt step: ``sched`` holds ``(seq, first new token, number of new tokens)``
        per sequence in batch order, ``slots`` (int64 [B]) their state slots (the KV rows
        already cover every new token). ``sample_rows[k]``: batch index of the sequence
        sample k reads its logits from (its last new token); ``sample_slots[k]``: the state
        slot of the sequence sample k belongs to. ``scores``: the rows scored and their
        targets (``prompt_scores.ScoreRows``), None for none."""
        bs = self._kv.block_size
        tables = self._kv.tables
        nb = len(sched)
        starts = np.fromiter((a for _, a, _ in sched), dtype=np.int64, count=nb)
        lens = np.fromiter((n for _, _, n in sched), dtype=np.int64, count=nb)
        buf = self._next()
        buf.rows = None
        qsl = buf.query_start_loc_np[: nb + 1]
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:])
        t = int(qsl[nb])
        ids: list[int] = []
        for seq, a, n in sched:
            ids += seq.token_slice(a, a + n)
        buf.input_ids_np[:t] = ids
        pos = buf.positions_np[:t]
        np.subtract(self._arange[:t], np.repeat(qsl[:-1] - starts, lens), out=pos)
        rows = np.repeat(slots, lens)
        blk = tables[rows, pos // bs].astype(np.int64)
        np.add(blk * bs, pos % bs, out=buf.slot_mapping_np[:t])
        seq_lens = starts + lens
        buf.seq_lens_np[:nb] = seq_lens
        buf.state_slots_np[:nb] = slots
        w = int(self._kv.nblocks[slots].max())
        self._block_tables(buf, slots, w)
        ns = len(sample_rows)
        if ns:
            np.subtract(qsl[1:][sample_rows], 1, out=buf.logits_indices_np[:ns])
            buf.sample_state_slots_np[:ns] = sample_slots
        if scores is None:
            return buf.make(t, nb, w, ns, int(lens.max()), int(seq_lens.max()))
        return buf.make(t, nb, w, ns, int(lens.max()), int(seq_lens.max()), scores.rows,
                        scores.targets)

    def decode(self, slots: np.ndarray, ntok: np.ndarray, slot_mapping: np.ndarray,
               max_len: int, last_token: np.ndarray, rows: object) -> LaunchBatch:
        """Decode step, one token per sequence: ``slots`` (int64 [B]) their state slots,
        ``ntok`` (int64 [B]) their lengths with the token each feeds (which it writes at
        position ``ntok - 1``), ``slot_mapping`` (int64 [B]) the KV slot of that
        position, ``max_len`` the longest of ``ntok``, ``last_token`` (int64
        [num_slots]) the input token by slot. ``rows``: the object the rows come from
        (``RunningRows``); a buffer that last held a step of the same object keeps the
        fields that depend only on the rows (query starts, logits rows, state slots)
        instead of writing them again."""
        bs = self._kv.block_size
        nb = slots.shape[0]
        buf = self._next()
        buf.input_ids_np[:nb] = last_token[slots]
        np.subtract(ntok, 1, out=buf.positions_np[:nb])
        buf.slot_mapping_np[:nb] = slot_mapping
        buf.seq_lens_np[:nb] = ntok
        if buf.rows is not rows:
            arange = self._arange
            buf.query_start_loc_np[: nb + 1] = arange[: nb + 1]
            buf.logits_indices_np[:nb] = arange[:nb]
            buf.state_slots_np[:nb] = slots
            buf.sample_state_slots_np[:nb] = slots
            buf.rows = rows
        # Blocks up to the longest length: a row never holds blocks past its length.
        w = -(-max_len // bs)
        self._block_tables(buf, slots, w)
        return buf.make(nb, nb, w, nb, 1, max_len)
