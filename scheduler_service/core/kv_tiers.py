"""KV tiers under the pool: what the workers hold in host memory (evicted, write-back) or on disk
(cached, write-through, surviving a restart), blocks and a hybrid's state snapshots; the loads in
flight, and whether a load costs less than computing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog

from protos.codec import TIER_DISK, TIER_HOST, TierOps
from scheduler_service.core.stats import TierStats
from scheduler_service.core.tier_lanes import Lane, TierIndex

log = structlog.get_logger("scheduler.kv_tiers")
TIER_NAMES = {TIER_HOST: "host", TIER_DISK: "disk"}
# A block's load cost per byte before any is measured; until a prompt token's compute is measured,
# loading is taken to pay.
_START_SECONDS_PER_BYTE = {TIER_HOST: 1 / 2e9, TIER_DISK: 1 / 4e8}
_EWMA = 0.2


@dataclass(slots=True)
class Load:
    """A block (or state snapshot) being read back; it joins the cache if it loaded."""

    block: int
    hash: bytes
    tier: int
    parent: bytes | None
    tokens: list[int]
    lora: int | None
    epoch: int
    state: bool = False


class KvTiers:
    def __init__(
        self,
        host_blocks: int,
        disk_blocks: int,
        disk_hashes: list[bytes],
        bytes_per_block: int,
        block_size: int,
        snapshots: tuple[int, int, list[bytes]] | None = None,
        bytes_per_snapshot: int = 0,
    ) -> None:
        """snapshots: a hybrid's (host, disk, hashes on disk) for its state snapshots."""
        self.blocks = Lane(host_blocks, disk_blocks, disk_hashes)
        self.states = Lane(*snapshots) if snapshots is not None else None
        self.bytes_per_block, self.block_size = bytes_per_block, block_size
        self.bytes_per_snapshot = bytes_per_snapshot
        self.inflight: dict[int, list[Load]] = {}  # by step id: the loads it carries
        self._waiting_on: dict[int, int] = {}  # sequence id -> the step loading its next blocks
        # (is a snapshot, hash) -> the step loading it
        self._loading: dict[tuple[bool, bytes], int] = {}
        self._epoch = 0  # moves on when every tier is cleared: loads planned before are dropped
        self.load_failures = 0
        self.seconds = 0.0  # the workers' time on the tiers
        self.seconds_per_byte = dict(_START_SECONDS_PER_BYTE)
        self.seconds_per_token: float | None = None  # a prompt token's compute, measured

    @property
    def host(self) -> TierIndex | None:
        return self.blocks.host

    @property
    def disk(self) -> TierIndex | None:
        return self.blocks.disk

    @property
    def epoch(self) -> int:
        """Moves on when every tier is cleared."""
        return self._epoch

    # --- writing down -----------------------------------------------------------------------------
    def evicted(self, block: int, h: bytes) -> None:
        """A cached block leaves the pool: the host tier keeps a copy."""
        self.blocks.evicted(block, h)

    def registered(self, block: int, h: bytes) -> None:
        """A computed block entered the prefix cache: the disk tier keeps it from now on."""
        self.blocks.registered(block, h)

    # --- reading back -----------------------------------------------------------------------------
    def is_loading(self, seq_id: int) -> bool:
        """The sequence waits for a step that loads its prefix."""
        step = self._waiting_on.get(seq_id)
        if step is not None and step not in self.inflight:
            del self._waiting_on[seq_id]
            return False
        return step is not None

    def wait_for(self, seq_id: int, h: bytes, state: bool = False) -> bool:
        """Another prompt loads block h now: wait for it rather than load it twice."""
        step = self._loading.get((state, h))
        if step is None or step not in self.inflight:
            return False
        self._waiting_on[seq_id] = step
        return True

    def holds(self, h: bytes) -> bool:
        return self.blocks.holds(h)

    def find(self, hashes: list[bytes]) -> list[tuple[bytes, int, int]]:
        """The leading run held below the pool: (hash, tier, host slot or -1), host preferred."""
        return self.blocks.find(hashes)

    def worth_loading(
        self,
        found: list[tuple[bytes, int, int]],
        request_id: str,
        snapshot: int = 0,
        tokens: int | None = None,
    ) -> bool:
        """Whether reading back costs less than computing, by each one's measured cost."""
        load = sum(self.seconds_per_byte[tier] for _, tier, _ in found) * self.bytes_per_block
        if snapshot:
            load += self.seconds_per_byte[snapshot] * self.bytes_per_snapshot
        tokens = len(found) * self.block_size if tokens is None else tokens
        compute = self.seconds_per_token * tokens if self.seconds_per_token is not None else None
        worth = compute is None or load < compute
        log.info(
            "kv_tier_lookup",
            request_id=request_id,
            blocks=len(found),
            snapshot=bool(snapshot),
            load_s=round(load, 4),
            compute_s=round(compute, 4) if compute is not None else None,
            load=worth,
            host=sum(1 for _, tier, _ in found if tier == TIER_HOST),
        )
        return worth

    def touch(self, found: list[tuple[bytes, int, int]]) -> None:
        """Mark these blocks most recently used, the prefix's root last."""
        self.blocks.touch(found)

    def start(self, step_id: int, seq_id: int, loads: list[Load], slots: list[int]) -> None:
        """Plan these loads in step step_id, holding their blocks and slots until its result."""
        for ld, slot in zip(loads, slots, strict=True):
            lane = self.states if ld.state else self.blocks
            lane.loads.append((ld.block, ld.tier, slot))
            lane.load_hashes.append(ld.hash)
            self._loading[(ld.state, ld.hash)] = step_id
        self.inflight.setdefault(step_id, []).extend(loads)
        self._waiting_on[seq_id] = step_id

    def settle(self, step_id: int, failed: set[int] | None) -> list[tuple[Load, bool]]:
        """A step's loads done (`failed`: indices that did not load; None: none did)."""
        loads = self.inflight.pop(step_id, [])
        index = [0, sum(1 for ld in loads if not ld.state)]  # the next block's, snapshot's index
        done = []
        for ld in loads:
            i, index[ld.state] = index[ld.state], index[ld.state] + 1
            if self._loading.get((ld.state, ld.hash)) == step_id:
                del self._loading[(ld.state, ld.hash)]
            lane = self.states if ld.state else self.blocks
            ok = failed is not None and i not in failed and ld.epoch == self._epoch
            if not ok and ld.epoch == self._epoch:
                self.load_failures += 1
                lane.forget(ld.hash, ld.tier)
            elif ok:
                lane.loaded[ld.tier] += 1
            done.append((ld, ok))
        if failed:
            log.warning("kv_tier_load_failed", step_id=step_id, loads=len(failed))
        return done

    def held_blocks(self) -> list[int]:
        """Pool blocks loads in flight hold (one reference each)."""
        return [ld.block for loads in self.inflight.values() for ld in loads if not ld.state]

    @property
    def has_ops(self) -> bool:
        """Work decided that no plan has carried yet (a step, even without rows, carries it)."""
        return self.blocks.has_ops or (self.states is not None and self.states.has_ops)

    # --- the plan, the measurements ---------------------------------------------------------------
    def take_ops(self) -> TierOps | None:
        """This step's stores, loads and drops in decision order; None if none."""
        ops = self.blocks.take()
        states = self.states.take() if self.states is not None else None
        if states is not None:
            ops = ops or TierOps.none()
            ops.states = states
        return ops

    def observe(
        self, ops: TierOps | None, seconds: float, prefill_tokens: int, step_seconds: float
    ) -> None:
        """Learn from a step's timings: seconds per byte moved, and per prompt token computed."""
        self.seconds += seconds
        states = ops.states if ops is not None and ops.states is not None else TierOps.none()
        if ops is not None and len(ops.loads) + len(states.loads):
            tiers = np.concatenate([ops.loads[:, 1], states.loads[:, 1]])
            tier = (
                TIER_HOST if np.count_nonzero(tiers == TIER_HOST) * 2 >= len(tiers) else TIER_DISK
            )
            moved = (len(ops.loads) + len(ops.stores)) * self.bytes_per_block + (
                len(states.loads) + len(states.stores)
            ) * self.bytes_per_snapshot
            per_byte = seconds / moved
            self.seconds_per_byte[tier] += _EWMA * (per_byte - self.seconds_per_byte[tier])
        if prefill_tokens >= self.block_size:
            per_token = max(step_seconds - seconds, 0.0) / prefill_tokens
            old = self.seconds_per_token
            self.seconds_per_token = per_token if old is None else old + _EWMA * (per_token - old)

    def clear(self) -> int:
        """Forget every tier's entries, deleting the disk's -> how many blocks were held."""
        self._epoch += 1
        if self.states is not None:
            self.states.clear()
        # (stores already planned still run: the drops, run after them, delete what they write)
        return self.blocks.clear()

    def stats(self) -> TierStats:
        """Held and capacity, loads and stores per tier, failures, seconds, snapshots."""
        b, s = self.blocks, self.states
        host, disk = b.host, b.disk  # an empty index is falsy: each compared with None
        return TierStats(
            host_blocks=len(host) if host is not None else 0,
            host_capacity=host.capacity if host is not None else 0,
            host_loaded=b.loaded[TIER_HOST],
            host_stored=b.stored[TIER_HOST],
            disk_blocks=len(disk) if disk is not None else 0,
            disk_capacity=disk.capacity if disk is not None else 0,
            disk_loaded=b.loaded[TIER_DISK],
            disk_stored=b.stored[TIER_DISK],
            load_failures=self.load_failures,
            seconds=self.seconds,
            host_snapshots=len(s.host) if s is not None and s.host is not None else 0,
            disk_snapshots=len(s.disk) if s is not None and s.disk is not None else 0,
        )
