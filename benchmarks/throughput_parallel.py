"""The throughput workload over several processes, next to the single-engine run of
``bench_throughput.py``: data parallel (``--dp N``: round-robin shares over N ranks of
deepinfer.distributed's launcher) and disaggregated prefill/decode (``--pd P:D``:
``run_disaggregated``'s PROMPT and COMPLETION processes, KV handed off between them)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from throughput_workload import Workload


def run_deepinfer_pd(args: argparse.Namespace, wl: Workload, normal: dict) -> dict:
    """The same workload through ``run_disaggregated`` (P PROMPT + D COMPLETION processes,
    KV hand-off over torch.distributed), next to the NORMAL single-engine figures.

    ``seconds`` is the slowest rank's round loop (model loading and process start-up
    excluded, like the NORMAL run's timing after its warm-up; the PD ranks get no warm-up,
    which matters on CUDA); ``wall_seconds`` is the whole call, start-up included."""
    import tempfile

    from deepinfer import SamplingParams
    from deepinfer.distributed.pd import parse_pd
    from deepinfer.engine_args import EngineArgs
    from deepinfer.jobs.input_records import JobRequest
    from deepinfer.jobs.pd_job import run_disaggregated

    num_prompt, num_decode = parse_pd(args.pd)
    eargs = EngineArgs(model=args.model, dtype=args.dtype, device=args.device,
                       max_num_seqs=args.max_num_seqs, max_model_len=2 * args.max_len + 16)
    reqs = [JobRequest(str(i), prompt_token_ids=p,
                      params=SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pd.jsonl")
        t0 = time.perf_counter()
        stats = run_disaggregated(eargs, reqs, out, num_prompt, num_decode)
        wall = time.perf_counter() - t0
        with open(out) as f:
            records = [json.loads(line) for line in f]
    bad = [r for r in records if "error" in r]
    if bad:
        raise RuntimeError(f"PD run: {len(bad)} request(s) failed, e.g. {bad[0]['error']}")
    tokens = sum(len(r["outputs"][0]["token_ids"]) for r in records)
    seconds = max(s["elapsed"] for s in stats)
    result = {"pd": f"{num_prompt}:{num_decode}", "seconds": seconds, "wall_seconds": wall,
              "tokens": tokens, "tok_per_s": tokens / seconds,
              "vs_normal": tokens / seconds / normal["tok_per_s"],
              "handed_off": sum(s["handed_off"] for s in stats),
              "credit_waits": sum(s["credit_waits"] for s in stats),
              "rounds": max(s["rounds"] for s in stats), "per_rank": stats}
    if args.device == "cpu" or not torch.cuda.is_available():
        result["note"] = (
            f"CPU: {num_prompt + num_decode} processes share the {os.cpu_count()} cores "
            "(which other jobs may also use) that the NORMAL engine had to itself, every KV "
            "hand-off is a gloo copy through local TCP, and rounds are lock-step, so a decode "
            "step waits for its round's prefill step. Slower than NORMAL here is expected: "
            "disaggregation pays off with one GPU per rank, where prefill and decode stop "
            "competing for one device (that path is untested)")
    return result


def run_deepinfer_dp(args: argparse.Namespace, wl: Workload, one_rank_tok_s: float) -> dict:
    """The same workload split round-robin over ``args.dp`` ranks (deepinfer.distributed's
    launcher; one GPU per rank on CUDA, CPU processes with gloo otherwise)."""
    from deepinfer.distributed.ranks import spawn_ranks

    per_rank = spawn_ranks(_bench_rank, args.dp, (vars(args).copy(), wl))
    wall = max(r["seconds"] for r in per_rank)
    tokens = sum(r["tokens"] for r in per_rank)
    scaling = tokens / wall / one_rank_tok_s
    out = {"ranks": args.dp, "seconds": wall, "tokens": tokens, "tok_per_s": tokens / wall,
           "per_rank": per_rank, "scaling_vs_1_rank": scaling}
    if per_rank[0]["device_type"] == "cpu":
        out["note"] = (
            f"CPU: {args.dp} ranks x {per_rank[0]['threads']} thread(s) vs 1 rank x "
            f"{torch.get_num_threads()} thread(s) on {os.cpu_count()} cores that other jobs "
            "may share; the ratio measures torch CPU threading and contention on this "
            "machine as much as DP (compare with OMP_NUM_THREADS=1 set for both). DP is "
            "meant for one GPU per rank")
    return out


def _bench_rank(info, args: dict, wl: Workload) -> list[dict] | None:
    """One DP rank of the throughput run: its round-robin share, timed after a warm-up;
    rank 0 returns every rank's figures."""
    import torch.distributed as dist

    from deepinfer import SamplingParams
    from deepinfer.distributed.ranks import init_distributed, select_device
    from deepinfer.engine import LLMEngine
    from deepinfer.engine_args import EngineArgs

    device = select_device(args["device"], info.local_rank)
    init_distributed(info, device, timeout_s=600)
    engine = LLMEngine(EngineArgs(model=args["model"], dtype=args["dtype"], device=device,
                                  max_num_seqs=args["max_num_seqs"],
                                  max_model_len=2 * args["max_len"] + 16),
                       dp_group=dist.group.WORLD)

    def drain(engine: LLMEngine) -> float:
        """Step until no rank has work; seconds until this rank's own work was done."""
        t0 = time.perf_counter()
        mine = t0
        while engine.scheduler.has_unfinished_dp():
            engine.step()
            if engine.has_unfinished():
                mine = time.perf_counter()
        return mine - t0

    engine.add_request("warmup", None, wl.prompts[0],
                       SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    dist.barrier()
    for i in range(info.rank, len(wl.prompts), info.world_size):
        engine.add_request(str(i), None, wl.prompts[i],
                           SamplingParams(temperature=0.0, max_tokens=wl.max_tokens[i],
                                          ignore_eos=True))
    tokens0 = engine.stats.generated_tokens
    t0 = time.perf_counter()
    own = drain(engine)
    wall = time.perf_counter() - t0
    tokens = engine.stats.generated_tokens - tokens0
    mine = {"rank": info.rank, "seconds": wall, "busy_seconds": own, "tokens": tokens,
            "tok_per_s": tokens / wall, "device_type": engine.device.type,
            "threads": torch.get_num_threads()}
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    del engine  # it holds the group: free both before exit (see deepinfer.distributed.ranks)
    gc.collect()
    dist.destroy_process_group()
    return everyone if info.rank == 0 else None
