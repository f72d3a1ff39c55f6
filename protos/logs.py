"""Structured logging (structlog) shared by every pagedserve process (scheduler, workers, launcher):
one JSON event per line, each naming its process."""

from __future__ import annotations

import logging
import sys

import structlog

# Request ids come from clients (up to 256 characters): logs carry at most this many of them.
MAX_LOGGED_ID = 64


def _truncate_request_id(logger, method, event: dict) -> dict:
    rid = event.get("request_id")
    if isinstance(rid, str) and len(rid) > MAX_LOGGED_ID:
        event["request_id"] = rid[:MAX_LOGGED_ID] + "…"
    return event


def configure_logging(level: str = "info", process: str = "pagedserve", json_lines: bool = True) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _truncate_request_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(process=process)
