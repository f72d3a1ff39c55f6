"""KV tier flags made into this rank's tier store, or a refusal saying why. A hybrid gives half of
each tier to its state snapshots.
"""

from __future__ import annotations

import os

import structlog

from worker.serve.config import Refused, WorkerConfig

log = structlog.get_logger("worker.serve.main")
SNAPSHOT_SHARE = 0.5  # of each tier's bytes, for a hybrid's state snapshots


def split(budget: int, block: int, snapshot: int) -> tuple[int, int]:
    """Blocks and snapshots a tier of `budget` bytes holds (snapshot 0: a model without state)."""
    if not snapshot:
        return budget // block, 0
    kept = int(budget * SNAPSHOT_SHARE)
    return (budget - kept) // block, kept // snapshot


def too_small(flag: str, value: str, blocks: int, snapshots: int, sizes: tuple[int, int]) -> None:
    if blocks < 1 or (sizes[1] and snapshots < 1):
        what = f"a block of {sizes[0]} bytes" + (
            f" beside a state snapshot of {sizes[1]} bytes (half of it holds snapshots)"
            if sizes[1]
            else ""
        )
        raise Refused("kv_offload_too_small", f"{flag} {value} holds no {what}")


def tier_store(cfg: WorkerConfig, loaded, pool):
    """The tiers under the pool (--kv-offload-size, --kv-offload-dir), or why they cannot be."""
    from protos.base.argtypes import parse_bytes
    from worker.model.kv_tiers import (
        DiskTier,
        KvTierStore,
        block_bytes,
        layout_key,
        snapshot_bytes,
        weights_identity,
    )

    size = block_bytes(pool).size
    snap = snapshot_bytes(pool.states).size if pool.states is not None else 0
    host = snaps = 0
    if cfg.kv_offload_size:
        host, snaps = split(parse_bytes(cfg.kv_offload_size), size, snap)
        too_small("--kv-offload-size", cfg.kv_offload_size, host, snaps, (size, snap))
    disk = disk_snaps = None
    if cfg.kv_offload_dir:
        budget = parse_bytes(cfg.kv_offload_disk_size)
        on_disk = split(budget, DiskTier.file_bytes(size), DiskTier.file_bytes(snap) if snap else 0)
        too_small("--kv-offload-disk-size", cfg.kv_offload_disk_size, *on_disk, (size, snap))
        weights = weights_identity(cfg.model, cfg.load_format, cfg.seed)
        key = layout_key(
            fingerprint(cfg, loaded), weights, pool, cfg.rank, cfg.tensor_parallel_size, cfg.replica
        )
        try:
            disk = DiskTier(cfg.kv_offload_dir, key, size, on_disk[0])
            if snap:
                disk_snaps = DiskTier(cfg.kv_offload_dir, key, snap, on_disk[1], suffix=".st")
        except OSError as e:
            raise Refused(
                "kv_offload_dir_unusable",
                f"--kv-offload-dir {cfg.kv_offload_dir} cannot be written: {e.strerror or e}",
                folder=cfg.kv_offload_dir,
            ) from None
    log.info(
        "kv_tiers",
        host_blocks=host,
        disk_blocks=disk.capacity if disk else 0,
        disk_held=len(disk.held()) if disk else 0,
        block_bytes=size,
        **(
            dict(
                host_snapshots=snaps,
                disk_snapshots=disk_snaps.capacity if disk_snaps else 0,
                disk_snapshots_held=len(disk_snaps.held()) if disk_snaps else 0,
                snapshot_bytes=snap,
            )
            if snap
            else {}
        ),
    )
    return KvTierStore(pool, host, disk, snaps, disk_snaps)


def fingerprint(cfg: WorkerConfig, loaded) -> str:
    """The model's fingerprint (config and weights' source) that every rank
    of a group must share.
    """
    return loaded.config.fingerprint(
        os.path.basename(os.path.normpath(cfg.model)) + cfg.load_format
    )
