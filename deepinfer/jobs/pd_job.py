"""Disaggregated prefill/decode jobs: ``run_disaggregated`` (library: spawn the P + D
ranks on this machine, merge their records) and ``pd_job_rank`` (one rank of a
``deepinfer-generate --pd P:D`` run: the records, error records, resume, exit status and
summary of a one-engine run, spawned or under torchrun).

Each rank runs the one loop (``run_loop``) on its engine, its results coming from the PD
rounds (``distributed.pd.PDRounds.drain``), and appends them to its part file; rank 0
merges the part files in input order at the end."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.distributed as dist

from deepinfer.distributed.pd import (
    PDOptions,
    PDRounds,
    check_pd_params,
    pd_engine,
    split_requests,
)
from deepinfer.distributed.ranks import (
    RankInfo,
    check_gpu_count,
    run_in_group,
    select_device,
    spawn_ranks,
)
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.formats import JobInput, job_format, warn_other_models
from deepinfer.jobs.input_index import InputIndex, pending_stream
from deepinfer.jobs.input_records import JobRequest, iter_requests
from deepinfer.jobs.output_records import NATIVE, show_result
from deepinfer.jobs.parts import input_order, merge_outputs, merge_rank_parts, part_path
from deepinfer.jobs.progress import RunProgress
from deepinfer.jobs.resume import announce_resume, load_resume_state
from deepinfer.jobs.resume_keys import openai_success
from deepinfer.jobs.run_loop import RequestFeed, RunTarget, max_in_flight, run_requests
from deepinfer.jobs.summary import RunSummary
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams


class PDRankTarget(RunTarget):
    """The engine of one PD rank; its finished requests come from the rounds."""

    def __init__(self, rounds: PDRounds) -> None:
        super().__init__(rounds.engine)
        self.rounds = rounds
        self.feed: RequestFeed | None = None

    def results(self, finished: Callable[[], int], bar: RunProgress,
                feed: RequestFeed) -> Iterator[RequestOutput]:
        self.feed = feed  # its peak in flight goes into the rank's counters
        return self.rounds.drain(feed)


def run_pd_rank(info: RankInfo, device: str, num_prompt: int, prompt_args: EngineArgs,
                decode_args: EngineArgs, requests: Iterable[JobRequest], output_path: str,
                options: PDOptions, fmt: Any = NATIVE,
                stream_args: argparse.Namespace | None = None) -> dict[str, Any]:
    """One rank's part of a disaggregated run, inside an initialised default group: build
    this rank's engine, run the rounds to the end, return its counters (the rounds', the
    ``RunSummary`` fields, and ``errors``: its error lines). ``requests``: this rank's own
    (empty on a COMPLETION rank), admitted all at once, or with ``stream_args`` (the
    CLI's) read lazily and at most ``max_in_flight(stream_args, engine)`` held at a time:
    waiting, prefilling or waiting for a hand-off. Records go to this rank's part file
    of ``output_path``."""
    engine = pd_engine(info.rank, num_prompt, prompt_args, decode_args, device)
    rounds = PDRounds(engine, info.rank, info.world_size, num_prompt, device, options)
    bound = max_in_flight(stream_args, engine) if stream_args is not None else None
    with open(part_path(output_path, info.rank), "a", encoding="utf-8") as out:
        rounds.setup()
        # No bar: the ranks' loops run in lock-step, and --show prints after the merge.
        target = PDRankTarget(rounds)
        summary = run_requests(target, requests if rounds.is_prompt else [], out, fmt,
                               progress=False, max_in_flight=bound)
    counters = {k: v for k, v in dataclasses.asdict(summary).items() if k != "failed"}
    return {**rounds.stats, **counters, "errors": summary.failed,
            "peak_in_flight": target.feed.peak_in_flight if target.feed else 0}


# ====================================================================== library
def pd_rank(info: RankInfo, num_prompt: int, prompt_args: EngineArgs,
            decode_args: EngineArgs, requests: list[list[JobRequest]], output_path: str,
            options: PDOptions) -> list[dict[str, Any]]:
    """One rank of ``run_disaggregated``: appends its records to
    ``part_path(output_path, rank)``; returns every rank's counters (gathered, in rank
    order). ``requests[r]``: the requests of PROMPT rank r."""
    is_prompt = info.rank < num_prompt
    device = select_device((prompt_args if is_prompt else decode_args).device,
                           info.local_rank)  # one GPU per rank on CUDA

    def body() -> list[dict[str, Any]]:
        own = run_pd_rank(info, device, num_prompt, prompt_args, decode_args,
                          requests[info.rank], output_path, options)
        stats: list[dict[str, Any]] = [{} for _ in range(info.world_size)]
        dist.all_gather_object(stats, own)
        return stats

    return run_in_group(info, device, options.timeout_s, body)


def run_disaggregated(engine_args: EngineArgs, requests: list[JobRequest], output_path: str,
                      num_prompt: int, num_decode: int, *,
                      decode_args: EngineArgs | None = None,
                      options: PDOptions | None = None,
                      order: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Run ``requests`` on ``num_prompt`` PROMPT + ``num_decode`` COMPLETION processes on
    this machine and merge one output record per request into ``output_path`` in request
    order (the format of ``deepinfer-generate``). ``decode_args``: engine options of the
    COMPLETION ranks (default ``engine_args``). ``order``: position of each id in the
    merged file (default: request order; records already in ``output_path`` whose id is
    not in it stay, last). Returns the per-rank counters. Requests go round-robin to the
    PROMPT ranks; on CUDA each rank gets its own GPU (P + D GPUs needed). Raises
    ``ValueError`` for bad options and ``RankFailedError`` when a rank fails."""
    if num_prompt < 1 or num_decode < 1:
        raise ValueError("run_disaggregated: need at least one prompt and one decode rank")
    decode_args = decode_args or engine_args
    if engine_args.block_size != decode_args.block_size:
        raise ValueError("--pd: prompt and decode ranks need the same block_size")
    engine_args.validate()
    decode_args.validate()
    world = num_prompt + num_decode
    check_gpu_count(engine_args.device, world, f"--pd {num_prompt}:{num_decode}")
    for r in requests:
        check_pd_params(r.request_id, r.params)
    per_rank = split_requests(requests, num_prompt, world)
    options = options or PDOptions()
    if order is None:
        order = input_order(r.request_id for r in requests)
    stats = spawn_ranks(pd_rank, world, (num_prompt, engine_args, decode_args, per_rank,
                                         output_path, options))
    merge_outputs(output_path, order, [part_path(output_path, r) for r in range(world)])
    return stats


# ====================================================================== the CLI
def pd_job_rank(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
                default_params: SamplingParams, num_prompt: int) -> int:
    """One process of a ``deepinfer-generate --pd`` run (spawned or under torchrun).
    Rank 0 alone prepares the output (resume, early error records) and sends the requests
    to all; after the rounds it merges the part files and reports. Returns the run's exit
    status, the same on every rank. Raises ``RankFailedError`` when a rank fails."""
    device = select_device(args.device, info.local_rank)
    return run_in_group(info, device, args.dp_timeout, _pd_job_body, info, args,
                        engine_args, default_params, num_prompt, device)


def _pd_job_body(info: RankInfo, args: argparse.Namespace, engine_args: EngineArgs,
                default_params: SamplingParams, num_prompt: int, device: str) -> int:
    rank0 = info.rank == 0
    inputs, fmt = job_format(args, engine_args.model)
    # Rank 0 alone indexes the input and touches the output before the run (folds
    # leftover parts, cuts a torn line), then tells the others what is done; each PROMPT
    # rank then reads its round-robin share of the pending records lazily.
    payload: list[Any] = [None]
    index = None
    if rank0:
        index = InputIndex.of(inputs)
        if fmt is not NATIVE:
            warn_other_models(index.models, args.input, engine_args.model)
        done = load_resume_state(args.output, index.order, fmt.final)
        payload = [(sorted(done), announce_resume(index, done, args.output))]
    dist.broadcast_object_list(payload, src=0)
    done_ids, pending = payload[0]
    if not pending:
        return 0
    done = set(done_ids)
    requests: Iterable[JobRequest] = ()
    if info.rank < num_prompt:
        # Records that fail by themselves (bad line, sampling values, n > 1) become
        # error lines of the rank that reads them; an over-long prompt is refused by its
        # engine's admission, fitted to the decode side.
        mine = itertools.islice(pending_stream(inputs, done), info.rank, None, num_prompt)
        requests = iter_requests(mine, default_params, args.chat, check=check_pd_params,
                                 track=fmt.track, template_kwargs=args.chat_template_kwargs)
    own = run_pd_rank(info, device, num_prompt, engine_args, engine_args, requests,
                      args.output, PDOptions(timeout_s=args.dp_timeout), fmt,
                      stream_args=args)
    stats: list[dict[str, Any]] = [{} for _ in range(info.world_size)]
    # Also the point after which every part file is complete and closed.
    dist.all_gather_object(stats, own)
    if rank0:
        merge_rank_parts(args.output, index.order, info.world_size)
        _report(args, stats, lambda: _shown_prompts(inputs, done, default_params, args))
    # Nobody exits before the merge is over: torchrun stops all ranks when one exits.
    dist.barrier()
    return 1 if sum(s["errors"] for s in stats) else 0


def _shown_prompts(inputs: JobInput, done: set[str], default_params: SamplingParams,
                   args: argparse.Namespace) -> dict[str, Any]:
    """The shown prompt of each record this run ran, read again from the input (for
    ``--show`` after the merge)."""
    return {r.request_id: r.shown for r in iter_requests(
        pending_stream(inputs, done), default_params, args.chat,
        template_kwargs=args.chat_template_kwargs) if r.error is None}


def _report(args: argparse.Namespace, stats: list[dict[str, Any]],
            shown: Callable[[], dict[str, Any]]) -> None:
    """The summary of a PD run (summed over the ranks; time: the slowest rank's rounds,
    model loading excluded as in a one-engine run) and ``--show`` (``shown()``: the
    prompt of each request by id)."""
    total = RunSummary.sum_over([RunSummary.from_dict(s) for s in stats])
    # A PROMPT rank counts each request it admitted as ok; the rank that writes a line it
    # could not counts it back: the sum is right.
    total.num_ok = sum(s["num_ok"] for s in stats)
    total.failed = sum(s["errors"] for s in stats)
    if args.show and total.num_ok + total.failed:
        _show_merged(args.output, shown())
    print(total.format(), file=sys.stderr)
    print(f"pd: {sum(s['role'] == 'prompt' for s in stats)} prompt + "
          f"{sum(s['role'] == 'completion' for s in stats)} completion ranks, "
          f"{sum(s['handed_off'] for s in stats)} sequences handed off in "
          f"{max(s['rounds'] for s in stats)} rounds, "
          f"{sum(s['credit_waits'] for s in stats)} rounds waiting for decode credits, "
          f"at most {max(s['peak_in_flight'] for s in stats)} requests held by a prompt "
          "rank", file=sys.stderr)


def _show_merged(output: str, prompts: dict[str, Any]) -> None:
    """``--show`` for a PD run: results are printed once merged (the ranks write part
    files; no process sees them as they finish)."""
    with open(output, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            text = _first_text(rec)
            if rec["id"] in prompts and text is not None:
                show_result(rec["id"], prompts[rec["id"]], text)


def _first_text(line: dict[str, Any]) -> str | None:
    """The text of an output line's first completion, what ``--show`` prints of a result
    (``RequestOutput.outputs[0].text``): a native line's ``outputs[0].text``, or an OpenAI
    batch line's first choice (``text``, or a chat ``message.content``). None for an error
    line."""
    if "outputs" in line:
        return line["outputs"][0]["text"]
    if not openai_success(line):
        return None
    choice = line["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
