"""Leader -> followers step hand-off of a TP group: gloo broadcast vs shared memory.

The issue asks "one broadcast of a flat buffer, or shared memory on one node: measure
which is cheaper". Per step size, this measures the latency from "the leader starts
sending" to "every follower holds the step" (a rebuilt ``LaunchBatch``), with 1 leader +
1 follower and 1 leader + 3 followers, for two channels:

- gloo: the engine's real ``deepinfer.step_channel.StepChannel`` (one broadcast of a
  fixed 64 KiB int64 buffer, header + payload, when the step fits; else a second one for
  the payload) over a gloo default group on 127.0.0.1, between spawned processes. The
  leader's step is a real ``LaunchBatch`` (the dtypes of ``scheduler/batch.py``) in a
  scheduler-output-like object.
- shm: ``ShmStepChannel`` (``shm_step_channel.py``, whose docstring gives the
  synchronization), over one ``multiprocessing.shared_memory`` segment: the leader
  writes the header and the payload (StepChannel's int64 layout) into it and bumps a
  step counter; each follower spin-polls the counter, copies the step out, rebuilds the
  ``LaunchBatch`` as ``StepChannel.recv`` does, and acks in its own counter.

Both channels run in lockstep, separated the same way: the leader starts step i only
once every follower has acknowledged step i - 1 (shm: the channel's own acks; gloo: the
same ack counters in a second segment, ``AckFence``, since StepChannel has none), and
the followers acknowledge only after the benchmark's check of the step, so neither the
separation nor the check is inside the timed window. Per step size the two channels run
one after the other in the same processes (interleaved, so that a change in the
machine's load hits both alike). Clocks: ``CLOCK_MONOTONIC`` is one clock for every
process of the machine, so the leader's start stamp and the followers' "holds the step"
stamps are compared directly; a step's latency is the latest follower's stamp minus the
leader's. Also reported: the leader's own send cost (its ``send_step`` call; shm: the
write + counter store, the ack wait excluded since in an engine the followers ack long
before the next step is scheduled). Every follower checks every step it receives against
the leader's tensors (values and dtypes; the leader stamps the step index into
``input_ids[0]``, so a stale or torn step is caught).

    python benchmarks/bench_step_broadcast.py                 # print the tables
    python benchmarks/bench_step_broadcast.py --save          # + results/step-broadcast-cpu.*
    python benchmarks/bench_step_broadcast.py --iters 500 --followers 1

Every rank runs torch with 1 thread. On a machine with fewer cores than ranks the
spinning followers (and gloo's helper threads) compete with the leader for the cores:
see the notes written into the .md.

The steps themselves (sizes, the leader's step, the followers' check) are
``step_fixtures.py``'s. The ``test_`` function at the bottom runs one small case of each
channel and checks the follower's steps against the leader's (no timing assertion).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import socket
import sys
import time
from dataclasses import asdict
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch
from results_meta import git_commit, utc_now  # noqa: E402
from shm_step_channel import (  # noqa: E402
    MAX_FOLLOWERS,
    TIMEOUT_S,
    AckFence,
    ShmStepChannel,
    now_ns,
)
from step_broadcast_report import notes, table_lines  # noqa: E402
from step_fixtures import (  # noqa: E402
    STEP_FIELDS,
    Shape,
    default_shapes,
    make_step,
    step_arrays,
    step_mismatch,
    step_seed,
)
from tree_state import commit_label, uncommitted_source  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------- the ranks
def _lockstep(ch: Any, channel: str, rank: int, fence: AckFence, shape: Shape,
              iters: int, warmup: int) -> dict[str, Any]:
    """``warmup + iters`` steps of ``shape`` through ``ch``: the leader's start and send-end
    stamps, or a follower's "holds the step" stamps and its checks."""
    want = make_step(shape, seed=step_seed(shape))
    n = warmup + iters
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    bad: list[str] = []
    checked = 0
    last = None
    for i in range(n):
        want.batch.input_ids[0] = i
        if rank == 0:
            if channel == "shm":
                ch.wait_acks()
            else:
                fence.wait()
            start[i] = now_ns()
            ch.send_step(want, False)
            end[i] = now_ns()
        else:
            step = ch.recv()
            end[i] = now_ns()
            if step is None:
                raise RuntimeError("stop before the last step")
            why = step_mismatch(step, want)
            checked += 1
            if why is not None and len(bad) < 5:
                bad.append(f"step {i}: {why}")
            if channel == "shm":
                ch.ack()
            else:
                fence.ack(rank - 1)
            last = step
    return {"start": start, "end": end, "checked": checked, "bad": bad,
            "last": step_arrays(last) if last is not None else None}


def _rank_main(rank: int, world: int, port: str, shm_names: tuple[str, ...],
               channels: list[str], shapes: list[Shape], iters: int, warmup: int,
               results: Any) -> None:
    """One rank of a group: per shape, each channel in turn (interleaved, so that a change
    in the machine's load hits both alike). Puts ``(rank, {channel: {shape name:
    record}}, error)`` on ``results``."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {c: {} for c in channels}
    try:
        import torch.distributed as dist

        from deepinfer.step_channel import StepChannel

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=TIMEOUT_S))
        # Spawned ranks share the parent's resource tracker, where the segments are
        # already registered; the parent unlinks them.
        shm, fence_shm = (shared_memory.SharedMemory(name=n) for n in shm_names)
        fence = AckFence(fence_shm, world - 1)
        shm_ch = ShmStepChannel(shm, world - 1, None if rank == 0 else rank - 1)
        ends = {"gloo": StepChannel(dist.group.WORLD, dist.group.WORLD, 0), "shm": shm_ch}
        for shape in shapes:
            for c in channels:
                out[c][shape.name] = _lockstep(ends[c], c, rank, fence, shape, iters, warmup)
        for c in channels:
            ch = ends[c]
            if rank == 0:
                if c == "shm":
                    ch.wait_acks()
                ch.send_stop()
            elif ch.recv() is not None:
                raise RuntimeError(f"{c}: a step after the last one")
        dist.barrier()
        dist.destroy_process_group()
        del ends, shm_ch, fence
        shm.close()
        fence_shm.close()
        results.put((rank, out, None))
    except BaseException as e:  # report it: the parent raises
        results.put((rank, out, f"{type(e).__name__}: {e}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(followers: int, shapes: list[Shape], iters: int, warmup: int,
              channels: tuple[str, ...] = ("gloo", "shm"),
              timeout_s: float = 300.0) -> dict[str, dict[int, Any]]:
    """Spawn 1 + ``followers`` ranks, run every shape through every channel; the ranks'
    records by channel, then rank."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    world = 1 + followers
    words = max(s.payload_words for s in shapes)
    segments = [shared_memory.SharedMemory(create=True, size=n)
                for n in (ShmStepChannel.nbytes(words), AckFence.nbytes())]
    for seg in segments:
        np.ndarray((seg.size // 8,), dtype=np.int64, buffer=seg.buf)[:] = 0
    results = ctx.Queue()
    port = str(_free_port())
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, tuple(seg.name for seg in segments),
                               list(channels), shapes, iters, warmup, results))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world:
            try:
                rank, rec, err = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                silent = sorted(set(range(world)) - set(got))
                raise TimeoutError(f"x{followers}: ranks {silent} silent after "
                                   f"{timeout_s:.0f} s") from None
            if err is not None:
                raise RuntimeError(f"x{followers} rank {rank}: {err}")
            got[rank] = rec
        for p in procs:
            p.join(30)
        return {c: {r: got[r][c] for r in got} for c in channels}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for seg in segments:
            seg.close()
            seg.unlink()


def summarize(ranks: dict[int, Any], shapes: list[Shape], warmup: int) -> dict[str, Any]:
    """Per shape: latency (latest follower's stamp - leader's start) and leader send cost,
    median / p90 in microseconds over the timed steps; the followers' check results."""
    rows = {}
    for s in shapes:
        lead = ranks[0][s.name]
        fol = [ranks[r][s.name] for r in sorted(ranks) if r != 0]
        t0 = lead["start"][warmup:]
        lat = (np.max([f["end"][warmup:] for f in fol], axis=0) - t0) / 1e3
        send = (lead["end"][warmup:] - t0) / 1e3
        rows[s.name] = {
            "median_us": float(np.median(lat)), "p90_us": float(np.percentile(lat, 90)),
            "send_median_us": float(np.median(send)),
            "send_p90_us": float(np.percentile(send, 90)),
            "steps_checked": [f["checked"] for f in fol],
            "mismatches": [b for f in fol for b in f["bad"]]}
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring): run, print the tables, and with
    ``--save`` write them to ``results/step-broadcast-cpu.{json,md}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--followers", default="1,3", help="comma-separated follower counts")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/step-broadcast-cpu.{json,md}")
    args = ap.parse_args(argv)
    shapes = default_shapes()
    counts = [int(x) for x in args.followers.split(",")]
    if not all(1 <= n <= MAX_FOLLOWERS for n in counts):
        ap.error(f"follower counts are 1 to {MAX_FOLLOWERS}")
    runs = {}
    load_start, date = os.getloadavg(), utc_now()
    t_all = time.monotonic()
    for nf in counts:
        t = time.monotonic()
        by_channel = run_group(nf, shapes, args.iters, args.warmup)
        for channel, ranks in by_channel.items():
            runs[f"{channel} x{nf}"] = rows = summarize(ranks, shapes, args.warmup)
            bad = {k: v["mismatches"] for k, v in rows.items() if v["mismatches"]}
            if bad:
                raise RuntimeError(f"{channel} x{nf}: follower steps differ: {bad}")
        print(f"1 + {nf}: {time.monotonic() - t:.1f} s", flush=True)
    wall = time.monotonic() - t_all
    data = {"commit": git_commit(),
            # Work in progress: the source that ran is HEAD plus these (see tree_state).
            "uncommitted_source": uncommitted_source(), "date": date, "device": "cpu",
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads_per_rank": 1, "iters": args.iters, "warmup": args.warmup,
            "followers": counts, "shapes": [dict(asdict(s), payload_words=s.payload_words)
                                            for s in shapes],
            "runs": runs, "wall_s": round(wall, 1),
            "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
            "latency": "leader's start stamp -> latest follower's 'holds the rebuilt "
                       "LaunchBatch' stamp, CLOCK_MONOTONIC, lockstep steps",
            "send": "leader's send call alone (gloo: StepChannel.send_step; shm: header "
                    "+ payload write + counter store, ack wait excluded)",
            "shm_sync": "leader waits for every follower's ack == step counter, writes "
                        "header + payload, stores counter + 1; followers spin-poll the "
                        "counter with os.sched_yield(), copy out, rebuild, ack"}
    print("\n".join(table_lines(data) + notes(data)[:len(counts)]))
    print(f"all runs: {wall:.0f} s")
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "step-broadcast-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
        head = [f"# Step hand-off, leader -> TP followers: gloo broadcast vs shared memory "
                f"(CPU, {data['cpus']} cores)", "",
                f"commit {commit_label(data['commit'], data['uncommitted_source'])}, "
                f"{data['date']}, {data['machine']}, torch "
                f"{data['torch']}, `python benchmarks/bench_step_broadcast.py --save` "
                f"({args.iters} timed steps per row after {args.warmup} warm-up, "
                f"{wall:.0f} s in all)", ""]
        (RESULTS / "step-broadcast-cpu.md").write_text(
            "\n".join(head + table_lines(data) + notes(data)) + "\n")
    return 0


def test_step_broadcast_smoke() -> None:
    """One small step size through each channel, 1 leader + 1 follower: the follower
    checked every step it received and the last one equals the leader's tensors (no
    timing assertion)."""
    shapes = [Shape("small prefill", t=24, b=3, w=4, s=3, max_q=8, is_prompt=True,
                    n_clone=2)]
    iters, warmup = 20, 2
    for channel, ranks in run_group(1, shapes, iters, warmup, timeout_s=60).items():
        rec = ranks[1][shapes[0].name]
        assert rec["checked"] == iters + warmup and rec["bad"] == [], (channel, rec["bad"])
        want = make_step(shapes[0], seed=step_seed(shapes[0]))
        want.batch.input_ids[0] = iters + warmup - 1
        got = rec["last"]
        for f in STEP_FIELDS:
            a, b = got[f], getattr(want.batch, f).numpy()
            assert a.dtype == b.dtype and np.array_equal(a, b), (channel, f)
        assert got["clone_blocks"].dtype == np.int64
        assert np.array_equal(got["clone_blocks"], want.clone_blocks.numpy()), channel
        assert got["is_prompt"] is True and got["num_tokens"] == 24
        assert (got["max_query_len"], got["max_seq_len"]) == (
            want.batch.max_query_len, want.batch.max_seq_len)
        assert summarize(ranks, shapes, warmup)[shapes[0].name]["median_us"] > 0
    # The followers' per-step check catches a wrong value, and a wrong dtype.
    want = make_step(shapes[0], seed=step_seed(shapes[0]))
    for f, change in (("slot_mapping", lambda t: t + (t == t[-1])),
                      ("block_tables", lambda t: t.long())):
        other = make_step(shapes[0], seed=step_seed(shapes[0]))
        setattr(other.batch, f, change(getattr(other.batch, f)))
        assert step_mismatch(other, want) is not None and step_mismatch(want, want) is None


if __name__ == "__main__":
    sys.exit(main())
