"""KV tiers under the pool: the scheduler's index (an LRU of block hashes per tier) of blocks the
worker holds in host memory (evicted, write-back) or on disk (cached, write-through, surviving a
restart).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import structlog

from protos.codec import TIER_DISK, TIER_HOST, TierOps
from scheduler_service.core.stats import TierStats

log = structlog.get_logger("scheduler.kv_tiers")
TIER_NAMES = {TIER_HOST: "host", TIER_DISK: "disk"}
# Before anything is measured: what a block costs to load (per byte) from each tier. A prompt
# token's compute is not guessed: until a step measures it, loading is taken to pay.
_START_SECONDS_PER_BYTE = {TIER_HOST: 1 / 2e9, TIER_DISK: 1 / 4e8}
_EWMA = 0.2


class TierIndex:
    """The block hashes one tier holds, LRU first, within its capacity; host entries name their
    slot.
    """

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


@dataclass(slots=True)
class Load:
    """A block read back into the pool in some step: it becomes
    a prefix-cache block if it loaded.
    """

    block: int
    hash: bytes
    tier: int
    parent: bytes | None
    tokens: list[int]
    lora: int | None
    epoch: int


class KvTiers:
    def __init__(
        self,
        host_blocks: int,
        disk_blocks: int,
        disk_hashes: list[bytes],
        bytes_per_block: int,
        block_size: int,
    ) -> None:
        self.host = TierIndex(TIER_HOST, host_blocks, True) if host_blocks else None
        self.disk = TierIndex(TIER_DISK, disk_blocks, False) if disk_blocks else None
        self.bytes_per_block, self.block_size = bytes_per_block, block_size
        self._stores: list[tuple[int, int, int]] = []
        self._loads: list[tuple[int, int, int]] = []
        self._store_hashes: list[bytes] = []
        self._load_hashes: list[bytes] = []
        self._drops: list[bytes] = []
        self.inflight: dict[int, list[Load]] = {}  # by step id: the loads it carries
        self._waiting_on: dict[int, int] = {}  # sequence id -> the step loading its next blocks
        self._loading: dict[bytes, int] = {}  # block hash -> the step loading it
        self._epoch = (
            0  # moves on when every tier is cleared: loads planned before then are dropped
        )
        self.loaded = {TIER_HOST: 0, TIER_DISK: 0}  # blocks loaded back, by tier
        self.stored = {TIER_HOST: 0, TIER_DISK: 0}  # blocks written down, by tier
        self.load_failures = 0
        self.seconds = 0.0  # the workers' time on the tiers
        self.seconds_per_byte = dict(_START_SECONDS_PER_BYTE)
        self.seconds_per_token: float | None = None  # a prompt token's compute, measured
        # what an earlier run left, oldest first; past the size, the oldest go
        if self.disk is not None:
            for h in disk_hashes:
                _, gone = self.disk.add(h)
                self._drops.extend(gone)

    @property
    def epoch(self) -> int:
        """Moves on when every tier is cleared."""
        return self._epoch

    # --- writing down -----------------------------------------------------------------------------
    def evicted(self, block: int, h: bytes) -> None:
        """A cached block leaves the pool: the host tier keeps its K/V (the plan copies it before
        the step reuses the block).
        """
        if self.host is None:
            return
        if h in self.host:
            self.host.touch(h)
            return
        slot, _ = self.host.add(h)
        self._stores.append((block, TIER_HOST, slot))
        self._store_hashes.append(h)
        self.stored[TIER_HOST] += 1

    def registered(self, block: int, h: bytes) -> None:
        """A computed block entered the prefix cache: the disk tier keeps it from now on."""
        if self.disk is None:
            return
        if h in self.disk:
            self.disk.touch(h)
            return
        _, gone = self.disk.add(h)
        self._drops.extend(gone)
        if h in self._drops:  # dropped earlier in this step: written again after the drop is not
            self._drops.remove(h)
        self._stores.append((block, TIER_DISK, -1))
        self._store_hashes.append(h)
        self.stored[TIER_DISK] += 1

    # --- reading back -----------------------------------------------------------------------------
    def is_loading(self, seq_id: int) -> bool:
        """The sequence waits for a step that loads its prefix."""
        step = self._waiting_on.get(seq_id)
        if step is not None and step not in self.inflight:
            del self._waiting_on[seq_id]
            return False
        return step is not None

    def wait_for(self, seq_id: int, h: bytes) -> bool:
        """Another prompt's step loads block h now: the sequence waits for it rather than load it
        twice.
        """
        step = self._loading.get(h)
        if step is None or step not in self.inflight:
            return False
        self._waiting_on[seq_id] = step
        return True

    def holds(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (
            self.disk is not None and h in self.disk
        )

    def find(self, hashes: list[bytes]) -> list[tuple[bytes, int, int]]:
        """The leading run of these hashes held below the pool: (hash, tier, host slot or -1), the
        host tier's copy where both hold one.
        """
        found = []
        for h in hashes:
            if self.host is not None and h in self.host:
                found.append((h, TIER_HOST, self.host.slot(h)))
            elif self.disk is not None and h in self.disk:
                found.append((h, TIER_DISK, -1))
            else:
                break
        return found

    def worth_loading(self, found: list[tuple[bytes, int, int]], request_id: str) -> bool:
        """Whether reading these blocks back costs less than computing their tokens, by the measured
        cost of each (logged with the choice).
        """
        load = sum(self.seconds_per_byte[tier] for _, tier, _ in found) * self.bytes_per_block
        compute = (
            self.seconds_per_token * len(found) * self.block_size
            if self.seconds_per_token is not None
            else None
        )
        worth = compute is None or load < compute
        log.info(
            "kv_tier_lookup",
            request_id=request_id,
            blocks=len(found),
            load_s=round(load, 4),
            compute_s=round(compute, 4) if compute is not None else None,
            load=worth,
            host=sum(1 for _, tier, _ in found if tier == TIER_HOST),
        )
        return worth

    def touch(self, found: list[tuple[bytes, int, int]]) -> None:
        """These entries are the most recently used of their tiers, the first (the prefix's root)
        last.
        """
        for h, tier, _ in reversed(found):
            (self.host if tier == TIER_HOST else self.disk).touch(h)

    def start(self, step_id: int, seq_id: int, loads: list[Load], slots: list[int]) -> None:
        """Plan these loads in step step_id (their blocks held until its result); the sequence
        waits.
        """
        for ld, slot in zip(loads, slots, strict=True):
            self._loads.append((ld.block, ld.tier, slot))
            self._load_hashes.append(ld.hash)
            self._loading[ld.hash] = step_id
        self.inflight.setdefault(step_id, []).extend(loads)
        self._waiting_on[seq_id] = step_id

    def settle(self, step_id: int, failed: set[int] | None) -> list[tuple[Load, bool]]:
        """The step's result for its loads (failed: indices that did not load; None: none did);
        failures are forgotten.
        """
        loads = self.inflight.pop(step_id, [])
        done = []
        for i, ld in enumerate(loads):
            if self._loading.get(ld.hash) == step_id:
                del self._loading[ld.hash]
            ok = failed is not None and i not in failed and ld.epoch == self._epoch
            if not ok and ld.epoch == self._epoch:
                self.load_failures += 1
                self._forget(ld.hash, ld.tier)
            elif ok:
                self.loaded[ld.tier] += 1
            done.append((ld, ok))
        if failed:
            log.warning("kv_tier_load_failed", step_id=step_id, blocks=len(failed))
        return done

    def _forget(self, h: bytes, tier: int) -> None:
        index = self.host if tier == TIER_HOST else self.disk
        if index is not None and h in index:
            index.remove(h)
            if tier == TIER_DISK:
                self._drops.append(h)

    def held_blocks(self) -> list[int]:
        """Pool blocks loads in flight hold (one reference each)."""
        return [ld.block for loads in self.inflight.values() for ld in loads]

    @property
    def has_ops(self) -> bool:
        """Work decided that no plan has carried yet (a step, even without rows, carries it)."""
        return bool(self._stores or self._loads or self._drops)

    # --- the plan, the measurements ---------------------------------------------------------------
    def take_ops(self) -> TierOps | None:
        """This step's stores, loads and drops, in the order they were decided; None when there are
        none.
        """
        if not (self._stores or self._loads or self._drops):
            return None
        ops = TierOps(
            np.asarray(self._stores, dtype=np.int32).reshape(-1, 3),
            np.asarray(self._loads, dtype=np.int32).reshape(-1, 3),
            self._store_hashes + self._load_hashes,
            self._drops,
        )
        self._stores, self._loads, self._store_hashes, self._load_hashes, self._drops = (
            [],
            [],
            [],
            [],
            [],
        )
        return ops

    def observe(
        self, ops: TierOps | None, seconds: float, prefill_tokens: int, step_seconds: float
    ) -> None:
        """A step's timings: the tiers' share per byte moved (into the tier most of its loads came
        from), a prompt token's compute where the step was mostly prompt.
        """
        self.seconds += seconds
        if ops is not None and len(ops.loads):
            tiers = ops.loads[:, 1]
            tier = (
                TIER_HOST if np.count_nonzero(tiers == TIER_HOST) * 2 >= len(tiers) else TIER_DISK
            )
            per_byte = seconds / ((len(ops.loads) + len(ops.stores)) * self.bytes_per_block)
            self.seconds_per_byte[tier] += _EWMA * (per_byte - self.seconds_per_byte[tier])
        if prefill_tokens >= self.block_size:
            per_token = max(step_seconds - seconds, 0.0) / prefill_tokens
            old = self.seconds_per_token
            self.seconds_per_token = per_token if old is None else old + _EWMA * (per_token - old)

    def clear(self) -> int:
        """Forget every tier's blocks (FlushCache); the disk's entries are deleted. How many were
        held.
        """
        n = 0
        self._epoch += 1
        if self.host is not None:
            n += len(self.host.clear())
        if self.disk is not None:
            gone = self.disk.clear()
            self._drops.extend(gone)
            n += len(gone)
        # (stores already planned still run: the drops, run after them, delete what they write)
        return n

    def stats(self) -> TierStats:
        """Blocks held and their capacity, loads and stores by
        tier, failures, the tiers' seconds.
        """
        host, disk = self.host, self.disk  # an empty index is falsy: each compared with None
        return TierStats(
            host_blocks=len(host) if host is not None else 0,
            host_capacity=host.capacity if host is not None else 0,
            host_loaded=self.loaded[TIER_HOST],
            host_stored=self.stored[TIER_HOST],
            disk_blocks=len(disk) if disk is not None else 0,
            disk_capacity=disk.capacity if disk is not None else 0,
            disk_loaded=self.loaded[TIER_DISK],
            disk_stored=self.stored[TIER_DISK],
            load_failures=self.load_failures,
            seconds=self.seconds,
        )
