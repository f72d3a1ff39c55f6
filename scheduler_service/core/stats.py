"""The pool's and the KV tiers' figures as the scheduler reports them (GetCacheStats, the gateway's
load, the metrics): typed records, each field said once, read by name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """The KV tiers' figures: held and capacity, loads, stores, failures, seconds."""

    host_blocks: int = 0
    host_capacity: int = 0
    host_loaded: int = 0
    host_stored: int = 0
    disk_blocks: int = 0
    disk_capacity: int = 0
    disk_loaded: int = 0
    disk_stored: int = 0
    load_failures: int = 0
    seconds: float = 0.0
    host_snapshots: int = 0  # a hybrid's state snapshots held
    disk_snapshots: int = 0

    def as_fields(self) -> dict[str, int | float]:
        """Them by GetCacheStats' names."""
        return {
            "host_tier_blocks": self.host_blocks,
            "host_tier_capacity": self.host_capacity,
            "host_tier_loaded": self.host_loaded,
            "host_tier_stored": self.host_stored,
            "disk_tier_blocks": self.disk_blocks,
            "disk_tier_capacity": self.disk_capacity,
            "disk_tier_loaded": self.disk_loaded,
            "disk_tier_stored": self.disk_stored,
            "kv_load_failures": self.load_failures,
            "kv_tier_seconds": self.seconds,
            "host_tier_snapshots": self.host_snapshots,
            "disk_tier_snapshots": self.disk_snapshots,
        }


TIER_FIELDS = tuple(TierStats().as_fields())  # GetCacheStats' tier fields, in order


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One scheduler's pool: blocks by state, queues, prefix lookups, preemptions, tiers."""

    num_blocks: int
    num_free_blocks: int
    num_available_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_shared_blocks: int
    num_running: int
    num_waiting: int
    waiting_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    tiers: TierStats | None = None
    num_state_slots: int = 0  # a hybrid's recurrent-state slots, those held now, its snapshots
    num_used_state_slots: int = 0
    num_state_snapshots: int = 0


@dataclass(frozen=True, slots=True)
class PoolGauges:
    """The pool's figures /metrics shows, read without walking a queue (a scrape reads them from the
    metrics server's thread while the scheduler runs).
    """

    num_running: int
    num_waiting: int
    num_available_blocks: int
    num_blocks: int
    num_used_state_slots: int
