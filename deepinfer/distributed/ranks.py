"""Ranks: who this process is, how ranks are started (spawned here or by torchrun), how
they join and leave the default process group, and how a failed rank is reported.

Two ways in, same code: ``deepinfer-generate --dp N`` / ``--pd P:D`` spawn the ranks on
this machine (``spawn_ranks``); under ``torchrun`` every process is already a rank
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment).
``launch`` takes either way.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from deepinfer_scheduler.dp import host_collective_stream

# Exit status of a run in which a rank died or a collective failed (1: records failed).
EXIT_RANK_FAILED = 3


class RankFailedError(RuntimeError):
    """A rank died, raised, or lost contact with the group. ``trace``: the traceback of
    the rank that raised, when known."""

    def __init__(self, message: str, rank: int | None = None,
                 exit_code: int | None = None, trace: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.trace = trace


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the group."""

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
    """A TCP port free right now on 127.0.0.1 (the rendezvous of locally spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the group
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


def check_gpu_count(device: str, world_size: int, what: str) -> None:
    """Raise ``ValueError`` when ranks on ``device`` need more GPUs than this node has."""
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda and torch.cuda.device_count() < world_size:
        raise ValueError(f"{what} needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")


#: The rendezvous waits for every rank to start, and a spawned rank imports torch first:
#: seconds on a loaded machine. So it is never bounded by a short collective timeout.
RENDEZVOUS_TIMEOUT_S = 120.0


def init_distributed(info: RankInfo, device: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the default group (rendezvous on MASTER_ADDR/MASTER_PORT, as env:// would).

    ``timeout_s`` bounds every collective: a rank that stops answering makes the others
    fail after it instead of hanging (a dead peer is usually reported sooner by gloo).
    The rendezvous itself waits up to ``max(timeout_s, RENDEZVOUS_TIMEOUT_S)``.
    """
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not set: the ranks' rendezvous needs "
                         "MASTER_ADDR and MASTER_PORT in the environment")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one machine would otherwise each start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)  # binds the communicator to our GPU
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          info.world_size, is_master=info.rank == 0,
                          timeout=dt.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)))
    dist.init_process_group(backend, store=store, rank=info.rank,
                            world_size=info.world_size,
                            timeout=dt.timedelta(seconds=timeout_s), **kwargs)
    return dist.group.WORLD


def destroy_group() -> None:
    """Leave the default group; a broken group may fail to tear down: ignored, since the
    rank is exiting anyway."""
    # Objects that still use the group's communicators (CUDA graphs that captured its
    # all-reduce, held in a reference cycle) are freed first: not after it is gone.
    gc.collect()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    # A group object still held by a reference cycle (a scheduler's voter, say) would
    # otherwise be freed during interpreter shutdown, where gloo's teardown can abort the
    # process ("terminate called without an active exception", SIGABRT).
    gc.collect()


def comm_device(device: str) -> torch.device:
    """Where collective tensors live: the GPU for NCCL, the CPU for gloo."""
    return torch.device(device) if device.startswith("cuda") else torch.device("cpu")


def allreduce_ints(values: list[int], device: torch.device,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, group: Any = None) -> list[int]:
    """All-reduce a short list of ints over ``group`` (None: the default group).

    On CUDA on the collectives' own stream (``scheduler.dp.host_collective_stream``): the
    copy in, the collective and the read back would otherwise wait for the step in
    flight, and a per-step call would end overlapped scheduling."""
    with host_collective_stream(device):
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()


# Where torch.distributed's Python code lives: a RuntimeError raised through it comes
# from a collective (gloo raises plain RuntimeErrors).
_DIST_DIR = os.path.dirname(os.path.abspath(dist.__file__)) + os.sep


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` came out of torch.distributed (a peer died or stopped answering,
    most likely): one of its exception types (``DistError``: DistBackendError,
    DistNetworkError, DistStoreError, ...) or a RuntimeError raised through its code.
    Running out of memory never is, even inside a collective."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        os.path.abspath(frame.f_code.co_filename).startswith(_DIST_DIR)
        for frame, _ in traceback.walk_tb(error.__traceback__))


def run_in_group(info: RankInfo, device: str, timeout_s: float,
                 body: Callable[..., Any], *args: Any) -> Any:
    """Join the group, run ``body(*args)``, leave the group; returns what ``body`` did.

    An error from a collective (``is_collective_error``; gloo: "Connection closed by
    peer" as soon as a rank dies; NCCL/gloo: a timeout) becomes ``RankFailedError``:
    which rank died is not known here, the launcher reports it. Any other error (a bug,
    CUDA out of memory) is this rank's own and is raised as it is, with its traceback.
    The group is destroyed while the interpreter is whole, after its last users are
    freed: a gloo group left for interpreter teardown can abort the process at exit.
    """
    init_distributed(info, device, timeout_s)
    error: Exception | None = None
    lost_peer = False
    try:
        result = body(*args)
    except Exception as e:
        error = e
        lost_peer = is_collective_error(e)
        # The failed frames hold the engine, whose scheduler holds the group.
        traceback.clear_frames(e.__traceback__)
    finally:
        gc.collect()
        destroy_group()
    if error is None:
        return result
    if isinstance(error, RankFailedError) or not lost_peer:
        raise error
    first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    raise RankFailedError(f"rank {info.rank}: a collective failed, so another rank died "
                          f"or stopped answering within {timeout_s:g}s ({first})")


def use_thread_lock_for_bars() -> None:
    """Give tqdm a threading lock in this rank, before any bar exists. Its default lock
    also holds a multiprocessing lock, a semaphore that a rank leaving through
    ``os._exit`` never unregisters: the launcher's resource tracker then warns of
    "leaked semaphore objects" at exit. A spawned rank's lock is its own anyway (no
    other process shares it), so a threading lock guards just as much."""
    tqdm.set_lock(threading.RLock())


# ---------------------------------------------------------------------------- launching
def launch(fn: Callable[..., int], world_size: int, fn_args: tuple = ()) -> int:
    """Run ``fn(info, *fn_args)`` on every rank and return rank 0's exit status: in this
    process under torchrun, else in ``world_size`` spawned processes. A failed rank is
    reported on stderr (a spawned rank that raised: with its traceback) and gives
    ``EXIT_RANK_FAILED``."""
    if torchrun_world_size():
        try:
            return fn(RankInfo.from_env(), *fn_args)
        except RankFailedError as e:
            print(f"deepinfer-generate: {e}", file=sys.stderr)
            return EXIT_RANK_FAILED
    try:
        status = spawn_ranks(fn, world_size, fn_args)
    except RankFailedError as e:
        if e.trace:
            print(f"deepinfer-generate: rank {e.rank} raised:\n{e.trace.rstrip()}",
                  file=sys.stderr)
        print(f"deepinfer-generate: {e}; the other ranks were stopped. Records already "
              "written are kept: rerun the same command to finish.", file=sys.stderr)
        return EXIT_RANK_FAILED
    return EXIT_RANK_FAILED if status is None else int(status)


def _spawn_entry(local_rank: int, fn: Callable[..., Any], nprocs: int, port: int,
                 result_queue, fn_args: tuple, launcher: int) -> None:
    """A spawned rank: the torchrun environment, then ``fn(info, *fn_args)``."""
    die_with_launcher(launcher)
    use_thread_lock_for_bars()  # it leaves through os._exit below
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = fn(RankInfo(local_rank, nprocs, local_rank, nprocs), *fn_args)
    except RankFailedError as e:
        # Lost a peer: say so and exit with the code that tells the launcher "not me".
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        sys.exit(EXIT_RANK_FAILED)
    if local_rank == 0:
        # Blocks until the launcher reads it when it is larger than the pipe's buffer:
        # the launcher polls the queue while it waits for the ranks.
        result_queue.put(result)
    # Skip interpreter teardown: its records are flushed and closed, and gloo's worker
    # threads can abort a process whose C++ state is destroyed at exit (a rare SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def die_with_launcher(launcher: int) -> None:
    """Have the kernel SIGTERM this process when the launcher (pid ``launcher``) dies,
    however it dies (SIGKILL included): a rank left running would keep appending to its
    part file while a rerun folds it. Linux only; elsewhere the launcher's own signal
    handling (``spawn_ranks``) is all there is."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died before the request took effect
        os._exit(EXIT_RANK_FAILED)


class _TerminatedError(KeyboardInterrupt):
    """SIGTERM / SIGHUP to the launcher, raised where it waits so its ranks are stopped
    (a ``KeyboardInterrupt``: the same way out as Ctrl-C)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _TerminatedError(signal.Signals(signum).name)


def spawn_ranks(fn: Callable[..., Any], nprocs: int, fn_args: tuple = ()) -> Any:
    """Run ``fn(info, *fn_args)`` in ``nprocs`` spawned processes; rank 0's return value.

    ``fn`` must be a module-level function (it is pickled by reference). When a rank
    fails, the others are stopped and ``RankFailedError`` names the rank that failed
    first and its exit code. A rank that raises ``RankFailedError`` (it only lost contact
    with a failed peer) exits with ``EXIT_RANK_FAILED``: it is then not blamed when the
    root cause is known. SIGTERM or SIGHUP to this process stops the ranks too (as
    Ctrl-C does), and a rank dies with this process (``die_with_launcher``).
    """
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _raise_terminated)
    try:
        return _run_spawned(fn, nprocs, fn_args, results)
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _run_spawned(fn: Callable[..., Any], nprocs: int, fn_args: tuple, results) -> Any:
    """``spawn_ranks``' body: start the ranks, wait for them, stop the rest on the way
    out (a failed rank, Ctrl-C, SIGTERM)."""
    import multiprocessing.connection as mpc

    import torch.multiprocessing as mp

    pctx = mp.start_processes(_spawn_entry, args=(fn, nprocs, free_port(), results, fn_args,
                                                  os.getpid()),
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

    got: list[Any] = []
    try:
        while alive and not failed:
            reap(1.0)
            if not got and not results.empty():
                got.append(results.get())
        # The root cause and the ranks that saw its connection close fail within
        # milliseconds of each other: collect them before choosing whom to blame.
        deadline = time.monotonic() + 2.0
        while alive and failed and time.monotonic() < deadline:
            reap(max(deadline - time.monotonic(), 0.0))
    finally:
        _stop(procs)
    try:
        return _outcome(pctx, procs, failed, got, results)
    finally:  # torch's spawn wrapper leaves a traceback file per rank that raised
        for path in getattr(pctx, "error_files", ()):
            if path and os.path.exists(path):
                with contextlib.suppress(OSError):
                    os.remove(path)


def _outcome(pctx, procs, failed: list[int], got: list[Any], results) -> Any:
    """Rank 0's result, or ``RankFailedError`` naming the rank that failed first."""
    if not failed:
        if not got and not results.empty():
            got.append(results.get())
        return got[0] if got else None
    root = next((i for i in failed if procs[i].exitcode != EXIT_RANK_FAILED), failed[0])
    code = procs[root].exitcode
    what = f"rank {root} exited with code {code}"
    if code < 0:
        what += f" ({signal.Signals(-code).name})"
    trace = _child_traceback(pctx, root)
    if trace:
        what += f": {trace.strip().splitlines()[-1]}"
    raise RankFailedError(what, root, code, trace)


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
