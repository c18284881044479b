"""Disaggregated prefill/decode (``--pd P:D``): P PROMPT ranks prefill and sample each
request's first token, then hand the sequence to one of D COMPLETION ranks, which decodes
it to the end. World = P + D processes; ranks ``0..P-1`` are PROMPT, ``P..P+D-1``
COMPLETION. Backend: NCCL on CUDA (one GPU per rank), gloo on CPU.

The ranks advance in rounds; one round on every rank is:

1. local work: a PROMPT rank runs one prefill step if it has waiting prompts and fewer
   than ``max_pending`` sequences waiting to be handed off (back-pressure: a PROMPT rank
   whose decode side has no credits stops admitting); a COMPLETION rank runs one decode
   step if it has running sequences.
2. one ``all_gather`` of a fixed-size int64 status row per rank
   (``[has_work, free_slots, free_blocks, n_offers, need_0 .. need_{K-1}]``): COMPLETION
   ranks publish their credits (``Scheduler.handoff_capacity``), PROMPT ranks up to K
   hand-off offers (blocks each sequence may need on the decode side).
3. every rank computes the same assignment from the gathered rows: offers in order,
   round-robin over PROMPT ranks, each to the COMPLETION rank with the most free blocks
   that can take it (least loaded); an offer that fits nowhere waits (and so do the later
   offers of its rank, to keep FIFO order).
4. transfers, pair by pair in one global order (so blocking send/recv can never wait in
   a cycle): ``send_object_list`` of the metadata (request, tokens, sampling params,
   generator state, logprobs), then one flat uint8 payload with the sequences' KV blocks
   (``kv_cache[:, :, blocks]``) and their sampler-state rows. The receiver allocates
   blocks and a slot (``Scheduler.add_prefilled``) first and scatters into them.
5. the round's gathered ``has_work`` flags say when every rank is done: all ranks leave
   the loop in the same round.

Buffers are bounded: at most K sequences per PROMPT rank per round travel, and a
COMPLETION rank only accepts what its credits cover (slots, and blocks for each
sequence's worst-case length, so it never preempts: it could not recompute a prompt).

Limitation: rounds are lock-step, so a decode step waits for the slowest prefill step of
its round (no overlap inside a round). n > 1 is rejected (ValueError from the scheduler).

Entry points: ``run_disaggregated`` (library; spawns the ranks), ``pd_rank`` (one rank,
e.g. under torchrun), ``generate_pd`` (``deepinfer-generate --pd P:D``: records, resume,
error records and summary of the CLI, spawned or under torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.dp import (
    EXIT_RANK_FAILED,
    RankFailedError,
    RankInfo,
    _comm_device,
    _destroy,
    init_distributed,
    input_order,
    merge_outputs,
    merge_rank_parts,
    part_path,
    select_device,
    spawn_ranks,
    torchrun_world_size,
)
from deepinfer.engine import LLMEngine, _RequestState
from deepinfer.engine_args import EngineArgs
from deepinfer.generate import (
    default_sampling_params,
    engine_args,
    load_resume_state,
    pending_records,
    queue_records,
    result_record,
    summary_line,
    write_record,
)
from deepinfer.sampling_params import SamplingParams

# Status row layout (int64), see the module docstring.
_HAS_WORK, _FREE_SLOTS, _FREE_BLOCKS, _N_OFFERS, _NEEDS = range(5)


@dataclass
class PDRequest:
    """One request of a disaggregated run: exactly one of ``prompt`` (text),
    ``prompt_token_ids`` or ``messages`` (chat; the template is applied on the PROMPT
    rank)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


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
    """``"P:D"`` -> ``(P, D)``, both >= 1."""
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


def split_requests(requests: list[PDRequest], num_prompt: int, world: int
                   ) -> list[list[PDRequest]]:
    """Round-robin over the PROMPT ranks; COMPLETION ranks get empty lists."""
    per_rank: list[list[PDRequest]] = [[] for _ in range(world)]
    for i, r in enumerate(requests):
        per_rank[i % num_prompt].append(r)
    return per_rank


# ====================================================================== engines
class CompletionEngine(LLMEngine):
    """An LLMEngine that also admits sequences prefilled on a PROMPT rank."""

    def add_prefilled(self, meta: dict[str, Any]):
        """Admit a handed-off sequence (``meta`` from ``PromptEngine.handoff_meta``):
        scheduler blocks + slot, and the host state (detokenizer fed the tokens generated
        so far, the generator state, logprobs). Returns its Sequence, or None when there
        are no credits (nothing changed)."""
        rid = meta["request_id"]
        params: SamplingParams = meta["params"]
        stop_ids = meta["stop_token_ids"]
        seq = self.scheduler.add_prefilled(
            rid, meta["prompt_token_ids"], meta["output_token_ids"], params.max_tokens,
            stop_token_ids=stop_ids, min_tokens=params.min_tokens)
        if seq is None:
            return None
        req = _RequestState(rid, meta["prompt"], list(meta["prompt_token_ids"]), params,
                            frozenset(stop_ids))
        self.requests[rid] = req
        st = self._sample_state(req, 0)
        if st.generator is not None and meta["generator_state"] is not None:
            st.generator.set_state(meta["generator_state"])
        if st.logprobs is not None and meta["logprobs"]:
            st.logprobs.extend(meta["logprobs"])
        for t in meta["output_token_ids"]:
            # As step() did on the PROMPT rank: the sequence is not finished, so every
            # token went through the detokenizer.
            st.token_ids.append(t)
            st.detok.add(t)
        self.stats.num_requests += 1
        return seq


class PromptEngine(LLMEngine):
    """An LLMEngine of type PROMPT that describes its handed-off sequences."""

    def handoff_meta(self, seq) -> dict[str, Any]:
        req = self.requests[seq.request_id]
        st = req.samples[seq.sample_index]
        return {
            "request_id": seq.request_id,
            "prompt": req.prompt,
            "prompt_token_ids": list(seq.prompt_token_ids),
            "output_token_ids": list(seq.output_token_ids),
            "params": req.params,
            "stop_token_ids": sorted(req.stop_token_ids),
            "generator_state": None if st.generator is None else st.generator.get_state(),
            "logprobs": st.logprobs,
            "num_blocks": len(seq.blocks),
        }


# ====================================================================== transfer
def _state_row_bytes(states: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in states)


def _pack(runner, blocks: list[int], slots: list[int]) -> torch.Tensor:
    """Flat uint8 payload: ``kv_cache[:, :, blocks]`` ([L, 2, nb, bs, Hkv, D]) then, per
    state tensor, its rows ``[slots]``. Bytes, not typed tensors, so that one send carries
    everything whatever the dtypes (gloo/NCCL need no bf16/bool support)."""
    dev = runner.kv_cache.device
    kv = runner.kv_cache.index_select(2, torch.tensor(blocks, dtype=torch.int64, device=dev))
    parts = [kv.reshape(-1).view(torch.uint8)]
    sidx = torch.tensor(slots, dtype=torch.int64, device=dev)
    for t in runner.states:
        parts.append(t.index_select(0, sidx).reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def _payload_bytes(runner, num_blocks: int, num_seqs: int) -> int:
    kv = runner.kv_cache
    block = kv[:, :, 0].numel() * kv.element_size()
    return num_blocks * block + num_seqs * _state_row_bytes(runner.states)


def _unpack(runner, payload: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
    """Scatter a ``_pack`` payload into ``blocks`` / state ``slots`` of this runner."""
    kv = runner.kv_cache
    dev = kv.device
    shape = list(kv.shape)
    shape[2] = len(blocks)
    nkv = kv[:, :, 0].numel() * kv.element_size() * len(blocks)
    # KV bytes come first, so the typed views below stay aligned.
    src = payload[:nkv].view(kv.dtype).view(shape)
    kv.index_copy_(2, torch.tensor(blocks, dtype=torch.int64, device=dev), src)
    sidx = torch.tensor(slots, dtype=torch.int64, device=dev)
    off = nkv
    for t in runner.states:
        n = len(slots) * t[0].numel() * t.element_size()
        rows = payload[off:off + n].view(t.dtype).view(len(slots), *t.shape[1:])
        t.index_copy_(0, sidx, rows)
        off += n


def assign_offers(rows: list[list[int]], num_prompt: int) -> list[tuple[int, int, int]]:
    """Deterministic routing from the gathered status rows: ``(prompt rank, offer index,
    decode rank)`` triples. Offers go round-robin over PROMPT ranks, in order per rank,
    each to the COMPLETION rank with the most free blocks among those with a free slot
    and enough blocks; a rank's first offer that fits nowhere stops that rank."""
    world = len(rows)
    cap = {d: [rows[d][_FREE_SLOTS], rows[d][_FREE_BLOCKS]] for d in range(num_prompt, world)}
    nxt = [0] * num_prompt
    blocked = [False] * num_prompt
    out: list[tuple[int, int, int]] = []
    progress = True
    while progress:
        progress = False
        for p in range(num_prompt):
            i = nxt[p]
            if blocked[p] or i >= rows[p][_N_OFFERS]:
                continue
            need = rows[p][_NEEDS + i]
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


# ====================================================================== worker
def _build_engine(cls, args: EngineArgs, engine_type: str, device: str):
    return cls(dataclasses.replace(args, engine_type=engine_type, device=device))


def pd_rank(info: RankInfo, num_prompt: int, prompt_args: EngineArgs,
            decode_args: EngineArgs, requests: list[list[PDRequest]], output_path: str,
            options: PDOptions) -> list[dict[str, Any]]:
    """One rank of a disaggregated run (spawned by ``run_disaggregated``, or under torchrun
    with ``RankInfo.from_env()``). Appends its output records to
    ``dp.part_path(output_path, rank)`` as requests finish; returns every rank's counters
    (gathered, in rank order). ``requests[r]``: the requests of PROMPT rank r."""
    is_prompt = info.rank < num_prompt
    device = select_device((prompt_args if is_prompt else decode_args).device,
                           info.local_rank)  # one GPU per rank on CUDA
    init_distributed(info, device, options.timeout_s)
    try:
        own = pd_worker(info, device, num_prompt, prompt_args, decode_args,
                        requests[info.rank], output_path, options)
        stats: list[dict[str, Any]] = [{} for _ in range(info.world_size)]
        dist.all_gather_object(stats, own)
    finally:
        # Free the engine and the loop's buffers while the interpreter is whole, then the
        # group: a gloo group torn down at interpreter exit can abort the process (see
        # deepinfer.dp.generate_rank).
        gc.collect()
        dist.destroy_process_group()
    return stats


def pd_worker(info: RankInfo, device: str, num_prompt: int, prompt_args: EngineArgs,
              decode_args: EngineArgs, requests: list[PDRequest], output_path: str,
              options: PDOptions) -> dict[str, Any]:
    """The body of ``pd_rank`` inside an initialised default group: build this rank's
    engine, run the rounds to the end, return its counters. ``requests``: this rank's
    own (empty on a COMPLETION rank)."""
    is_prompt = info.rank < num_prompt
    if is_prompt:
        engine = _build_engine(PromptEngine, prompt_args, "prompt", device)
    else:
        engine = _build_engine(CompletionEngine, decode_args, "completion", device)
    loop = _PDLoop(engine, info.rank, info.world_size, num_prompt, device,
                   part_path(output_path, info.rank), options)
    return loop.run(requests if is_prompt else [])


class _PDLoop:
    def __init__(self, engine: LLMEngine, rank: int, world: int, num_prompt: int,
                 device: str, part: str, options: PDOptions) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.rank = rank
        self.world = world
        self.num_prompt = num_prompt
        self.is_prompt = rank < num_prompt
        self.dev = _comm_device(device)
        self.k = options.max_offers
        self.max_pending = options.max_pending or self.sched.config.max_num_seqs
        self.out = open(part, "a", encoding="utf-8")
        self.stats: dict[str, Any] = {"rank": rank, "role": "prompt" if self.is_prompt
                                      else "completion", "rounds": 0, "handed_off": 0,
                                      "received": 0, "max_pending": 0, "steps": 0,
                                      # rounds with offers out and none taken (no credits)
                                      "credit_waits": 0,
                                      # requests answered with an error record
                                      "errors": 0}
        self.pending: deque = deque()  # handed-off sequences not yet sent (PROMPT)
        self._row = torch.zeros(5 + self.k, dtype=torch.int64, device=self.dev)
        self._rows = [torch.zeros_like(self._row) for _ in range(world)]

    def _write(self, rec: dict[str, Any]) -> None:
        write_record(self.out, rec)  # flushed: a killed run leaves whole records
        if "error" in rec:
            self.stats["errors"] += 1

    def _gather(self, row: list[int]) -> list[list[int]]:
        self._row.copy_(torch.tensor(row, dtype=torch.int64))
        dist.all_gather(self._rows, self._row)
        return torch.stack(self._rows).cpu().tolist()

    # ------------------------------------------------------------------ setup
    def _add_requests(self, requests: list[PDRequest], decode_cfg: list[list[int]]) -> None:
        """Queue this PROMPT rank's requests; one that no decode rank could ever hold is
        an error record instead of a hang."""
        from deepinfer.tokenizer import apply_chat_template

        eng = self.engine
        max_blocks = max(nb for nb, _ in decode_cfg)
        max_len = max(ml for _, ml in decode_cfg)
        for r in requests:
            try:
                ids = r.prompt_token_ids
                if r.messages is not None:
                    ids = apply_chat_template(eng.tokenizer, r.messages)
                elif ids is None:
                    ids = eng.tokenize(r.prompt) if r.prompt is not None else None
                if ids is not None:
                    need = self.sched.prefilled_blocks(len(ids), r.params.max_tokens)
                    if need > max_blocks or len(ids) + r.params.max_tokens > max_len:
                        raise ValueError(
                            f"request {r.request_id!r}: prompt + max_tokens needs {need} KV "
                            f"blocks / {len(ids) + r.params.max_tokens} positions; no decode "
                            f"rank has that many ({max_blocks} blocks, {max_len} positions)")
                eng.add_request(r.request_id, r.prompt, ids, r.params)
            except ValueError as e:
                self._write({"id": r.request_id, "error": str(e)})

    # ------------------------------------------------------------------ loop
    def run(self, requests: list[PDRequest]) -> dict[str, Any]:
        c = self.sched.config
        # Setup exchange: block size, KV blocks and positions of every rank.
        cfg = self._gather([int(self.is_prompt), c.block_size, c.num_blocks, c.max_model_len]
                           + [0] * (self.k + 1))
        if len({row[1] for row in cfg}) != 1:
            raise ValueError("--pd: all ranks need the same block_size (KV moves by block)")
        if self.is_prompt:
            self._add_requests(requests, [[row[2], row[3]] for row in cfg[self.num_prompt:]])
        t0 = time.perf_counter()
        while True:
            self._local_step()
            rows = self._gather(self._status())
            self.stats["rounds"] += 1
            if not any(row[_HAS_WORK] for row in rows):
                break
            plan = assign_offers(rows, self.num_prompt)
            if self.is_prompt and self.pending and not any(p == self.rank for p, _, _ in plan):
                self.stats["credit_waits"] += 1
            self._transfer(plan)
        self.out.close()
        st = self.engine.stats
        self.stats.update(
            elapsed=time.perf_counter() - t0, prompt_tokens=st.prompt_tokens,
            generated_tokens=st.generated_tokens,
            prefix_cache_hits=self.sched.stats.prefix_cache_hits,
            prefix_cache_queries=self.sched.stats.prefix_cache_queries,
            preemptions=self.sched.stats.num_preemptions)
        return self.stats

    def _local_step(self) -> None:
        eng, s = self.engine, self.sched
        if self.is_prompt:
            if not s.waiting or len(self.pending) >= self.max_pending:
                return  # nothing to prefill, or back-pressure from the decode side
            done = eng.step()
            self.pending.extend(s.take_handoffs())
            self.stats["max_pending"] = max(self.stats["max_pending"], len(self.pending))
        else:
            if not s.running:
                return
            done = eng.step()
        self.stats["steps"] += 1
        for res in done:  # PROMPT side: requests that ended at their first token
            self._write(result_record(res))

    def _status(self) -> list[int]:
        row = [0] * (5 + self.k)
        if self.is_prompt:
            row[_HAS_WORK] = int(self.sched.has_unfinished() or bool(self.pending))
            offers = list(self.pending)[: self.k]
            row[_N_OFFERS] = len(offers)
            for i, seq in enumerate(offers):
                row[_NEEDS + i] = self.sched.prefilled_blocks(len(seq.prompt_token_ids),
                                                              seq.max_tokens)
        else:
            row[_HAS_WORK] = int(self.sched.has_unfinished())
            row[_FREE_SLOTS], row[_FREE_BLOCKS] = self.sched.handoff_capacity()
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
                self.sched.release_handoff(q.seq_id)
                self.engine.requests.pop(q.request_id, None)
            self.stats["handed_off"] += len(sent)

    def _send(self, dst: int, seqs: list) -> None:
        eng: PromptEngine = self.engine  # type: ignore[assignment]
        metas = [eng.handoff_meta(q) for q in seqs]
        dist.send_object_list([metas], dst=dst, device=self.dev)
        blocks = [b for q in seqs for b in q.blocks]
        payload = _pack(eng.runner, blocks, [q.slot for q in seqs])
        dist.send(payload, dst=dst)

    def _recv(self, src: int) -> None:
        eng: CompletionEngine = self.engine  # type: ignore[assignment]
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, device=self.dev)
        metas = box[0]
        seqs = []
        for m in metas:
            seq = eng.add_prefilled(m)
            if seq is None or len(seq.blocks) != m["num_blocks"]:
                # The plan only assigns what the published credits cover.
                raise RuntimeError(f"rank {self.rank}: no room for handed-off request "
                                   f"{m['request_id']!r} despite its credits")
            seqs.append(seq)
        blocks = [b for q in seqs for b in q.blocks]
        payload = torch.empty(_payload_bytes(eng.runner, len(blocks), len(seqs)),
                              dtype=torch.uint8, device=eng.runner.kv_cache.device)
        dist.recv(payload, src=src)
        _unpack(eng.runner, payload, blocks, [q.slot for q in seqs])
        self.stats["received"] += len(seqs)


# ====================================================================== launcher
def run_disaggregated(engine_args: EngineArgs, requests: list[PDRequest], output_path: str,
                      num_prompt: int, num_decode: int, *,
                      decode_args: EngineArgs | None = None,
                      options: PDOptions | None = None,
                      order: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Run ``requests`` on ``num_prompt`` PROMPT + ``num_decode`` COMPLETION processes on
    this machine (``dp.spawn_ranks``) and merge one output record per request into
    ``output_path`` in request order (``dp.merge_outputs``; the format of
    ``deepinfer-generate``). ``decode_args``: engine options of the COMPLETION ranks
    (default ``engine_args``). ``order``: position of each id in the merged file (default:
    request order; records already in ``output_path`` whose id is not in it stay, last).
    Returns the per-rank counters. Requests go round-robin to the PROMPT ranks; on CUDA
    each rank gets its own GPU (P + D GPUs needed). Raises ``dp.RankFailedError`` when a
    rank fails."""
    if num_prompt < 1 or num_decode < 1:
        raise ValueError("run_disaggregated: need at least one prompt and one decode rank")
    decode_args = decode_args or engine_args
    if engine_args.block_size != decode_args.block_size:
        raise ValueError("--pd: prompt and decode ranks need the same block_size")
    engine_args.validate()
    decode_args.validate()
    world = num_prompt + num_decode
    dev = engine_args.device
    if (dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())) \
            and torch.cuda.device_count() < world:
        raise ValueError(f"--pd {num_prompt}:{num_decode} needs {world} GPUs, "
                         f"{torch.cuda.device_count()} visible")
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
def generate_pd(args: argparse.Namespace, inputs: list) -> int:
    """``deepinfer-generate --pd P:D``: the records, error records, resume, exit status
    and summary of a one-engine run, through P PROMPT + D COMPLETION processes. Spawns
    them on this machine, or, under torchrun (WORLD_SIZE must be P + D), this process is
    one of them. ``inputs``: the parsed input records."""

    num_prompt, num_decode = parse_pd(args.pd)
    world = torchrun_world_size()
    if world:
        if world != num_prompt + num_decode:
            print(f"deepinfer-generate: --pd {args.pd} needs WORLD_SIZE="
                  f"{num_prompt + num_decode}; the launcher set {world}", file=sys.stderr)
            return 2
        return _generate_pd_torchrun(args, inputs, num_prompt)
    pending = pending_records(inputs, load_resume_state(args.output, inputs), args.output)
    if not pending:
        return 0
    requests, failed = pd_requests(pending, args)
    stats: list[dict[str, Any]] = []
    if requests:
        try:
            stats = run_disaggregated(engine_args(args), requests, args.output, num_prompt,
                                      num_decode, options=PDOptions(timeout_s=args.dp_timeout),
                                      order=input_order(r.id for r in inputs))
        except ValueError as e:  # engine options, or too few GPUs for P + D ranks
            print(f"deepinfer-generate: {e}", file=sys.stderr)
            return 2
        except RankFailedError as e:
            print(f"deepinfer-generate: {e}; the other ranks were stopped. Records already "
                  "written are kept: rerun the same command to finish.", file=sys.stderr)
            return EXIT_RANK_FAILED
    return _pd_report(args, requests, failed, stats)


def pd_requests(pending: list, args: argparse.Namespace) -> tuple[list[PDRequest], int]:
    """``PDRequest``s of the good records; the others (bad line, invalid sampling values,
    n > 1) are appended to ``args.output`` as error records at once. Returns the requests
    and the number of error records. Checks that need the tokenizer or the engines'
    sizes (an over-long prompt) are made by the PROMPT ranks, which write those errors."""

    requests: list[PDRequest] = []

    def accept(rec, sp: SamplingParams, prompt, messages) -> None:
        check_pd_params(rec.id, sp)
        requests.append(PDRequest(rec.id, prompt=prompt, messages=messages, params=sp))

    with open(args.output, "a", encoding="utf-8") as out:
        failed = queue_records(pending, default_sampling_params(args), args.chat, out, accept)
    return requests, failed


def _pd_report(args: argparse.Namespace, requests: list[PDRequest], failed: int,
               stats: list[dict[str, Any]]) -> int:
    """The summary of a PD run (summed over the ranks; time: the slowest rank's rounds,
    model loading excluded as in a one-engine run), ``--show``, and the exit status."""

    def total(key: str) -> int:
        return sum(s[key] for s in stats)

    errors = total("errors")
    failed += errors
    if args.show and requests:
        _show_records(args.output, {r.request_id: r.prompt if r.prompt is not None
                                    else r.messages for r in requests})
    print(summary_line(len(requests) - errors, failed, total("prompt_tokens"),
                       total("generated_tokens"), max((s["elapsed"] for s in stats),
                                                      default=0.0),
                       total("preemptions"), total("prefix_cache_hits"),
                       total("prefix_cache_queries")), file=sys.stderr)
    if stats:
        print(f"pd: {sum(s['role'] == 'prompt' for s in stats)} prompt + "
              f"{sum(s['role'] == 'completion' for s in stats)} completion ranks, "
              f"{total('handed_off')} sequences handed off in "
              f"{max(s['rounds'] for s in stats)} rounds, "
              f"{total('credit_waits')} rounds waiting for decode credits", file=sys.stderr)
    return 1 if failed else 0


def _show_records(output: str, prompts: dict[str, Any]) -> None:
    """``--show`` for a PD run: results are printed once merged (the ranks write part
    files; no process sees them as they finish)."""
    with open(output, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["id"] in prompts and "outputs" in rec:
                print(f"[{rec['id']}] {prompts[rec['id']]!r}\n"
                      f"  -> {rec['outputs'][0]['text']!r}")


def _generate_pd_torchrun(args: argparse.Namespace, inputs: list, num_prompt: int) -> int:
    """One process of a torchrun-launched ``--pd`` run. Rank 0 alone prepares the output
    (resume, early error records) and sends the requests to all; after the rounds it
    merges the part files. Returns the run's exit status (3: a rank failed)."""

    info = RankInfo.from_env()
    rank0 = info.rank == 0
    try:
        device = select_device(args.device, info.local_rank)
    except RankFailedError as e:
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        return EXIT_RANK_FAILED
    init_distributed(info, device, args.dp_timeout)
    status = 0
    try:
        payload: list[Any] = [None]
        if rank0:
            pending = pending_records(inputs, load_resume_state(args.output, inputs),
                                      args.output)
            payload = [pd_requests(pending, args) if pending else ([], 0)]
        dist.broadcast_object_list(payload, src=0)
        requests, failed = payload[0]
        stats: list[dict[str, Any]] = []
        if requests:
            eargs = engine_args(args)
            mine = split_requests(requests, num_prompt, info.world_size)[info.rank]
            own = pd_worker(info, device, num_prompt, eargs, eargs, mine, args.output,
                            PDOptions(timeout_s=args.dp_timeout))
            stats = [None] * info.world_size  # type: ignore[list-item]
            # Also the point after which every part file is complete and closed.
            dist.all_gather_object(stats, own)
            if rank0:
                merge_rank_parts(args.output, input_order(r.id for r in inputs), info.world_size)
        if rank0 and (requests or failed):
            status = _pd_report(args, requests, failed, stats)
        else:
            status = 1 if failed + sum(s["errors"] for s in stats) else 0
        # Nobody exits before the merge is over: torchrun stops all ranks when one exits.
        dist.barrier()
    except RuntimeError as e:
        # gloo: "Connection closed by peer" when a rank dies; NCCL/gloo: a timeout.
        first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        print(f"deepinfer-generate: rank {info.rank}: {first}", file=sys.stderr)
        status = EXIT_RANK_FAILED
    finally:
        gc.collect()  # free the group's last users before the group (see deepinfer.dp)
        _destroy()
    return status
