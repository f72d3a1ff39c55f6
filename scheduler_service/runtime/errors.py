"""Why the engine refused or ended a request; each maps to one gRPC status and one HTTP status."""

from __future__ import annotations


class QueueFull(RuntimeError):
    """Too many requests wait already; answered with RESOURCE_EXHAUSTED."""


class EngineUnavailable(RuntimeError):
    """No replica can serve (no live worker group); answered with UNAVAILABLE."""


class Draining(EngineUnavailable):
    """The server is shutting down: running requests finish, new ones are refused (UNAVAILABLE)."""

    REASON = "the server is draining (shutting down)"

    def __init__(self) -> None:
        super().__init__(f"{self.REASON}; send the request to another instance")


class StepFailed(RuntimeError):
    """A step holding this request failed on a worker; answered with INTERNAL."""


class Unschedulable(RuntimeError):
    """The request can never be admitted to its replica's pool; answered with RESOURCE_EXHAUSTED."""
