"""Ports, process groups and a server in a child process: what the launchers, the load tester and
the test helpers share.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def read_port_file(path: Path) -> dict | None:
    """{"port", "worker_endpoint"} a scheduler bound, or None before it writes the file."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call's metadata (a server started with
    --api-key).
    """

    def __init__(self, key: str) -> None:
        self.header = ("authorization", f"Bearer {key}")

    def _with_key(self, d):
        metadata = [*(d.metadata or ()), self.header]
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


def channel_to(
    address: str, api_key: str | None = None, root_certificates: bytes | None = None
) -> grpc.Channel:
    """A channel to a server, TLS where a CA is given, carrying the API key where given."""
    if root_certificates is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
    else:
        channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _BearerKey(api_key)) if api_key else channel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a child started in its own session and everything
    it started; SIGKILL after timeout.
    """
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class LocalServer:
    """`pagedserve serve` in its own session on free ports; `stop()` ends all it started."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        """args: extra launcher flags; the port is written beside its log."""
        self.model_dir = model_dir
        self.log_path = log_path
        self.args = list(args)
        self.port: int | None = None
        self.worker_endpoint: str | None = None  # the scheduler's ZeroMQ endpoint, as bound
        self.metrics_port: int | None = None  # where it serves Prometheus metrics, as bound
        self.http_port: int | None = None  # where it serves the OpenAI API, as bound
        self.port_file = Path(log_path).with_suffix(".port")
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self._log = None

    @property
    def api_key(self) -> str | None:
        """The --api-key this server was started with (its gRPC calls carry it), if any."""
        args = self.args
        return args[args.index("--api-key") + 1] if "--api-key" in args[:-1] else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI API's base URL (…/v1)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def start(self, timeout: float = 180.0) -> Self:
        self.port_file.unlink(missing_ok=True)
        self.port = self.channel = None  # a restart binds a port of its own
        # any free port, reported
        ports = [] if "--metrics-port" in self.args else ["--metrics-port", "-1"]
        ports += [] if "--http-port" in self.args else ["--http-port", "-1"]
        cmd = [
            sys.executable,
            "-m",
            "deploy.launcher",
            "--model",
            str(self.model_dir),
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            *ports,
            *self.args,
        ]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.channel is None and (bound := read_port_file(self.port_file)) is not None:
                self.port, self.worker_endpoint = bound["port"], bound["worker_endpoint"]
                self.metrics_port, self.http_port = (
                    bound.get("metrics_port"),
                    bound.get("http_port"),
                )
                self.channel = channel_to(self.address, self.api_key)
            if self.channel is not None and self._serving():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not serving within {timeout}s:\n{self.log_tail()}")

    def _serving(self) -> bool:
        try:
            resp = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        stop_group(self.proc, 20)
        if self._log is not None:
            self._log.close()
