"""The worker's side of the ZeroMQ wire: handshake, step loop, heartbeats.

A DEALER socket (identity worker-<rank>) carries the handshake, plans and results; a second DEALER
(identity hb-<rank>) on its own thread sends heartbeats even while a long forward runs, so the
scheduler can tell a dead worker from a slow one. Only protobuf crosses the socket, never pickle.
"""

from __future__ import annotations

import threading
import time

import structlog
import zmq

from protos import WIRE_VERSION, wire_pb2
from worker.runner import ModelRunner

log = structlog.get_logger("worker.server")


class WorkerServer:
    def __init__(
        self,
        endpoint: str,
        runner: ModelRunner,
        handshake: wire_pb2.Handshake,
        heartbeat_interval: float = 0.5,
        scheduler_timeout: float = 30.0,
    ) -> None:
        self.endpoint = endpoint
        self.runner = runner
        self.handshake = handshake
        self.rank = handshake.rank
        self.heartbeat_interval = heartbeat_interval
        self.scheduler_timeout = scheduler_timeout
        self.busy_step_id = 0
        self._stop = threading.Event()
        self._last_from_scheduler = time.monotonic()
        self._ctx = zmq.Context()

    def _send(self, sock: zmq.Socket, **body) -> None:
        sock.send(wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString())

    def _heartbeats(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"hb-{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                beat = wire_pb2.Heartbeat(rank=self.rank, sent_at_ns=time.time_ns(), busy_step_id=self.busy_step_id)
                self._send(sock, heartbeat=beat)
                if sock.poll(int(self.heartbeat_interval * 1000)):
                    sock.recv()  # the scheduler echoes each beat: it is alive
                    self._last_from_scheduler = time.monotonic()
                    self._stop.wait(self.heartbeat_interval)
                if time.monotonic() - self._last_from_scheduler > self.scheduler_timeout:
                    log.error("scheduler_lost", rank=self.rank, timeout_s=self.scheduler_timeout)
                    self._stop.set()
        finally:
            sock.close()

    def serve(self) -> int:
        """Run until the scheduler says shutdown or is lost. Returns a process exit code."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"worker-{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._send(sock, handshake=self.handshake)
        beats = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beats.start()
        log.info("worker_ready", rank=self.rank, endpoint=self.endpoint, num_blocks=self.handshake.num_blocks)
        code = 0
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
            self._send(sock, result=wire_pb2.StepResult(rank=self.rank, error=f"malformed frame: {e}"))
            return None
        if msg.version != WIRE_VERSION:
            self._send(sock, result=wire_pb2.StepResult(
                rank=self.rank, error=f"wire version {msg.version}, this worker speaks {WIRE_VERSION}"))
            return None
        kind = msg.WhichOneof("body")
        if kind == "handshake_ack":
            if not msg.handshake_ack.accepted:
                log.error("handshake_refused", reason=msg.handshake_ack.reason)
                return 2
            log.info("handshake_accepted", num_blocks=msg.handshake_ack.num_blocks)
        elif kind == "plan":
            self.busy_step_id = msg.plan.step_id
            try:
                result = self.runner.execute(msg.plan)
            except Exception as e:  # noqa: BLE001 - a failed step is reported, the worker keeps serving
                log.exception("step_failed", step_id=msg.plan.step_id)
                result = wire_pb2.StepResult(step_id=msg.plan.step_id, error=f"step failed: {e!r}")
            finally:
                self.busy_step_id = 0
            result.rank = self.rank
            self._send(sock, result=result)
        elif kind == "shutdown":
            log.info("shutdown", reason=msg.shutdown.reason)
            return 0
        else:
            log.warning("unexpected_message", kind=kind)
        return None
