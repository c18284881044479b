"""The tensor-parallel layers on their own, over a real 2-rank gloo group: a row-parallel
Linear with a bias (no decoder here has one, so the model tests never add it) and the
launcher's hand-back of a large rank-0 result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer.distributed.ranks import RankInfo, destroy_group, init_distributed, spawn_ranks
from deepinfer.models.parallel_layers import RowParallelLinear, VocabParallelEmbedding
from deepinfer.models.tensor_parallel import TPGroup

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _layers_rank(info: RankInfo, w: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                 table: torch.Tensor, ids: torch.Tensor) -> tuple[list, list]:
    """Each rank holds its block of columns of ``w`` / rows of ``table``; every rank
    must end with the whole result (rank 0's is returned, as lists: a tensor would be
    passed by a handle to memory of a process that is gone)."""
    torch.set_num_threads(1)
    init_distributed(info, "cpu", timeout_s=60)
    try:
        tp = TPGroup(info.rank, info.world_size, dist.group.WORLD)
        cols = w.shape[1] // tp.size
        row = RowParallelLinear(cols, w.shape[0], bias=True, tp=tp)
        row.weight.data = w[:, tp.rank * cols:(tp.rank + 1) * cols].contiguous()
        row.bias.data = bias.clone()
        rows = table.shape[0] // tp.size
        emb = VocabParallelEmbedding(rows, table.shape[1], tp.rank * rows, tp)
        emb.weight.data = table[tp.rank * rows:(tp.rank + 1) * rows].contiguous()
        with torch.inference_mode():
            y = row(x[:, tp.rank * cols:(tp.rank + 1) * cols].contiguous())
            e = emb(ids)
        same = torch.stack([y.sum(), e.sum()])
        copies = [torch.empty_like(same) for _ in range(tp.size)]
        dist.all_gather(copies, same)  # every rank holds the same output
        assert all(torch.equal(c, same) for c in copies)
        return y.tolist(), e.tolist()
    finally:
        destroy_group()


def test_row_parallel_bias_added_once_and_vocab_lookup(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(6, 8, generator=g), torch.randn(6, generator=g) + 3.0
    x = torch.randn(5, 8, generator=g)
    table = torch.randn(10, 4, generator=g)
    ids = torch.tensor([0, 9, 4, 5, 5, 1])  # both halves of the vocabulary, repeats
    y, e = spawn_ranks(_layers_rank, 2, (w, bias, x, table, ids))
    torch.testing.assert_close(torch.tensor(y), x @ w.T + bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(e), table[ids], atol=0, rtol=0)


def _big_result(info: RankInfo, n: int) -> bytes:
    return bytes([info.rank]) * n


def test_spawn_ranks_returns_a_result_larger_than_the_pipe():
    """Rank 0's result is read while the ranks run: one past the pipe's 64 KiB buffer
    would otherwise block rank 0 in ``put`` and the launcher in ``join``, forever."""
    assert spawn_ranks(_big_result, 2, (1 << 20,)) == bytes([0]) * (1 << 20)


def _raise_on_rank_1(info: RankInfo) -> None:
    if info.rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_a_rank_that_raises_is_named_and_leaves_no_file_behind(tmp_path, monkeypatch):
    """torch's spawn wrapper saves a raising rank's traceback in a temp file: read into
    the error (which names the rank and its exception), then removed."""
    from deepinfer.distributed.ranks import RankFailedError

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the spawn wrapper's files go
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with pytest.raises(RankFailedError, match="rank 1 exited with code 1: ValueError: "
                                              "rank 1 fails on purpose"):
        spawn_ranks(_raise_on_rank_1, 2)
    assert list(tmp_path.iterdir()) == []


def _make_step(seed: int, t: int, b: int, w: int, n_clone: int, is_prompt: bool):
    """A scheduler-output-like step with random launch tensors (the scheduler's dtypes)."""
    from types import SimpleNamespace

    from deepinfer_scheduler.batch import LaunchBatch

    g = torch.Generator().manual_seed(seed)

    def ints(n: int, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(0, 1 << 20, (n,), generator=g).to(dtype)

    batch = LaunchBatch(
        input_ids=ints(t), positions=ints(t), slot_mapping=ints(t),
        block_tables=ints(b * w, torch.int32).view(b, w), seq_lens=ints(b, torch.int32),
        query_start_loc=ints(b + 1, torch.int32), logits_indices=ints(b),
        state_slots=ints(b), sample_state_slots=ints(b), max_query_len=t // b,
        max_seq_len=int(seed), num_tokens=t)
    return SimpleNamespace(batch=batch, is_prompt=is_prompt,
                           clone_blocks=ints(2 * n_clone).view(-1, 2))


#: (seed, T, B, W, clone pairs, prompt): a decode step that fits one broadcast, a prompt
#: step past it (3 x 3000 token ints alone), and one with copy-on-write pairs.
STEPS = [(1, 64, 64, 8, 0, False), (2, 3000, 4, 40, 0, True), (3, 16, 16, 4, 3, False)]


def _channel_rank(info: RankInfo) -> bool:
    from deepinfer.step_channel import StepChannel

    torch.set_num_threads(1)
    init_distributed(info, "cpu", timeout_s=60)
    try:
        channel = StepChannel(dist.group.WORLD, dist.group.WORLD, leader=0)
        ok = True
        if info.rank == 0:
            for spec in STEPS:
                channel.send_step(_make_step(*spec), ids_on_device=spec[0] == 3)
            channel.send_stop()
        else:
            for spec in STEPS:
                want, got = _make_step(*spec), channel.recv()
                wb, gb = want.batch, got.batch
                for name in ("input_ids", "positions", "slot_mapping", "block_tables",
                             "seq_lens", "query_start_loc", "logits_indices"):
                    a, b = getattr(wb, name), getattr(gb, name)
                    ok &= a.dtype == b.dtype and torch.equal(a, b)
                ok &= torch.equal(want.clone_blocks, got.clone_blocks)
                ok &= (gb.num_tokens, gb.max_query_len, gb.max_seq_len, got.is_prompt,
                       got.ids_on_device) == (wb.num_tokens, wb.max_query_len,
                                              wb.max_seq_len, want.is_prompt, spec[0] == 3)
            ok &= channel.recv() is None
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    finally:
        destroy_group()


def test_step_channel_delivers_small_and_large_steps():
    """What the followers rebuild equals what the leader sent, for a step inside the one
    fixed-size broadcast and one that needs the second; then the stop."""
    assert spawn_ranks(_channel_rank, 2) is True
