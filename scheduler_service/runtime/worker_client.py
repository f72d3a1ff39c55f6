"""The scheduler's side of the ZeroMQ wire: one ROUTER all ranks connect to. A plan goes to every
rank of a group, rank 0 answers; a rank silent past heartbeat_timeout is lost. Loopback only without
CurveZMQ keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING, Protocol

import structlog
import zmq
import zmq.asyncio

from protos import WIRE_VERSION, wire_pb2
from protos.base import ConfigError
from protos.curve import server_keys
from scheduler_service.runtime.groups import (
    InsecureEndpoint,
    WorkerError,
    WorkerGroup,
    WorkerInfo,
    WorkerLost,
    is_loopback_endpoint,
    merged_result,
    worker_process_state,
)
from scheduler_service.runtime.handshakes import Handshakes

log = structlog.get_logger("scheduler.worker_client")

# Largest frame accepted from a worker: results and handshakes are small.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

if TYPE_CHECKING:
    from scheduler_service.core.adapters import AdapterRegistry


class GroupEvents(Protocol):
    """What a WorkerClient asks and tells the engine about groups."""

    adapters: AdapterRegistry | None

    def check_group(self, group: WorkerGroup) -> str: ...

    def group_ready(self, group: WorkerGroup) -> None: ...

    async def group_lost(self, replica: int, reason: str) -> None: ...


class WorkerClient(Handshakes):
    def __init__(
        self,
        endpoint: str,
        num_replicas: int = 1,
        tp_size: int = 1,
        heartbeat_timeout: float = 10,
        expected: dict[str, object] | None = None,
        curve_keys: str | None = None,
        insecure_wire: bool = False,
        step_timeout: float = 60.0,
        step_timeout_per_token: float = 0.05,
    ) -> None:
        """A step of T tokens must finish within step_timeout + T x step_timeout_per_token."""
        self.endpoint, self.tp_size, self.heartbeat_timeout = endpoint, tp_size, heartbeat_timeout
        self.step_timeout, self.step_timeout_per_token = step_timeout, step_timeout_per_token
        self.expected = dict(expected or {})
        self.curve_keys, self.insecure_wire = curve_keys, insecure_wire
        self.groups = [WorkerGroup(d, tp_size) for d in range(num_replicas)]
        # without an owner: any group is accepted, a lost one dropped
        self.events: GroupEvents | None = None
        self._by_identity: dict[bytes, WorkerInfo] = {}
        self._by_heartbeat: dict[bytes, WorkerInfo] = {}
        self._refusals: list[str] = []
        self._changed = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._auth = None
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._pending: dict[
            tuple[int, int], tuple[asyncio.Future, dict[int, wire_pb2.StepResult]]
        ] = {}

    # --- lifecycle -------------------------------------------------------------------------------
    def attach(self, events: GroupEvents) -> None:
        """The owner that judges, hears of and takes down this client's groups."""
        self.events = events

    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint workers must connect to (port resolved)."""
        if not is_loopback_endpoint(self.endpoint):
            if not self.curve_keys and not self.insecure_wire:
                raise InsecureEndpoint(
                    f"the worker endpoint {self.endpoint} is not on loopback: give CurveZMQ keys "
                    "(--curve-keys, made by `pagedserve keys`) or accept an unauthenticated wire "
                    "with --insecure-wire"
                )
            if not self.curve_keys:
                log.warning(
                    "insecure_wire",
                    endpoint=self.endpoint,
                    detail="any host that reaches this port can act as a worker",
                )
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # ZMTP heartbeats: a dead peer host is disconnected
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.curve_keys:
            from zmq.auth.asyncio import AsyncioAuthenticator

            public, secret, authorized = server_keys(self.curve_keys)
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorized))
            self._sock.curve_server = True
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
        self._sock.bind(self.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        return self.endpoint

    async def wait_for_workers(self, timeout: float) -> None:
        """Wait until every replica's group is accepted; a refused handshake fails the start."""
        deadline = time.monotonic() + timeout
        while not all(g.is_ready for g in self.groups):
            if self._refusals:  # a worker this configuration cannot serve with: exit 2, one line
                raise ConfigError(f"worker refused: {self._refusals[0]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ready = sum(len(g.workers) for g in self.groups if g.is_ready)
                raise TimeoutError(
                    f"{ready} of {len(self.groups) * self.tp_size} worker ranks joined within "
                    f"{timeout}s"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        log.info(
            "workers_ready",
            replicas=len(self.groups),
            tp_size=self.tp_size,
            num_blocks=[g.num_blocks for g in self.groups],
        )

    async def close(self) -> None:
        for info in list(self._by_identity.values()):
            await self._send_quietly(
                info.identity, shutdown=wire_pb2.Shutdown(reason="scheduler stopping")
            )
        if self._recv_task:
            self._recv_task.cancel()
        if self._auth is not None:
            self._auth.stop()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    @property
    def num_workers(self) -> int:
        return sum(len(g.workers) for g in self.groups if g.is_ready)

    async def lost(self, replica: int, reason: str) -> None:
        """A ready group's rank is gone: the engine takes the replica down."""
        if self.events is not None:
            await self.events.group_lost(replica, reason)
        else:
            await self.drop_group(replica, reason)

    def find_lost(self) -> list[tuple[int, str]]:
        """Ready groups with a rank silent past the heartbeat timeout, and why."""
        lost = []
        for group in self.groups:
            try:
                self.check_alive(group.replica)
            except WorkerLost as e:
                if group.is_ready:
                    lost.append((group.replica, str(e)))
        return lost

    def _forget(self, info: WorkerInfo) -> None:
        self._by_identity.pop(info.identity, None)
        self._by_heartbeat.pop(info.heartbeat_identity, None)

    async def drop_group(self, replica: int, reason: str) -> None:
        """Forget a lost group; survivors stop, locals die, so none writes a reused pool."""
        group = self.groups[replica]
        for w in list(group.workers.values()):
            self._forget(w)
            await self._send_quietly(w.identity, shutdown=wire_pb2.Shutdown(reason=reason))
            if w.local_pid is not None and worker_process_state(w.local_pid) == "alive":
                os.kill(w.local_pid, signal.SIGKILL)
                log.warning("worker_fenced", replica=replica, tp_rank=w.tp_rank, pid=w.local_pid)
        group.workers.clear()
        group.is_ready = False
        group.num_blocks = 0
        for (d, _), (future, _) in list(self._pending.items()):
            if d == replica and not future.done():
                future.set_exception(WorkerLost(reason))
                future.exception()  # retrieved: its step loop may be cancelled rather than await it

    # --- steps -----------------------------------------------------------------------------------
    def step_limit(self, plan: wire_pb2.StepPlan) -> float:
        """Seconds a group has for a step once it starts it."""
        return self.step_timeout + self.step_timeout_per_token * plan.num_tokens

    async def execute(
        self,
        replica: int,
        plan: wire_pb2.StepPlan,
        queued_behind: float = 0.0,
        sent: asyncio.Event | None = None,
    ) -> wire_pb2.StepResult:
        """Send a plan to every rank and await all answers; `sent` lets a StepMask follow."""
        group = self.groups[replica]
        if not group.is_ready:
            raise WorkerLost(f"replica {replica} has no workers connected")
        # once, for every rank
        frame = wire_pb2.WireMessage(version=WIRE_VERSION, plan=plan).SerializeToString()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        key = (replica, plan.step_id)
        limit = self.step_limit(plan) + queued_behind
        deadline = time.monotonic() + limit
        self._pending[key] = (future, {})
        try:
            try:
                for w in list(group.workers.values()):
                    try:
                        await self._sock.send_multipart([w.identity, frame])
                    except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer's connection is gone
                        raise WorkerLost(
                            f"worker rank {w.tp_rank} of replica {replica} is unreachable: {e}"
                        ) from e
            finally:
                if sent is not None:
                    sent.set()
            while True:
                done, _ = await asyncio.wait({future}, timeout=min(1.0, self.heartbeat_timeout))
                if done:
                    break
                self.check_alive(replica)
                if time.monotonic() > deadline:
                    raise WorkerLost(
                        f"replica {replica} did not finish step {plan.step_id} "
                        f"({plan.num_tokens} tokens) within its {limit:.1f}s deadline"
                    )
            results = future.result()
        finally:
            self._pending.pop(key, None)
        for rank in sorted(results):
            if results[rank].error:
                raise WorkerError(f"worker rank {rank} of replica {replica}: {results[rank].error}")
        for rank, r in results.items():
            if r.sampled_token_ids != results[0].sampled_token_ids:
                raise WorkerError(
                    f"replica {replica}: rank {rank} sampled other tokens than rank 0"
                )
        return merged_result(results)

    async def send_mask(self, replica: int, mask: wire_pb2.StepMask) -> None:
        """A plan's masks to every rank after it; an unreachable rank fails its step."""
        group = self.groups[replica]
        frame = wire_pb2.WireMessage(version=WIRE_VERSION, mask=mask).SerializeToString()
        for w in list(group.workers.values()):
            try:
                await self._sock.send_multipart([w.identity, frame])
            except zmq.ZMQError:
                pass

    def check_alive(self, replica: int) -> None:
        group = self.groups[replica]
        if not group.is_ready:
            raise WorkerLost(f"replica {replica} has no workers connected")
        now = time.monotonic()
        for w in group.workers.values():
            if w.local_pid is not None and worker_process_state(w.local_pid) != "alive":
                raise WorkerLost(
                    f"worker rank {w.tp_rank} of replica {replica} (pid {w.local_pid}) exited"
                )
            if now - w.last_heartbeat > self.heartbeat_timeout:
                raise WorkerLost(
                    f"worker rank {w.tp_rank} of replica {replica} (pid {w.handshake.pid}) sent "
                    f"no heartbeat for {now - w.last_heartbeat:.1f}s"
                )

    # --- socket ----------------------------------------------------------------------------------
    async def _send_quietly(self, identity: bytes, **body) -> None:
        try:
            frame = wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString()
            await self._sock.send_multipart([identity, frame])
        except zmq.ZMQError:
            pass

    async def _recv_loop(self) -> None:
        while True:
            try:
                await self._receive_one()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad message
                log.exception("receive_failed")

    async def _receive_one(self) -> None:
        parts = await self._sock.recv_multipart()
        if len(parts) != 2:
            return
        identity, frame = parts
        msg = wire_pb2.WireMessage()
        try:
            msg.ParseFromString(frame)
        except Exception:  # noqa: BLE001 - a malformed frame is logged and dropped
            log.warning("malformed_frame", size=len(frame))
            return
        if msg.version != WIRE_VERSION:
            log.warning("wire_version_mismatch", version=msg.version)
            return
        kind = msg.WhichOneof("body")
        if kind == "heartbeat":
            info = self._by_heartbeat.get(identity)
            if info is not None:
                info.last_heartbeat = time.monotonic()
            # Echo every beat, accepted or not: a worker waiting for its group's ack must not give
            # up.
            await self._send_quietly(identity, heartbeat=msg.heartbeat)
        elif kind == "handshake":
            await self._on_handshake(identity, msg.handshake)
        elif kind == "result":
            info = self._by_identity.get(identity)
            if info is None:
                log.warning(
                    "result_dropped",
                    reason="not from an accepted worker",
                    step_id=msg.result.step_id,
                )
                return
            self._on_result(info, msg.result)

    def _on_result(self, info: WorkerInfo, result: wire_pb2.StepResult) -> None:
        replica, rank = info.replica, info.tp_rank
        pending = self._pending.get((replica, result.step_id))
        targets = [pending] if pending else []
        # an error with no step (a malformed frame) fails the group's step
        if pending is None and result.error:
            targets = [p for (d, _), p in self._pending.items() if d == replica]
        for future, results in targets:
            results[rank] = result
            if len(results) == self.tp_size and not future.done():
                future.set_result(results)
