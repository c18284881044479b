"""The scheduling policy: queues, admission with prefix caching and chunked prefill,
decode with copy-on-write and preemption, and ``update``. What it relies on is written
down in ``docs/scheduling.md``.

The parts it composes: ``step_type`` (prompt or decode step, DP votes), ``admission``
(packing a prompt step, chunking, forks), ``kv_cache`` (block-table rows, prefix
cache), ``state_manager`` (slots and their host rows), ``batch`` (launch tensors),
``samples`` (applying sampled tokens), ``handoff`` (PD export/import), ``registry``
(live sequences, request validation).

A decode step over B sequences: vectorized gathers of per-slot numpy rows, and Python
work only where a sequence needs a new block, a copy-on-write or a finish."""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Sequence as _Seq

import numpy as np
import torch

from deepinfer_scheduler.admission import Admission
from deepinfer_scheduler.batch import BatchBuilder, LaunchBatch
from deepinfer_scheduler.block_manager import BlockPool
from deepinfer_scheduler.config import EngineType, SchedulerConfig
from deepinfer_scheduler.decode_cursor import DecodeStep
from deepinfer_scheduler.decode_plan import DecodePlanner
from deepinfer_scheduler.dp import DPVoter
from deepinfer_scheduler.handoff import Handoffs
from deepinfer_scheduler.invariants import check_scheduler
from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.outputs import SchedulerOutputs, SchedulerStats
from deepinfer_scheduler.prompt_scores import ScoreRows, score_rows
from deepinfer_scheduler.registry import SequenceRegistry, validate_request
from deepinfer_scheduler.running_rows import RunningRows
from deepinfer_scheduler.samples import SampleApplier, token_list
from deepinfer_scheduler.sequence import Sequence, SequenceStatus
from deepinfer_scheduler.state_manager import StateManager
from deepinfer_scheduler.step_type import Voter, choose_step, wants_prefill

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_FINISHED = SequenceStatus.FINISHED
_TRANSFERRING = SequenceStatus.TRANSFERRING


class Scheduler:
    """One rank's scheduler. ``dp_group``: a ``torch.distributed`` process group whose
    ranks vote on the step type, or None for a single rank (no collective at all).
    ``voter``: the object the votes go through (a ``DPVoter`` over ``dp_group``); tests
    may replace it with anything that has ``allreduce_min(int) -> int``.

    Thread safety: one lock (re-entrant) covers the block pool, the state slots and the
    queues; ``schedule``, ``update``, ``add_request``, ``abort`` and ``finish_sequence``
    all take it, so requests may be added or aborted from other threads at any time.
    """

    def __init__(self, config: SchedulerConfig, dp_group=None) -> None:
        config.validate()
        self.config = c = config
        self.block_size = c.block_size
        self._lock = threading.RLock()
        self.block_pool = BlockPool(c.num_blocks, c.block_size, c.enable_prefix_caching)
        # Live sequences (slot holders) never exceed the decode budget either.
        self.state_manager = StateManager(c.max_num_seqs,
                                          min(c.max_num_seqs, c.max_num_batched_tokens))
        self.kv_cache = KVCache(self.block_pool, c.max_num_seqs, c.max_blocks_per_seq)
        self.voter: Voter = DPVoter(dp_group, c.device)
        pin = c.device.startswith("cuda") and torch.cuda.is_available()
        self._batches = BatchBuilder(self.kv_cache, max(c.max_num_batched_tokens,
                                                        c.max_num_seqs), c.max_num_seqs, pin)
        self._registry = SequenceRegistry()
        self._decode = DecodePlanner(self.kv_cache, self.state_manager)
        self._admission = Admission(c, self.state_manager, self.kv_cache, self._registry)
        self._handoffs = Handoffs(self.state_manager, self.kv_cache, self._registry)
        # Finishing there is bulk: update() rebuilds `running` once afterwards.
        self._samples = SampleApplier(self.state_manager, self.kv_cache, self._registry,
                                      c.enable_prefix_caching,
                                      functools.partial(self._finish, bulk=True))

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # The decode rows of `running` (None: stale; reset wherever `running` changes).
        self._run_rows: RunningRows | None = None
        self._partial: Sequence | None = None  # prompt cut by chunked prefill, if any

        self._empty_prompt = functools.partial(self._empty, True)
        self.decode_step = 0
        self.stats = SchedulerStats()
        self._step = 0
        # Steps scheduled and not yet updated, oldest first: at most two (overlap).
        self._unapplied: deque[int] = deque()

    # ================================================================== requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, *,
                    n: int = 1, stop_token_ids: _Seq[int] = (), min_tokens: int = 0,
                    score_prompt: bool = False, cache_salt: int = 0) -> None:
        """Queue a request of ``n`` samples; ``ValueError`` naming it and the rule it breaks
        (state unchanged) if it is malformed or could never run. ``score_prompt``: its
        prompt steps also score every prompt position (``SchedulerOutputs.scores``), none
        skipped through the prefix cache; ``cache_salt``: blocks shared within it only."""
        prompt = [int(t) for t in prompt_token_ids]
        validate_request(self.config, request_id, prompt, max_tokens, n=n,
                         min_tokens=min_tokens, max_live=self.state_manager.max_live)
        stops = tuple(int(t) for t in stop_token_ids)
        with self._lock:
            self._registry.check_new(request_id)
            seq = Sequence(self._registry.new_id(), request_id, 0, prompt, max_tokens,
                           min_tokens=min_tokens, stop_token_ids=stops, num_forks=n - 1,
                           kv_cache=self.kv_cache, score_prompt=score_prompt,
                           cache_salt=int(cache_salt))
            self._registry.add(seq)
            self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """End every live sequence of a request (finish_reason "abort"); False if unknown
        or already finished."""
        with self._lock:
            seqs = self._registry.requests.get(request_id)
            if not seqs:
                return False
            for seq in list(seqs):
                self._finish(seq, "abort")
            return True

    def finish_sequence(self, seq_id: int, reason: str = "stop") -> Sequence | None:
        """End one live sequence early (e.g. a stop string matched); None if unknown."""
        with self._lock:
            seq = self._registry.seqs.get(seq_id)
            if seq is None:
                return None
            self._finish(seq, reason)
            return seq

    def get_sequences(self, request_id: str) -> list[Sequence]:
        """Live sequences of a request (empty once it finished or if unknown)."""
        with self._lock:
            return list(self._registry.requests.get(request_id, ()))

    def has_unfinished(self) -> bool:
        """Waiting, running or (PROMPT engine) handed-off sequences not yet released."""
        return bool(self.waiting or self.running or self._handoffs.pending)

    def has_unfinished_dp(self) -> bool:
        """Whether any rank of the DP group has unfinished work (one all-reduce, called by
        every rank at the same point; a rank with no work steps empty batches until then)."""
        with self._lock:
            return self.voter.allreduce_min(0 if self.has_unfinished() else 1) == 0

    def cache_usage(self) -> float:
        """Fraction of KV blocks held by live sequences (evictable cached blocks are free)."""
        return self.block_pool.usage()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ============ hand-off: PD export (PROMPT) / import (COMPLETION); see scheduler.handoff

    @property
    def num_handoffs(self) -> int:
        """Handed-off sequences still holding their blocks and slot (PROMPT engine)."""
        return len(self._handoffs)

    def take_handoffs(self) -> list[Sequence]:
        """Sequences handed off since the last call, holding their blocks and slot until
        ``release_handoff`` (``Handoffs.take``)."""
        with self._lock:
            return self._handoffs.take()

    def release_handoff(self, seq_id: int) -> Sequence:
        """Free a handed-off sequence's blocks and slot once its transfer completed; it
        ends with finish_reason "handoff" (``Handoffs.get``)."""
        with self._lock:
            seq = self._handoffs.get(seq_id)
            self._finish(seq, "handoff")
            return seq

    def prefilled_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a prefilled sequence may hold at most here: what ``add_prefilled``
        reserves."""
        return self._handoffs.blocks_needed(prompt_len, max_tokens)

    def handoff_capacity(self) -> tuple[int, int]:
        """``(slots, blocks)`` still available to ``add_prefilled`` (``Handoffs.capacity``:
        blocks running sequences may still claim are held back, so no preemption)."""
        with self._lock:
            return self._handoffs.capacity(self._running_rows().slots)

    def can_accept(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether ``add_prefilled`` of such a sequence would succeed now (credits)."""
        with self._lock:
            return self._handoffs.can_accept(self._running_rows().slots, prompt_len, max_tokens)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int],
                      output_token_ids: list[int], max_tokens: int, *,
                      stop_token_ids: _Seq[int] = (), min_tokens: int = 0
                      ) -> Sequence | None:
        """Admit a sequence prefilled elsewhere (first output token(s) sampled there)
        straight into running; the caller fills ``seq.blocks`` and ``seq.slot``
        (``Handoffs.admit``). None, changing nothing, when ``can_accept`` says no;
        ``ValueError`` if it could never be admitted. n = 1 only."""
        prompt = [int(t) for t in prompt_token_ids]
        outs = [int(t) for t in output_token_ids]
        validate_request(self.config, request_id, prompt, max_tokens, outputs=outs,
                         min_tokens=min_tokens)
        with self._lock:
            self._registry.check_new(request_id)
            if not self.can_accept(len(prompt), max_tokens):
                return None
            seq = self._handoffs.admit(request_id, prompt, outs, max_tokens,
                                       stop_token_ids, min_tokens)
            self.running.append(seq)
            self._run_rows = None
            return seq

    # ================================================================== schedule
    def schedule(self) -> SchedulerOutputs:
        """Decide this step's type and contents; see ``SchedulerOutputs`` for the borrow
        contract of what it returns. The previous step may still be waiting for its
        ``update()`` (overlapped scheduling: its samples are counted, their ids are
        placeholders in this step's inputs); two may not."""
        with self._lock:
            if len(self._unapplied) > 1:
                raise RuntimeError("schedule(): two steps already wait for update(); at "
                                   "most one step may be in flight")
            # This step's copy lists (docs/scheduling.md, "State slots"). The previous
            # outputs borrowed them; they must have been consumed by now.
            self.kv_cache.clone_blocks.clear()
            self._admission.new_step()
            self._step += 1
            self._unapplied.append(self._step)
            out = choose_step(self.config, self.decode_step, self.voter,
                              want=self._wants_prefill, prefill=self._schedule_prefill,
                              decode=self._schedule_decode,
                              empty_prompt=self._empty_prompt)
            if out.is_prompt:
                self.decode_step = 0
                self.stats.num_prompt_steps += 1
            else:
                self.decode_step += 1
                self.stats.num_decode_steps += 1
            return out

    def _wants_prefill(self) -> bool:
        if not self.waiting:  # the usual decode step: skip the rest
            return False
        return wants_prefill(self.cache_usage(), self.config.prefill_watermark,
                             True, bool(self.running))

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> SchedulerOutputs | None:
        """A prompt step of the waiting sequences that fit (``Admission.pack``); None if
        nothing could be scheduled."""
        sched = self._admission.pack(self.waiting, self.stats)
        if not sched:
            return None
        return self._start_prefill(sched)

    def _start_prefill(self, sched: list[tuple[Sequence, int, int]]) -> SchedulerOutputs:
        """Sequences whose prompt completes in this step move to running (from the head of
        waiting, in order) and sample, forking n > 1 groups; then the launch batch."""
        seqs = [s for s, _, _ in sched]
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=len(seqs))
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        for i, seq in enumerate(seqs):
            if seq.num_computed < seq.num_tokens:
                self._partial = seq  # cut: stays at the head of waiting
                continue
            if self._partial is seq:
                self._partial = None
            head = self.waiting.popleft()
            assert head is seq, "prefill must complete waiting sequences in order"
            seq.status = _RUNNING
            self.running.append(seq)
            sample_seqs.append(seq)
            sample_rows.append(i)
            if seq.num_forks:
                for child in self._admission.fork(seq):
                    self.running.append(child)
                    sample_seqs.append(child)
                    sample_rows.append(i)
        self._run_rows = None
        sample_slots = [s.slot for s in sample_seqs]
        scores = score_rows(sched)
        batch = self._batches.prefill(sched, slots, sample_rows, sample_slots, scores)
        if sample_slots:
            self.state_manager.advance(np.array(sample_slots, dtype=np.int64))
        return self._outputs(True, seqs, sample_seqs, batch, None, scores=scores)

    # ------------------------------------------------------------------ decode
    def _schedule_decode(self) -> SchedulerOutputs:
        """One token for every running sequence (``DecodePlanner``); preempts the most
        recently admitted ones when a sequence cannot get the block it writes into."""
        if not self.running:
            return self._empty(False)
        plan = self._decode.plan(self._running_rows(), self._reserve_decode)
        if plan is None:
            return self._empty(False)
        rows, ntok, step = plan
        slots = rows.slots
        states = self.state_manager
        batch = self._batches.decode(slots, ntok, step.slot_mapping, step.max_len,
                                     states.last_token, rows)
        states.advance(slots, settled=len(self._unapplied) == 1)
        return self._outputs(False, rows.seqs, rows.seqs, batch, rows, step)

    def _reserve_decode(self, seqs: list[Sequence], todo: list[int],
                        ending: list[Sequence]) -> int:
        """Give rows ``todo`` of ``seqs`` (this step's running sequences) their next block
        (new or copy-on-write), preempting when the pool is empty: a cut prompt, then
        ``ending`` (left out of the step: their last token is in flight, they lose
        nothing), then the tail of ``seqs``. Returns how many remain (a prefix)."""
        kv = self.kv_cache
        num_tokens = self.state_manager.num_tokens
        end = len(seqs)
        preempted = False
        for i in todo:
            if i >= end:
                break
            seq = seqs[i]
            while not kv.make_writable(seq.slot, int(num_tokens[seq.slot]) - 1):
                # A cut prompt was admitted last: it goes first. A sequence of
                # ``ending`` still gets its in-flight token (update's per-row path).
                preempted = preempted or self._partial is None
                victim = self._partial or (ending.pop() if ending else None)
                if victim is None:
                    end -= 1
                    victim = seqs[end]
                self._preempt(victim)
                if victim is seq:
                    break
        if preempted:
            self.running = [s for s in self.running if s.status is _RUNNING]
            self._run_rows = None
        return end

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence to recompute (a running one to the head of ``waiting``)."""
        self._release(seq)
        self.stats.num_preemptions += 1
        if seq is self._partial:
            self._partial = None
            return
        seq.status = _WAITING
        self.waiting.appendleft(seq)

    # ================================================================== update
    def update(self, out: SchedulerOutputs, sampled_token_ids) -> list[Sequence]:
        """Apply one step's sampled tokens (``out.num_samples`` ids in sample order: a
        list or a 1-D tensor/array): append, stop tokens and max_tokens, free finished
        sequences, register newly full blocks. Returns the sequences that finished.
        Steps are updated in schedule order, each once (``dropped``: see there)."""
        tl = token_list(sampled_token_ids)
        with self._lock:
            if not self._unapplied or out.step != self._unapplied[0]:
                raise ValueError("update() takes the outputs of the oldest schedule() not "
                                 "yet updated, once")
            if len(tl) != out.num_samples:
                raise ValueError(
                    f"update(): got {len(tl)} sampled token ids, the step has "
                    f"{out.num_samples} samples")
            self._unapplied.popleft()
            if out.is_prompt:
                finished = self._samples.prompt(out.seqs, out.sample_seqs, tl)
            elif out.rows is None:  # an empty decode step
                finished = []
            else:
                # Rows cannot have changed hands while no slot was unbound since; no
                # later step in flight: each row had exactly this token pending.
                finished = self._samples.decode(
                    out.rows, tl, moved=out.unbinds != self.state_manager.num_unbinds,
                    settled=not self._unapplied, filled=out.filled, may_end=out.may_end)
            handed = (out.is_prompt and self.config.engine_type is EngineType.PROMPT
                      # A PROMPT engine never decodes: hand off what would start decoding.
                      and self._handoffs.export(out.sample_seqs))
            if finished or handed:
                self.running = [s for s in self.running if s.status is _RUNNING]
                self._run_rows = None
            return finished

    @property
    def dropped(self) -> list[Sequence]:
        """Sequences of the last ``update()`` whose token was dropped: they had ended
        (finished or aborted) after that step was scheduled."""
        return self._samples.dropped

    # ================================================================== helpers
    def _finish(self, seq: Sequence, reason: str, bulk: bool = False) -> None:
        """End a live sequence in any state. ``bulk``: the caller rebuilds ``running``."""
        if seq.status is _FINISHED:
            return
        if seq.status is _RUNNING:
            if not bulk:
                self.running.remove(seq)
                self._run_rows = None
        elif seq.status is _TRANSFERRING:
            self._handoffs.discard(seq)
        else:
            self.waiting.remove(seq)
            if self._partial is seq:
                self._partial = None
        self._release(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        self._registry.remove(seq)

    def _release(self, seq: Sequence) -> None:
        """Free a sequence's blocks and slots; it will recompute from scratch."""
        self.kv_cache.release(seq)
        self.state_manager.unbind(seq)
        seq.num_computed = 0

    def _running_rows(self) -> RunningRows:
        """The decode rows of ``running``, in order (cached until ``running`` changes)."""
        rows = self._run_rows
        if rows is None or len(rows) != len(self.running):
            rows = self._run_rows = RunningRows.of(self.running, self.state_manager)
        return rows

    def _outputs(self, is_prompt: bool, seqs: list[Sequence],
                 sample_seqs: list[Sequence], batch: LaunchBatch,
                 rows: RunningRows | None, step: DecodeStep | None = None,
                 scores: ScoreRows | None = None) -> SchedulerOutputs:
        adm = self._admission
        return SchedulerOutputs.build(
            is_prompt, seqs, sample_seqs, batch, clone_blocks=self.kv_cache.clone_blocks,
            zero_states=adm.zero_states, clone_states=adm.clone_states,
            admitted=adm.admitted, forked=adm.forked, rows=rows,
            unbinds=self.state_manager.num_unbinds, step=self._step,
            filled=None if step is None else step.filled,
            may_end=True if step is None else step.may_end, scores=scores)

    def _empty(self, is_prompt: bool) -> SchedulerOutputs:
        return self._outputs(is_prompt, [], [], self._batches.empty(), None)

    # ================================================================== checks
    def check_invariants(self) -> None:
        """Assert internal consistency (tests); see ``scheduler.invariants``."""
        with self._lock:
            check_scheduler(list(self._registry.seqs.values()), self.running, self.waiting,
                            self._handoffs.pending, self._partial, self.kv_cache,
                            self.state_manager)
