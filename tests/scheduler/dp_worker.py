"""Worker for the multi-process DP tests (spawned; kept free of pytest imports)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def run_rank(rank: int, world: int, port: int, loads: list, cfg: dict, outdir: str) -> None:
    """One DP rank: its own scheduler, votes over a real gloo group.

    ``loads[rank]``: list of (arrival step, prompt length, max_tokens). Writes the
    per-step log ``[decode_step before the step, is_prompt, num seqs]`` and the
    finished sequences' output lengths to ``outdir/rank{rank}.json``."""
    torch.set_num_threads(1)
    from deepinfer.distributed.ranks import destroy_group
    from deepinfer_scheduler import Scheduler, SchedulerConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    s = None
    try:
        s = Scheduler(SchedulerConfig(**cfg), dp_group=dist.group.WORLD)
        pending = sorted(loads[rank])
        log = []
        done = {}
        flag = torch.zeros(1, dtype=torch.int64)
        step = 0
        while True:
            while pending and pending[0][0] <= step:
                arrive, plen, max_tokens = pending.pop(0)
                rid = f"r{rank}-{arrive}-{plen}-{len(done)}-{len(pending)}"
                s.add_request(rid, [(rank * 31 + i) % 97 for i in range(plen)], max_tokens)
            # The engine's loop: stop when no rank has (or will have) work.
            flag.fill_(1 if (s.has_unfinished() or pending) else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() == 0:
                break
            d = s.decode_step
            out = s.schedule()
            log.append([d, out.is_prompt, len(out.seqs)])
            for seq in s.update(out, [7] * out.num_samples):
                done[seq.request_id] = len(seq.output_token_ids)
            s.check_invariants()
            step += 1
            if step > 5000:
                raise RuntimeError("no progress")
        assert not s.has_unfinished_dp()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump({"log": log, "done": done, "usage": s.cache_usage()}, f)
    finally:
        del s  # the scheduler's voter holds the group: drop it before the teardown
        destroy_group()
