"""Structured output in the engine: one xgrammar ``GrammarMatcher`` per constrained
sample, a token bitmask per step for the constrained rows only, and the sampled tokens
fed back to the matchers.

How it fits the step loop (``LLMEngine``):

- ``add``: at ``add_request``. The grammar is built at once (an unsupported schema or a
  bad regex is a ``ValueError`` for that request alone) and compiled in a thread pool
  (``GrammarCache``). The request is *parked*: it reaches the scheduler only once its
  grammar is compiled (``take_ready``, called before each ``schedule()``), so it is never
  sampled without its mask and other requests never wait for its compilation. Only an
  engine with nothing else to run blocks on the oldest compilation.
- ``logits_mask``: at launch. Returns a callable that the runner calls after enqueuing
  the forward and before sampling (on a GPU the host fills the bitmask while the device
  runs the model): each constrained row's matcher fills its row of the bitmask; the
  runner applies it to those rows' logits on their device. A row whose sequence ended
  meanwhile (its token will be dropped) is left unmasked.
- ``after_update``: after ``Scheduler.update``. Each matcher is fed the tokens its
  sequence gained. A matcher that terminated (it accepted a stop token; with
  ``ignore_eos`` the model's EOS) ends its sequence with ``"stop"``, also under
  ``min_tokens`` (the sampler lifts a ban that would leave a row nothing to draw, so a
  grammar that can only end draws its stop token). A token the matcher rejects, which
  that leaves no way to sample, would end it with ``"abort"``.

One invariant keeps preemption, forks and hand-offs simple: a matcher has accepted
exactly ``output_token_ids[start:start + fed]`` of its sequence (``start``: 0, or past
a thinking model's ``</think>``), and ``sync`` feeds the rest. A
preempted sequence keeps its tokens and its matcher (recompute changes neither); an
n > 1 child gets its own matcher, fed its own (empty) output; an imported sequence gets a
matcher fed the tokens it brings. Nothing is accepted twice.

Logprobs of a constrained sample are those of its masked logits (disallowed tokens at
-inf), as the sampler sees them.

Overlapped scheduling: step k+1's bitmask needs step k's token accepted, which is still
on its way when k+1 is launched. The engine enqueues step k+1's forward, lands step k
(``after_update`` feeds its tokens), and only then calls the mask callable and enqueues
k+1's sampling: every mask is built from matchers that have seen every earlier token,
and the host's work still runs while the device computes the forward.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.structured.bitmask import TokenMask
from deepinfer.structured.grammar import GrammarCache, tokenizer_info
from deepinfer.structured.params import StructuredOutputsParams
from deepinfer_scheduler import Sequence

# A row's mask costs 1-19 us on one core (SmolLM2's 49k vocabulary; most inside strings).
# Many rows are filled by xgrammar's thread pool where there are cores to spare: on 2 cores
# it was slower than one thread (18 vs 15 us a row at 64 rows), so only from 8 cores.
# bench_structured measures both where the pool is used.
BATCH_FILL_MIN_ROWS = 16


def default_fill_threads() -> int:
    """Threads for a step's masks: half the cores, at most 8; 1 below 8 cores."""
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(8, cores // 2) if cores >= 8 else 1


@dataclass
class FillStats:
    """Host time spent filling masks (``StructuredOutputs.stats``): seconds, steps with a
    mask, rows filled."""

    fill_seconds: float = 0.0
    fills: int = 0
    filled_rows: int = 0


@dataclass
class _Request:
    future: Future
    stops: list[int] | None
    parked: bool
    seq_ids: list[int] = field(default_factory=list)
    after: int | None = None  # the grammar starts after this token (end of reasoning)


class SampleMatcher:
    """A ``GrammarMatcher`` and how many of its sequence's output tokens it accepted.

    ``after``: a token id (a thinking model's ``</think>``) before which the output is
    free: the grammar starts with the token after its first occurrence (``start``,
    None until then; the row is left unmasked meanwhile)."""

    __slots__ = ("matcher", "fed", "rejected", "after", "start")

    def __init__(self, matcher: Any, after: int | None = None) -> None:
        self.matcher = matcher
        self.fed = 0
        self.rejected = False
        self.after = after
        self.start: int | None = 0 if after is None else None

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the tokens of ``output_token_ids`` not accepted yet (those after the
        reasoning's end, if any); stop at the first one the grammar rejects
        (``rejected``)."""
        if self.start is None:
            if self.after not in output_token_ids:
                return
            self.start = output_token_ids.index(self.after) + 1
        tokens = output_token_ids[self.start:]
        while self.fed < len(tokens) and not self.rejected:
            if self.matcher.accept_token(tokens[self.fed]):
                self.fed += 1
            else:
                self.rejected = True

    @property
    def active(self) -> bool:
        """Whether the grammar applies to the next token (the reasoning, if any, ended)."""
        return self.start is not None

    @property
    def ended(self) -> str | None:
        """``"stop"`` when the grammar terminated, ``"abort"`` after a rejected token,
        else None."""
        if self.rejected:
            return "abort"
        return "stop" if self.matcher.is_terminated() else None


class StructuredOutputs:
    """The constrained requests of one engine: compiled grammars, parked requests,
    per-sample matchers and the step bitmask.

    ``tokenizer``: the engine's (transformers) tokenizer; ``vocab_size``: the model's
    logits width; ``eos_token_ids``: the model's EOS ids (a grammar's end when a request
    ignores EOS). xgrammar is loaded at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]
                 ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._cache: GrammarCache | None = None
        self._requests: dict[str, _Request] = {}
        self._matchers: dict[int, SampleMatcher] = {}
        self._bitmask: torch.Tensor | None = None
        self.fill_threads = default_fill_threads()
        # (threads, xgrammar's BatchGrammarMatcher), made at the first batch fill
        self._batch: tuple[int, Any] | None = None
        self.stats = FillStats()

    @property
    def cache(self) -> GrammarCache:
        """The compiled-grammar cache (built at first use: tokenizer info, compiler)."""
        if self._cache is None:
            stops = self.eos_token_ids or [self.tokenizer.eos_token_id]
            info = tokenizer_info(self.tokenizer, self.vocab_size, stops)
            self._cache = GrammarCache(info)
        return self._cache

    @property
    def live(self) -> bool:
        """Whether a constrained request is registered (parked or running)."""
        return bool(self._requests)

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, so: StructuredOutputsParams,
            stop_token_ids: Iterable[int], park: bool = True,
            after: int | None = None) -> None:
        """Register a constrained request and start compiling its grammar. ``ValueError``
        (naming the field) when the schema/regex/grammar is not supported; nothing is
        registered then. ``park``: hold it back from the scheduler until compiled (an
        imported sequence is in the scheduler already: its first step waits instead).
        Stop ids must be special tokens (EOS, end of turn): they are the grammar's end,
        and a text token that ended the output would cut it short of the grammar, one
        masked as text would change it. ``after``: the token that ends a thinking
        model's reasoning; the grammar constrains what follows it (None: all output)."""
        text = sorted(set(stop_token_ids) - self._special_ids)
        if text:
            raise ValueError(f"stop_token_ids {text[:5]}: text tokens cannot end a "
                             "constrained output (the grammar decides where it ends); "
                             "give special tokens only")
        fut = self.cache.compile(so)
        stops = sorted(set(stop_token_ids)) or self.eos_token_ids or None
        self._requests[request_id] = _Request(fut, stops, park, after=after)

    @functools.cached_property
    def _special_ids(self) -> set[int]:
        """The tokenizer's special tokens and the model's EOS ids (built once)."""
        tok = self.tokenizer
        special = set(getattr(tok, "all_special_ids", None) or ())
        decoder = getattr(tok, "added_tokens_decoder", None) or {}
        special |= {i for i, t in decoder.items() if getattr(t, "special", False)}
        return special | set(self.eos_token_ids)

    def has_parked(self) -> bool:
        """Whether a request waits for its grammar."""
        return any(r.parked for r in self._requests.values())

    def take_ready(self, block: bool) -> list[str]:
        """Ids of the parked requests whose grammar is compiled, in the order they were
        added; they are no longer parked. ``block``: when none is ready, wait for one
        first (the engine has nothing else to run)."""
        parked = [(rid, r) for rid, r in self._requests.items() if r.parked]
        if not parked:
            return []
        if block and not any(r.future.done() for _, r in parked):
            wait([r.future for _, r in parked], return_when=FIRST_COMPLETED)
        ready = [rid for rid, r in parked if r.future.done()]
        for rid in ready:
            self._requests[rid].parked = False
        return ready

    def forget(self, request_id: str) -> None:
        """Drop a request (finished, aborted, handed off) and its matchers."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            for sid in req.seq_ids:
                self._matchers.pop(sid, None)

    # ------------------------------------------------------------------ steps
    def matcher_of(self, seq: Sequence) -> SampleMatcher:
        """The matcher of a constrained sample, created at its first step (waiting for
        the compilation if it is still running) and synced with its output tokens."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            import xgrammar as xgr

            req = self._requests[seq.request_id]
            compiled = req.future.result()
            m = SampleMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=req.stops),
                              req.after)
            self._matchers[seq.seq_id] = m
            req.seq_ids.append(seq.seq_id)
        m.sync(seq.output_token_ids)
        return m

    def logits_mask(self, sample_seqs: list[Sequence]
                    ) -> Callable[[], TokenMask | None] | None:
        """For a launched step whose sample rows are ``sample_seqs``: None when no row is
        constrained, else a callable building the step's ``TokenMask`` (the runner calls
        it between the forward and the sampling)."""
        rows = [(i, s) for i, s in enumerate(sample_seqs) if s.request_id in self._requests]
        if not rows:
            return None
        return lambda: self._fill(len(sample_seqs), rows)

    def _fill(self, n: int, rows: list[tuple[int, Sequence]]) -> TokenMask | None:
        t0 = time.perf_counter()
        bm = self._bitmask
        if bm is None or bm.shape[0] < n:
            import xgrammar as xgr

            bm = self._bitmask = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        filled, matchers = [], []
        for i, seq in rows:
            if seq.finish_reason is not None or seq.request_id not in self._requests:
                continue  # ended after the launch (overlap): its token is dropped
            m = self.matcher_of(seq)
            if m.active and m.ended is None:
                matchers.append(m.matcher)
                filled.append(i)
        if len(filled) >= BATCH_FILL_MIN_ROWS and self.fill_threads > 1:
            if self._batch is None or self._batch[0] != self.fill_threads:
                import xgrammar as xgr

                pool = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
                self._batch = (self.fill_threads, pool)
            self._batch[1].batch_fill_next_token_bitmask(matchers, bm, filled)
        else:
            for m, i in zip(matchers, filled):
                m.fill_next_token_bitmask(bm, i)
        self.stats.fill_seconds += time.perf_counter() - t0
        self.stats.fills += 1
        self.stats.filled_rows += len(filled)
        return TokenMask(bm[:n], filled) if filled else None

    def after_update(self, sample_seqs: list[Sequence],
                     finish: Callable[[int, str], object]) -> list[Sequence]:
        """Feed each constrained sample the tokens ``Scheduler.update`` gave it; end the
        live ones whose grammar terminated (``finish(seq_id, reason)``, the scheduler's
        ``finish_sequence``). Returns the sequences ended here."""
        ended = []
        for seq in sample_seqs:
            m = self._matchers.get(seq.seq_id)
            if m is None or seq.finish_reason == "abort":
                continue  # an aborted sample's last token may be any: not fed
            m.sync(seq.output_token_ids)
            reason = m.ended
            if reason is not None and seq.finish_reason is None:
                finish(seq.seq_id, reason)
                ended.append(seq)
        return ended
