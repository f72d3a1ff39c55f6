"""The KV block allocator: free list, reference counts, and the prefix cache.

A block is free (refcount 0, on the free list), cached (refcount 0, hashed, in the LRU) or
referenced (refcount > 0). New blocks come from the free list, then the LRU's oldest. A request that
cannot be met raises and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


class OutOfBlocks(RuntimeError):
    """Raised by allocate() when too few blocks are available; nothing was allocated."""


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of a full block: its tokens and its parent's hash."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


class BlockAllocator:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        # LRU of cached-free blocks, oldest first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._refcount = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0
        # When a list: the cache's gains and losses in order for KV-event subscribers.
        self.events: list[tuple] | None = None
        # The KV tiers under the pool, told of every eviction and registration.
        self.tiers = None

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing reusable."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._cached)

    @property
    def num_available_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Held blocks with more than one owner (a pass over the pool: for reports only)."""
        return sum(1 for r in self._refcount if r > 1)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, h: bytes) -> int | None:
        """The block holding the prefix with this hash, if it is still in the pool."""
        return self._block_of.get(h) if self.enable_prefix_caching else None

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached

    def touch(self, block_id: int, h: bytes) -> bool:
        """Make a cached-free block holding `h` the last to evict; False if it is gone."""
        if block_id not in self._cached or self._hash_of[block_id] != h:
            return False
        self._cached.move_to_end(block_id)
        return True

    def is_hashed(self, block_id: int) -> bool:
        """Holds a registered prefix that others may read, so it is never rewritten."""
        return self._hash_of[block_id] is not None

    # --- check, then act -----------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks fresh blocks with refcount 1, or raise OutOfBlocks and take none."""
        if num_blocks < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfBlocks(
                f"asked for {num_blocks} blocks, {self.num_available_blocks} available"
            )
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently used cached prefix
                b, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of[b]]
                if self.tiers is not None:
                    self.tiers.evicted(b, self._hash_of[b])
                if self.events is not None:
                    self.events.append(("removed", self._hash_of[b]))
                self._hash_of[b] = None
                self.num_evictions += 1
            self._refcount[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to each block; a cached-free one leaves the LRU."""
        for b in block_ids:
            if self._refcount[b] <= 0 and b not in self._cached:
                raise ValueError(f"block {b} is free and holds nothing to share")
        for b in block_ids:
            if self._refcount[b] == 0:
                del self._cached[b]
            self._refcount[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop a reference; at 0 a hashed block joins the LRU, others the free list."""
        for b in block_ids:
            if self._refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
        for b in block_ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self._hash_of[b] is not None:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def register(
        self,
        block_id: int,
        h: bytes,
        parent: bytes | None = None,
        tokens=(),
        lora: int | None = None,
    ) -> None:
        """Mark a full computed block as prefix h (the first holder stays the cached copy)."""
        if not self.enable_prefix_caching or self._hash_of[block_id] is not None:
            return
        if self._refcount[block_id] <= 0:
            raise ValueError(f"block {block_id} is not held and cannot be registered")
        if h not in self._block_of:
            self._block_of[h] = block_id
            self._hash_of[block_id] = h
            if self.events is not None:
                self.events.append(
                    ("stored", h, parent, list(tokens)) + (() if lora is None else (lora,))
                )
            if self.tiers is not None:
                self.tiers.registered(block_id, h)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; held blocks keep their contents. Returns how many."""
        forgotten = len(self._block_of)
        self._block_of.clear()
        self._hash_of = [None] * self.num_blocks
        self._free.extend(self._cached)
        self._cached.clear()
        if self.events is not None:
            self.events.append(("cleared",))
        return forgotten

    # --- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self._free)
        cached = set(self._cached)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & cached:
            raise AssertionError(f"blocks both free and cached: {sorted(free & cached)[:5]}")
        referenced = 0
        for b, rc in enumerate(self._refcount):
            if rc < 0:
                raise AssertionError(f"block {b} has refcount {rc}")
            if rc > 0:
                referenced += 1
                if b in free or b in cached:
                    raise AssertionError(f"block {b} is referenced and on a free list")
            elif b not in free and b not in cached:
                raise AssertionError(f"block {b} has refcount 0 but is on no list")
            if b in cached and self._hash_of[b] is None:
                raise AssertionError(f"cached block {b} has no hash")
            if b in free and self._hash_of[b] is not None:
                raise AssertionError(f"free block {b} still has a hash")
        if len(free) + len(cached) + referenced != self.num_blocks:
            raise AssertionError("free + cached + referenced != num_blocks")
        for h, b in self._block_of.items():
            if self._hash_of[b] != h:
                raise AssertionError(f"hash map points at block {b} which holds another prefix")
