"""Admission: what one prompt step can take (``docs/scheduling.md``, "What a prefill
needs").

Waiting sequences are packed first come, first served within the token budget. Each
newly admitted one needs a free state slot per sample and enough KV blocks for its new
tokens (evictable prefix-cache blocks count as free); its cached prefix is not
recomputed. The last one packed may be cut (chunked prefill): it keeps its slot and
blocks and continues first in the next prompt step. When a prompt with n > 1 samples
completes, its children are forked from it.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer_scheduler.config import SchedulerConfig
from deepinfer_scheduler.kv_cache import KVCache
from deepinfer_scheduler.outputs import SchedulerStats
from deepinfer_scheduler.registry import SequenceRegistry
from deepinfer_scheduler.sequence import Sequence
from deepinfer_scheduler.state_manager import StateManager
from deepinfer_scheduler.util import cdiv


class Admission:
    """Packs prompt steps and forks completed groups. Guarded by the scheduler's lock.

    zero_states   list[int]       this step's newly admitted slots (their state is zeroed)
    clone_states  list[int]       this step's forks, flat ``parent slot, child slot, ...``
    admitted      list[Sequence]  the sequences of ``zero_states``, same order
    forked        list[Sequence]  the children of ``clone_states``, same order
    (``new_step()`` clears all four at the start of every ``schedule()``)
    """

    def __init__(self, config: SchedulerConfig, states: StateManager, kv: KVCache,
                 registry: SequenceRegistry) -> None:
        self._config = config
        self._states = states
        self._kv = kv
        self._registry = registry
        self.zero_states: list[int] = []
        self.clone_states: list[int] = []
        self.admitted: list[Sequence] = []
        self.forked: list[Sequence] = []

    def new_step(self) -> None:
        """Clear the step's lists (the previous outputs consumed or copied them)."""
        self.zero_states.clear()
        self.clone_states.clear()
        self.admitted.clear()
        self.forked.clear()

    def pack(self, waiting: Iterable[Sequence],
             stats: SchedulerStats) -> list[tuple[Sequence, int, int]]:
        """Admit ``waiting`` sequences in order while they fit, giving each the blocks for
        its new tokens; returns ``(seq, first new token, number of new tokens)`` for each,
        empty if nothing fits. Stops at the first that does not fit (no overtaking).
        Prefix-cache lookups are counted in ``stats``."""
        c = self._config
        bs = c.block_size
        kv = self._kv
        budget = c.max_num_batched_tokens
        sched: list[tuple[Sequence, int, int]] = []
        for seq in waiting:
            if budget <= 0:
                break
            ntok = seq.num_tokens
            if seq.slot < 0:
                start, have = self._admit(seq, budget, stats)
                if start < 0:
                    break
            else:  # continues a chunked prompt: already holds its slot and blocks
                start, have = seq.num_computed, kv.num_blocks(seq.slot)
            num_new = min(ntok - start, budget)
            if not c.enable_chunked_prefill and num_new < ntok - start:
                break
            need = cdiv(start + num_new, bs) - have
            if need > kv.num_free:
                break  # only a continuing prompt can get here: _admit checked the rest
            if need:
                kv.allocate(seq.slot, need)
            seq.num_computed = start + num_new
            budget -= num_new
            sched.append((seq, start, num_new))
        return sched

    def _admit(self, seq: Sequence, budget: int, stats: SchedulerStats) -> tuple[int, int]:
        """Give a waiting sequence its state slot(s) and prefix-cache hits if it can be
        admitted with this step's ``budget``. Returns its first token to compute and the
        blocks it now holds, or ``(-1, 0)`` (nothing changed) if it cannot."""
        c = self._config
        bs = c.block_size
        kv = self._kv
        states = self._states
        if states.room < 1 + seq.num_forks:
            return -1, 0
        ntok = seq.num_tokens
        # The last token is always computed, so its block too.
        nfull = (ntok - 1) // bs
        if seq.prompt_scored >= 0:
            # A scored prompt computes every position it has not scored yet: the cache
            # holds K/V, not the hidden states a position's logprobs come from.
            nfull = min(nfull, seq.prompt_scored // bs)
        hits = kv.cached_prefix(seq, nfull) if nfull else []
        start = len(hits) * bs
        num_new = min(ntok - start, budget)
        if not c.enable_chunked_prefill and num_new < ntok - start:
            return -1, 0
        if not kv.fits(cdiv(start + num_new, bs) - len(hits), hits):
            return -1, 0
        stats.prefix_cache_queries += ntok
        stats.prefix_cache_hits += start
        states.bind(seq)
        seq.reserved_slots = [states.allocate() for _ in range(seq.num_forks)]
        if hits:  # else its row stays empty and num_registered 0 (released or new)
            kv.take_hits(seq, hits)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = start
        self.zero_states.append(seq.slot)
        self.admitted.append(seq)
        return start, len(hits)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Create the n-1 children of a parent whose prompt just completed: they share its
        blocks (copy-on-write) and get a copy of its state slot (``clone_states``) in the
        slots reserved at admission."""
        ps = parent.slot
        children = []
        for k, slot in enumerate(parent.reserved_slots):
            child = parent.fork(self._registry.new_id(), k + 1)
            self._states.bind_fork(child, slot, ps)
            self._kv.share(ps, slot)
            self.clone_states += (ps, slot)
            self.forked.append(child)
            self._registry.add(child)
            children.append(child)
        parent.num_forks = 0
        parent.reserved_slots = []
        return children
