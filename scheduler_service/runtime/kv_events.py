"""The prefix cache's changes as a numbered stream for subscribers (a gateway's cache-aware
routing): blocks stored, removed and cleared. A subscriber resumes from its last number; one too far
behind is dropped with a reason.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("scheduler.kv_events")


def event_hash(h: bytes) -> int:
    """The digest's first 8 bytes as a signed little-endian int64, as the wire carries it."""
    return int.from_bytes(h[:8], "little", signed=True)


@dataclass(slots=True)
class KvEventBatch:
    sequence_number: int
    timestamp: float
    replica: int
    # the allocator's records, hashes as event_hash ints
    events: list[tuple] = field(default_factory=list)


class SubscriberGone(Exception):
    """Queued for a subscriber too far behind; its stream ends."""


class KvEventPublisher:
    """A replica's records as numbered batches, in a bounded history, queued to subscribers."""

    def __init__(self, history: int = 4096, max_pending: int = 4096) -> None:
        self._history: deque[KvEventBatch] = deque(maxlen=history)
        self._subscribers: set[asyncio.Queue] = set()
        self.max_pending = max_pending
        self.sequence_number = 0

    def collect(self, replica: int, records: list[tuple]) -> None:
        """Publish a replica's records since the last call (the list is emptied)."""
        if not records:
            return
        events = []
        for r in records:
            if r[0] == "stored":
                # and the LoRA adapter's event id, where the block is one's
                events.append(
                    (
                        "stored",
                        event_hash(r[1]),
                        None if r[2] is None else event_hash(r[2]),
                        # packed: the history holds 4,096 batches, a long prompt's dozens of
                        # blocks each, and a list of ints costs four times the bytes
                        array("I", r[3]),
                        *r[4:],
                    )
                )
            elif r[0] == "removed":
                events.append(("removed", event_hash(r[1])))
            else:
                events.append(("cleared",))
        records.clear()
        self.sequence_number += 1
        batch = KvEventBatch(self.sequence_number, time.time(), replica, events)
        self._history.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_pending:
                self._subscribers.discard(queue)
                queue.put_nowait(
                    SubscriberGone(f"the subscriber fell {self.max_pending} batches behind")
                )
                log.warning("kv_event_subscriber_dropped", pending=queue.qsize())
            else:
                queue.put_nowait(batch)

    def subscribe(self, start_sequence_number: int = 0) -> asyncio.Queue:
        """Batches after start_sequence_number still held (0: only new ones), then every new one."""
        queue: asyncio.Queue = asyncio.Queue()
        if start_sequence_number:
            for batch in self._history:
                if batch.sequence_number > start_sequence_number:
                    queue.put_nowait(batch)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
