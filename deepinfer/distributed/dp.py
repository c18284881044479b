"""Data parallelism for ``deepinfer-generate``: one engine per replica, each over a
round-robin share of the pending records. A replica is one rank, or with ``--tp N`` a
tensor-parallel group of N ranks whose leader runs the engine (``distributed.tp``); a
``--tp N`` run alone is one replica.

Each replica appends what it finishes to its own part file next to the output
(``OUTPUT.part{replica}``). The schedulers' step-type votes go through the group of the
replicas' leaders. A replica with no work left keeps stepping with empty batches until
one all-reduce says that no replica has unfinished work; then rank 0 merges the output
and every part file into the output, in input order. Multi-node runs need the output
folder (and the input file) on a filesystem that every node sees at the same path.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch.distributed as dist

from deepinfer.distributed.ranks import (
    RankInfo,
    allreduce_ints,
    comm_device,
    merge_rank_parts,
    run_in_group,
    select_device,
    torchrun_world_size,
)
from deepinfer.distributed.tp import RankLayout, check_layout, make_groups
from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.parts import input_order, part_path
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.records import InputRecord, show_result, submit_records, write_record
from deepinfer.jobs.resume import load_resume_state, pending_records
from deepinfer.jobs.summary import RunSummary
from deepinfer.sampling.params import SamplingParams
from deepinfer.worker import run_follower


def dp_rank(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
            default_params: SamplingParams) -> int:
    """One rank of a DP ``deepinfer-generate`` run (spawned, or under torchrun); returns
    the run's exit status (the same on every rank). Raises ``RankFailedError`` when a
    collective fails."""
    from deepinfer.jobs.formats import open_job

    device = select_device(args.device, info.local_rank)
    inputs, fmt = open_job(args.input, getattr(args, "format", "auto"), engine_args.model)
    return run_in_group(info, device, args.dp_timeout, _dp_body, info, args,
                        dataclasses.replace(engine_args, device=device), default_params, inputs,
                        fmt)


def _dp_body(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
             default_params: SamplingParams, inputs: list[InputRecord], fmt: Any) -> int:
    rank0 = info.rank == 0
    cdev = comm_device(engine_args.device)
    tp = engine_args.tensor_parallel_size
    layout = RankLayout(info.rank, check_layout(args.dp, tp, torchrun_world_size()), tp)
    groups = make_groups(layout, args.dp_timeout)
    # Rank 0 alone touches the output before the run (folds leftover parts, cuts a torn
    # line), then tells the others what is done so that all split the same pending list.
    payload: list[Any] = [None]
    if rank0:
        payload = [sorted(load_resume_state(args.output, inputs, fmt.final))]
    dist.broadcast_object_list(payload, src=0)
    pending = pending_records(inputs, set(payload[0]), args.output, announce=rank0)
    if not pending:
        return 0
    if not layout.leader:
        run_follower(engine_args, groups.tp)  # until the leader's engine closes
        dist.barrier()  # the part files are complete
        return _exit_status(0, cdev)
    mine = pending[layout.replica::layout.dp]  # round-robin share
    leaders = groups.leaders

    def leaders_sum(values: list[int]) -> list[int]:
        # Over the replicas' leaders; a lone replica has nothing to add up.
        return values if leaders is None else allreduce_ints(values, cdev, group=leaders)

    # Every leader builds an engine, even with no records: its scheduler must vote.
    engine = LLMEngine(engine_args, dp_group=leaders, tp=groups.tp)
    st = engine.stats
    # Created even when empty: rank 0 checks that it can see every replica's part file.
    with open(part_path(args.output, layout.replica), "a", encoding="utf-8") as out:
        prompts, failed = submit_records(engine, mine, default_params, args.chat, out, fmt)
        (total_ok,) = leaders_sum([len(prompts)])
        bar = RunProgress(total_ok, _bar_title(layout), disable=args.no_progress or not rank0)
        finished = 0

        def group_has_work() -> bool:
            # One all-reduce per step: whether any rank has work (the loop's end, the same
            # on every rank) plus the group's progress for rank 0's bar.
            unfinished, g_done, g_prompt, g_gen = leaders_sum(
                [int(engine.has_unfinished()), finished, st.prompt_tokens,
                 st.generated_tokens])
            bar.update(g_done, g_prompt, g_gen)
            return bool(unfinished)

        # Empty steps without work while another replica has some; a lone replica (a
        # --tp run) only updates its bar.
        drain = (engine.drain(keep_going=group_has_work) if leaders is not None else
                 engine.drain(on_step=lambda: bar.update(finished, st.prompt_tokens,
                                                         st.generated_tokens)))
        unwritable = 0
        for res in drain:
            if not write_record(out, fmt.result(res)):
                unwritable += 1  # written as an error line instead: failed, as one engine
            finished += 1
            if args.show:
                show_result(res.request_id, prompts[res.request_id], res.outputs[0].text,
                            prefix=f"(replica {layout.replica}) ")
        bar.close()
    engine.close()  # the followers leave their loop
    elapsed = bar.elapsed()
    mine_summary = RunSummary.of_engine(engine, len(prompts) - unwritable,
                                        failed + unwritable, elapsed)
    total = RunSummary.from_counts(leaders_sum(mine_summary.counts()), elapsed)
    dist.barrier()  # every part file is complete and closed
    if rank0:
        merge_rank_parts(args.output, input_order(r.id for r in inputs), layout.dp)
        print(total.format(), file=sys.stderr)
    # Nobody exits before the merge is over: torchrun stops all ranks when one exits 1.
    return _exit_status(1 if total.failed else 0, cdev)


def _exit_status(mine: int, device) -> int:
    """Rank 0's exit status on every rank (a collective: also the run's last barrier)."""
    (status,) = allreduce_ints([mine], device, op=dist.ReduceOp.MAX)
    return status


def _bar_title(layout: RankLayout) -> str:
    if layout.tp == 1:
        return f"generate (dp={layout.dp})"
    return f"generate (dp={layout.dp}, tp={layout.tp})"
