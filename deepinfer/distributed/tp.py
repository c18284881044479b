"""Tensor-parallel groups, alone or under data parallelism.

A run of ``--dp M --tp N`` has ``M x N`` ranks: DP replica ``g`` is the TP group of
global ranks ``g*N .. g*N + N - 1``, whose first rank (the leader) schedules, samples and
writes records; the other ranks of the group only run the forward on their shard
(``worker.run_follower``). Only leaders take part in the DP step-type votes and the DP
bookkeeping (``leaders`` group); every rank takes part in the run's start (resume state)
and end (barriers, exit status) on the default group.

``start_llm_followers`` is the same for ``LLM(..., tensor_parallel_size=N)``: the
calling process becomes rank 0 and ``N - 1`` spawned processes follow it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.distributed.ranks import (
    RankInfo,
    check_gpu_count,
    destroy_group,
    free_port,
    init_distributed,
    select_device,
    use_thread_lock_for_bars,
)
from deepinfer.engine_args import EngineArgs
from deepinfer.models.tensor_parallel import TPGroup
from deepinfer.step_channel import StepChannel
from deepinfer.worker import TensorParallel, run_follower

#: How long a follower waits for its leader's next step: unbounded in practice.
HOST_WAIT = dt.timedelta(days=365)


@dataclass(frozen=True)
class RankLayout:
    """Where a global rank sits in a ``dp x tp`` run."""

    rank: int
    dp: int
    tp: int

    @property
    def replica(self) -> int:
        """Which DP replica (TP group) this rank belongs to."""
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def leader_ranks(self) -> list[int]:
        return [g * self.tp for g in range(self.dp)]


@dataclass
class RunGroups:
    """The groups of one rank: its TP wiring (None when ``tp == 1``) and the group of
    the DP leaders (None when ``dp == 1``)."""

    tp: TensorParallel | None
    leaders: Any


def make_groups(layout: RankLayout, timeout_s: float) -> RunGroups:
    """Create every group of the run (collective: every rank creates all of them, in
    the same order) and return this rank's. ``timeout_s`` bounds each collective of the
    device and DP-leader groups (a new group does not inherit the default group's: it
    would wait torch's 30 minutes)."""
    timeout = dt.timedelta(seconds=timeout_s)
    mine: TensorParallel | None = None
    if layout.tp > 1:
        for g in range(layout.dp):
            ranks = list(range(g * layout.tp, (g + 1) * layout.tp))
            device_group = dist.new_group(ranks, timeout=timeout)
            # Step messages live in host memory: gloo, so that no rank syncs its GPU. Its
            # own group without a timeout: followers wait in it for as long as the leader
            # does host work or, under LLM, as long as the caller waits between calls (a
            # dead leader still closes its connections at once).
            host_group = dist.new_group(ranks, backend="gloo", timeout=HOST_WAIT)
            if g == layout.replica:
                group = TPGroup(layout.tp_rank, layout.tp, device_group)
                mine = TensorParallel(group, StepChannel(host_group, device_group, ranks[0]))
    leaders = None
    if layout.dp > 1:
        leaders = (dist.group.WORLD if layout.tp == 1
                   else dist.new_group(layout.leader_ranks, timeout=timeout))
    return RunGroups(mine, leaders)


def check_layout(dp: int, tp: int, world: int) -> int:
    """The DP size of a run: ``dp`` when spawning here (``world == 0``), else the
    launcher's ``WORLD_SIZE / tp``. ``ValueError`` when they disagree."""
    if world == 0:
        return dp
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide WORLD_SIZE={world} set by the "
                         "launcher (it must be dp x tp)")
    if dp > 1 and dp * tp != world:
        raise ValueError(f"--dp {dp} --tp {tp} needs WORLD_SIZE={dp * tp}; the launcher "
                         f"set {world}")
    return world // tp


# ---------------------------------------------------------------------------- LLM(...)
class LLMFollowers:
    """The spawned TP ranks of an in-process ``LLM`` and the groups this process joined
    as their leader. ``close()`` (after the engine's) joins them and leaves the group."""

    def __init__(self, procs: list[Any], tp: TensorParallel, num_threads: int) -> None:
        self.procs = procs
        self.tp = tp
        self._num_threads = num_threads  # joining the group shares the cores out

    def failure(self, wait_s: float = 1.0) -> str | None:
        """Which follower died and how (None while all live). Called after a collective
        failed: a dying follower closes its connections just before it exits, so its
        exit code may take a moment (``wait_s`` over all of them)."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        for rank, p in enumerate(self.procs, 1):
            if p.exitcode is not None and p.exitcode != 0:
                return f"tensor-parallel rank {rank} exited with code {p.exitcode}"
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` in all for the followers to leave (after the engine
        sent them stop; 0: it could not, kill them now), then leave the group."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
        destroy_group()
        torch.set_num_threads(self._num_threads)


def _llm_follower(rank: int, world: int, port: int, args: EngineArgs,
                  timeout_s: float) -> None:
    """A spawned follower of an in-process ``LLM``."""
    use_thread_lock_for_bars()  # it leaves through os._exit below (loading makes a bar)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = RankInfo(rank, world, rank, world)
    device = select_device(args.device, rank)
    init_distributed(info, device, timeout_s)
    try:
        groups = make_groups(RankLayout(rank, 1, world), timeout_s)
        run_follower(dataclasses.replace(args, device=device), groups.tp)
    finally:
        destroy_group()
    sys.stdout.flush()
    os._exit(0)


def start_llm_followers(args: EngineArgs, timeout_s: float = 120.0
                        ) -> tuple[EngineArgs, LLMFollowers]:
    """Spawn ``args.tensor_parallel_size - 1`` followers and join them as rank 0; returns
    the engine arguments of this rank (its device) and the followers' handle."""
    import torch.multiprocessing as mp

    if dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1: this process already belongs to a "
                         "torch.distributed group; run LLM in a fresh process")
    world = args.tensor_parallel_size
    check_gpu_count(args.device, world, f"tensor_parallel_size={world}")
    port = free_port()
    num_threads = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_llm_follower, args=(r, world, port, args, timeout_s),
                         daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = select_device(args.device, 0)
    try:
        init_distributed(RankInfo(0, world, 0, world), device, timeout_s)
        groups = make_groups(RankLayout(0, 1, world), timeout_s)
    except Exception as e:
        if dist.is_initialized():
            destroy_group()  # or every later LLM(...) finds this process in a group
        dead = [(r, p.exitcode) for r, p in enumerate(procs, 1) if p.exitcode is not None]
        for p in procs:
            p.kill()
        if dead:
            rank, code = dead[0]
            raise RuntimeError(
                f"tensor-parallel rank {rank} exited with code {code} before joining the "
                "group (spawned ranks re-import the main script: guard its entry point "
                "with `if __name__ == '__main__':`)") from e
        raise
    return dataclasses.replace(args, device=device), LLMFollowers(procs, groups.tp, num_threads)
