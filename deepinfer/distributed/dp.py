"""Data parallelism for ``deepinfer-generate``: one engine per rank, each over a
round-robin share of the pending records.

Each rank appends what it finishes to its own part file next to the output
(``OUTPUT.part{rank}``). The schedulers' step-type votes go through the default
``torch.distributed`` group. A rank with no work left keeps stepping with empty batches
until one all-reduce says that no rank has unfinished work; then rank 0 merges the output
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
)
from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.parts import input_order, part_path
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.records import InputRecord, show_result, submit_records, write_record
from deepinfer.jobs.resume import load_resume_state, pending_records
from deepinfer.jobs.summary import RunSummary
from deepinfer.sampling_params import SamplingParams


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
    # Rank 0 alone touches the output before the run (folds leftover parts, cuts a torn
    # line), then tells the others what is done so that all split the same pending list.
    payload: list[Any] = [None]
    if rank0:
        payload = [sorted(load_resume_state(args.output, inputs, fmt.final))]
    dist.broadcast_object_list(payload, src=0)
    pending = pending_records(inputs, set(payload[0]), args.output, announce=rank0)
    if not pending:
        return 0
    mine = pending[info.rank::info.world_size]  # round-robin share

    # Every rank builds an engine, even with no records: its scheduler must vote.
    engine = LLMEngine(engine_args, dp_group=dist.group.WORLD)
    st = engine.stats
    # Created even when empty: rank 0 checks that it can see every rank's part file.
    with open(part_path(args.output, info.rank), "a", encoding="utf-8") as out:
        prompts, failed = submit_records(engine, mine, default_params, args.chat, out, fmt)
        (total_ok,) = allreduce_ints([len(prompts)], cdev)
        bar = RunProgress(total_ok, f"generate (dp={info.world_size})",
                          disable=args.no_progress or not rank0)
        finished = 0

        def group_has_work() -> bool:
            # One all-reduce per step: whether any rank has work (the loop's end, the same
            # on every rank) plus the group's progress for rank 0's bar.
            unfinished, g_done, g_prompt, g_gen = allreduce_ints(
                [int(engine.has_unfinished()), finished, st.prompt_tokens,
                 st.generated_tokens], cdev)
            bar.update(g_done, g_prompt, g_gen)
            return bool(unfinished)

        for res in engine.drain(keep_going=group_has_work):  # empty steps without work
            write_record(out, fmt.result(res))
            finished += 1
            if args.show:
                show_result(res.request_id, prompts[res.request_id], res.outputs[0].text,
                            prefix=f"(rank {info.rank}) ")
        bar.close()
    elapsed = bar.elapsed()
    mine_summary = RunSummary.of_engine(engine, len(prompts), failed, elapsed)
    total = RunSummary.from_counts(allreduce_ints(mine_summary.counts(), cdev), elapsed)
    dist.barrier()  # every part file is complete and closed
    if rank0:
        merge_rank_parts(args.output, input_order(r.id for r in inputs), info.world_size)
        print(total.format(), file=sys.stderr)
    # Nobody exits before the merge is over: torchrun stops all ranks when one exits 1.
    dist.barrier()
    return 1 if total.failed else 0
