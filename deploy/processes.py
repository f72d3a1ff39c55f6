"""Ports and process groups: what the launchers and the test helpers share."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_port_file(path: Path) -> dict | None:
    """What a scheduler started with --port-file bound ({"port", "worker_endpoint"}), or None before it has
    written the file."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a child started in its own session and everything it started; SIGKILL after timeout."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
