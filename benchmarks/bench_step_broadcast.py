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
- shm: ``ShmStepChannel`` below, over one ``multiprocessing.shared_memory`` segment.
  Synchronization: the leader waits until every follower's ack counter equals the
  step counter (the previous step has been copied out: the buffer is free), writes the
  header and the payload (the same int64 layout as StepChannel's, concatenated straight
  into the segment), then stores step counter + 1. Each follower spin-polls the step
  counter (``os.sched_yield()`` between polls, what ``time.sleep(0)`` is meant to do),
  copies header and payload out, rebuilds the ``LaunchBatch`` exactly as
  ``StepChannel.recv`` does, and stores the counter into its own ack slot (one 64-byte
  line per follower). Counters are aligned int64 stores from numpy: ordered for the
  reader on x86-64 (TSO), which is what this machine and GPU hosts are; a weakly ordered
  CPU (aarch64) would need fences (or an atomic op in C) around the counter.

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

The ``test_`` function at the bottom runs one small case of each channel and checks the
follower's steps against the leader's (no timing assertion).
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
import zlib
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_meta import git_commit, utc_now  # noqa: E402
from tree_state import commit_label, uncommitted_source  # noqa: E402

from deepinfer.step_channel import payload_size, unpack_step  # noqa: E402
from scheduler.batch import LaunchBatch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
_HEADER = 10          # StepChannel's header: kind, is_prompt, T, B, W, S, N, max_q, max_seq, dev
_LINE = 8             # int64 words per cache line: one line per counter
_MAX_FOLLOWERS = 7
_TIMEOUT_S = 30.0     # a wait (spin loop, gloo op) longer than this reports a hang


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------- the steps
@dataclass(frozen=True)
class Shape:
    """One step size: T tokens, B sequences, W block-table width, S samples, N
    copy-on-write pairs."""

    name: str
    t: int
    b: int
    w: int
    s: int
    max_q: int
    is_prompt: bool
    n_clone: int = 0

    @property
    def payload_words(self) -> int:
        return 3 * self.t + self.b * self.w + 2 * self.b + 1 + self.s + 2 * self.n_clone


def _seed(shape: Shape) -> int:
    """The same seed in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(shape.name.encode())


def decode_shape(b: int, w: int) -> Shape:
    return Shape(f"decode B={b} W={w}", t=b, b=b, w=w, s=b, max_q=1, is_prompt=False)


def default_shapes() -> list[Shape]:
    shapes = [decode_shape(b, w) for w in (8, 64) for b in (1, 16, 64, 256)]
    # 2048 prompt tokens over 8 sequences of 256 (block size 16: 16 blocks each), two
    # copy-on-write pairs (a prefix-cache hit on a partly filled block).
    shapes.append(Shape("prefill T=2048 B=8 W=16", t=2048, b=8, w=16, s=8, max_q=256,
                        is_prompt=True, n_clone=2))
    return shapes


@dataclass
class SchedOut:
    """What ``StepChannel.send_step`` reads of a scheduler output."""

    batch: LaunchBatch
    is_prompt: bool
    clone_blocks: torch.Tensor


def make_step(shape: Shape, seed: int = 0) -> SchedOut:
    """A deterministic step of ``shape`` with realistic values and the dtypes of
    ``scheduler/batch.py``."""
    g = torch.Generator().manual_seed(seed)
    b, t, w = shape.b, shape.t, shape.w
    block = 16
    if shape.is_prompt:
        q = torch.full((b,), t // b, dtype=torch.int64)
        q[-1] += t - int(q.sum())
        cached = torch.zeros(b, dtype=torch.int64)
    else:
        q = torch.ones(b, dtype=torch.int64)
        cached = torch.randint(1, w * block, (b,), generator=g)
    seq_lens = cached + q
    qsl = torch.zeros(b + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q, 0)
    seq_of = torch.repeat_interleave(torch.arange(b), q)
    positions = cached[seq_of] + (torch.arange(t) - qsl[:-1][seq_of])
    tables = torch.randint(1, 50_000, (b, w), generator=g, dtype=torch.int32)
    slots = tables[seq_of, (positions // block).clamp(max=w - 1)].long() * block \
        + positions % block
    batch = LaunchBatch(
        input_ids=torch.randint(0, 150_000, (t,), generator=g),
        positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl.to(torch.int32),
        logits_indices=qsl[1:] - 1, state_slots=torch.arange(b),
        sample_state_slots=torch.arange(shape.s),
        max_query_len=shape.max_q, max_seq_len=int(seq_lens.max()), num_tokens=t)
    clone = torch.randint(1, 50_000, (shape.n_clone, 2), generator=g)
    return SchedOut(batch, shape.is_prompt, clone)


_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
           "query_start_loc", "logits_indices")


def step_mismatch(got: Any, want: SchedOut) -> str | None:
    """None when follower step ``got`` holds exactly ``want``'s launch tensors (values,
    shapes, dtypes), scalars and clone pairs; else what differs."""
    for f in _FIELDS:
        a, b = getattr(got.batch, f), getattr(want.batch, f)
        if a.dtype != b.dtype or not torch.equal(a, b):
            return f"{f}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)} or values"
    for f in ("max_query_len", "max_seq_len", "num_tokens"):
        if getattr(got.batch, f) != getattr(want.batch, f):
            return f"{f}: {getattr(got.batch, f)} != {getattr(want.batch, f)}"
    if bool(got.is_prompt) != want.is_prompt:
        return "is_prompt"
    if got.clone_blocks.dtype != torch.int64 or not torch.equal(got.clone_blocks,
                                                                 want.clone_blocks):
        return "clone_blocks"
    return None


def step_arrays(step: Any) -> dict[str, Any]:
    """A received step as plain numpy / python values (to hand back to the parent)."""
    d: dict[str, Any] = {f: getattr(step.batch, f).numpy().copy() for f in _FIELDS}
    d.update(max_query_len=step.batch.max_query_len, max_seq_len=step.batch.max_seq_len,
             num_tokens=step.batch.num_tokens, is_prompt=bool(step.is_prompt),
             clone_blocks=step.clone_blocks.numpy().copy())
    return d


# ---------------------------------------------------------------------- the shm channel
@dataclass
class ShmStep:
    is_prompt: bool
    batch: LaunchBatch
    clone_blocks: torch.Tensor


class ShmStepChannel:
    """One end of a leader -> followers step channel over a shared-memory segment.

    Layout (int64 words): the step counter on line 0, follower f's ack counter on line
    1 + f, then the 10-word header (StepChannel's), then the payload (StepChannel's
    layout). See the module docstring for the synchronization.
    """

    def __init__(self, shm: shared_memory.SharedMemory, followers: int,
                 follower: int | None = None) -> None:
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self._shm = shm
        self.followers = followers
        self.follower = follower  # None on the leader
        self._seq = words[0:1]
        self._acks = words[_LINE: _LINE * (1 + followers): _LINE]
        off = _LINE * (1 + _MAX_FOLLOWERS)
        self._header = words[off: off + _HEADER]
        self._payload = words[off + _HEADER:]
        self._last = 0  # the segment starts zeroed; a follower that attaches late must
        # still wait for step 1, not for whatever step the counter shows by then

    @staticmethod
    def nbytes(max_payload_words: int) -> int:
        return 8 * (_LINE * (1 + _MAX_FOLLOWERS) + _HEADER + max_payload_words)

    def _spin(self, done: Any) -> None:
        n = 0
        while not done():
            os.sched_yield()
            n += 1
            if n % 4096 == 0 and _now() - self._spin_start > _TIMEOUT_S * 1e9:
                raise TimeoutError(f"shm channel: no progress in {_TIMEOUT_S:.0f} s")

    # ---------------------------------------------------------------- leader
    def wait_acks(self) -> None:
        """Block until every follower has copied out the last step (the buffer is free)."""
        seq, acks = self._last, self._acks
        self._spin_start = _now()
        self._spin(lambda: bool((acks == seq).all()))

    def send_step(self, out: Any, ids_on_device: bool = False) -> None:
        """Write ``out`` (acks already awaited, ``wait_acks``) and publish it."""
        b = out.batch
        bt = b.block_tables
        clone = out.clone_blocks
        self._header[:] = (1, int(out.is_prompt), b.num_tokens, bt.shape[0], bt.shape[1],
                           b.logits_indices.shape[0], clone.shape[0], b.max_query_len,
                           b.max_seq_len, int(ids_on_device))
        parts = [b.input_ids, b.positions, b.slot_mapping, bt.reshape(-1), b.seq_lens,
                 b.query_start_loc, b.logits_indices, clone.reshape(-1)]
        arrays = [p.numpy() for p in parts]
        n = sum(a.shape[0] for a in arrays)
        np.concatenate(arrays, out=self._payload[:n])
        self._last += 1
        self._seq[0] = self._last  # publish: payload stores precede this one (x86 TSO)

    def send_stop(self) -> None:
        self._header[0] = 0
        self._last += 1
        self._seq[0] = self._last

    # ---------------------------------------------------------------- followers
    def recv(self) -> ShmStep | None:
        """The next step (copied out of the segment), or None when the run is over. The
        caller acks it with ``ack()`` once it no longer needs the segment."""
        seq, last = self._seq, self._last
        self._spin_start = _now()
        self._spin(lambda: int(seq[0]) != last)
        self._last = int(seq[0])
        kind, is_prompt, t, b, w, s, n_clone, max_q, max_seq, _ = self._header.tolist()
        if kind == 0:
            return None
        n = payload_size(t, b, w, s, n_clone)
        payload = torch.from_numpy(self._payload[:n].copy())
        batch, clone = unpack_step(payload, t, b, w, s, n_clone, max_q, max_seq)
        return ShmStep(bool(is_prompt), batch, clone)

    def ack(self) -> None:
        assert self.follower is not None
        self._acks[self.follower] = self._last


class AckFence:
    """What separates the gloo channel's steps in this benchmark: the shm channel's ack
    protocol without the data. Follower f stores "steps done" into its own line; the
    leader spin-waits (``os.sched_yield()``) until every follower's count reaches its
    own before it starts the next step. Same separation as the shm channel's, cheaper
    than a gloo barrier, and outside the timed window."""

    def __init__(self, shm: shared_memory.SharedMemory, followers: int) -> None:
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self._acks = words[_LINE: _LINE * (1 + followers): _LINE]
        self.done = 0

    @staticmethod
    def nbytes() -> int:
        return 8 * _LINE * (1 + _MAX_FOLLOWERS)

    def wait(self) -> None:
        """Leader: block until every follower has finished the leader's last step."""
        acks, done, start, n = self._acks, self.done, _now(), 0
        while not bool((acks >= done).all()):
            os.sched_yield()
            n += 1
            if n % 4096 == 0 and _now() - start > _TIMEOUT_S * 1e9:
                raise TimeoutError(f"ack fence: no progress in {_TIMEOUT_S:.0f} s")
        self.done += 1

    def ack(self, follower: int) -> None:
        """Follower ``follower``: one more step done."""
        self.done += 1
        self._acks[follower] = self.done


# ------------------------------------------------------------------------- the ranks
def _lockstep(ch: Any, channel: str, rank: int, fence: AckFence, shape: Shape,
              iters: int, warmup: int) -> dict[str, Any]:
    """``warmup + iters`` steps of ``shape`` through ``ch``: the leader's start and send-end
    stamps, or a follower's "holds the step" stamps and its checks."""
    want = make_step(shape, seed=_seed(shape))
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
            start[i] = _now()
            ch.send_step(want, False)
            end[i] = _now()
        else:
            step = ch.recv()
            end[i] = _now()
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
                                timeout=dt.timedelta(seconds=_TIMEOUT_S))
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


# ---------------------------------------------------------------------------- report
def table_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for nf in data["followers"]:
        lines += [f"### 1 leader + {nf} follower{'s' if nf > 1 else ''}", "",
                  "| step | payload KiB | gloo median | gloo p90 | shm median | shm p90 "
                  "| shm/gloo (median) | gloo send | shm send |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in data["shapes"]:
            g = data["runs"][f"gloo x{nf}"][s["name"]]
            m = data["runs"][f"shm x{nf}"][s["name"]]
            kib = (s["payload_words"] + _HEADER) * 8 / 1024
            lines.append(
                f"| {s['name']} | {kib:.1f} | {g['median_us']:.0f} | {g['p90_us']:.0f} "
                f"| {m['median_us']:.0f} | {m['p90_us']:.0f} "
                f"| **{m['median_us'] / g['median_us']:.2f}** "
                f"| {g['send_median_us']:.0f} | {m['send_median_us']:.0f} |")
        lines.append("")
    return lines


def notes(data: dict[str, Any]) -> list[str]:
    """The .md's reading of the tables: the ratio ranges, then what they depend on."""
    lines = []
    for nf in data["followers"]:
        r = [data["runs"][f"shm x{nf}"][s["name"]]["median_us"]
             / data["runs"][f"gloo x{nf}"][s["name"]]["median_us"] for s in data["shapes"]]
        lines.append(f"- 1 + {nf}: shm/gloo median latency {min(r):.2f} to {max(r):.2f} "
                     f"over the {len(r)} step sizes.")
    cpus, world = data["cpus"], 1 + max(data["followers"])
    lines += [
        "",
        "Latency: from the leader's stamp just before it starts sending to the stamp of "
        "the last follower holding the rebuilt `LaunchBatch` (one CLOCK_MONOTONIC for all "
        "processes), median and p90 over the timed steps, in µs. Send: the leader's own "
        "call (gloo: `StepChannel.send_step`, one `dist.broadcast` when the step fits "
        "64 KiB, two past it; shm: header + payload write + counter store; the wait "
        "for the previous step's acks is not in it). "
        "Steps run in lockstep: the next starts once every follower acknowledged the "
        "previous one, after checking it against the leader's tensors (every step "
        "checked, values and dtypes; none differed).",
        "",
        "shm synchronization: the leader waits until every follower's ack counter equals "
        "its step counter (the segment is free), writes the 10-word header and the int64 "
        "payload (StepChannel's layout) into the segment, then stores step counter + 1. "
        "Followers spin-poll the counter with `os.sched_yield()` between polls, copy the "
        "header and payload out, rebuild the `LaunchBatch` as `StepChannel.recv` does, "
        "and store the counter into their own ack line (one 64-byte line per follower). "
        "Plain aligned int64 stores from numpy: ordered on x86-64 (TSO); a weakly ordered "
        "CPU (aarch64) would need fences around the counters (a C helper or atomics).",
        "",
        f"Caveats of this machine: {cpus} cores for {world} processes at 1 + "
        f"{max(data['followers'])}. The shm followers never block: each spins "
        "(yielding) and competes with the leader for the cores, so with 3 followers on "
        f"{cpus} cores the leader can be preempted while it writes (its send column is "
        "higher than with 1 follower) and the shm figures are pessimistic and noisy; "
        "gloo's followers block in the kernel instead, but every broadcast hops through "
        "gloo's worker and transport threads, each hop a wake-up that waits for a free "
        "core (the multi-ms p90s are such waits). Other jobs shared the machine too: "
        f"1-minute load average {data['loadavg_start'][0]:.1f} before the run, "
        f"{data['loadavg_end'][0]:.1f} after (this run's own spinning ranks included). "
        "GPU nodes have many cores (one or more per rank to spare), "
        "where a spinning follower has a core to itself: there both channels' figures "
        "should be far lower and steadier, and the shm wake-up is one cache-line "
        "transfer rather than a scheduler wake-up.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--followers", default="1,3", help="comma-separated follower counts")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/step-broadcast-cpu.{json,md}")
    args = ap.parse_args(argv)
    shapes = default_shapes()
    counts = [int(x) for x in args.followers.split(",")]
    if not all(1 <= n <= _MAX_FOLLOWERS for n in counts):
        ap.error(f"follower counts are 1 to {_MAX_FOLLOWERS}")
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
        want = make_step(shapes[0], seed=_seed(shapes[0]))
        want.batch.input_ids[0] = iters + warmup - 1
        got = rec["last"]
        for f in _FIELDS:
            a, b = got[f], getattr(want.batch, f).numpy()
            assert a.dtype == b.dtype and np.array_equal(a, b), (channel, f)
        assert got["clone_blocks"].dtype == np.int64
        assert np.array_equal(got["clone_blocks"], want.clone_blocks.numpy()), channel
        assert got["is_prompt"] is True and got["num_tokens"] == 24
        assert (got["max_query_len"], got["max_seq_len"]) == (
            want.batch.max_query_len, want.batch.max_seq_len)
        assert summarize(ranks, shapes, warmup)[shapes[0].name]["median_us"] > 0
    # The followers' per-step check catches a wrong value, and a wrong dtype.
    want = make_step(shapes[0], seed=_seed(shapes[0]))
    for f, change in (("slot_mapping", lambda t: t + (t == t[-1])),
                      ("block_tables", lambda t: t.long())):
        other = make_step(shapes[0], seed=_seed(shapes[0]))
        setattr(other.batch, f, change(getattr(other.batch, f)))
        assert step_mismatch(other, want) is not None and step_mismatch(want, want) is None


if __name__ == "__main__":
    sys.exit(main())
