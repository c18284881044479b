"""KV block pool: ref-counted blocks and a prefix cache of full blocks.

A block is free (ref 0, uncached), evictable (ref 0, still holding a cached full block that
a later prompt may reuse) or in use (ref >= 1: referenced by that many block tables).
Allocation takes a never-cached free block first and otherwise evicts the least recently
freed cached block, so cached prefixes live as long as the pool allows.

Prefix caching keys a full block by a chained hash ``h_i = hash((h_{i-1}, tokens_i))``.
The hash only finds a candidate: a hit is verified against the block's stored tokens and
its parent's identity ``(parent block id, parent generation)``. A block's generation
changes every time it is allocated, so a verified chain means every block of the prefix
still holds exactly the K/V it was registered with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

ROOT_HASH = hash(("deepinfer-prefix-root",))


def root_hash(salt: int) -> int:
    """The chain hash a sequence's first block chains from: ``ROOT_HASH`` unsalted, one
    of its own per ``cache_salt``."""
    return ROOT_HASH if not salt else hash((ROOT_HASH, salt))


def root_parent(salt: int) -> tuple[int, int] | None:
    """The parent a first block is verified against: None unsalted, else ``(-1, salt)``,
    so a hit is exact across salts, not only unlikely to collide."""
    return None if not salt else (-1, salt)


def chain_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's chain hash. Python's ``hash`` of a tuple
    holding a str varies per process: keys are only compared within one process."""
    return hash((parent_hash, tokens))


class BlockPool:
    """``num_blocks`` blocks with ref counts, a free list, an LRU of evictable cached blocks
    and the hash -> block map of the prefix cache. Not thread-safe: the scheduler's lock
    guards it."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # int32 [num_blocks]: numpy so that decode can test "shared?" for a whole batch.
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        # Pop from the end: block 0 is handed out first (only for readable tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._gen = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._parent: list[tuple[int, int] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (evictable blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    # ------------------------------------------------------------------ alloc / free
    def allocate(self) -> int:
        """One block with ref 1; evicts the LRU cached block if no free one is left."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
        else:
            raise RuntimeError("BlockPool.allocate: no free block (caller must check)")
        self._gen[b] += 1
        self.ref[b] = 1
        return b

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks as ``allocate`` gives them, in order (the caller checked
        ``num_free``): one call for a decode step's new blocks."""
        free, gen = self._free, self._gen
        out = []
        for _ in range(n):
            if free:
                b = free.pop()
                gen[b] += 1
            else:  # evicts, as allocate does
                b = self.allocate()
            out.append(b)
        self.ref[out] = 1
        return out

    def take(self, b: int) -> None:
        """Add a reference to block ``b`` (a prefix-cache hit or a fork share)."""
        if self.ref[b] == 0:
            del self._evictable[b]
        self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are released first so that they
        are evicted before the prefix blocks, which are likelier to be shared again."""
        ref = self.ref
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
            elif r < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")

    def _uncache(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            if self._cached.get(h) == b:
                del self._cached[h]
            self._hash[b] = None
            self._tokens[b] = None
            self._parent[b] = None

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: list[int],
               tokens_of: Callable[[int], tuple[int, ...]], salt: int = 0) -> list[int]:
        """Longest verified cached prefix: block ids for the first k of ``hashes``.

        ``hashes[i]`` is the chain hash of block i, ``tokens_of(i)`` its tokens (only
        built for candidates); ``salt`` the sequence's ``cache_salt``. Does not take
        references (see ``take``)."""
        if not self.enable_caching:
            return []
        out: list[int] = []
        parent: tuple[int, int] | None = root_parent(salt)
        for i, h in enumerate(hashes):
            b = self._cached.get(h)
            if b is None or self._parent[b] != parent or self._tokens[b] != tokens_of(i):
                break
            out.append(b)
            parent = (b, self._gen[b])
        return out

    def register(self, b: int, h: int, tokens: tuple[int, ...], parent_block: int,
                 salt: int = 0) -> int:
        """Record full block ``b`` (whose parent in the cached chain is ``parent_block``,
        -1 for the first block, of a sequence of ``cache_salt`` ``salt``) under chain
        hash ``h``; returns the block the chain goes
        on from: the one that already holds ``h`` with these tokens after the same parent
        (another sequence computed the same prefix in the same step), else ``b``. A block
        already cached, or a hash held by a block of another chain, is left as it is."""
        if not self.enable_caching:
            return b
        parent = (root_parent(salt) if parent_block < 0
                  else (parent_block, self._gen[parent_block]))
        return self._add(b, h, tokens, parent)

    def _add(self, b: int, h: int, tokens: tuple[int, ...],
             parent: tuple[int, int] | None) -> int:
        """``register``'s body, the parent given as ``(block, generation)``."""
        owner = self._cached.get(h)
        if owner is not None:
            # Chaining on through the owner keeps the next blocks reachable by lookup,
            # which walks the cached chain.
            same = self._tokens[owner] == tokens and self._parent[owner] == parent
            return owner if same else b
        if self._hash[b] is None:
            self._hash[b] = h
            self._tokens[b] = tokens
            self._parent[b] = parent
            self._cached[h] = b
        return b

    def generation(self, b: int) -> int:
        """How many times block ``b`` has been allocated: unchanged means it still holds
        what it held when read."""
        return self._gen[b]

    def register_after(self, tail: int, tail_gen: int, tail_hash: int, b: int, h: int,
                       tokens: tuple[int, ...]) -> tuple[int, int]:
        """``register(b, h, tokens, tail)`` for a chain known to continue from block
        ``tail`` (the block the cache held under ``tail_hash`` when it was allocated for
        the ``tail_gen``-th time), in one call: returns the block the chain now goes on
        from and its generation, or ``(-1, -1)``, with nothing changed, if ``tail``
        no longer holds that place (``chain_block`` finds where the chain stands)."""
        gen = self._gen
        if gen[tail] != tail_gen or self._cached.get(tail_hash) != tail:
            return -1, -1
        b = self._add(b, h, tokens, (tail, tail_gen))
        return b, gen[b]

    def chain_block(self, h: int, tokens: tuple[int, ...], own: int) -> int:
        """The block a chain continues from after a sequence's block ``own`` (chain hash
        ``h``, ``tokens``) registered in an earlier step: the block the cache holds for
        it (``own``, or another sequence's copy that took the hash first), else ``own``.
        ``register`` returns the same within one call."""
        owner = self._cached.get(h) if self.enable_caching else None
        return owner if owner is not None and self._tokens[owner] == tokens else own

    # ------------------------------------------------------------------ checks
    def check(self, references: dict[int, int]) -> None:
        """Assert pool consistency given ``references`` (block -> number of block-table
        references from live sequences). For tests; O(num_blocks)."""
        free = set(self._free)
        evict = set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evict, "block both free and evictable"
        for b in range(self.num_blocks):
            want = references.get(b, 0)
            assert self.ref[b] == want, f"block {b}: ref {self.ref[b]} != {want} references"
            if want:
                assert b not in free and b not in evict, f"block {b} referenced and free"
            else:
                assert b in free or b in evict, f"block {b} leaked"
            if b in evict:
                assert self._hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"hash map entry of block {b} is stale"
