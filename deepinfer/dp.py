"""Data parallelism for ``deepinfer-generate``: rank setup, launcher, per-rank loop, merge.

Each rank runs its own ``LLMEngine`` over a round-robin share of the pending records and
appends what it finishes to its own part file next to the output (``OUTPUT.part{rank}``).
The scheduler's step-type votes go through the default ``torch.distributed`` group (NCCL
on CUDA, one GPU per rank; gloo on CPU). A rank with no work left keeps stepping with empty
batches until one all-reduce says that no rank has unfinished work; then rank 0 merges the
output and every part file into the output, in input order.

Two ways in, same code:
- ``deepinfer-generate --dp N`` spawns N ranks on this machine (``spawn_ranks``);
- ``torchrun ... -m deepinfer.generate ...`` starts the ranks itself (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment): each joins the group.

Multi-node runs need the output folder (and the input file) on a filesystem that every
node sees at the same path: rank 0 reads the other ranks' part files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import glob
import hashlib
import json
import os
import pickle
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Exit status of a run in which a rank died or a collective failed (1: records failed).
EXIT_RANK_FAILED = 3


class RankFailedError(RuntimeError):
    """A rank died, raised, or lost contact with the group."""

    def __init__(self, message: str, rank: int | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the DP group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls) -> RankInfo:
        """The torchrun variables (LOCAL_* default to a single node)."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def torchrun_world_size() -> int:
    """WORLD_SIZE when launched by torchrun (or an equivalent launcher), else 0."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 0


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the rendezvous of a local ``--dp N``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- rank setup
def select_device(requested: str, local_rank: int) -> str:
    """One GPU per rank on CUDA (GPU ``LOCAL_RANK``), else the requested CPU device."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise RankFailedError(
                f"rank with LOCAL_RANK={local_rank} has no GPU: "
                f"{torch.cuda.device_count()} visible on this node")
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return requested


def init_distributed(info: RankInfo, device: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the default group (env:// rendezvous: MASTER_ADDR/MASTER_PORT).

    ``timeout_s`` bounds every collective: a rank that stops answering makes the others
    fail after it instead of hanging (a dead peer is usually reported sooner by gloo).
    """
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one machine would otherwise each start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)  # binds the communicator to our GPU
    dist.init_process_group(backend, init_method="env://", rank=info.rank,
                            world_size=info.world_size,
                            timeout=dt.timedelta(seconds=timeout_s), **kwargs)
    return dist.group.WORLD


def _comm_device(device: str) -> torch.device:
    """Where collective tensors live: the GPU for NCCL, the CPU for gloo."""
    return torch.device(device) if device.startswith("cuda") else torch.device("cpu")


def allreduce_ints(values: list[int], device: torch.device,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


# ---------------------------------------------------------------------------- launcher
def _spawn_entry(local_rank: int, fn: Callable[..., Any], nprocs: int, port: int,
                 result_queue, fn_args: tuple) -> None:
    """A spawned rank: the torchrun environment, then ``fn(info, *fn_args)``."""
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = fn(RankInfo(local_rank, nprocs, local_rank, nprocs), *fn_args)
    if local_rank == 0:
        result_queue.put(result)  # SimpleQueue: written to the pipe before put returns
    # Skip interpreter teardown: its records are flushed and closed, and gloo's worker
    # threads can abort a process whose C++ state is destroyed at exit (a rare SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], nprocs: int, fn_args: tuple = ()) -> Any:
    """Run ``fn(info, *fn_args)`` in ``nprocs`` spawned processes; rank 0's return value.

    ``fn`` must be a module-level function (it is pickled by reference). When a rank
    fails, the others are stopped and ``RankFailedError`` names the rank that failed
    first and its exit code. A rank that only lost contact with a failed peer should exit
    with ``EXIT_RANK_FAILED``: it is then not blamed when the root cause is known.
    """
    import multiprocessing.connection as mpc

    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    pctx = mp.start_processes(_spawn_entry, args=(fn, nprocs, free_port(), results, fn_args),
                              nprocs=nprocs, join=False, start_method="spawn")
    procs = pctx.processes
    alive = {p.sentinel: i for i, p in enumerate(procs)}
    failed: list[int] = []

    def reap(timeout: float) -> None:
        for sentinel in mpc.wait(list(alive), timeout=timeout):
            i = alive.pop(sentinel)
            procs[i].join()
            if procs[i].exitcode != 0:
                failed.append(i)

    try:
        while alive and not failed:
            reap(1.0)
        # The root cause and the ranks that saw its connection close fail within
        # milliseconds of each other: collect them before choosing whom to blame.
        deadline = time.monotonic() + 2.0
        while alive and failed and time.monotonic() < deadline:
            reap(max(deadline - time.monotonic(), 0.0))
    finally:
        _stop(procs)
    if not failed:
        return None if results.empty() else results.get()
    root = next((i for i in failed if procs[i].exitcode != EXIT_RANK_FAILED), failed[0])
    code = procs[root].exitcode
    what = f"rank {root} exited with code {code}"
    if code < 0:
        what += f" ({signal.Signals(-code).name})"
    trace = _child_traceback(pctx, root)
    if trace:
        what += f": {trace.strip().splitlines()[-1]}"
    raise RankFailedError(what, root, code)


def _stop(procs) -> None:
    """SIGTERM the ranks still running, then SIGKILL those that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join()


def _child_traceback(pctx, index: int) -> str | None:
    """The traceback torch's spawn wrapper saved for a rank that raised, if any."""
    path = getattr(pctx, "error_files", [None] * (index + 1))[index]
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


# ---------------------------------------------------------------------------- output files
_PART_RE = re.compile(r"\.part(\d+)$")


def part_path(output: str, rank: int) -> str:
    return f"{output}.part{rank}"


def list_part_files(output: str) -> list[str]:
    """Part files of ``output`` (any rank count), by rank."""
    paths = [p for p in glob.glob(glob.escape(output) + ".part*")
             if _PART_RE.search(p[len(output):])]
    return sorted(paths, key=lambda p: int(_PART_RE.search(p).group(1)))


def _valid_lines(path: str):
    """``(offset, raw_line, id)`` of each whole record; stops at a torn or bad line (a
    killed writer leaves at most its last line torn; ``load_done_ids`` drops the same)."""
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return
            if not isinstance(rec, dict) or "id" not in rec:
                return
            yield offset, raw, str(rec["id"])
            offset += len(raw)


def merge_outputs(output: str, order: dict[str, int], parts: list[str]) -> None:
    """Rewrite ``output`` as its records plus those of ``parts``, in input order; then
    remove the parts.

    ``order``: input position of each id (ids not in it go last, in file order). Written
    to a temp file and moved into place, so a kill at any point leaves the old output and
    the parts, or the new output: never a half-written one. A line present twice (a kill
    between the move and the removal of the parts) is kept once; records are copied byte
    for byte.
    """
    sources = ([output] if os.path.exists(output) else []) + parts
    entries: list[tuple[int, int, int, int, int]] = []  # key, seq, source, offset, length
    seen: set[bytes] = set()
    for si, path in enumerate(sources):
        for offset, raw, rid in _valid_lines(path):
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            entries.append((order.get(rid, len(order)), len(entries), si, offset, len(raw)))
    entries.sort()
    tmp = f"{output}.merge.tmp"
    files = [open(p, "rb") for p in sources]
    try:
        with open(tmp, "wb") as out:
            for _, _, si, offset, length in entries:
                f = files[si]
                f.seek(offset)
                out.write(f.read(length))
            out.flush()
            os.fsync(out.fileno())
    finally:
        for f in files:
            f.close()
    os.replace(tmp, output)
    for p in parts:
        os.remove(p)


def merge_rank_parts(output: str, order: dict[str, int], world_size: int) -> None:
    """Rank 0, once every rank closed its part: merge all parts into ``output``.

    Raises ``RankFailedError`` if a part is not visible here (multi-node runs need the
    output folder on a filesystem every node shares).
    """
    parts = [part_path(output, r) for r in range(world_size)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise RankFailedError(
            f"rank 0 cannot see {missing[0]}: the output folder must be shared by all "
            "nodes; part files stay where they are")
    merge_outputs(output, order, parts)


def input_order(ids: Iterable[str]) -> dict[str, int]:
    """First input position of each id."""
    order: dict[str, int] = {}
    for i, rid in enumerate(ids):
        order.setdefault(rid, i)
    return order


def fold_part_files(output: str, inputs) -> bool:
    """Merge part files left by a killed DP run into ``output``; False if there were none."""
    parts = list_part_files(output)
    if not parts:
        return False
    print(f"resuming: merging {len(parts)} part file(s) of an earlier run into {output}",
          file=sys.stderr)
    merge_outputs(output, input_order(r.id for r in inputs), parts)
    return True


# ---------------------------------------------------------------------------- the CLI
def generate_dp(args: argparse.Namespace) -> int:
    """``deepinfer-generate`` over a DP group: join torchrun's, or spawn ``--dp`` ranks."""
    world = torchrun_world_size()
    if world > 1:
        if args.dp > 1 and args.dp != world:
            print(f"deepinfer-generate: --dp {args.dp} disagrees with WORLD_SIZE={world} "
                  "set by the launcher", file=sys.stderr)
            return 2
        try:
            return generate_rank(RankInfo.from_env(), args)
        except RankFailedError as e:
            print(f"deepinfer-generate: {e}", file=sys.stderr)
            return EXIT_RANK_FAILED
    try:
        status = spawn_ranks(_spawned_generate, args.dp, (args,))
    except RankFailedError as e:
        print(f"deepinfer-generate: {e}; the other ranks were stopped. Records already "
              "written are kept: rerun the same command to finish.", file=sys.stderr)
        return EXIT_RANK_FAILED
    return EXIT_RANK_FAILED if status is None else int(status)


def _spawned_generate(info: RankInfo, args: argparse.Namespace) -> int:
    try:
        return generate_rank(info, args)
    except RankFailedError as e:
        # Lost a peer: say so and exit with the code that tells the launcher "not me".
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        sys.exit(EXIT_RANK_FAILED)


def generate_rank(info: RankInfo, args: argparse.Namespace) -> int:
    """One rank of a DP ``deepinfer-generate`` run; returns the run's exit status (the
    same on every rank). Raises ``RankFailedError`` when a collective fails."""
    from deepinfer.generate import read_inputs

    device = select_device(args.device, info.local_rank)
    inputs = list(read_inputs(args.input))
    init_distributed(info, device, args.dp_timeout)
    error: RuntimeError | None = None
    try:
        status = _generate_rank(info, args, device, inputs)
    except RuntimeError as e:
        error = e
        # The failed frames hold the engine, whose scheduler holds the group.
        traceback.clear_frames(e.__traceback__)
    # Free the group's last users, then the group, while the interpreter is whole: a
    # gloo group left for interpreter teardown can abort the process at exit.
    gc.collect()
    _destroy()
    if error is None:
        return status
    if isinstance(error, RankFailedError):
        raise error
    # gloo: "Connection closed by peer" as soon as a rank dies; NCCL/gloo: a timeout.
    # Which rank it was is not known here: the launcher reports it.
    first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    raise RankFailedError(f"rank {info.rank}: a collective failed, so another rank died "
                          f"or stopped answering within {args.dp_timeout:g}s ({first})")


def _destroy() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may fail to tear down: exiting anyway
        pass


def _generate_rank(info: RankInfo, args: argparse.Namespace, device: str, inputs) -> int:
    from tqdm.auto import tqdm

    from deepinfer.engine import LLMEngine
    from deepinfer.generate import (
        default_sampling_params,
        engine_args,
        load_resume_state,
        pending_records,
        result_record,
        show_result,
        submit,
        summary_line,
        write_record,
    )

    rank0 = info.rank == 0
    cdev = _comm_device(device)
    order = input_order(r.id for r in inputs)
    # Rank 0 alone touches the output before the run (folds leftover parts, cuts a torn
    # line), then tells the others what is done so that all split the same pending list.
    payload: list[Any] = [None]
    if rank0:
        payload = [sorted(load_resume_state(args.output, inputs))]
    dist.broadcast_object_list(payload, src=0)
    done = set(payload[0])
    pending = pending_records(inputs, done, args.output, announce=rank0)
    if not pending:
        return 0
    mine = pending[info.rank::info.world_size]  # round-robin share

    # Every rank builds an engine, even with no records: its scheduler must vote.
    engine = LLMEngine(engine_args(args, device), dp_group=dist.group.WORLD)
    t_start = time.perf_counter()
    st = engine.stats
    # Created even when empty: rank 0 checks that it can see every rank's part file.
    with open(part_path(args.output, info.rank), "a", encoding="utf-8") as out:
        prompts, failed = submit(engine, mine, default_sampling_params(args), args.chat, out)
        (total_ok,) = allreduce_ints([len(prompts)], cdev)
        bar = tqdm(total=total_ok, desc=f"generate (dp={info.world_size})", unit="req",
                   disable=args.no_progress or not rank0, dynamic_ncols=True, file=sys.stderr)
        finished = 0
        while True:
            # One all-reduce per step: whether any rank has work (the loop's end, the same
            # on every rank) plus the group's progress for rank 0's bar.
            unfinished, g_finished, g_prompt, g_gen = allreduce_ints(
                [int(engine.has_unfinished()), finished, st.prompt_tokens,
                 st.generated_tokens], cdev)
            if rank0:
                bar.update(g_finished - bar.n)
                elapsed = max(time.perf_counter() - t_start, 1e-9)
                bar.set_postfix_str(f"in {g_prompt / elapsed:.0f} tok/s, "
                                    f"out {g_gen / elapsed:.0f} tok/s", refresh=False)
            if not unfinished:
                break
            for res in engine.step():  # an empty batch on a rank without work
                write_record(out, result_record(res))
                finished += 1
                if args.show:
                    show_result(res, prompts, prefix=f"(rank {info.rank}) ")
        bar.close()
    sst = engine.scheduler.stats
    totals = allreduce_ints([len(prompts), failed, st.prompt_tokens, st.generated_tokens,
                             sst.num_preemptions, sst.prefix_cache_hits,
                             sst.prefix_cache_queries], cdev)
    elapsed = time.perf_counter() - t_start
    dist.barrier()  # every part file is complete and closed
    if rank0:
        merge_rank_parts(args.output, order, info.world_size)
        print(summary_line(*totals[:4], elapsed, *totals[4:]), file=sys.stderr)
    # Nobody exits before the merge is over: torchrun stops all ranks when one exits 1.
    dist.barrier()
    return 1 if totals[1] else 0
