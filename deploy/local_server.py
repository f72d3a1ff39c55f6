"""Start a real pagedserve (scheduler + worker processes, gRPC + ZeroMQ on localhost) and wait until it serves.

Used by the end-to-end tests and the benchmarks: the same launcher `make run` uses, in a child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2, generation_pb2_grpc

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


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        """args: extra launcher flags (see `pagedserve serve --help`). The server binds any free port
        (--port 0) and writes the one it got to a file beside its log: no port is picked and hoped for."""
        self.model_dir = model_dir
        self.log_path = log_path
        self.args = list(args)
        self.port: int | None = None
        self.worker_endpoint: str | None = None  # the scheduler's ZeroMQ endpoint, as bound
        self.metrics_port: int | None = None  # where it serves Prometheus metrics, as bound
        self.port_file = Path(log_path).with_suffix(".port")
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.port_file.unlink(missing_ok=True)
        self.port = self.channel = None  # a restart binds a port of its own
        metrics = [] if "--metrics-port" in self.args else ["--metrics-port", "-1"]  # any free port, reported
        cmd = [sys.executable, "-m", "deploy.launcher", "--model", str(self.model_dir), "--port", "0",
               "--port-file", str(self.port_file), *metrics, *self.args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            bound = read_port_file(self.port_file) if self.channel is None else None
            if bound is not None:
                self.port, self.worker_endpoint = bound["port"], bound["worker_endpoint"]
                self.metrics_port = bound.get("metrics_port")
                self.channel = grpc.insecure_channel(self.address)
                health = health_pb2_grpc.HealthStub(self.channel)
            if self.channel is not None:
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not serving within {timeout}s:\n{self.log_tail()}")

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def stats(self) -> generation_pb2.CacheStats:
        return self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        stop_group(self.proc, 20)
        if hasattr(self, "_log"):
            self._log.close()


def stop_group(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a child started in its own session and everything it started; SIGKILL after timeout."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def greedy_request(prompt: list[int], max_tokens: int, request_id: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
