"""A lost replica's requests: resumed on another replica at once, or waiting
(--worker-restart-timeout) for a group to join, else ended UNAVAILABLE.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from scheduler_service.core.sequence import Request
from scheduler_service.runtime.errors import EngineUnavailable

if TYPE_CHECKING:
    from scheduler_service.runtime.step_loop import StepLoop

log = structlog.get_logger("scheduler.engine")


class Orphans:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.requests: list[Request] = []
        self.deadline: float | None = None  # set by the first to wait, cleared when they are taken
        self.reason = ""  # why the first of them lost its replica

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, requests: list[Request], reason: str) -> None:
        self.requests.extend(requests)
        if self.requests and self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
            self.reason = reason

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def take(self) -> list[Request]:
        """Every waiting request, oldest first; none wait after."""
        taken, self.requests, self.deadline = self.requests, [], None
        return taken

    def expired(self) -> list[Request]:
        """The waiting requests once the deadline has passed (taken), else none."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return []
        return self.take()

    @property
    def expiry_message(self) -> str:
        return f"no worker came back within {self.timeout:g}s after: {self.reason}"


class Failover:
    """The engine's side of a lost replica: its requests moved or kept waiting."""

    async def group_lost(self, replica: int, reason: str) -> None:
        """A rank went silent outside a step: its group dropped before start, its replica down
        after.
        """
        if self.limits is None:
            await self.client.drop_group(replica, reason)
        else:
            await self.on_lost(self.replicas[replica], reason)

    async def on_lost(self, replica: StepLoop, message: str) -> None:
        """The replica goes down and its requests resume elsewhere; seeded sampling draws the same
        tokens.
        """
        if not replica.is_serving:
            return
        moved = replica.live_requests()
        await replica.detach(message)
        self._report_health()
        for request in moved:
            self.streams[request.request_id].replica = None
        self._orphans.add(moved, message)
        self._resume_orphans()
        log.error(
            "workers_lost",
            replica=replica.index,
            error=message,
            requests_to_resume=len(moved),
            serving_replicas=sum(r.is_serving for r in self.replicas),
        )

    def _resume_orphans(self) -> None:
        """Give a lost replica's requests to serving replicas, oldest first."""
        if not self._orphans or not self.is_serving:
            return
        # adopt() queues at the head: the oldest goes last
        for request in reversed(self._orphans.take()):
            replica = self._pick(request)
            stream = self.streams[request.request_id]
            replica.adopt(request, stream.samples)
            stream.replica = replica
            log.info(
                "request_resumed",
                request_id=request.request_id,
                replica=replica.index,
                tokens=[s.num_output_tokens for s in request.seqs],
            )

    def _expire_orphans(self) -> None:
        """No replica came back within --worker-restart-timeout: the waiting requests end with
        UNAVAILABLE.
        """
        orphans = self._orphans.expired()
        if not orphans:
            return
        message = self._orphans.expiry_message
        for request in orphans:
            self._fail_request(request, EngineUnavailable(message))
        log.error("requests_expired", count=len(orphans), error=message)

    @property
    def orphans(self) -> list[Request]:
        """Live requests whose replica was lost, waiting for one to serve again."""
        return self._orphans.requests
