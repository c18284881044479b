"""Data-parallel jobs of ``deepinfer-generate``: one engine per replica, each over a
round-robin share of the pending records. A replica is one rank, or with ``--tp N`` a
tensor-parallel group of N ranks whose leader runs the engine (``distributed.tp``); a
``--tp N`` run alone is one replica.

Each replica's leader runs the one loop (``run_loop``) and appends what it finishes to
its own part file next to the output (``OUTPUT.part{replica}``). The schedulers'
step-type votes go through the group of the replicas' leaders. A replica with no work
left keeps stepping with empty batches until one all-reduce says that no replica has
unfinished work; then rank 0 merges the output and every part file into the output, in
input order. Multi-node runs need the output folder (and the input file) on a filesystem
that every node sees at the same path.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.distributed.ranks import (
    RankInfo,
    allreduce_ints,
    comm_device,
    run_in_group,
    select_device,
    torchrun_world_size,
)
from deepinfer.distributed.tp import RankLayout, check_layout, make_groups
from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.formats import NATIVE, JobInput, job_format, warn_other_models
from deepinfer.jobs.input_index import InputIndex, pending_stream
from deepinfer.jobs.input_records import iter_requests, lora_requests
from deepinfer.jobs.parts import merge_rank_parts, part_path
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.resume import announce_resume, load_resume_state
from deepinfer.jobs.run_loop import RequestFeed, RunTarget, max_in_flight, run_requests
from deepinfer.jobs.summary import RunSummary
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams
from deepinfer.worker import run_follower


class ReplicaTarget(RunTarget):
    """The engine of one DP replica's leader. ``leaders``: the group of the replicas'
    leaders (None: a lone replica, e.g. a ``--tp`` run alone)."""

    def __init__(self, engine: LLMEngine, layout: RankLayout, leaders: Any,
                 device: torch.device) -> None:
        super().__init__(engine)
        self.leaders, self.device = leaders, device
        self.show_prefix = f"(replica {layout.replica}) "
        self.bar_title = (f"generate (dp={layout.dp})" if layout.tp == 1 else
                          f"generate (dp={layout.dp}, tp={layout.tp})")

    def leaders_sum(self, values: list[int]) -> list[int]:
        """``values`` summed over the replicas' leaders (a lone replica: as they are)."""
        if self.leaders is None:
            return values
        return allreduce_ints(values, self.device, group=self.leaders)

    def total(self, queued: int) -> int:
        (total,) = self.leaders_sum([queued])
        return total

    def results(self, finished: Callable[[], int], bar: RunProgress,
                feed: RequestFeed) -> Iterator[RequestOutput]:
        if self.leaders is None:  # a lone replica only updates its bar
            return super().results(finished, bar, feed)
        engine, st = self.engine, self.engine.stats

        def group_has_work() -> bool:
            # One all-reduce per step: whether any rank has work (the loop's end, the same
            # on every rank) plus the group's progress for rank 0's bar. Empty steps
            # without work while another replica has some. This replica's share of the
            # input is topped up first: an engine with records left to read has work.
            feed.top_up()
            unfinished, g_done, g_prompt, g_gen = self.leaders_sum(
                [int(engine.has_unfinished()), finished(), st.prompt_tokens,
                 st.generated_tokens])
            bar.update(g_done, g_prompt, g_gen)
            return bool(unfinished)

        return engine.drain(keep_going=group_has_work)


def dp_rank(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
            default_params: SamplingParams) -> int:
    """One rank of a DP ``deepinfer-generate`` run (spawned, or under torchrun); returns
    the run's exit status (the same on every rank). Raises ``RankFailedError`` when a
    collective fails."""
    device = select_device(args.device, info.local_rank)
    inputs, fmt = job_format(args, engine_args.model)
    return run_in_group(info, device, args.dp_timeout, _dp_body, info, args,
                        dataclasses.replace(engine_args, device=device), default_params, inputs,
                        fmt)


def _dp_body(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
            default_params: SamplingParams, inputs: JobInput, fmt: Any) -> int:
    rank0 = info.rank == 0
    cdev = comm_device(engine_args.device)
    tp = engine_args.tensor_parallel_size
    layout = RankLayout(info.rank, check_layout(args.dp, tp, torchrun_world_size()), tp)
    groups = make_groups(layout, args.dp_timeout)
    # Every rank indexes the input itself (one lazy pass); rank 0 alone touches the
    # output before the run (folds leftover parts, cuts a torn line), then tells the
    # others what is done so that all split the same pending records.
    index = InputIndex.of(inputs)
    payload: list[Any] = [None]
    if rank0:
        if fmt is not NATIVE:
            warn_other_models(index.models, args.input, engine_args.model)
        payload = [sorted(load_resume_state(args.output, index.order, fmt.final))]
    dist.broadcast_object_list(payload, src=0)
    done = set(payload[0])
    pending = (announce_resume(index, done, args.output) if rank0
               else index.pending_count(done))
    if not pending:
        return 0
    if not layout.leader:
        run_follower(engine_args, groups.tp)  # until the leader's engine closes
        dist.barrier()  # the part files are complete
        return _exit_status(0, cdev)
    # Round-robin share of the pending records, read lazily by this replica.
    mine = itertools.islice(pending_stream(inputs, done), layout.replica, None, layout.dp)
    share = len(range(layout.replica, pending, layout.dp))
    # Every leader builds an engine, even with no records: its scheduler must vote.
    engine = LLMEngine(engine_args, dp_group=groups.leaders, tp=groups.tp)
    target = ReplicaTarget(engine, layout, groups.leaders, cdev)
    # Created even when empty: rank 0 checks that it can see every replica's part file.
    with open(part_path(args.output, layout.replica), "a", encoding="utf-8") as out:
        requests = iter_requests(mine, default_params, args.chat, track=fmt.track,
                                 template_kwargs=args.chat_template_kwargs,
                                 loras=lora_requests(args.lora))
        mine_summary = run_requests(target, requests, out, fmt, show=args.show,
                                    progress=not args.no_progress and rank0,
                                    max_in_flight=max_in_flight(args, engine), total=share)
    engine.close()  # the followers leave their loop
    total = RunSummary.from_counts(target.leaders_sum(mine_summary.counts()),
                                   mine_summary.elapsed, mine_summary.model_defaults)
    dist.barrier()  # every part file is complete and closed
    if rank0:
        merge_rank_parts(args.output, index.order, layout.dp)
        print(total.format(), file=sys.stderr)
    # Nobody exits before the merge is over: torchrun stops all ranks when one exits 1.
    return _exit_status(1 if total.failed else 0, cdev)


def _exit_status(mine: int, device: torch.device) -> int:
    """Rank 0's exit status on every rank (a collective: also the run's last barrier)."""
    (status,) = allreduce_ints([mine], device, op=dist.ReduceOp.MAX)
    return status
