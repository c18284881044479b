"""Disaggregated prefill/decode: the rounds of one rank and the KV hand-off.

``PDRounds.drain`` hands each finished request back to its caller, as
``LLMEngine.drain`` does (the PD jobs, ``jobs/pd_job.py``, write them); requests go
in through the rank's engine (``add_request``), whose admission also fits a PROMPT
rank's requests to the decode side (``PDRounds.setup``).

P PROMPT ranks prefill and sample each request's first token, then hand the sequence to
one of D COMPLETION ranks, which decodes it to the end. World = P + D processes; ranks
``0..P-1`` are PROMPT, ``P..P+D-1`` COMPLETION. One round on every rank is:

1. local work: a PROMPT rank runs one prefill step if it has waiting prompts and fewer
   than ``max_pending`` sequences waiting to be handed off (back-pressure: a PROMPT rank
   whose decode side has no credits stops admitting); a COMPLETION rank runs one decode
   step if it has running sequences.
2. one ``all_gather`` of a fixed-size int64 status row per rank
   (``[has_work, free_slots, free_blocks, n_offers, need_0 .. need_{K-1}]``): COMPLETION
   ranks publish their credits (``Scheduler.handoff_capacity``), PROMPT ranks up to K
   hand-off offers (blocks each sequence may need on the decode side).
3. every rank computes the same assignment from the gathered rows (``assign_offers``).
4. transfers, pair by pair in one global order (so blocking send/recv can never wait in
   a cycle): ``send_object_list`` of the ``SequenceExport``s, then one flat uint8 payload
   with the sequences' KV blocks and sampler-state rows (``ModelRunner.export_kv``). The
   receiver admits them first (``LLMEngine.import_sequence``) and scatters into them.
5. the round's gathered ``has_work`` flags say when every rank is done: all ranks leave
   the loop in the same round.

A job may feed a PROMPT rank lazily (``RoundFeed``, the CLI's bounded stream): it tops
up the rank's requests at the start of each round, a rank with requests still unread has
work, and each hand-off tells it that the request left (so it admits another) and
carries what the job needs to write that request's line on the decode rank.

Buffers are bounded: at most K sequences per PROMPT rank per round travel, and a
COMPLETION rank only accepts what its credits cover (slots, and blocks for each
sequence's worst-case length, so it never preempts: it could not recompute a prompt).
Rounds are lock-step, so a decode step waits for the slowest prefill step of its round.
n > 1 is rejected (a forked group shares blocks that would have to move together).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from deepinfer.distributed.ranks import comm_device
from deepinfer.engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams

# Status row layout (int64), see the module docstring.
HAS_WORK, FREE_SLOTS, FREE_BLOCKS, N_OFFERS, NEEDS = range(5)


@dataclass
class PDOptions:
    """``max_offers``: K, sequences one PROMPT rank may hand off per round.
    ``max_pending``: a PROMPT rank runs no prefill step while this many sequences wait to
    be handed off (None: its ``max_num_seqs``). ``timeout_s``: bound on every collective
    (a dead peer fails the run instead of hanging it)."""

    max_offers: int = 16
    max_pending: int | None = None
    timeout_s: float = 1800.0


def parse_pd(spec: str) -> tuple[int, int]:
    """``"P:D"`` -> ``(P, D)``, both >= 1; ``ValueError`` naming ``--pd`` otherwise."""
    try:
        p, d = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--pd {spec!r}: expected P:D, e.g. 1:1") from None
    if p < 1 or d < 1:
        raise ValueError(f"--pd {spec!r}: need at least one prompt and one decode rank")
    return p, d


def check_pd_params(request_id: str, params: SamplingParams) -> None:
    """Raise ``ValueError`` for sampling options a disaggregated run cannot serve."""
    if params.n != 1:
        raise ValueError(f"request {request_id!r}: n={params.n} is not supported with --pd "
                         "(disaggregated prefill hands off single sequences); use n=1")


T = TypeVar("T")


def split_requests(requests: list[T], num_prompt: int, world: int) -> list[list[T]]:
    """Round-robin over the PROMPT ranks; COMPLETION ranks get empty lists."""
    per_rank: list[list[T]] = [[] for _ in range(world)]
    for i, r in enumerate(requests):
        per_rank[i % num_prompt].append(r)
    return per_rank


def assign_offers(rows: list[list[int]], num_prompt: int) -> list[tuple[int, int, int]]:
    """Deterministic routing from the gathered status rows: ``(prompt rank, offer index,
    decode rank)`` triples. Offers go round-robin over PROMPT ranks, in order per rank,
    each to the COMPLETION rank with the most free blocks among those with a free slot
    and enough blocks; a rank's first offer that fits nowhere stops that rank."""
    world = len(rows)
    cap = {d: [rows[d][FREE_SLOTS], rows[d][FREE_BLOCKS]] for d in range(num_prompt, world)}
    nxt = [0] * num_prompt
    blocked = [False] * num_prompt
    out: list[tuple[int, int, int]] = []
    progress = True
    while progress:
        progress = False
        for p in range(num_prompt):
            i = nxt[p]
            if blocked[p] or i >= rows[p][N_OFFERS]:
                continue
            need = rows[p][NEEDS + i]
            fit = [d for d, (s, b) in cap.items() if s >= 1 and b >= need]
            if not fit:
                blocked[p] = True
                continue
            d = max(fit, key=lambda r: (cap[r][1], -r))
            cap[d][0] -= 1
            cap[d][1] -= need
            out.append((p, i, d))
            nxt[p] = i + 1
            progress = True
    return out


def pd_engine(rank: int, num_prompt: int, prompt_args: EngineArgs,
              decode_args: EngineArgs, device: str) -> LLMEngine:
    """The engine of ``rank``: PROMPT (ranks below ``num_prompt``, ``prompt_args``) or
    COMPLETION (``decode_args``), on ``device``."""
    is_prompt = rank < num_prompt
    args = prompt_args if is_prompt else decode_args
    role = "prompt" if is_prompt else "completion"
    return LLMEngine(dataclasses.replace(args, engine_type=role, device=device))


# The KV dtype in the setup exchange (ranks on different machines may resolve "auto"
# differently).
KV_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class RoundFeed(Protocol):
    """A rank's requests fed lazily (``deepinfer.jobs.run_loop.RequestFeed``):
    ``top_up()`` admits more into the engine, ``exhausted`` says none is left unread,
    ``send_off(id)`` hears that a request left for a decode rank and returns what travels
    with it (picklable), ``arrived(id, obj)`` receives that on the decode rank."""

    exhausted: bool

    def top_up(self) -> None: ...

    def send_off(self, request_id: str) -> Any: ...

    def arrived(self, request_id: str, record: Any) -> None: ...


class PDRounds:
    """The round loop of one rank (see the module docstring): ``setup`` (every rank, a
    collective), then requests added to ``engine`` (PROMPT ranks), then ``drain``.
    ``stats``: the rank's round counters."""

    def __init__(self, engine: LLMEngine, rank: int, world: int, num_prompt: int,
                 device: str, options: PDOptions) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.rank = rank
        self.world = world
        self.num_prompt = num_prompt
        self.is_prompt = rank < num_prompt
        self.dev = comm_device(device)
        self.k = options.max_offers
        self.max_pending = options.max_pending or self.sched.config.max_num_seqs
        self.stats: dict[str, Any] = {"rank": rank, "role": "prompt" if self.is_prompt
                                      else "completion", "rounds": 0, "handed_off": 0,
                                      "received": 0, "max_pending": 0, "steps": 0,
                                      # rounds with offers out and none taken (no credits)
                                      "credit_waits": 0}
        self.pending: deque = deque()  # handed-off sequences not yet sent (PROMPT)
        self._feed: RoundFeed | None = None
        self._row = torch.zeros(5 + self.k, dtype=torch.int64, device=self.dev)
        self._rows = [torch.zeros_like(self._row) for _ in range(world)]

    def _gather(self, row: list[int]) -> list[list[int]]:
        self._row.copy_(torch.tensor(row, dtype=torch.int64))
        dist.all_gather(self._rows, self._row)
        return torch.stack(self._rows).cpu().tolist()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Every rank, before any request: exchange block size, KV blocks, positions and
        KV dtype. A PROMPT engine then admits only requests that some decode rank could
        hold (``AdmissionLimits.hand_off``): one that none could is an error record
        instead of a hang."""
        c = self.sched.config
        cfg = self._gather([int(self.is_prompt), c.block_size, c.num_blocks,
                            c.max_model_len, KV_DTYPE_CODES[self.engine.dtype]]
                           + [0] * self.k)
        if len({row[1] for row in cfg}) != 1:
            raise ValueError("--pd: all ranks need the same block_size (KV moves by block)")
        if len({row[4] for row in cfg}) != 1:
            # dtype "auto" is bf16 on a CPU with native bf16 and fp32 on one without.
            raise ValueError("--pd: the ranks resolved different dtypes (KV moves as "
                             "bytes): pass the same --dtype to all of them")
        if self.is_prompt:
            decode = cfg[self.num_prompt:]
            self.engine.admission.hand_off(max(row[3] for row in decode),
                                           max(row[2] for row in decode),
                                           self.sched.prefilled_blocks)

    # ------------------------------------------------------------------ loop
    def drain(self, feed: RoundFeed | None = None) -> Iterator[RequestOutput]:
        """Run rounds until no rank has work; yield each request this rank finishes (a
        PROMPT rank: those that ended at their first token), as it finishes. Every rank
        leaves in the same round. ``feed``: this rank's requests fed lazily (None: every
        request was added before)."""
        self._feed = feed
        while True:
            if feed is not None and self.is_prompt:
                feed.top_up()
            yield from self._local_step()
            rows = self._gather(self._status())
            self.stats["rounds"] += 1
            if not any(row[HAS_WORK] for row in rows):
                return
            plan = assign_offers(rows, self.num_prompt)
            if self.is_prompt and self.pending and not any(p == self.rank
                                                           for p, _, _ in plan):
                self.stats["credit_waits"] += 1
            self._transfer(plan)

    def _local_step(self) -> list[RequestOutput]:
        eng, s = self.engine, self.sched
        if self.is_prompt:
            # A constrained request waits in the engine (parked) until its grammar is
            # compiled; the step takes it into the scheduler then.
            if (not (s.waiting or eng.structured.has_parked())
                    or len(self.pending) >= self.max_pending):
                return []  # nothing to prefill, or back-pressure from the decode side
            done = eng.step()
            self.pending.extend(s.take_handoffs())
            self.stats["max_pending"] = max(self.stats["max_pending"], len(self.pending))
        else:
            if not s.running:
                return []
            done = eng.step()
        self.stats["steps"] += 1
        return done  # PROMPT side: requests that ended at their first token

    def _status(self) -> list[int]:
        row = [0] * (5 + self.k)
        if self.is_prompt:
            unread = self._feed is not None and not self._feed.exhausted
            row[HAS_WORK] = int(self.engine.has_unfinished() or bool(self.pending) or unread)
            offers = list(self.pending)[: self.k]
            row[N_OFFERS] = len(offers)
            for i, seq in enumerate(offers):
                row[NEEDS + i] = self.sched.prefilled_blocks(len(seq.prompt_token_ids),
                                                             seq.max_tokens)
        else:
            row[HAS_WORK] = int(self.sched.has_unfinished())
            row[FREE_SLOTS], row[FREE_BLOCKS] = self.sched.handoff_capacity()
        return row

    def _transfer(self, plan: list[tuple[int, int, int]]) -> None:
        """Run this rank's part of the round's transfers, pair by pair in one global
        order (sorted by (prompt rank, decode rank)), so blocking send/recv match up."""
        pairs: dict[tuple[int, int], list[int]] = {}
        for p, i, d in plan:
            pairs.setdefault((p, d), []).append(i)
        sent: list = []
        for (p, d), idx in sorted(pairs.items()):
            if self.rank == p:
                seqs = [self.pending[i] for i in idx]
                self._send(d, seqs)
                sent += seqs
            elif self.rank == d:
                self._recv(p)
        if sent:
            ids = {q.seq_id for q in sent}
            self.pending = deque(q for q in self.pending if q.seq_id not in ids)
            for q in sent:
                self.engine.release_exported(q)
            self.stats["handed_off"] += len(sent)

    def _send(self, dst: int, seqs: list) -> None:
        eng = self.engine
        exports = [eng.export_sequence(q) for q in seqs]
        feed = self._feed
        carried = [feed.send_off(q.request_id) if feed is not None else None for q in seqs]
        dist.send_object_list([(exports, carried)], dst=dst, device=self.dev)
        blocks = [b for q in seqs for b in q.blocks]
        dist.send(eng.runner.export_kv(blocks, [q.slot for q in seqs]), dst=dst)

    def _recv(self, src: int) -> None:
        eng = self.engine
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, device=self.dev)
        exports, carried = box[0]
        seqs = []
        for exp, obj in zip(exports, carried):
            if self._feed is not None:
                self._feed.arrived(exp.request_id, obj)
            seq = eng.import_sequence(exp)
            if seq is None or len(seq.blocks) != exp.num_blocks:
                # The plan only assigns what the published credits cover.
                raise RuntimeError(f"rank {self.rank}: no room for handed-off request "
                                   f"{exp.request_id!r} despite its credits")
            seqs.append(seq)
        blocks = [b for q in seqs for b in q.blocks]
        runner = eng.runner
        payload = torch.empty(runner.transfer_bytes(len(blocks), len(seqs)),
                              dtype=torch.uint8, device=runner.kv_cache.device)
        dist.recv(payload, src=src)
        runner.import_kv(payload, blocks, [q.slot for q in seqs])
        self.stats["received"] += len(seqs)
