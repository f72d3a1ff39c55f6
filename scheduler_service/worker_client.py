"""The scheduler's side of the ZeroMQ wire: a ROUTER socket that every worker rank connects to.

Handshake: each rank reports its pool size, block size and model fingerprint; the scheduler sizes
its allocator to the smallest pool and refuses a mismatch. Each step the same StepPlan goes to every
rank; rank 0's StepResult carries the sampled tokens (every rank answers, so a failed rank is seen).
Heartbeats arrive on a separate identity per rank and are echoed back; a rank silent for longer than
heartbeat_timeout is dead, however long its current step takes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from protos import WIRE_VERSION, wire_pb2

log = structlog.get_logger("scheduler.worker_client")


class WorkerError(RuntimeError):
    """A worker rejected or failed a step; the requests in it are failed, the service goes on."""


class WorkerLost(RuntimeError):
    """A worker stopped sending heartbeats (died or hung): nothing can be served until one returns."""


@dataclass
class WorkerInfo:
    rank: int
    identity: bytes
    handshake: wire_pb2.Handshake
    last_heartbeat: float


class WorkerClient:
    def __init__(self, endpoint: str, world_size: int = 1, heartbeat_timeout: float = 10.0) -> None:
        self.endpoint = endpoint
        self.world_size = world_size
        self.heartbeat_timeout = heartbeat_timeout
        self.workers: dict[int, WorkerInfo] = {}
        self.num_blocks = 0
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._handshakes: asyncio.Queue = asyncio.Queue()
        self._pending: dict[int, tuple[asyncio.Future, dict[int, wire_pb2.StepResult]]] = {}

    # --- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint workers must connect to (port resolved)."""
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(self.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        return self.endpoint

    async def wait_for_workers(self, timeout: float, expected: dict[str, object] | None = None) -> None:
        """Collect one handshake per rank; check they agree; answer each with an ack."""
        deadline = time.monotonic() + timeout
        while len(self.workers) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(self.workers)} of {self.world_size} workers connected within {timeout}s")
            try:
                identity, hs = await asyncio.wait_for(self._handshakes.get(), remaining)
            except asyncio.TimeoutError:
                continue
            reason = self._check_handshake(hs, expected or {})
            if reason:
                await self._send(identity, handshake_ack=wire_pb2.HandshakeAck(accepted=False, reason=reason))
                raise RuntimeError(f"worker rank {hs.rank} refused: {reason}")
            self.workers[hs.rank] = WorkerInfo(hs.rank, identity, hs, time.monotonic())
        self.num_blocks = min(w.handshake.num_blocks for w in self.workers.values())
        for w in self.workers.values():
            await self._send(w.identity, handshake_ack=wire_pb2.HandshakeAck(accepted=True, num_blocks=self.num_blocks))
        log.info("workers_ready", world_size=self.world_size, num_blocks=self.num_blocks)

    def _check_handshake(self, hs: wire_pb2.Handshake, expected: dict[str, object]) -> str:
        if hs.world_size != self.world_size:
            return f"world size {hs.world_size}, scheduler expects {self.world_size}"
        if hs.rank >= self.world_size or hs.rank in self.workers:
            return f"rank {hs.rank} is out of range or already connected"
        for key, value in expected.items():
            if getattr(hs, key) != value:
                return f"{key} is {getattr(hs, key)!r}, scheduler expects {value!r}"
        for other in self.workers.values():
            for key in ("model_fingerprint", "block_size", "vocab_size"):
                if getattr(hs, key) != getattr(other.handshake, key):
                    return f"{key} differs from rank {other.rank}"
        return ""

    async def close(self) -> None:
        for w in list(self.workers.values()):
            try:
                await self._send(w.identity, shutdown=wire_pb2.Shutdown(reason="scheduler stopping"))
            except zmq.ZMQError:
                pass
        if self._recv_task:
            self._recv_task.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    @property
    def handshake(self) -> wire_pb2.Handshake:
        return self.workers[0].handshake

    # --- steps -----------------------------------------------------------------------------------
    async def execute(self, plan: wire_pb2.StepPlan) -> wire_pb2.StepResult:
        """Send a plan to every rank and wait for all answers; raises WorkerError / WorkerLost."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending[plan.step_id] = (future, {})
        try:
            for w in self.workers.values():
                try:
                    await self._send(w.identity, plan=plan)
                except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer's connection is gone
                    raise WorkerLost(f"worker rank {w.rank} is unreachable: {e}") from e
            while True:
                done, _ = await asyncio.wait({future}, timeout=min(1.0, self.heartbeat_timeout))
                if done:
                    break
                self.check_alive()
            results = future.result()
        finally:
            self._pending.pop(plan.step_id, None)
        for r in results.values():
            if r.error:
                raise WorkerError(f"worker rank {r.rank}: {r.error}")
        return results[0]

    def check_alive(self) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            if now - w.last_heartbeat > self.heartbeat_timeout:
                raise WorkerLost(f"worker rank {w.rank} sent no heartbeat for {now - w.last_heartbeat:.1f}s")

    # --- socket ----------------------------------------------------------------------------------
    async def _send(self, identity: bytes, **body) -> None:
        frame = wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString()
        await self._sock.send_multipart([identity, frame])

    async def _recv_loop(self) -> None:
        while True:
            try:
                await self._receive_one()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad message
                log.exception("receive_failed")

    async def _receive_one(self) -> None:
        identity, frame = await self._sock.recv_multipart()
        msg = wire_pb2.WireMessage()
        try:
            msg.ParseFromString(frame)
        except Exception:  # noqa: BLE001 - a malformed frame is logged and dropped
            log.warning("malformed_frame", identity=identity.decode(errors="replace"), size=len(frame))
            return
        if msg.version != WIRE_VERSION:
            log.warning("wire_version_mismatch", identity=identity.decode(errors="replace"), version=msg.version)
            return
        kind = msg.WhichOneof("body")
        if kind == "heartbeat":
            info = self.workers.get(msg.heartbeat.rank)
            if info is not None:
                info.last_heartbeat = time.monotonic()
            try:
                await self._sock.send_multipart([identity, frame])
            except zmq.ZMQError:
                pass
        elif kind == "handshake":
            self._handshakes.put_nowait((identity, msg.handshake))
        elif kind == "result":
            self._on_result(msg.result)

    def _on_result(self, result: wire_pb2.StepResult) -> None:
        pending = self._pending.get(result.step_id)
        if pending is None:
            if result.error:  # an error with no step (e.g. a malformed frame) fails whatever is in flight
                for future, results in self._pending.values():
                    results[result.rank] = result
                    if not future.done():
                        future.set_result(results)
            return
        future, results = pending
        results[result.rank] = result
        if len(results) == len(self.workers) and not future.done():
            future.set_result(results)
