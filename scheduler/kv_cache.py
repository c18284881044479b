"""The KV side of live sequences: which blocks each one holds, growing and sharing
them, the prefix cache, and how many blocks are left.

Block tables live in one place: a numpy row per state slot (``tables[slot, :nblocks[slot]]``),
the layout the launch batches copy from. ``Sequence.blocks`` is derived from that row;
only this class writes it. The decode step gathers the rows of a whole batch at once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from deepinfer_scheduler.block_manager import BlockPool, chain_hash, root_hash
from deepinfer_scheduler.sequence import Sequence
from deepinfer_scheduler.util import cdiv


class KVCache:
    """Block-table rows over a ``BlockPool``. Guarded by the scheduler's lock.

    tables        int32 [num_slots, max_blocks]  block ids of the slot's holder, 0-padded
    nblocks       int64 [num_slots]              blocks in each row (0 for a free slot)
    clone_blocks  list[int]  this step's copy-on-write pairs, flat ``src, dst, ...``
                  (the scheduler clears it at the start of every ``schedule()``)
    shared_tail   set[int]   slots whose row may share the block its next decode write
                  falls in (a fork shares the partial last block); only these rows can
                  need a copy-on-write, so a decode step need not test every row. A
                  slot leaves the set once ``make_writable`` made its block its own.
    """

    def __init__(self, pool: BlockPool, num_slots: int, max_blocks: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.tables = np.zeros((num_slots, max_blocks), dtype=np.int32)
        self.nblocks = np.zeros(num_slots, dtype=np.int64)
        self.clone_blocks: list[int] = []
        self.shared_tail: set[int] = set()
        # tables[slot, i] as a Python int, bound once: register() runs per full block.
        self._block_id = self.tables.item

    # ------------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get (evictable cached blocks included)."""
        return self.pool.num_free

    def fits(self, need: int, hits: list[int]) -> bool:
        """Whether ``need`` fresh blocks can be allocated after taking the prefix-cache
        ``hits``: a hit that is evictable now stops counting as free once taken."""
        if not hits:
            return need <= self.pool.num_free
        ref = self.pool.ref
        revived = sum(1 for b in hits if ref[b] == 0)
        return need + revived <= self.pool.num_free

    def owed_blocks(self, slots: np.ndarray, max_len: np.ndarray) -> int:
        """Blocks the holders of ``slots`` (int64 [B]) may still claim before reaching
        their length limits ``max_len`` (int64 [num_slots], indexed by slot); the last
        sampled token is never fed back, so a sequence holds at most ``max_len - 1``."""
        if not slots.shape[0]:
            return 0
        worst = cdiv(max_len[slots] - 1, self.block_size)
        return int(np.maximum(worst - self.nblocks[slots], 0).sum())

    # ------------------------------------------------------------------ rows
    def blocks_of(self, slot: int) -> list[int]:
        """Block ids of the slot's row, in order."""
        return self.tables[slot, : self.nblocks[slot]].tolist()

    def num_blocks(self, slot: int) -> int:
        return int(self.nblocks[slot])

    def allocate(self, slot: int, n: int) -> None:
        """Append ``n`` fresh blocks to the slot's row (the caller checked ``num_free``)."""
        i = int(self.nblocks[slot])
        tables = self.tables
        allocate = self.pool.allocate
        for k in range(i, i + n):  # n is 1 or a prompt's few blocks: scalar writes
            tables[slot, k] = allocate()
        self.nblocks[slot] = i + n

    def take_hits(self, seq: Sequence, hits: list[int]) -> None:
        """Start the (empty) row of ``seq``'s slot with its prefix-cache ``hits``
        (referenced; already registered)."""
        take = self.pool.take
        for b in hits:
            take(b)
        n = len(hits)
        if n:
            self.tables[seq.slot, :n] = hits
            self.nblocks[seq.slot] = n
            seq.chain_tail = hits[-1]  # lookup returns the cached chain itself
            seq.chain_gen = self.pool.generation(hits[-1])
        seq.num_registered = n

    def share(self, src: int, dst: int) -> None:
        """Fork: slot ``dst``'s (empty) row references every block of ``src``'s row;
        a later write into a shared block copies it first (``make_writable``)."""
        n = int(self.nblocks[src])
        row = self.tables[src, :n]
        take = self.pool.take
        for b in row.tolist():
            take(b)
        self.tables[dst, :n] = row
        self.nblocks[dst] = n
        self.shared_tail.update((src, dst))

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s row (its full registered blocks stay in the prefix cache)."""
        slot = seq.slot
        if slot >= 0:
            n = int(self.nblocks[slot])
            if n:
                self.pool.free(self.tables[slot, :n].tolist())
                self.tables[slot, :n] = 0
                self.nblocks[slot] = 0
            self.shared_tail.discard(slot)
        seq.num_registered = 0

    # ------------------------------------------------------------------ decode writes
    def decode_todo(self, slots: np.ndarray, bidx: np.ndarray) -> list[int]:
        """Decode rows that need ``make_writable`` before writing into block index
        ``bidx`` (int64 [B]) of slots ``slots`` (int64 [B]): no block there yet, or one
        that may be shared (``shared_tail``). Row indices, ascending."""
        todo = (bidx >= self.nblocks[slots]).nonzero()[0].tolist()
        if self.shared_tail:
            shared = self.shared_tail
            todo = sorted(set(todo).union(
                i for i, s in enumerate(slots.tolist()) if s in shared))
        return todo

    def grow(self, slots: np.ndarray, rows: list[int]) -> list[int] | None:
        """Append one fresh block to the rows ``rows`` (from ``decode_todo``) of
        ``slots`` (int64 [B]) when that is all they need: no row may share its block
        and the pool has a block for each. Returns the new blocks, in row order; None,
        with nothing changed, otherwise (``make_writable`` row by row then)."""
        if self.shared_tail or len(rows) > self.pool.num_free:
            return None
        s = slots[rows]
        n = self.nblocks[s]
        blocks = self.pool.allocate_many(len(rows))
        self.tables[s, n] = blocks
        self.nblocks[s] = n + 1
        return blocks

    def slot_mapping(self, slots: np.ndarray, bidx: np.ndarray,
                     offset: np.ndarray) -> np.ndarray:
        """int64 [B]: the KV slot of in-block offset ``offset[i]`` of block index
        ``bidx[i]`` of slot ``slots[i]``'s row (all int64 [B])."""
        return self.tables[slots, bidx] * np.int64(self.block_size) + offset

    def holds_exactly(self, slots: np.ndarray, bidx: np.ndarray) -> bool:
        """Whether each row of ``slots`` holds exactly the blocks up to index ``bidx``
        (no block allocated ahead): what ``DecodeCursor`` relies on."""
        return bool((self.nblocks[slots] == bidx + 1).all())

    def make_writable(self, slot: int, pos: int) -> bool:
        """Make the block that position ``pos`` of the slot's holder falls in exist and
        be its own (a shared block is copied: a pair in ``clone_blocks``). False, with
        nothing changed, if the pool has no block left."""
        pool = self.pool
        bi = pos // self.block_size
        n = int(self.nblocks[slot])
        if bi >= n:
            if pool.num_free < 1:
                return False
            self.tables[slot, n] = pool.allocate()
            self.nblocks[slot] = n + 1
            self.shared_tail.discard(slot)  # its next writes go to blocks of its own
            return True
        old = int(self.tables[slot, bi])
        if pool.ref[old] > 1:  # shared with a fork sibling: copy before writing
            if pool.num_free < 1:
                return False
            new = pool.allocate()
            pool.free([old])
            self.tables[slot, bi] = new
            self.clone_blocks += (old, new)
        self.shared_tail.discard(slot)
        return True

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, seq: Sequence, n: int) -> list[int]:
        """Chain hashes of the sequence's first ``n`` full blocks (computed once)."""
        hashes = seq.block_hashes
        if len(hashes) < n:
            bs = self.block_size
            h = hashes[-1] if hashes else root_hash(seq.cache_salt)
            for i in range(len(hashes), n):
                h = chain_hash(h, tuple(seq.token_slice(i * bs, (i + 1) * bs)))
                hashes.append(h)
        return hashes

    def cached_prefix(self, seq: Sequence, nfull: int) -> list[int]:
        """Blocks of the longest verified cached prefix among the sequence's first
        ``nfull`` full blocks (no references taken: see ``take_hits``)."""
        if not self.pool.enable_caching or not nfull:
            return []
        bs = self.block_size
        return self.pool.lookup(self._hashes(seq, nfull)[:nfull],
                                lambda i: tuple(seq.token_slice(i * bs, (i + 1) * bs)),
                                seq.cache_salt)

    def register(self, seqs: Iterable[Sequence], computed: Iterable[int]) -> None:
        """Register each sequence's full blocks among its first ``computed`` tokens
        (paired in order) in the prefix cache, those not registered yet. One call for a
        whole step: a decode step registers a block for every ``block_size``-th row."""
        bs = self.block_size
        pool = self.pool
        block = self._block_id
        register_after = pool.register_after
        for seq, n in zip(seqs, computed):
            nfull = n // bs
            i0 = seq.num_registered
            if nfull <= i0:
                continue
            hashes = seq.block_hashes  # len(hashes) >= num_registered always
            if i0 and nfull == i0 + 1 and i0 == len(hashes):
                # A decode step filled the block after the chain's registered ones.
                toks = tuple(seq.token_slice(i0 * bs, nfull * bs))
                h = chain_hash(hashes[-1], toks)
                tail, gen = register_after(seq.chain_tail, seq.chain_gen, hashes[-1],
                                           block(seq.slot, i0), h, toks)
                if tail >= 0:
                    hashes.append(h)
                    seq.num_registered = nfull
                    seq.chain_tail, seq.chain_gen = tail, gen
                    continue
            self._register_one(seq, nfull)

    def _register_one(self, seq: Sequence, nfull: int) -> None:
        """``register`` of blocks ``num_registered..nfull-1`` of one sequence, finding
        where its chain stands first."""
        bs = self.block_size
        pool = self.pool
        block = self._block_id
        i0 = seq.num_registered
        hashes = seq.block_hashes
        slot = seq.slot
        # Where the chain stands: the cached copy of the last block registered (another
        # sequence's when it took the hash first), so that lookups reach what follows.
        parent = -1 if not i0 else pool.chain_block(
            hashes[i0 - 1], tuple(seq.token_slice((i0 - 1) * bs, i0 * bs)), block(slot, i0 - 1))
        for i in range(i0, nfull):
            toks = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            if i < len(hashes):
                h = hashes[i]
            else:
                h = chain_hash(hashes[i - 1] if i else root_hash(seq.cache_salt), toks)
                hashes.append(h)
            parent = pool.register(block(slot, i), h, toks, parent, seq.cache_salt)
        seq.num_registered = nfull
        seq.chain_tail = parent
        seq.chain_gen = pool.generation(parent)

    # ------------------------------------------------------------------ checks
    def check(self, seqs: list[Sequence]) -> None:
        """Assert that the rows of ``seqs`` (every live sequence) account for every block
        reference, that no block is twice in a row, and that all padding, and every row
        no live sequence holds, is 0. For tests; O(slots x width)."""
        refs: dict[int, int] = {}
        held = np.zeros(self.nblocks.shape[0], dtype=bool)
        for seq in seqs:
            if seq.slot < 0:
                continue
            held[seq.slot] = True
            blocks = seq.blocks
            assert len(set(blocks)) == len(blocks), "block twice in one table"
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
            assert not self.tables[seq.slot, len(blocks):].any(), "table padding not 0"
        assert not self.nblocks[~held].any() and not self.tables[~held].any(), \
            "blocks in a row no live sequence holds"
        self.pool.check(refs)
