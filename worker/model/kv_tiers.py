"""The KV tiers' bytes: a host buffer and a folder of block files, each block with its hash and a
checksum; a failed load is reported and computed instead. Disk writes run on a thread.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import structlog
import torch

from protos.codec import HASH_BYTES, TIER_DISK, TIER_HOST, TierOps
from worker.model.kv_pool import KVPool
from worker.model.state_pool import StatePool

log = structlog.get_logger("worker.kv_tiers")
MAGIC = b"PSKV1"
# magic, layout key, block hash, payload bytes, crc32 of the payload
HEADER = struct.Struct("<5s16s16sQI")


class TierError(ValueError):
    """A plan's tier work names a block, tier or slot this worker does not have."""


def layout_key(
    fingerprint: str, weights: str, pool: KVPool, rank: int, tp: int, replica: int
) -> bytes:
    """What a block's bytes depend on besides its tokens: other layouts' files are never read."""
    text = "|".join(
        map(
            str,
            (
                fingerprint,
                weights,
                pool.dtype,
                pool.block_size,
                max(t.shape for t in pool.k),
                rank,
                tp,
                replica,
                len(pool.k),
                pool.states.bytes_per_slot if pool.states is not None else 0,
            ),
        )
    )
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def weights_identity(model: str, load_format: str, seed: int) -> str:
    """The weight files' names, sizes and times, or the dummy seed."""
    if load_format == "dummy":
        return f"dummy:{seed}"
    path = Path(model)
    files = (
        [path]
        if path.is_file()
        else sorted(
            p for p in path.glob("*") if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")
        )
    )
    return ";".join(
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.exists()
    )


class RowBytes:
    """Entries of some tensors as rows of bytes (a block: every layer's K, V, token record)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.part_bytes = [t[0].numel() * t.element_size() for t in parts]
        self.size = sum(self.part_bytes)
        self.device = parts[0].device

    def gather(self, ids: list[int]) -> np.ndarray:
        """uint8 [len(ids), size] on the host."""
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = [t[idx].reshape(len(ids), -1).view(torch.uint8) for t in self.parts]
        return torch.cat(rows, dim=1).cpu().numpy()

    def scatter(self, ids: list[int], data: np.ndarray) -> None:
        """Write rows of bytes (uint8 [len(ids), size]) into these entries."""
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        src = torch.from_numpy(np.ascontiguousarray(data)).to(self.device)
        off = 0
        for t, n in zip(self.parts, self.part_bytes, strict=True):
            t[idx] = src[:, off : off + n].contiguous().view(t.dtype).view(len(ids), *t.shape[1:])
            off += n


def block_bytes(pool: KVPool) -> RowBytes:
    """A hybrid's linear layers hold no K/V: only its attention layers' are a block's."""
    return RowBytes([t for t in [*pool.k, *pool.v] if t.numel()] + [pool.tokens])


def snapshot_bytes(states: StatePool) -> RowBytes:
    return RowBytes(states.tensors())


class HostTier:
    """Host-memory slots of block bytes, each with its hash and checksum."""

    def __init__(self, slots: int, size: int, pin: bool) -> None:
        self.data = torch.empty((slots, size), dtype=torch.uint8, pin_memory=pin).numpy()
        self.hashes: list[bytes | None] = [None] * slots
        self.crcs = [0] * slots

    def store(self, slot: int, h: bytes, row: np.ndarray) -> None:
        self.data[slot] = row
        self.hashes[slot], self.crcs[slot] = h, zlib.crc32(row)

    def load(self, slot: int, h: bytes) -> np.ndarray | None:
        row = self.data[slot]
        if self.hashes[slot] != h or zlib.crc32(row) != self.crcs[slot]:
            return None
        return row


class DiskTier:
    """One file a block under folder/<layout key>/, written atomically on a thread."""

    def __init__(
        self, folder: str, key: bytes, size: int, capacity: int, suffix: str = ".kv"
    ) -> None:
        """suffix: what this tier's files end in (".kv" blocks, ".st" state snapshots)."""
        self.dir = Path(folder) / key.hex()
        self.key, self.size, self.capacity, self.suffix = key, size, capacity, suffix
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".probe"
        probe.write_bytes(b"")  # a folder that cannot be written is refused at start (OSError)
        probe.unlink()
        for tmp in self.dir.glob("*.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        self._pending: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def file_bytes(size: int) -> int:
        return HEADER.size + size

    def held(self) -> list[bytes]:
        """Block hashes with a file here, oldest first."""
        files = []
        for p in self.dir.glob(f"*{self.suffix}"):
            try:
                if len(p.stem) == 2 * HASH_BYTES:
                    files.append((p.stat().st_mtime_ns, bytes.fromhex(p.stem)))
            except (OSError, ValueError):
                continue
        return [h for _, h in sorted(files)]

    def _path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}{self.suffix}"

    def _warn_once(self, what: str, **fields) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(what, folder=str(self.dir), **fields)

    def store(self, h: bytes, row: np.ndarray) -> None:
        with self._lock:
            self._pending[h] = row
        self._queue.put(("store", h))

    def drop(self, h: bytes) -> None:
        self._queue.put(("drop", h))

    def load(self, h: bytes) -> np.ndarray | None:
        with self._lock:
            row = self._pending.get(h)
        if row is not None:
            return row
        try:
            with open(self._path(h), "rb") as f:
                blob = f.read(HEADER.size + self.size + 1)
        except OSError as e:
            self._warn_once("kv_disk_read_failed", error=str(e))
            return None
        if len(blob) != HEADER.size + self.size:
            self._warn_once("kv_disk_block_truncated", bytes=len(blob))
            return None
        magic, key, stored, n, crc = HEADER.unpack_from(blob)
        row = np.frombuffer(blob, dtype=np.uint8, offset=HEADER.size)
        if (magic, key, stored, n) != (MAGIC, self.key, h, self.size) or zlib.crc32(row) != crc:
            self._warn_once("kv_disk_block_corrupt", hash=h.hex())
            return None
        return row

    def flush(self) -> None:
        """Wait until every write and drop asked so far is done."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            op, h = self._queue.get()
            try:
                if op == "store":
                    self._write(h)
                else:
                    self._path(h).unlink(missing_ok=True)
            except OSError as e:
                self._warn_once(f"kv_disk_{op}_failed", error=str(e))
            finally:
                self._queue.task_done()

    def _write(self, h: bytes) -> None:
        with self._lock:
            row = self._pending.get(h)
        if row is None:
            return
        tmp = self.dir / f"{h.hex()}{self.suffix}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, self.key, h, self.size, zlib.crc32(row)))
                f.write(memoryview(row))
            os.replace(tmp, self._path(h))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            with self._lock:
                if self._pending.get(h) is row:
                    del self._pending[h]


class TierLane:
    """One kind of entry's tiers on this rank: its bytes, a host tier, a disk tier."""

    def __init__(self, rows: RowBytes, host_slots: int, disk: DiskTier | None, what: str) -> None:
        self.rows, self.disk, self.what = rows, disk, what
        pin = rows.device.type == "cuda"
        self.host = HostTier(host_slots, rows.size, pin) if host_slots else None

    @property
    def host_slots(self) -> int:
        return len(self.host.hashes) if self.host is not None else 0

    def check(self, ops: TierOps, count: int) -> None:
        """TierError where the work names what this rank lacks."""
        for rows in (ops.stores, ops.loads):
            if len(rows) and ((rows[:, 0] < 0).any() or (rows[:, 0] >= count).any()):
                raise TierError(f"a KV-tier row names a {self.what} outside the pool")
            for tier, slot in rows[:, 1:].tolist():
                if tier == TIER_HOST and (self.host is None or not 0 <= slot < self.host_slots):
                    raise TierError(
                        f"host slot {slot} is not one of this worker's {self.host_slots} for "
                        f"{self.what}s"
                    )
                if tier == TIER_DISK and self.disk is None:
                    raise TierError(f"the plan writes {self.what}s to a disk tier it does not have")
                if tier not in (TIER_HOST, TIER_DISK):
                    raise TierError(f"unknown KV tier {tier}")
        if ops.drops and self.disk is None:
            raise TierError(f"the plan drops disk {self.what}s this worker does not have")

    def run(self, ops: TierOps) -> list[int]:
        """Stores, loads, drops; -> indices of the loads that failed."""
        n = len(ops.stores)
        if n:
            rows = self.rows.gather(ops.stores[:, 0].tolist())
            for i, (tier, slot) in enumerate(ops.stores[:, 1:].tolist()):
                if tier == TIER_HOST:
                    self.host.store(slot, ops.hashes[i], rows[i])
                else:
                    self.disk.store(ops.hashes[i], rows[i].copy())
        failed, good, data = [], [], []
        for j, (entry, tier, slot) in enumerate(ops.loads.tolist()):
            h = ops.hashes[n + j]
            row = self.host.load(slot, h) if tier == TIER_HOST else self.disk.load(h)
            if row is None:
                failed.append(j)
            else:
                good.append(entry)
                data.append(row)
        if good:
            self.rows.scatter(good, np.stack(data))
        for h in ops.drops:
            self.disk.drop(h)
        return failed


class KvTierStore:
    """This rank's tiers and the plan's work on them: blocks, and a hybrid's snapshots."""

    def __init__(
        self,
        pool: KVPool,
        host_blocks: int,
        disk: DiskTier | None,
        host_snapshots: int = 0,
        disk_snapshots: DiskTier | None = None,
    ) -> None:
        self.pool = pool
        self.blocks = TierLane(block_bytes(pool), host_blocks, disk, "block")
        self.states = (
            TierLane(snapshot_bytes(pool.states), host_snapshots, disk_snapshots, "state slot")
            if pool.states is not None and (host_snapshots or disk_snapshots is not None)
            else None
        )

    @property
    def host(self) -> HostTier | None:
        return self.blocks.host

    @property
    def disk(self) -> DiskTier | None:
        return self.blocks.disk

    def flush(self) -> None:
        """Wait for the disk tiers' writes and deletes asked for so far."""
        for lane in (self.blocks, self.states):
            if lane is not None and lane.disk is not None:
                lane.disk.flush()

    def describe(self, handshake) -> None:
        """Say this rank's tiers in its handshake: their sizes, and what is on disk now."""
        handshake.host_tier_blocks = self.blocks.host_slots
        if self.disk is not None:
            handshake.disk_tier_blocks = self.disk.capacity
            handshake.disk_tier_hashes = b"".join(self.disk.held())
        if (states := self.states) is not None:
            handshake.host_tier_snapshots = states.host_slots
            if states.disk is not None:
                handshake.disk_tier_snapshots = states.disk.capacity
                handshake.disk_tier_snapshot_hashes = b"".join(states.disk.held())

    def check(self, ops: TierOps, num_blocks: int) -> None:
        """TierError where the work names what this rank lacks."""
        self.blocks.check(ops, num_blocks)
        if ops.states is not None:
            if self.states is None:
                raise TierError("the plan moves state snapshots; this worker keeps none in tiers")
            self.states.check(ops.states, self.pool.states.num_slots)

    def run(self, ops: TierOps) -> tuple[np.ndarray, float]:
        """Blocks then snapshots: stores, loads, drops -> (failed loads, seconds)."""
        t0 = time.perf_counter()
        failed = self.blocks.run(ops)
        if ops.states is not None:
            failed += [len(ops.loads) + j for j in self.states.run(ops.states)]
        return np.asarray(failed, dtype=np.int32), time.perf_counter() - t0


def check_tiers(store: KvTierStore | None, ops: TierOps, num_blocks: int) -> None:
    """TierError where a plan's tier work cannot run on this rank."""
    if store is None:
        raise TierError(
            "the plan moves KV-tier blocks; this worker has no tiers (--kv-offload-size, "
            "--kv-offload-dir)"
        )
    store.check(ops, num_blocks)
