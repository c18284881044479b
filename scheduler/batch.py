"""Launch tensors of one step, written with numpy into host buffers reused across steps.

Each ``BatchBuffers`` owns one set of host tensors at their maximum sizes (pinned when
the engine runs on CUDA, so that ``.to(device, non_blocking=True)`` is a real async copy)
and numpy views of the same memory. The scheduler fills the views and hands out
``LaunchBatch`` slices of the tensors: no allocation per step. The scheduler alternates
between two buffer sets, so a step's tensors are not overwritten by the very next
``schedule()`` even if the runner's async copies are still in flight; the contract it
publishes is still "valid until the next ``schedule()``".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


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

    def block_tables_view(self, b: int, w: int) -> np.ndarray:
        """Writable contiguous ``[b, w]`` numpy view for the block tables."""
        return self.block_tables_np[: b * w].reshape(b, w)

    def make(self, t: int, b: int, w: int, s: int, max_query_len: int,
             max_seq_len: int) -> LaunchBatch:
        """Tensors over the first t tokens / b sequences / s samples of the buffers."""
        return LaunchBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[: b * w].view(b, w),
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            logits_indices=self.logits_indices[:s],
            state_slots=self.state_slots[:b],
            sample_state_slots=self.sample_state_slots[:s],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_tokens=t,
        )
