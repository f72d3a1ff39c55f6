"""Worker groups as the scheduler knows them: ranks, groups, step errors, and whether a handshake
may join or a group serve.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from protos import wire_pb2
from protos.codec import HASH_BYTES
from scheduler_service.core.adapters import AdapterRegistry
from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.core.kv_tiers import KvTiers
from scheduler_service.text.limits import Limits


def workers_max_num_seqs(config: SchedulerConfig, groups: list[WorkerGroup]) -> int | None:
    """Where --max-num-seqs was left to the workers: the smallest they proposed, within a step's
    tokens.
    """
    proposed = [
        w.handshake.max_num_seqs
        for g in groups
        for w in g.workers.values()
        if w.handshake.max_num_seqs
    ]
    if not config.auto_max_num_seqs or not proposed:
        return None
    return min(min(proposed), config.max_num_batched_tokens)


def adopted_config(config: SchedulerConfig, groups: list[WorkerGroup]) -> SchedulerConfig:
    """The config with what the workers decide: max_num_seqs, max_loras."""
    slots = [getattr(w.handshake, "lora_slots", 0) for g in groups for w in g.workers.values()]
    held = min(slots, default=0)
    adopted = replace(
        config,
        max_num_seqs=workers_max_num_seqs(config, groups) or config.max_num_seqs,
        max_loras=min(config.max_loras, held) if held else config.max_loras,
    )
    workers = [w.handshake for g in groups for w in g.workers.values()]
    states = min((getattr(hs, "state_slots", 0) for hs in workers), default=0)
    if not states:
        return adopted
    # one state slot per running sequence, snapshots in the rest; no drafts (state cannot roll back)
    return replace(
        adopted,
        state_slots=states,
        max_num_seqs=min(adopted.max_num_seqs, states),
        speculative="off",
    )


def context_limit(spec: ModelSpec, group: WorkerGroup) -> int:
    """The longest context a request may have: the model's, unless the workers hold less."""
    return min(spec.max_context, group.handshake.max_context)


def group_problem(
    group: WorkerGroup, spec: ModelSpec, config: SchedulerConfig, limits: Limits | None
) -> str:
    """Why a complete worker group cannot serve this model, or ""."""
    hs = group.handshake
    if hs.vocab_size != spec.vocab_size:
        return (
            f"worker vocabulary {hs.vocab_size} differs from the model config's {spec.vocab_size}"
        )
    max_context = context_limit(spec, group)
    if limits is not None:
        max_context = limits.max_context
        if group.num_blocks < limits.num_blocks:
            return (
                f"its pool of {group.num_blocks} blocks is smaller than the {limits.num_blocks} "
                "the service promised requests at start"
            )
    pool_tokens = group.num_blocks * config.block_size
    what = f"the full {max_context}-token context"
    # a sequence holds its sliding window and a step's tokens at most
    if (
        hs.kv_window
        and hs.kv_window + config.max_num_batched_tokens + 2 * config.block_size < max_context
    ):
        max_context = hs.kv_window + config.max_num_batched_tokens + 2 * config.block_size
        what = f"a {hs.kv_window}-key sliding window and a step's tokens ({max_context} tokens)"
    if pool_tokens < max_context:
        return (
            f"the KV pool ({group.num_blocks} blocks x {config.block_size} = {pool_tokens} "
            f"tokens) cannot hold one request of {what}: give the workers more KV memory "
            "(--kv-cache-memory / --gpu-memory-utilization / --num-blocks) or lower --max-model-len"
        )
    return ""


def lora_problem(group: WorkerGroup, adapters: AdapterRegistry | None) -> str:
    """Why a group cannot hold this service's adapters, or ""."""
    if adapters is None:
        return ""
    for w in group.workers.values() if adapters.adapters else ():
        hs = w.handshake
        if hs.lora_slots < 1:
            return (
                f"rank {hs.tp_rank} keeps no LoRA adapters (--max-cpu-loras 0) and this service "
                f"serves {len(adapters.adapters)}: start the workers with --max-cpu-loras N"
            )
        for a in adapters.adapters.values():
            if a.rank > hs.max_lora_rank:
                return (
                    f"LoRA adapter {a.name!r} has rank {a.rank}; the workers take up to "
                    f"{hs.max_lora_rank} (--max-lora-rank)"
                )
    ranks = [w.handshake.max_lora_rank for w in group.workers.values()]
    adapters.max_rank = min(ranks + ([adapters.max_rank] if adapters.max_rank else []))
    return ""


class WorkerError(RuntimeError):
    """A worker rejected or failed a step: its requests fail, the service goes on."""


class WorkerLost(RuntimeError):
    """A rank is gone: the replica cannot serve."""


class InsecureEndpoint(ValueError):
    """A non-loopback endpoint without CurveZMQ keys or an explicit insecure flag."""


@dataclass
class WorkerInfo:
    replica: int
    tp_rank: int
    identity: bytes  # w.<nonce>: plans and results
    heartbeat_identity: bytes  # hb.<nonce>
    handshake: wire_pb2.Handshake
    last_heartbeat: float = field(default_factory=time.monotonic)
    # The worker's pid where this host sees it: its exit is seen at once and a lost one fenced.
    local_pid: int | None = None


def worker_process_state(pid: int) -> str | None:
    """'alive', 'dead', or None when pid is not a pagedserve worker this process can see."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "dead"
    if b"worker.serve.main" not in cmdline and b"pagedserve-worker" not in cmdline:
        return None
    return "dead" if state in ("Z", "X") else "alive"


@dataclass
class WorkerGroup:
    """The ranks of one replica: candidates until every rank has shaken hands, then accepted."""

    replica: int
    tp_size: int
    workers: dict[int, WorkerInfo] = field(default_factory=dict)
    num_blocks: int = 0
    is_ready: bool = False

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all ranks (each rank holds its heads' slice)."""
        return sum(w.handshake.bytes_per_block for w in self.workers.values())

    @property
    def handshake(self) -> wire_pb2.Handshake:
        return self.workers[0].handshake

    @property
    def pids(self) -> list[int]:
        return [self.workers[r].handshake.pid for r in sorted(self.workers)]

    def preload(self, adapters: AdapterRegistry | None) -> list[wire_pb2.LoraRef]:
        """Adapters the workers read before serving: the latest, as many as every rank keeps."""
        if adapters is None or not adapters.adapters:
            return []
        slots = min(w.handshake.lora_slots for w in self.workers.values())
        latest = list(adapters.adapters.values())[-slots:] if slots else []
        return [wire_pb2.LoraRef(identity=a.identity, path=a.path) for a in latest]

    def kv_tiers(self, block_size: int) -> KvTiers | None:
        """The smallest tiers every rank holds, or None where some rank has none."""
        ranks = [self.workers[r].handshake for r in sorted(self.workers)]
        host = min(hs.host_tier_blocks for hs in ranks)
        disk = min(hs.disk_tier_blocks for hs in ranks)
        if not host and not disk:
            return None

        def on_disk(field: str) -> list[bytes]:
            """The hashes every rank holds on disk, in rank 0's order."""
            held = [getattr(hs, field) for hs in ranks]
            lists = [[b[i : i + HASH_BYTES] for i in range(0, len(b), HASH_BYTES)] for b in held]
            others = [set(x) for x in lists[1:]]
            return [h for h in lists[0] if len(h) == HASH_BYTES and all(h in o for o in others)]

        snapshots = None
        if ranks[0].state_slots:
            snapshots = (
                min(hs.host_tier_snapshots for hs in ranks),
                min(hs.disk_tier_snapshots for hs in ranks),
                on_disk("disk_tier_snapshot_hashes") if disk else [],
            )
        return KvTiers(
            host,
            disk,
            on_disk("disk_tier_hashes") if disk else [],
            ranks[0].bytes_per_block,
            block_size,
            snapshots,
            ranks[0].bytes_per_state_slot,
        )


def merged_result(results: dict[int, wire_pb2.StepResult]) -> wire_pb2.StepResult:
    """Rank 0's result, where a tier load failed if it failed on any rank."""
    first = results[0]
    failed = {r.kv_load_failed for r in results.values()}
    if len(failed) > 1:
        merged = sorted({int(i) for blob in failed for i in memoryview(blob).cast("i")})
        first.kv_load_failed = b"".join(i.to_bytes(4, "little", signed=True) for i in merged)
    return first


def is_loopback_endpoint(endpoint: str) -> bool:
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name
        return False


# Handshake fields every rank of every replica must agree on (one model behind the service).
SAME_MODEL = ("model_fingerprint", "vocab_size", "block_size", "max_context", "dtype", "kv_window")


def handshake_problem(
    hs: wire_pb2.Handshake, groups: list[WorkerGroup], tp_size: int, expected: dict[str, object]
) -> str:
    """Why a rank cannot join (out of range, unlike the others), or ""."""
    if hs.tp_size != tp_size:
        return f"tensor-parallel size {hs.tp_size}, the scheduler expects {tp_size}"
    if hs.replica >= len(groups):
        return f"replica {hs.replica} is out of range: the scheduler drives {len(groups)}"
    if hs.tp_rank >= tp_size:
        return f"rank {hs.tp_rank} is out of range for a group of {tp_size}"
    group = groups[hs.replica]
    if group.is_ready:
        return f"replica {hs.replica} rank {hs.tp_rank} is already connected"
    for key, value in expected.items():
        if getattr(hs, key) != value:
            return f"{key} is {getattr(hs, key)}, the scheduler's is {value}"
    peers = [w for g in groups for w in g.workers.values() if g.is_ready or g is group]
    for other in peers:
        if other.tp_rank == hs.tp_rank and other.replica == hs.replica:
            continue  # a candidate replaced by its restart
        for key in SAME_MODEL + (("rendezvous",) if other.replica == hs.replica else ()):
            if getattr(hs, key) != getattr(other.handshake, key):
                return (
                    f"{key} {getattr(hs, key)!r} differs from replica {other.replica} rank "
                    f"{other.tp_rank}'s {getattr(other.handshake, key)!r}"
                )
    return ""
