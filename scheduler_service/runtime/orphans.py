"""Requests whose replica was lost while no other served: they wait (at most --worker-restart-timeout) for a
group to join, then resume where they were, or end with UNAVAILABLE."""

from __future__ import annotations

import time

from scheduler_service.core.sequence import Request


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
