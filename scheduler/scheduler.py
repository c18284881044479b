"""The scheduler: step type (a port of the seed's ``_schedule``), admission with prefix
caching and chunked prefill, decode with copy-on-write and preemption, and ``update``.

Per live sequence, the hot decode path reads numpy arrays indexed by its state slot
(length, last token, block-table row, block count, length limit), so a decode step over
B sequences is a handful of vectorized gathers plus Python work only for the few
sequences that need a new block, a copy-on-write or a finish.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence as _Seq

import numpy as np
import torch

from scheduler.batch import BatchBuffers, LaunchBatch
from scheduler.block_manager import ROOT_HASH, BlockPool, chain_hash
from scheduler.config import EngineType, SchedulerConfig
from scheduler.dp import DPVoter
from scheduler.outputs import SchedulerOutputs, SchedulerStats
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.state_manager import StateManager

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED
_TRANSFERRING = SequenceStatus.TRANSFERRING


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """One rank's scheduler. ``dp_group``: a ``torch.distributed`` process group whose
    ranks vote on the step type, or None for a single rank (no collective at all).

    Thread safety: one lock (re-entrant) covers the block pool, the state slots and the
    queues; ``schedule``, ``update``, ``add_request``, ``abort`` and ``finish_sequence``
    all take it, so requests may be added or aborted from other threads at any time.
    """

    def __init__(self, config: SchedulerConfig, dp_group=None) -> None:
        config.validate()
        self.config = config
        c = config
        self.block_size = bs = c.block_size
        self._lock = threading.RLock()
        self.block_pool = BlockPool(c.num_blocks, bs, c.enable_prefix_caching)
        self.state_manager = StateManager(c.max_num_seqs)
        self._voter = DPVoter(dp_group, c.device)
        # Live sequences (slot holders) never exceed the decode budget either.
        self._max_live = min(c.max_num_seqs, c.max_num_batched_tokens)
        nslots, mb = c.max_num_seqs, c.max_blocks_per_seq
        # Per-slot rows: the decode hot path gathers these by slot.
        self._tables = np.zeros((nslots, mb), dtype=np.int32)  # block-table rows, 0-padded
        self._nblocks = np.zeros(nslots, dtype=np.int64)
        self._len = np.zeros(nslots, dtype=np.int64)  # prompt + outputs
        self._last_tok = np.zeros(nslots, dtype=np.int64)
        self._max_len = np.zeros(nslots, dtype=np.int64)  # prompt + max_tokens
        pin = c.device.startswith("cuda") and torch.cuda.is_available()
        max_tokens = max(c.max_num_batched_tokens, nslots)
        self._bufs = (BatchBuffers(max_tokens, nslots, mb, pin),
                      BatchBuffers(max_tokens, nslots, mb, pin))
        self._buf_index = 0
        self._arange = np.arange(max_tokens + 1, dtype=np.int64)

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._run_slots: np.ndarray | None = None  # cached slots of `running` (None: stale)
        self._partial: Sequence | None = None  # prompt cut by chunked prefill, if any
        # PROMPT engines: sequences handed off (TRANSFERRING) and not yet released, in
        # hand-off order, and the ones take_handoffs() has not returned yet.
        self._handoffs: dict[int, Sequence] = {}
        self._new_handoffs: list[Sequence] = []
        self._requests: dict[str, list[Sequence]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._stop_refs: dict[int, int] = {}
        self._stop_union: np.ndarray | None = np.zeros(0, dtype=np.int64)

        self.decode_step = 0
        self.stats = SchedulerStats()
        self._step = 0
        self._updated = True
        self._epoch = 0  # bumped by abort/finish_sequence: update() re-checks statuses
        # Per-step lists (the seed's clone_blocks / zero_states / clone_states).
        self._clone_blocks: list[int] = []
        self._zero_states: list[int] = []
        self._clone_states: list[int] = []
        self._empty_1d = torch.zeros(0, dtype=torch.int64)
        self._empty_pairs = torch.zeros((0, 2), dtype=torch.int64)

    # ================================================================== requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, *,
                    n: int = 1, stop_token_ids: _Seq[int] = (), min_tokens: int = 0) -> None:
        """Queue a request of ``n`` samples. Raises ``ValueError`` naming the request and
        the rule it breaks (state unchanged) if it is malformed or could never run."""
        rid = request_id
        c = self.config
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt (prompt_token_ids has no tokens)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens={max_tokens!r} must be >= 1")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"request {rid!r}: n={n!r} must be >= 1")
        if not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"request {rid!r}: min_tokens={min_tokens!r} must be >= 0")
        total = len(prompt) + max_tokens
        if total > c.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                f"= {total} exceeds max_model_len={c.max_model_len}")
        prompt_blocks = _cdiv(len(prompt), c.block_size)
        if prompt_blocks > c.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt needs {prompt_blocks} KV blocks, more than the "
                f"whole cache (num_blocks={c.num_blocks})")
        # The last sampled token is never fed back, so a sequence holds at most
        # prompt + max_tokens - 1 tokens of K/V; more than the cache could never run.
        seq_blocks = _cdiv(total - 1, c.block_size)
        if seq_blocks > c.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt + max_tokens needs {seq_blocks} KV blocks, more "
                f"than the whole cache (num_blocks={c.num_blocks}); it could never finish")
        if n > self._max_live:
            raise ValueError(
                f"request {rid!r}: n={n} samples need {n} state slots, more than "
                f"max_num_seqs={c.max_num_seqs} (or max_num_batched_tokens)")
        if n > 1 and c.engine_type is EngineType.PROMPT:
            # Forked children share their parent's blocks; handing a group off would need
            # shared-block transfers and COW bookkeeping across engines. Not supported.
            raise ValueError(
                f"request {rid!r}: n={n} is not supported with disaggregated prefill "
                "(a PROMPT engine hands off single sequences only); use n=1")
        stops = tuple(int(t) for t in stop_token_ids)
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"request {rid!r}: duplicate request id (still running)")
            seq = Sequence(self._new_seq_id(), rid, 0, prompt, max_tokens,
                           min_tokens=min_tokens, stop_token_ids=stops, num_forks=n - 1)
            self._track(seq)
            self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """End every live sequence of a request (finish_reason "abort"); False if unknown
        or already finished."""
        with self._lock:
            seqs = self._requests.get(request_id)
            if not seqs:
                return False
            for seq in list(seqs):
                self._finish(seq, "abort")
            self._epoch += 1
            return True

    def finish_sequence(self, seq_id: int, reason: str = "stop") -> Sequence | None:
        """End one live sequence early (e.g. a stop string matched); None if unknown."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return None
            self._finish(seq, reason)
            self._epoch += 1
            return seq

    def get_sequences(self, request_id: str) -> list[Sequence]:
        """Live sequences of a request (empty once it finished or if unknown)."""
        with self._lock:
            return list(self._requests.get(request_id, ()))

    def has_unfinished(self) -> bool:
        """Waiting, running or (PROMPT engine) handed-off sequences not yet released."""
        return bool(self.waiting or self.running or self._handoffs)

    def has_unfinished_dp(self) -> bool:
        """Whether any rank of the DP group has unfinished work (one all-reduce; every
        rank must call it at the same point of its loop). A rank with no work keeps
        stepping (empty batches) until this says the whole group is done."""
        with self._lock:
            return self._voter.allreduce_min(0 if self.has_unfinished() else 1) == 0

    def cache_usage(self) -> float:
        """Fraction of KV blocks held by live sequences (evictable cached blocks are free)."""
        return self.block_pool.usage()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ================================================================== disaggregation
    # PROMPT side: update() moves a sequence whose prompt completed and whose first
    # token was appended to TRANSFERRING instead of running (a PROMPT engine never
    # decodes). The engine takes it (take_handoffs), ships its tokens, KV blocks and
    # state row, then releases it (release_handoff). COMPLETION side: add_prefilled
    # allocates blocks + a slot for such a sequence and puts it straight into running.

    @property
    def num_handoffs(self) -> int:
        """Handed-off sequences still holding their blocks and slot (PROMPT engine)."""
        return len(self._handoffs)

    def take_handoffs(self) -> list[Sequence]:
        """Sequences that entered TRANSFERRING since the last call, in order. Each keeps
        its ``blocks`` (the first ``ceil(num_computed_tokens / block_size)`` hold its
        K/V) and ``slot`` until ``release_handoff``; those finished meanwhile (a stop
        string in the first token, an abort) are left out."""
        with self._lock:
            out = [s for s in self._new_handoffs if s.status is _TRANSFERRING]
            self._new_handoffs.clear()
            return out

    def release_handoff(self, seq_id: int) -> Sequence:
        """Free a handed-off sequence's blocks (full ones stay in the prefix cache) and
        slot once its transfer completed; it ends here with finish_reason "handoff"."""
        with self._lock:
            seq = self._handoffs.get(seq_id)
            if seq is None:
                raise ValueError(f"release_handoff: sequence {seq_id} is not handed off")
            self._finish(seq, "handoff")
            self._epoch += 1
            return seq

    def prefilled_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a prefilled sequence may hold at most on this engine (its last sampled
        token is never fed back): what ``add_prefilled`` reserves."""
        return _cdiv(prompt_len + max_tokens - 1, self.block_size)

    def handoff_capacity(self) -> tuple[int, int]:
        """``(slots, blocks)`` still available to ``add_prefilled``: free state slots, and
        free KV blocks minus the blocks running sequences may still claim until they reach
        their length limit. Admitting only within this budget means a running sequence
        never has to be preempted; a COMPLETION engine could never recompute one."""
        with self._lock:
            slots = self._slot_room()
            owed = 0
            if self.running:
                rs = self._running_slots()
                worst = (self._max_len[rs] - 1 + self.block_size - 1) // self.block_size
                owed = int(np.maximum(worst - self._nblocks[rs], 0).sum())
            return max(slots, 0), max(self.block_pool.num_free - owed, 0)

    def can_accept(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether ``add_prefilled`` of such a sequence would succeed now (credits)."""
        slots, blocks = self.handoff_capacity()
        return slots >= 1 and blocks >= self.prefilled_blocks(prompt_len, max_tokens)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int],
                      output_token_ids: list[int], max_tokens: int, *,
                      stop_token_ids: _Seq[int] = (), min_tokens: int = 0
                      ) -> Sequence | None:
        """Admit a sequence prefilled elsewhere (its first output token(s) sampled there)
        straight into running. Allocates a state slot and fresh blocks for its
        ``num_tokens - 1`` computed tokens: the caller fills ``seq.blocks`` with their K/V
        and ``seq.slot``'s state rows before the next ``schedule()`` (the slot is not
        zeroed). Returns None, changing nothing, when ``can_accept`` says no
        (back-pressure); raises ``ValueError`` if it could never be admitted. n = 1 only."""
        rid = request_id
        c = self.config
        prompt = [int(t) for t in prompt_token_ids]
        outs = [int(t) for t in output_token_ids]
        if not prompt or not outs:
            raise ValueError(f"request {rid!r}: add_prefilled needs a prompt and at least "
                             "one output token")
        if not isinstance(max_tokens, int) or len(outs) >= max_tokens:
            raise ValueError(f"request {rid!r}: max_tokens={max_tokens!r} must exceed the "
                             f"{len(outs)} output tokens already generated")
        total = len(prompt) + max_tokens
        if total > c.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({len(prompt)} tokens) + max_tokens "
                             f"({max_tokens}) = {total} exceeds max_model_len={c.max_model_len}")
        need = self.prefilled_blocks(len(prompt), max_tokens)
        if need > c.num_blocks:
            raise ValueError(f"request {rid!r}: needs {need} KV blocks, more than the whole "
                             f"cache (num_blocks={c.num_blocks}); it could never finish")
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"request {rid!r}: duplicate request id (still running)")
            if not self.can_accept(len(prompt), max_tokens):
                return None
            seq = Sequence(self._new_seq_id(), rid, 0, prompt, max_tokens,
                           min_tokens=min_tokens,
                           stop_token_ids=tuple(int(t) for t in stop_token_ids))
            seq.output_token_ids = outs
            ntok = seq.num_tokens
            self._bind_slot(seq, self.state_manager.allocate())
            for _ in range(_cdiv(ntok - 1, self.block_size)):
                self._append_block(seq, self.block_pool.allocate())
            seq._computed = ntok - 1
            seq.admitted = True
            seq.status = _RUNNING
            self._track(seq)
            self.running.append(seq)
            self._run_slots = None
            return seq

    # ================================================================== schedule
    def schedule(self) -> SchedulerOutputs:
        """Decide this step's type and contents; see ``SchedulerOutputs`` for the borrow
        contract of what it returns."""
        with self._lock:
            # The previous outputs borrowed these; they must have been consumed by now.
            self._clone_blocks.clear()
            self._zero_states.clear()
            self._clone_states.clear()
            self._step += 1
            self._updated = False
            et = self.config.engine_type
            if et is EngineType.PROMPT:
                # Prefill-only engine: a prefill result even if nothing was scheduled.
                out = self._schedule_prefill()
                if out is None:
                    out = self._empty(True)
            elif et is EngineType.COMPLETION:
                out = self._schedule_decode()
            else:
                out = self._schedule_normal()
            if out.is_prompt:
                self.decode_step = 0
                self.stats.num_prompt_steps += 1
            else:
                self.decode_step += 1
                self.stats.num_decode_steps += 1
            return out

    def _schedule_normal(self) -> SchedulerOutputs:
        """The seed's NORMAL branch: ALL/ANY vote points, then a second vote on whether
        any rank actually scheduled a prefill."""
        c = self.config
        d = self.decode_step
        is_any = d != 0 and d % c.prefill_any_attempt_interval == 0
        is_all = d % c.prefill_attempt_interval == 0
        if not is_any and not is_all:
            return self._schedule_decode()
        # Deviation from the seed, for liveness only: with nothing running no decode can
        # ever lower the usage (a cut prompt may hold blocks), so the watermark is waived.
        want = bool(self.waiting) and (self.cache_usage() <= c.prefill_watermark
                                       or not self.running)
        vote = self._voter.allreduce_min
        if is_any:
            do_prefill = vote(0 if want else 1) == 0  # ANY: one rank wanting is enough
        else:
            do_prefill = vote(1 if want else 0) == 1  # ALL: every rank must want
        if not do_prefill:
            return self._schedule_decode()
        out = self._schedule_prefill() if want else None
        # Prefill can still come back empty (no slot, no blocks). If it did on every
        # rank, decode: an empty prompt step would reset decode_step and vote again
        # forever while running is full and waiting is not empty.
        if vote(0 if out is not None else 1) != 0:
            return self._schedule_decode()
        if out is not None:
            return out
        return self._empty(True)  # another rank prefills: keep the step types equal

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> SchedulerOutputs | None:
        """Pack waiting sequences first-come-first-served into one prompt step; the last
        may be cut (chunked prefill). None if nothing could be scheduled."""
        c = self.config
        bs = self.block_size
        pool = self.block_pool
        budget = c.max_num_batched_tokens
        sched: list[tuple[Sequence, int, int]] = []  # (seq, first new token, num new)
        for seq in self.waiting:
            if budget <= 0:
                break
            ntok = seq.num_tokens
            if seq.slot < 0:
                start = self._admit(seq, budget)
                if start < 0:
                    break
            else:  # continues a chunked prompt: already holds its slot and blocks
                start = seq._computed
            num_new = min(ntok - start, budget)
            if not c.enable_chunked_prefill and num_new < ntok - start:
                break
            need = _cdiv(start + num_new, bs) - len(seq.blocks)
            if need > pool.num_free:
                break  # only a continuing prompt can get here: _admit checked the rest
            for _ in range(need):
                self._append_block(seq, pool.allocate())
            seq._computed = start + num_new
            budget -= num_new
            sched.append((seq, start, num_new))
        if not sched:
            return None
        return self._build_prefill(sched)

    def _slot_room(self) -> int:
        """State slots a new sequence (or group) may still take: free ones, within the cap
        on live sequences."""
        states = self.state_manager
        live = states.num_slots - states.num_free
        return min(states.num_free, self._max_live - live)

    def _bind_slot(self, seq: Sequence, slot: int) -> None:
        """Give ``seq`` the freshly allocated ``slot`` and its per-slot arrays (a free
        slot's block count is already 0)."""
        ntok = seq.num_tokens
        seq.slot = slot
        self._len[slot] = ntok
        self._last_tok[slot] = seq.token_slice(ntok - 1, ntok)[0]
        self._max_len[slot] = len(seq.prompt_token_ids) + seq.max_tokens

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its state slot(s) and prefix-cache hits if it can be
        admitted with this step's ``budget``; returns its first token to compute, or -1
        (nothing changed) if it cannot."""
        c = self.config
        bs = self.block_size
        pool = self.block_pool
        states = self.state_manager
        need_slots = 1 + seq.num_forks
        if self._slot_room() < need_slots:
            return -1
        ntok = seq.num_tokens
        hits: list[int] = []
        nfull = (ntok - 1) // bs  # the last token is always computed, so its block too
        if c.enable_prefix_caching and nfull:
            hashes = self._seq_hashes(seq, nfull)
            hits = pool.lookup(hashes[:nfull],
                               lambda i: tuple(seq.token_slice(i * bs, (i + 1) * bs)))
        start = len(hits) * bs
        num_new = min(ntok - start, budget)
        if not c.enable_chunked_prefill and num_new < ntok - start:
            return -1
        need = _cdiv(start + num_new, bs) - len(hits)
        revived = sum(1 for b in hits if pool.ref[b] == 0)  # hits that are evictable now
        if need + revived > pool.num_free:
            return -1
        self.stats.prefix_cache_queries += ntok
        self.stats.prefix_cache_hits += start
        self._bind_slot(seq, states.allocate())
        seq.reserved_slots = [states.allocate() for _ in range(seq.num_forks)]
        for b in hits:
            pool.take(b)
            self._append_block(seq, b)
        seq.num_registered = len(hits)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = start
        self._zero_states.append(seq.slot)
        return start

    def _build_prefill(self, sched: list[tuple[Sequence, int, int]]) -> SchedulerOutputs:
        bs = self.block_size
        nb = len(sched)
        seqs = [s for s, _, _ in sched]
        starts = np.fromiter((a for _, a, _ in sched), dtype=np.int64, count=nb)
        lens = np.fromiter((n for _, _, n in sched), dtype=np.int64, count=nb)
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=nb)
        buf = self._next_buffers()
        qsl = buf.query_start_loc_np[: nb + 1]
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:])
        t = int(qsl[nb])
        ids: list[int] = []
        for seq, a, n in sched:
            ids += seq.token_slice(a, a + n)
        buf.input_ids_np[:t] = ids
        pos = buf.positions_np[:t]
        np.subtract(self._arange[:t], np.repeat(qsl[:-1] - starts, lens), out=pos)
        rows = np.repeat(slots, lens)
        blk = self._tables[rows, pos // bs].astype(np.int64)
        np.add(blk * bs, pos % bs, out=buf.slot_mapping_np[:t])
        seq_lens = starts + lens
        buf.seq_lens_np[:nb] = seq_lens
        buf.state_slots_np[:nb] = slots
        w = int(self._nblocks[slots].max())
        np.take(self._tables[:, :w], slots, axis=0, out=buf.block_tables_view(nb, w))

        # Sequences whose prompt completes now move to running (they are at the head of
        # waiting, in order) and sample; a group with n > 1 forks its children here.
        sample_seqs: list[Sequence] = []
        rows_out: list[int] = []
        for i, seq in enumerate(seqs):
            if seq._computed < seq.num_tokens:
                self._partial = seq  # cut: stays at the head of waiting
                continue
            if self._partial is seq:
                self._partial = None
            head = self.waiting.popleft()
            assert head is seq, "prefill must complete waiting sequences in order"
            seq.status = _RUNNING
            self.running.append(seq)
            row = int(qsl[i + 1]) - 1
            sample_seqs.append(seq)
            rows_out.append(row)
            if seq.num_forks:
                for child in self._fork(seq):
                    self.running.append(child)
                    sample_seqs.append(child)
                    rows_out.append(row)
        self._run_slots = None
        ns = len(sample_seqs)
        buf.logits_indices_np[:ns] = rows_out
        buf.sample_state_slots_np[:ns] = [s.slot for s in sample_seqs]
        batch = buf.make(t, nb, w, ns, int(lens.max()), int(seq_lens.max()))
        return self._outputs(True, seqs, sample_seqs, t, batch,
                             slots)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create the parent's n-1 children: they share its blocks and get a copy of its
        state slot (clone_states) in the reserved slots."""
        pool = self.block_pool
        ps = parent.slot
        children = []
        for k, slot in enumerate(parent.reserved_slots):
            child = Sequence(self._new_seq_id(), parent.request_id, k + 1,
                             parent.prompt_token_ids, parent.max_tokens,
                             min_tokens=parent.min_tokens,
                             stop_token_ids=parent.stop_token_ids)
            child.status = _RUNNING
            child.slot = slot
            child.blocks = list(parent.blocks)
            for b in child.blocks:
                pool.take(b)
            nblk = len(child.blocks)
            self._tables[slot, :nblk] = self._tables[ps, :nblk]
            self._nblocks[slot] = nblk
            self._len[slot] = self._len[ps]
            self._last_tok[slot] = self._last_tok[ps]
            self._max_len[slot] = self._max_len[ps]
            child.block_hashes = list(parent.block_hashes)
            child.num_registered = parent.num_registered
            child.admitted = True
            child.num_cached_tokens = parent.num_cached_tokens
            child._computed = parent._computed
            self._clone_states += (ps, slot)
            self._track(child)
            children.append(child)
        parent.num_forks = 0
        parent.reserved_slots = []
        return children

    # ------------------------------------------------------------------ decode
    def _schedule_decode(self) -> SchedulerOutputs:
        """One token for every running sequence; preempts the most recently admitted
        ones when a sequence cannot get the block it writes into."""
        if not self.running:
            return self._empty(False)
        bs = self.block_size
        slots = self._running_slots()
        pos = self._len[slots] - 1
        bidx = pos // bs
        need_new = bidx >= self._nblocks[slots]
        tgt = self._tables[slots, bidx]
        # Rows that need Python work: a new block, or a write into a shared block (COW).
        todo = np.flatnonzero(need_new | (self.block_pool.ref[tgt] > 1))
        if todo.size:
            nb = self._reserve_decode(todo.tolist())
            if nb == 0:
                return self._empty(False)
            if nb < slots.shape[0]:
                slots, pos, bidx = slots[:nb], pos[:nb], bidx[:nb]
                self._run_slots = slots
            tgt = self._tables[slots, bidx]
        nb = slots.shape[0]
        buf = self._next_buffers()
        np.take(self._last_tok, slots, out=buf.input_ids_np[:nb])
        buf.positions_np[:nb] = pos
        sm = buf.slot_mapping_np[:nb]
        np.multiply(tgt, bs, out=sm)
        sm += pos % bs
        buf.seq_lens_np[:nb] = pos + 1
        buf.query_start_loc_np[: nb + 1] = self._arange[: nb + 1]
        buf.logits_indices_np[:nb] = self._arange[:nb]
        buf.state_slots_np[:nb] = slots
        buf.sample_state_slots_np[:nb] = slots
        w = int(self._nblocks[slots].max())
        np.take(self._tables[:, :w], slots, axis=0, out=buf.block_tables_view(nb, w))
        batch = buf.make(nb, nb, w, nb, 1, int(pos.max()) + 1)
        seqs = list(self.running)
        return self._outputs(False, seqs, seqs, nb, batch, slots)

    def _reserve_decode(self, todo: list[int]) -> int:
        """Give rows ``todo`` of running their next block (new or copy-on-write),
        preempting from the tail of running when the pool is empty. Returns how many
        running sequences remain (a prefix of running, in order)."""
        running = self.running
        end = len(running)
        for i in todo:
            if i >= end:
                break
            seq = running[i]
            while not self._give_block(seq):
                if self._partial is not None:
                    # A cut prompt was admitted last: it goes first.
                    self._preempt_partial()
                    continue
                end -= 1
                victim = running[end]
                self._release(victim)
                victim.status = _WAITING
                self.waiting.appendleft(victim)
                self.stats.num_preemptions += 1
                if victim is seq:
                    break
        if end < len(running):
            del running[end:]
        return end

    def _give_block(self, seq: Sequence) -> bool:
        pool = self.block_pool
        slot = seq.slot
        bi = (int(self._len[slot]) - 1) // self.block_size
        if bi >= len(seq.blocks):
            if pool.num_free < 1:
                return False
            self._append_block(seq, pool.allocate())
            return True
        old = seq.blocks[bi]
        if pool.ref[old] > 1:  # shared with a fork sibling: copy before writing
            if pool.num_free < 1:
                return False
            new = pool.allocate()
            pool.free([old])
            seq.blocks[bi] = new
            self._tables[slot, bi] = new
            self._clone_blocks += (old, new)
        return True

    def _preempt_partial(self) -> None:
        seq = self._partial
        assert seq is not None
        self._partial = None
        self._release(seq)  # stays where it is in waiting
        self.stats.num_preemptions += 1

    # ================================================================== update
    def update(self, out: SchedulerOutputs, sampled_token_ids) -> list[Sequence]:
        """Apply one step's sampled tokens (``out.num_samples`` ids in sample order: a
        list or a 1-D tensor/array). Appends them, applies stop tokens and max_tokens,
        frees finished sequences, registers newly full blocks in the prefix cache.
        Returns the sequences that finished."""
        if isinstance(sampled_token_ids, list):
            tl = sampled_token_ids  # the runner's .tolist(): already Python ints
        elif isinstance(sampled_token_ids, (torch.Tensor, np.ndarray)):
            tl = sampled_token_ids.reshape(-1).tolist()
        else:
            tl = [int(t) for t in sampled_token_ids]
        with self._lock:
            if out._step != self._step or self._updated:
                raise ValueError("update() takes the outputs of the latest schedule(), once")
            if len(tl) != out.num_samples:
                raise ValueError(
                    f"update(): got {len(tl)} sampled token ids, the step has "
                    f"{out.num_samples} samples")
            self._updated = True
            if out.is_prompt:
                if self.config.enable_prefix_caching:
                    for seq in out.seqs:
                        if seq.status is not _FINISHED:
                            self._register(seq, seq._computed)
                finished = self._apply_samples(out.sample_seqs, tl, register=False)
            elif out._epoch != self._epoch:
                finished = self._apply_samples(out.seqs, tl, register=True)
            else:
                finished = self._update_decode(out, tl)
            handed = False
            if out.is_prompt and self.config.engine_type is EngineType.PROMPT:
                # A PROMPT engine never decodes: hand off what would start decoding.
                for seq in out.sample_seqs:
                    if seq.status is _RUNNING:
                        seq.status = _TRANSFERRING
                        self._handoffs[seq.seq_id] = seq
                        self._new_handoffs.append(seq)
                        handed = True
            if finished or handed:
                self.running = [s for s in self.running if s.status is _RUNNING]
                self._run_slots = None
            return finished

    def _apply_samples(self, seqs: list[Sequence], tl: list[int],
                       register: bool) -> list[Sequence]:
        """Per-sequence path (prompt steps, or decode after a concurrent abort)."""
        bs = self.block_size
        caching = register and self.config.enable_prefix_caching
        finished = []
        for seq, t in zip(seqs, tl):
            if seq.status is not _RUNNING:
                continue  # aborted / finished since schedule()
            slot = seq.slot
            seq.output_token_ids.append(t)
            self._len[slot] += 1
            self._last_tok[slot] = t
            if caching:
                computed = seq.num_tokens - 1
                if computed % bs == 0:
                    self._register(seq, computed)
            reason = self._stop_reason(seq, t)
            if reason is not None:
                self._finish(seq, reason, bulk=True)
                finished.append(seq)
        return finished

    def _update_decode(self, out: SchedulerOutputs, tl: list[int]) -> list[Sequence]:
        """Vectorized decode update: every sequence of ``out`` is still running."""
        seqs = out.seqs
        slots = out._slots
        toks = np.asarray(tl, dtype=np.int64)
        self._len[slots] += 1
        self._last_tok[slots] = toks
        for seq, t in zip(seqs, tl):
            seq.output_token_ids.append(t)
        newlen = self._len[slots]
        if self.config.enable_prefix_caching:
            for i in np.flatnonzero((newlen - 1) % self.block_size == 0).tolist():
                self._register(seqs[i], int(newlen[i]) - 1)
        done = np.flatnonzero(newlen >= self._max_len[slots])
        union = self._stop_ids()
        if union.size:
            cand = np.flatnonzero(np.isin(toks, union))
            if cand.size:
                done = np.union1d(done, cand)
        finished = []
        for i in done.tolist():
            seq = seqs[i]
            reason = self._stop_reason(seq, tl[i])
            if reason is not None:
                self._finish(seq, reason, bulk=True)
                finished.append(seq)
        return finished

    @staticmethod
    def _stop_reason(seq: Sequence, t: int) -> str | None:
        nout = len(seq.output_token_ids)
        if t in seq.stop_token_ids and nout > seq.min_tokens:
            return "stop"
        if nout >= seq.max_tokens:
            return "length"
        return None

    # ================================================================== helpers
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _track(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        self._requests.setdefault(seq.request_id, []).append(seq)
        for t in seq.stop_token_ids:
            n = self._stop_refs.get(t, 0)
            self._stop_refs[t] = n + 1
            if n == 0:
                self._stop_union = None

    def _stop_ids(self) -> np.ndarray:
        if self._stop_union is None:
            self._stop_union = np.fromiter(self._stop_refs, dtype=np.int64,
                                           count=len(self._stop_refs))
        return self._stop_union

    def _finish(self, seq: Sequence, reason: str, bulk: bool = False) -> None:
        """End a live sequence in any state. ``bulk``: the caller rebuilds ``running``."""
        if seq.status is _FINISHED:
            return
        if seq.status is _RUNNING:
            if not bulk:
                self.running.remove(seq)
                self._run_slots = None
        elif seq.status is _TRANSFERRING:
            del self._handoffs[seq.seq_id]
        else:
            self.waiting.remove(seq)
            if self._partial is seq:
                self._partial = None
        self._release(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        group = self._requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
        for t in seq.stop_token_ids:
            n = self._stop_refs[t] - 1
            if n:
                self._stop_refs[t] = n
            else:
                del self._stop_refs[t]
                self._stop_union = None

    def _release(self, seq: Sequence) -> None:
        """Free a sequence's blocks and slots; it will recompute from scratch."""
        if seq.blocks:
            self.block_pool.free(seq.blocks)
            seq.blocks = []
        slot = seq.slot
        if slot >= 0:
            self._tables[slot, : self._nblocks[slot]] = 0
            self._nblocks[slot] = 0
            self.state_manager.free(slot)
            seq.slot = -1
        for s in seq.reserved_slots:
            self.state_manager.free(s)
        seq.reserved_slots = []
        seq._computed = 0
        seq.num_registered = 0

    def _append_block(self, seq: Sequence, b: int) -> None:
        i = len(seq.blocks)
        seq.blocks.append(b)
        self._tables[seq.slot, i] = b
        self._nblocks[seq.slot] = i + 1

    def _seq_hashes(self, seq: Sequence, n: int) -> list[int]:
        """Chain hashes of the sequence's first ``n`` full blocks (computed once)."""
        hashes = seq.block_hashes
        if len(hashes) < n:
            bs = self.block_size
            h = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), n):
                h = chain_hash(h, tuple(seq.token_slice(i * bs, (i + 1) * bs)))
                hashes.append(h)
        return hashes

    def _register(self, seq: Sequence, computed: int) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        bs = self.block_size
        nfull = computed // bs
        i0 = seq.num_registered
        if nfull <= i0:
            return
        hashes = seq.block_hashes  # len(hashes) >= num_registered always
        blocks = seq.blocks
        register = self.block_pool.register
        for i in range(i0, nfull):
            toks = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            if i < len(hashes):
                h = hashes[i]
            else:
                h = chain_hash(hashes[i - 1] if i else ROOT_HASH, toks)
                hashes.append(h)
            register(blocks[i], h, toks, blocks[i - 1] if i else -1)
        seq.num_registered = nfull

    def _running_slots(self) -> np.ndarray:
        if self._run_slots is None or self._run_slots.shape[0] != len(self.running):
            self._run_slots = np.fromiter((s.slot for s in self.running), dtype=np.int64,
                                          count=len(self.running))
        return self._run_slots

    def _next_buffers(self) -> BatchBuffers:
        self._buf_index ^= 1
        return self._bufs[self._buf_index]

    def _pairs(self, flat: list[int]) -> torch.Tensor:
        if not flat:
            return self._empty_pairs
        return torch.tensor(flat, dtype=torch.int64).view(-1, 2)

    def _outputs(self, is_prompt: bool, seqs: list[Sequence],
                 sample_seqs: list[Sequence], t: int, batch: LaunchBatch,
                 slots: np.ndarray) -> SchedulerOutputs:
        zs = self._zero_states
        return SchedulerOutputs(
            is_prompt=is_prompt, seqs=seqs, sample_seqs=sample_seqs,
            num_batched_tokens=t, num_samples=len(sample_seqs),
            clone_blocks=self._pairs(self._clone_blocks),
            zero_states=torch.tensor(zs, dtype=torch.int64) if zs else self._empty_1d,
            clone_states=self._pairs(self._clone_states),
            batch=batch, _slots=slots, _epoch=self._epoch, _step=self._step,
        )

    def _empty(self, is_prompt: bool) -> SchedulerOutputs:
        buf = self._next_buffers()
        buf.query_start_loc_np[0] = 0
        batch = buf.make(0, 0, 0, 0, 0, 0)
        return self._outputs(is_prompt, [], [], 0, batch, np.zeros(0, dtype=np.int64))

    # ================================================================== checks
    def check_invariants(self) -> None:
        """Assert internal consistency (tests): block ref counts equal block-table
        references, free and referenced blocks are disjoint, slots are held exactly by
        the live sequences, block-table rows mirror the sequences' block lists."""
        with self._lock:
            refs: dict[int, int] = {}
            slots: set[int] = set()
            for seq in self._seqs.values():
                assert seq.status is not _FINISHED
                for b in seq.blocks:
                    refs[b] = refs.get(b, 0) + 1
                assert len(set(seq.blocks)) == len(seq.blocks), "block twice in one table"
                for s in ([seq.slot] if seq.slot >= 0 else []) + seq.reserved_slots:
                    assert s not in slots, f"slot {s} held twice"
                    slots.add(s)
                if seq.slot >= 0:
                    n = len(seq.blocks)
                    assert self._nblocks[seq.slot] == n
                    assert list(self._tables[seq.slot, :n]) == seq.blocks
                    assert not self._tables[seq.slot, n:].any(), "table padding not 0"
                    assert self._len[seq.slot] == seq.num_tokens
                else:
                    assert not seq.blocks, "blocks without a slot"
                if seq.status in (_RUNNING, _TRANSFERRING):
                    assert seq.slot >= 0
                    assert len(seq.blocks) * self.block_size >= seq.num_tokens - 1
            self.block_pool.check(refs)
            sm = self.state_manager
            assert sm.num_free == sm.num_slots - len(slots)
            for s in slots:
                assert sm.is_used(s)
            assert (len(self.running) + len(self.waiting) + len(self._handoffs)
                    == len(self._seqs))
            assert all(s.status is _TRANSFERRING for s in self._handoffs.values())
            assert all(s.status is _RUNNING for s in self.running)
            assert all(s.status is _WAITING for s in self.waiting)
            held = [s for s in self.waiting if s.slot >= 0]
            assert len(held) <= 1 and (not held or held[0] is self._partial)
