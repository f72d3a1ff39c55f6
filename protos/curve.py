"""CurveZMQ keys for the scheduler <-> worker wire: encryption and mutual authentication.

`pagedserve keys --out DIR` writes the scheduler's pair (scheduler.key_secret), its public key
(scheduler.key), the workers' pair (worker.key_secret) and authorized/ (public keys the scheduler
accepts, one file per key). Copy each host only the files its side needs.
"""

from __future__ import annotations

from pathlib import Path

import zmq.auth


def make_keys(folder: str | Path) -> Path:
    folder = Path(folder)
    (folder / "authorized").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(folder), "scheduler")
    public, _ = zmq.auth.create_certificates(str(folder), "worker")
    Path(public).replace(folder / "authorized" / "worker.key")
    for secret in folder.glob("*.key_secret"):
        secret.chmod(0o600)
    return folder


def client_keys(folder: str | Path) -> tuple[bytes, bytes, bytes]:
    """A worker's (public, secret, scheduler public) keys."""
    folder = Path(folder)
    public, secret = zmq.auth.load_certificate(str(folder / "worker.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(folder / "scheduler.key"))
    return public, secret, server_public


def server_keys(folder: str | Path) -> tuple[bytes, bytes, Path]:
    """The scheduler's (public, secret) keys and the folder of public keys it accepts."""
    folder = Path(folder)
    public, secret = zmq.auth.load_certificate(str(folder / "scheduler.key_secret"))
    return public, secret, folder / "authorized"
