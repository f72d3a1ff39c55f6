"""How a worker rank joins (a base of WorkerClient): its handshake checked, a silent rank's
replacement taking the replica down first, a complete group accepted or refused as a whole.
"""

from __future__ import annotations

import time

import structlog

from protos import wire_pb2
from scheduler_service.runtime.groups import (
    WorkerGroup,
    WorkerInfo,
    handshake_problem,
    is_loopback_endpoint,
    worker_process_state,
)

log = structlog.get_logger("scheduler.worker_client")

# A rank silent this long is taken for dead when a new process offers itself for the same rank.
REJOIN_SILENCE_S = 1.5


class Handshakes:
    """The handshake side of WorkerClient."""

    # --- handshakes ------------------------------------------------------------------------------
    def _refuse_reason(self, hs: wire_pb2.Handshake) -> str:
        return handshake_problem(hs, self.groups, self.tp_size, self.expected)

    async def _on_handshake(self, identity: bytes, hs: wire_pb2.Handshake) -> None:
        if not identity.startswith(b"w."):
            log.warning("handshake_dropped", reason="not a worker identity")
            return
        group = self.groups[hs.replica] if hs.replica < len(self.groups) else None
        if group is not None and group.is_ready and hs.tp_rank in group.workers:
            old = group.workers[hs.tp_rank]
            silent = time.monotonic() - old.last_heartbeat
            if silent < REJOIN_SILENCE_S:
                await self._refuse(
                    identity,
                    hs,
                    f"replica {hs.replica} rank {hs.tp_rank} is held by a live "
                    f"worker (pid {old.handshake.pid})",
                    retry=True,
                )
                return
            # a new process for the rank of a silent one: the old one is gone, and so is its group
            await self.lost(
                hs.replica,
                f"worker rank {hs.tp_rank} of replica {hs.replica} (pid "
                f"{old.handshake.pid}) was replaced by pid {hs.pid}",
            )
        reason = self._refuse_reason(hs)
        if reason:
            await self._refuse(identity, hs, reason)
            return
        group = self.groups[hs.replica]
        old = group.workers.get(hs.tp_rank)
        if old is not None:  # a candidate restarted before its group formed
            self._forget(old)
        info = WorkerInfo(hs.replica, hs.tp_rank, identity, b"hb." + identity[2:], hs)
        if is_loopback_endpoint(self.endpoint) and worker_process_state(hs.pid) == "alive":
            info.local_pid = hs.pid
        group.workers[hs.tp_rank] = info
        self._by_identity[identity] = info
        self._by_heartbeat[info.heartbeat_identity] = info
        log.info(
            "worker_handshake",
            replica=hs.replica,
            tp_rank=hs.tp_rank,
            pid=hs.pid,
            num_blocks=hs.num_blocks,
        )
        if len(group.workers) == self.tp_size:
            await self._complete(group)

    async def _complete(self, group: WorkerGroup) -> None:
        """Every rank has shaken hands: the group is accepted, or refused as a whole."""
        group.num_blocks = min(w.handshake.num_blocks for w in group.workers.values())
        reason = self.events.check_group(group) if self.events is not None else ""
        if reason:
            for w in list(group.workers.values()):
                self._forget(w)
                await self._refuse(w.identity, w.handshake, reason)
            group.workers.clear()
            return
        group.is_ready = True
        loras = group.preload(self.events.adapters if self.events is not None else None)
        for w in group.workers.values():
            w.last_heartbeat = time.monotonic()
            await self._send_quietly(
                w.identity,
                handshake_ack=wire_pb2.HandshakeAck(
                    accepted=True, num_blocks=group.num_blocks, loras=loras
                ),
            )
        log.info("group_ready", replica=group.replica, num_blocks=group.num_blocks, pids=group.pids)
        self._changed.set()
        if self.events is not None:
            self.events.group_ready(group)

    async def _refuse(
        self, identity: bytes, hs: wire_pb2.Handshake, reason: str, retry: bool = False
    ) -> None:
        log.error(
            "worker_refused",
            replica=hs.replica,
            tp_rank=hs.tp_rank,
            pid=hs.pid,
            reason=reason,
            retry=retry,
        )
        if not retry:
            self._refusals.append(f"replica {hs.replica} rank {hs.tp_rank}: {reason}")
            self._changed.set()
        await self._send_quietly(
            identity,
            handshake_ack=wire_pb2.HandshakeAck(accepted=False, reason=reason, retry=retry),
        )
