"""The worker's side of the ZeroMQ wire: handshake, step loop, heartbeats.

A DEALER socket carries the handshake, plans and results; a second DEALER on its own thread sends
heartbeats even while a long forward runs, so the scheduler can tell a dead worker from a slow one.
Both identities carry a random nonce ("w.<nonce>", "hb.<nonce>"): the scheduler binds them to this
worker when it accepts the handshake, and a restarted worker is a new peer, never mistaken for the old
one. Only protobuf crosses the socket, never pickle. With CurveZMQ keys both sockets are encrypted and
authenticated.

In a tensor-parallel group a failed step may leave the ranks out of step in their collectives, so a
rank whose step raises exits (and is restarted with its group) instead of answering more plans.
"""

from __future__ import annotations

import secrets
import threading
import time

import structlog
import zmq

from protos import EXIT_CONFIG, EXIT_RETRY, WIRE_VERSION, wire_pb2
from protos.curve import client_keys
from worker.runner import ModelRunner

log = structlog.get_logger("worker.server")

# Largest frame accepted from the scheduler (a plan of a million tokens is ~20 MB).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class WorkerServer:
    def __init__(
        self,
        endpoint: str,
        runner: ModelRunner,
        handshake: wire_pb2.Handshake,
        heartbeat_interval: float = 0.5,
        scheduler_timeout: float = 30.0,
        curve_keys: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.runner = runner
        self.handshake = handshake
        self.tp_rank = handshake.tp_rank
        self.heartbeat_interval = heartbeat_interval
        self.scheduler_timeout = scheduler_timeout
        self.busy_step_id = 0
        self.nonce = secrets.token_hex(8)
        self._curve = client_keys(curve_keys) if curve_keys else None
        self._stop = threading.Event()
        self._last_from_scheduler = time.monotonic()
        self._ctx = zmq.Context()

    def _socket(self, identity: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self._curve is not None:
            public, secret, server_public = self._curve
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
        sock.connect(self.endpoint)
        return sock

    def _send(self, sock: zmq.Socket, **body) -> None:
        sock.send(wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString())

    def _heartbeats(self) -> None:
        sock = self._socket(f"hb.{self.nonce}")
        try:
            while not self._stop.is_set():
                beat = wire_pb2.Heartbeat(tp_rank=self.tp_rank, sent_at_ns=time.time_ns(),
                                          busy_step_id=self.busy_step_id)
                self._send(sock, heartbeat=beat)
                if sock.poll(int(self.heartbeat_interval * 1000)):
                    sock.recv()  # the scheduler echoes each beat: it is alive
                    self._last_from_scheduler = time.monotonic()
                    self._stop.wait(self.heartbeat_interval)
                if time.monotonic() - self._last_from_scheduler > self.scheduler_timeout:
                    log.error("scheduler_lost", timeout_s=self.scheduler_timeout)
                    self._stop.set()
        finally:
            sock.close()

    def serve(self) -> int:
        """Run until the scheduler says shutdown or is lost. Returns a process exit code."""
        sock = self._socket(f"w.{self.nonce}")
        self._send(sock, handshake=self.handshake)
        beats = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beats.start()
        log.info("worker_ready", endpoint=self.endpoint, num_blocks=self.handshake.num_blocks)
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                self._last_from_scheduler = time.monotonic()
                code = self._handle(sock, sock.recv())
                if code is not None:
                    return code
            return 1
        finally:
            self._stop.set()
            beats.join(timeout=2)
            sock.close()
            self._ctx.term()

    def _handle(self, sock: zmq.Socket, frame: bytes) -> int | None:
        msg = wire_pb2.WireMessage()
        try:
            msg.ParseFromString(frame)
        except Exception as e:  # noqa: BLE001 - any malformed frame is answered, never fatal
            log.warning("malformed_frame", error=str(e), size=len(frame))
            self._send(sock, result=wire_pb2.StepResult(tp_rank=self.tp_rank, error=f"malformed frame: {e}"))
            return None
        if msg.version != WIRE_VERSION:
            self._send(sock, result=wire_pb2.StepResult(
                tp_rank=self.tp_rank, error=f"wire version {msg.version}, this worker speaks {WIRE_VERSION}"))
            return None
        kind = msg.WhichOneof("body")
        if kind == "handshake_ack":
            if not msg.handshake_ack.accepted:
                log.error("handshake_refused", reason=msg.handshake_ack.reason, retry=msg.handshake_ack.retry)
                return EXIT_RETRY if msg.handshake_ack.retry else EXIT_CONFIG
            self.runner.num_blocks = msg.handshake_ack.num_blocks
            log.info("handshake_accepted", num_blocks=msg.handshake_ack.num_blocks)
        elif kind == "plan":
            self.busy_step_id = msg.plan.step_id
            try:
                result = self.runner.execute(msg.plan)
            except Exception as e:  # noqa: BLE001 - a failed step is reported
                log.exception("step_failed", step_id=msg.plan.step_id)
                result = wire_pb2.StepResult(step_id=msg.plan.step_id, error=f"step failed: {e!r}")
                if self.handshake.tp_size > 1:  # the group may be out of step: leave it, to be restarted
                    result.tp_rank = self.tp_rank
                    self._send(sock, result=result)
                    return 3
            finally:
                self.busy_step_id = 0
            result.tp_rank = self.tp_rank
            self._send(sock, result=result)
        elif kind == "shutdown":
            log.info("shutdown", reason=msg.shutdown.reason)
            return 0
        else:
            log.warning("unexpected_message", kind=kind)
        return None
