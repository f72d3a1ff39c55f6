"""The KV tiers' books, one lane a kind of entry (pool blocks; a hybrid's state snapshots): an LRU
of hashes per tier (host slots, disk files), and the stores, loads and drops decided for the next
plan.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from protos.codec import TIER_DISK, TIER_HOST, TierOps


class TierIndex:
    """One tier's hashes, LRU first, within capacity; host entries name their slot."""

    def __init__(self, tier: int, capacity: int, slotted: bool) -> None:
        self.tier, self.capacity = tier, capacity
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._free = deque(range(capacity)) if slotted else None

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def slot(self, h: bytes) -> int:
        return self._lru[h]

    def touch(self, h: bytes) -> None:
        self._lru.move_to_end(h)

    def add(self, h: bytes) -> tuple[int, list[bytes]]:
        """Hold h (most recently used): its slot (-1 unslotted), and
        the entries evicted for room.
        """
        evicted = []
        while len(self._lru) >= self.capacity:
            old, slot = self._lru.popitem(last=False)
            evicted.append(old)
            if self._free is not None:
                self._free.append(slot)
        slot = self._free.popleft() if self._free is not None else -1
        self._lru[h] = slot
        return slot, evicted

    def remove(self, h: bytes) -> None:
        slot = self._lru.pop(h, None)
        if slot is not None and self._free is not None:
            self._free.append(slot)

    def clear(self) -> list[bytes]:
        gone = list(self._lru)
        for h in gone:
            self.remove(h)
        return gone


class Lane:
    """One kind of tier entry (blocks or snapshots): each tier's index and pending work."""

    def __init__(self, host: int, disk: int, disk_hashes: list[bytes]) -> None:
        self.host = TierIndex(TIER_HOST, host, True) if host else None
        self.disk = TierIndex(TIER_DISK, disk, False) if disk else None
        self.stores: list[tuple[int, int, int]] = []
        self.loads: list[tuple[int, int, int]] = []
        self.store_hashes: list[bytes] = []
        self.load_hashes: list[bytes] = []
        self.drops: list[bytes] = []
        # disk stores of what the plan being made computes: they go in the plan after it
        self.later: list[tuple[int, bytes]] = []
        self.loaded = {TIER_HOST: 0, TIER_DISK: 0}  # entries read back, by tier
        self.stored = {TIER_HOST: 0, TIER_DISK: 0}  # entries written down, by tier
        # what an earlier run left, oldest first; past the size, the oldest go
        if self.disk is not None:
            for h in disk_hashes:
                _, gone = self.disk.add(h)
                self.drops.extend(gone)

    def index(self, tier: int) -> TierIndex | None:
        return self.host if tier == TIER_HOST else self.disk

    def evicted(self, entry: int, h: bytes) -> None:
        """Entry h leaves the pool: the host tier keeps it."""
        if self.host is None:
            return
        if h in self.host:
            self.host.touch(h)
            return
        slot, _ = self.host.add(h)
        self.stores.append((entry, TIER_HOST, slot))
        self.store_hashes.append(h)
        self.stored[TIER_HOST] += 1

    def registered(self, entry: int, h: bytes, later: bool = False) -> None:
        """Entry h was computed: the disk tier keeps it."""
        if self.disk is None:
            return
        if h in self.disk:
            self.disk.touch(h)
            return
        _, gone = self.disk.add(h)
        self.drops.extend(gone)
        if h in self.drops:  # dropped earlier in this step: written again after the drop is not
            self.drops.remove(h)
        if later:
            self.later.append((entry, h))
        else:
            self.stores.append((entry, TIER_DISK, -1))
            self.store_hashes.append(h)
        self.stored[TIER_DISK] += 1

    def holds(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (
            self.disk is not None and h in self.disk
        )

    def find(self, hashes: list[bytes]) -> list[tuple[bytes, int, int]]:
        """The leading run held here: (hash, tier, host slot or -1), host preferred."""
        found = []
        for h in hashes:
            if self.host is not None and h in self.host:
                found.append((h, TIER_HOST, self.host.slot(h)))
            elif self.disk is not None and h in self.disk:
                found.append((h, TIER_DISK, -1))
            else:
                break
        return found

    def touch(self, found: list[tuple[bytes, int, int]]) -> None:
        """These entries are the most recently used of their tiers, the first last."""
        for h, tier, _ in reversed(found):
            self.index(tier).touch(h)

    def forget(self, h: bytes, tier: int) -> None:
        index = self.index(tier)
        if index is not None and h in index:
            index.remove(h)
            if tier == TIER_DISK:
                self.drops.append(h)

    def clear(self) -> int:
        """Forget every entry; the disk's are deleted. How many were held."""
        self.later = []
        n = len(self.host.clear()) if self.host is not None else 0
        if self.disk is not None:
            gone = self.disk.clear()
            self.drops.extend(gone)
            n += len(gone)
        return n

    @property
    def has_ops(self) -> bool:
        return bool(self.stores or self.loads or self.drops or self.later)

    def take(self) -> TierOps | None:
        """This plan's work in decision order (None: none)."""
        ops = None
        if self.stores or self.loads or self.drops:
            ops = TierOps(
                np.asarray(self.stores, dtype=np.int32).reshape(-1, 3),
                np.asarray(self.loads, dtype=np.int32).reshape(-1, 3),
                self.store_hashes + self.load_hashes,
                self.drops,
            )
            self.stores, self.loads, self.store_hashes, self.load_hashes = [], [], [], []
            self.drops = []
        for entry, h in self.later:
            self.stores.append((entry, TIER_DISK, -1))
            self.store_hashes.append(h)
        self.later = []
        return ops
