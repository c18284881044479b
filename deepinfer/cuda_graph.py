"""CUDA graphs for decode steps.

A decode step's launch sequence depends only on the batch size, so one graph per size
bucket replays the whole forward with one launch: the Python and launch overhead of a
small model's decode step is otherwise larger than its GPU time. Inputs are copied into
static buffers; rows past the real batch are padding (slot -1: nothing stored).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.attention import AttentionMetadata

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes 1, 2, 4, 8, then every 16 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphRunner:
    """Captures and replays decode forwards, one CUDA graph per batch-size bucket."""

    def __init__(self, forward: ForwardFn, device: torch.device, *, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, max_seq_len: int) -> None:
        self.forward = forward
        self.device = device
        self.max_seq_len = max_seq_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        kw = {"device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)
        self.positions = torch.zeros(n, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prompt=False, slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool.
        Under ``no_grad``: a parameter that required grad would otherwise record autograd
        state into the captured forward."""
        with torch.no_grad():
            self._capture_all()

    def _capture_all(self) -> None:
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], meta)
            self.forward(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.forward(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, batch) -> bool:
        """Whether a captured bucket fits this decode batch."""
        width = batch.block_tables.shape[1]
        return 0 < batch.num_tokens <= self.sizes[-1] and width <= self.block_tables.shape[1]

    def run(self, batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the smallest bucket that holds ``batch``; returns hidden ``[B, H]``.
        ``input_ids``: ``[B]`` int64 on the device to use instead of the batch's own
        (placeholders already resolved)."""
        n = batch.num_tokens
        bs = next(s for s in self.sizes if s >= n)
        w = batch.block_tables.shape[1]
        ids = batch.input_ids if input_ids is None else input_ids
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, :w].copy_(batch.block_tables, non_blocking=True)
        self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
