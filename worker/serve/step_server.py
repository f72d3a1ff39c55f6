"""The worker's side of the ZeroMQ wire: handshake, step loop, heartbeats. Only protobuf crosses the
socket, never pickle; with CurveZMQ keys both sockets are encrypted and authenticated.
"""

from __future__ import annotations

import secrets
import threading
import time

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from protos import WIRE_VERSION, wire_pb2
from protos.base import EXIT_CONFIG, EXIT_FAILED, EXIT_RETRY
from protos.codec import decode_mask
from protos.curve import client_keys
from worker.step.runner import ModelRunner
from worker.step.staging import is_device_fatal

log = structlog.get_logger("worker.serve.step_server")

# Largest frame accepted from the scheduler (a plan of a million tokens is ~20 MB).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class StopServing(Exception):
    """Shutdown while a step waited for its masks: exit with `code`."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class WorkerServer:
    """Plans on one DEALER, heartbeats on another thread's, so a long forward never looks dead."""

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
        self._ctx = zmq.Context()
        # worker/step/runner.py InFlight: the step launched and not yet answered
        self._inflight = None
        # SIGTERM without a supervisor's order (as under Kubernetes): serve the draining scheduler
        # until told to stop or it is gone, at most stop_timeout seconds.
        self.stop_requested_at: float | None = None
        self.stop_timeout = 60.0

    def _socket(
        self, identity: str, monitor_events: int = 0
    ) -> tuple[zmq.Socket, zmq.Socket | None]:
        """A DEALER with its monitor attached before connecting, so no event is missed."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        # ZMTP heartbeats in libzmq's I/O threads: a dead or frozen peer is dropped.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self._curve is not None:
            public, secret, server_public = self._curve
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
                public,
                secret,
                server_public,
            )
        monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
        sock.connect(self.endpoint)
        return sock, monitor

    def _send(self, sock: zmq.Socket, **body) -> None:
        sock.send(wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString())

    def _heartbeats(self) -> None:
        """Beat every interval; the scheduler is gone only when ZMTP heartbeats drop it."""
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        sock, monitor = self._socket(f"hb.{self.nonce}", events)
        down_since: float | None = time.monotonic()  # not connected yet
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                beat = wire_pb2.Heartbeat(
                    tp_rank=self.tp_rank, sent_at_ns=time.time_ns(), busy_step_id=self.busy_step_id
                )
                try:
                    self._send(sock, heartbeat=beat)
                except zmq.Again:
                    pass
                deadline = time.monotonic() + self.heartbeat_interval
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    ready = dict(poller.poll(left * 1000))
                    if monitor in ready:
                        event = recv_monitor_message(monitor)["event"]
                        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            down_since = None
                        elif down_since is None:
                            down_since = time.monotonic()
                    if sock in ready:
                        sock.recv()  # the scheduler's echo
                if (
                    down_since is not None
                    and time.monotonic() - down_since > self.scheduler_timeout
                ):
                    log.error("scheduler_lost", timeout_s=self.scheduler_timeout)
                    self._stop.set()
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def serve(self) -> int:
        """Run until shutdown or the scheduler is lost -> exit code. On a GPU the next plan launches
        first.
        """
        sock, _ = self._socket(f"w.{self.nonce}")
        self._send(sock, handshake=self.handshake)
        beats = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beats.start()
        log.info("worker_ready", endpoint=self.endpoint, num_blocks=self.handshake.num_blocks)
        self._inflight = None
        try:
            while not self._stop.is_set():
                if (
                    self.stop_requested_at is not None
                    and self._inflight is None
                    and time.monotonic() - self.stop_requested_at > self.stop_timeout
                ):
                    log.warning(
                        "stopping_without_scheduler",
                        waited_s=self.stop_timeout,
                        reason=(
                            "asked to stop, and the scheduler neither said shutdown nor went away"
                        ),
                    )
                    return 0
                if self._inflight is not None:
                    frame = self._next_frame_before_done(sock)
                    code = self._land(sock) if frame is None else self._handle(sock, frame)
                elif sock.poll(200):
                    code = self._handle(sock, sock.recv())
                else:
                    continue
                if code is not None:
                    return code
            # asked to stop, and the scheduler is gone
            return 0 if self.stop_requested_at is not None else 1
        finally:
            self._stop.set()
            beats.join(timeout=2)
            sock.close()
            self._ctx.term()

    def request_stop(self, timeout: float) -> None:
        """Stop once the scheduler says shutdown or is gone, or after `timeout` seconds
        (signal-safe).
        """
        if self.stop_requested_at is None:
            self.stop_requested_at, self.stop_timeout = time.monotonic(), timeout
            log.info("stop_requested", timeout_s=timeout, waiting_for="the scheduler's shutdown")

    def _next_frame_before_done(self, sock: zmq.Socket) -> bytes | None:
        """The next message if it arrives while the step runs, else None."""
        clock = self._inflight.clock
        while not self._stop.is_set():
            if clock.done():
                return None
            if sock.poll(0):
                return sock.recv()
            time.sleep(0.0001)
        return None

    def _land(self, sock: zmq.Socket) -> int | None:
        """Read back the step in flight and answer it."""
        f, self._inflight = self._inflight, None
        try:
            result = self.runner.land(f)
        except Exception as e:  # noqa: BLE001 - a failed step is reported
            return self._failed(sock, f.step_id, e)
        finally:
            self.busy_step_id = 0
        result.tp_rank = self.tp_rank
        self._send(sock, result=result)
        return None

    def _failed(self, sock: zmq.Socket, step_id: int, e: Exception) -> int | None:
        log.error("step_failed", step_id=step_id, error=repr(e), exc_info=e)
        result = wire_pb2.StepResult(
            step_id=step_id, error=f"step failed: {e!r}", tp_rank=self.tp_rank
        )
        self._send(sock, result=result)
        # A CUDA error poisons the context, a failed rank unsyncs its group: report, exit, be
        # restarted.
        if is_device_fatal(e) or self.handshake.tp_size > 1:
            log.error(
                "worker_exiting",
                reason="device error" if is_device_fatal(e) else "group out of step",
            )
            return EXIT_FAILED
        return None

    def _await_mask(self, sock: zmq.Socket, step_id: int):
        """Read until step_id's StepMask; anything else is shutdown or a broken peer."""
        while True:
            if self._stop.is_set():
                raise StopServing("the scheduler is gone", 1)
            if not sock.poll(200):
                continue
            msg = wire_pb2.WireMessage()
            msg.ParseFromString(sock.recv())
            kind = msg.WhichOneof("body")
            if kind == "mask" and msg.mask.step_id == step_id:
                return decode_mask(msg.mask)
            if kind == "mask":  # a refused plan's masks, sent before this one's
                continue
            if kind == "shutdown":
                raise StopServing(msg.shutdown.reason, 0)
            raise RuntimeError(f"step {step_id} waited for its masks and got a {kind} message")

    def _launch(self, sock: zmq.Socket, plan) -> int | None:
        """Launch a plan, then answer the step before it (first, where its masks follow from it)."""
        previous, self._inflight = self._inflight, None

        def answer_previous() -> int | None:
            nonlocal previous
            if previous is None:
                return None
            self._inflight, previous = previous, None
            return self._land(sock)

        def await_mask(step_id: int):
            if (code := answer_previous()) is not None:
                raise StopServing("the step before failed", code)
            return self._await_mask(sock, step_id)

        self.busy_step_id = plan.step_id
        try:
            launched = self.runner.launch(plan, await_mask=await_mask)
        except StopServing as e:
            log.info("shutdown", reason=str(e))
            return e.code
        except Exception as e:  # noqa: BLE001 - a failed step is reported
            code = answer_previous()
            return code if code is not None else self._failed(sock, plan.step_id, e)
        if (code := answer_previous()) is not None:
            return code
        if isinstance(launched, wire_pb2.StepResult):  # a rejected plan
            self.busy_step_id = 0
            launched.tp_rank = self.tp_rank
            self._send(sock, result=launched)
            return None
        self._inflight = launched
        return None

    def _handle(self, sock: zmq.Socket, frame: bytes) -> int | None:
        msg = wire_pb2.WireMessage()
        try:
            msg.ParseFromString(frame)
        except Exception as e:  # noqa: BLE001 - any malformed frame is answered, never fatal
            log.warning("malformed_frame", error=str(e), size=len(frame))
            self._send(
                sock,
                result=wire_pb2.StepResult(tp_rank=self.tp_rank, error=f"malformed frame: {e}"),
            )
            return None
        if msg.version != WIRE_VERSION:
            self._send(
                sock,
                result=wire_pb2.StepResult(
                    tp_rank=self.tp_rank,
                    error=f"wire version {msg.version}, this worker speaks {WIRE_VERSION}",
                ),
            )
            return None
        kind = msg.WhichOneof("body")
        # anything but a plan waits for the step in flight
        if kind != "plan" and self._inflight is not None:
            code = self._land(sock)
            if code is not None:
                return code
        if kind == "handshake_ack":
            if not msg.handshake_ack.accepted:
                log.error(
                    "handshake_refused",
                    reason=msg.handshake_ack.reason,
                    retry=msg.handshake_ack.retry,
                )
                return EXIT_RETRY if msg.handshake_ack.retry else EXIT_CONFIG
            self.runner.num_blocks = msg.handshake_ack.num_blocks
            log.info("handshake_accepted", num_blocks=msg.handshake_ack.num_blocks)
            # the adapters the scheduler serves, read before the first plan
            if msg.handshake_ack.loras:
                self.runner.preload_loras([(r.identity, r.path) for r in msg.handshake_ack.loras])
        elif kind == "plan":
            return self._launch(sock, msg.plan)
        elif kind == "shutdown":
            log.info("shutdown", reason=msg.shutdown.reason)
            return 0
        # the masks of a plan this worker refused before its forward: nothing waits
        elif kind == "mask":
            log.debug("stale_mask", step_id=msg.mask.step_id)
        else:
            log.warning("unexpected_message", kind=kind)
        return None
