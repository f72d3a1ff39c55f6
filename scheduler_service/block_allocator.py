"""The KV block allocator: a free list and reference counts over the pool's physical blocks.

Invariant (checkable at any moment): every block is either free (refcount 0, on the free list once)
or referenced (refcount > 0, on no list); free + referenced == num_blocks. Operations come in
check-then-act pairs; an act that cannot be satisfied raises and changes nothing.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised by allocate() when the free list is shorter than asked; nothing was allocated."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- check, then act -----------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks free blocks with refcount 1, or raise OutOfBlocks and take none."""
        if num_blocks < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks that are already held (several sequences reading one block)."""
        for b in block_ids:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
        for b in block_ids:
            self._refcount[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block whose count reaches 0 returns to the free list.

        Freeing never zeroes memory: attention masks by sequence length, stale bytes are never read.
        """
        for b in block_ids:
            if self._refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
        for b in block_ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    # --- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b, rc in enumerate(self._refcount):
            if rc < 0:
                raise AssertionError(f"block {b} has refcount {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b} has refcount {rc} but free-list membership {b in free}")
        referenced = sum(1 for rc in self._refcount if rc > 0)
        if len(free) + referenced != self.num_blocks:
            raise AssertionError("free + referenced != num_blocks")
