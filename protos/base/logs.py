"""Structured logging for every process: one event a line naming its process (and request); console
lines on a terminal, JSON otherwise (`--log-format`).
"""

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


LOG_FORMATS = ("auto", "console", "json")


def wants_json(log_format: str = "auto") -> bool:
    """auto: JSON unless stderr is a terminal."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    return log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())


def configure_logging(
    level: str = "info", process: str = "pagedserve", log_format: str = "auto"
) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    if wants_json(log_format):
        renderer = structlog.processors.JSONRenderer()
        stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=24)
        stamp = structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _truncate_request_id,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write a line: processes sharing a log never interleave halves
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(process=process)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
