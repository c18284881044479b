"""Multi-process DP votes over real gloo groups (2 and 4 ranks)."""

from __future__ import annotations

import json
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.scheduler.dp_worker import run_rank

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

CFG = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
           max_model_len=64, prefill_attempt_interval=2, prefill_any_attempt_interval=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, loads: list, tmp_path) -> list[dict]:
    mp.spawn(run_rank, args=(world, free_port(), loads, CFG, str(tmp_path)), nprocs=world,
             join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def check_common(results, loads):
    logs = [r["log"] for r in results]
    assert all(len(lg) == len(logs[0]) for lg in logs)
    for steps in zip(*logs):
        assert len({is_prompt for _, is_prompt, _ in steps}) == 1, steps  # same step type
        assert len({d for d, _, _ in steps}) == 1, steps  # same decode_step everywhere
    for r, res in enumerate(results):
        assert sorted(res["done"].values()) == sorted(mt for _, _, mt in loads[r])
        assert res["usage"] == 0.0
        prompt_steps = [(d, n) for d, p, n in res["log"] if p]
        for d, _ in prompt_steps:  # prefill only at ALL or ANY points
            assert d % CFG["prefill_attempt_interval"] == 0 or (
                d != 0 and d % CFG["prefill_any_attempt_interval"] == 0)
    return logs


def test_two_ranks_unequal_loads(tmp_path):
    loads = [
        [(0, 6, 3), (0, 9, 12), (0, 5, 2), (3, 7, 5), (4, 20, 4), (9, 6, 6), (10, 3, 3)],
        [(0, 30, 2), (14, 5, 8)],
    ]
    results = run(2, loads, tmp_path)
    logs = check_common(results, loads)
    # Rank 1 sat out some prompt steps with an empty batch while rank 0 prefilled.
    assert any(p and n == 0 for _, p, n in logs[1])


def test_four_ranks_one_idle(tmp_path):
    loads = [
        [(0, 6, 3), (0, 9, 6), (2, 5, 2), (6, 7, 5)],
        [(0, 12, 4), (5, 5, 3)],
        [(1, 8, 7)],
        [],  # idle rank
    ]
    results = run(4, loads, tmp_path)
    logs = check_common(results, loads)
    any_int = CFG["prefill_any_attempt_interval"]
    prompt_ds = [d for d, p, _ in logs[3] if p]
    assert prompt_ds, "the busy ranks never prefilled"
    # An idle rank never wants: ALL votes fail, prefill happens at ANY points only.
    assert all(d != 0 and d % any_int == 0 for d in prompt_ds)
    assert all(n == 0 for _, _, n in logs[3])
