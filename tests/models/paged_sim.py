"""A minimal stand-in for the scheduler in model tests: a paged KV cache and per-sequence
block tables, one ``step`` per packed batch through the torch reference kernels."""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.kv_cache_spec import kv_cache_shape
from deepinfer.models.attention import AttentionMetadata
from deepinfer.models.tensor_parallel import SINGLE, TPGroup
from deepinfer_kernels import reference


class PagedSim:
    """Minimal stand-in for the scheduler: a paged cache and per-sequence block tables
    drawn from a shuffled free list (so logical and physical block order differ)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int = 32, block_size: int = 4,
                 seed: int = 0, tp: TPGroup = SINGLE) -> None:
        self.block_size = block_size
        # A tensor-parallel rank's cache holds its KV heads only.
        self.cache = torch.zeros(kv_cache_shape(cfg, num_blocks, block_size, tp))
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, model, chunks: dict[int, list[int]], is_prompt: bool,
             backend=reference) -> torch.Tensor | None:
        """Run one step over ``{seq_id: new tokens}`` with ``backend``'s kernels (the
        torch reference by default); returns logits ``[T, vocab]`` (None on a
        tensor-parallel rank other than the leader)."""
        ids, pos, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for sid, toks in chunks.items():
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // self.block_size] * self.block_size
                             + p % self.block_size)
            ids += toks
            pos += range(start, end)
            starts.append(starts[-1] + len(toks))
            seq_lens.append(end)
            tables.append(table)
            self.lens[sid] = end
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            is_prompt=is_prompt,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), self.cache, meta, backend)
            return model.compute_logits(hidden)


def prefill_then_decode(model, cfg: ModelConfig, seqs: dict[int, list[int]],
                        prompt_len: dict[int, int], steps: int = 4) -> dict[int, torch.Tensor]:
    """Each sequence's logits ``[prompt_len + steps, vocab]`` through a packed prefill of
    its first ``prompt_len`` tokens, then ``steps`` teacher-forced decode steps (one token
    per sequence per step), on a fresh :class:`PagedSim`."""
    sim = PagedSim(cfg)
    ours: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    logits = sim.step(model, {s: seqs[s][:prompt_len[s]] for s in seqs}, is_prompt=True)
    start = 0
    for s in seqs:
        ours[s].append(logits[start:start + prompt_len[s]])
        start += prompt_len[s]
    for k in range(steps):
        logits = sim.step(model, {s: [seqs[s][prompt_len[s] + k]] for s in seqs},
                          is_prompt=False)
        for i, s in enumerate(seqs):
            ours[s].append(logits[i:i + 1])
    return {s: torch.cat(ours[s]) for s in seqs}
