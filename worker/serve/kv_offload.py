"""The KV tier flags made into this rank's tier store, or a start-up refusal that says why."""

from __future__ import annotations

import os

import structlog

from worker.serve.config import Refused, WorkerConfig

log = structlog.get_logger("worker.serve.main")


def tier_store(cfg: WorkerConfig, loaded, pool):
    """The KV tiers' bytes under the pool (--kv-offload-size, --kv-offload-dir), or a refusal that
    says why they cannot be.
    """
    from protos.base.argtypes import parse_bytes
    from worker.model.kv_tiers import (
        BlockBytes,
        DiskTier,
        KvTierStore,
        layout_key,
        weights_identity,
    )

    size = BlockBytes(pool).size
    host = parse_bytes(cfg.kv_offload_size) // size if cfg.kv_offload_size else 0
    disk = None
    if cfg.kv_offload_dir:
        capacity = parse_bytes(cfg.kv_offload_disk_size) // DiskTier.file_bytes(size)
        if capacity < 1:
            raise Refused(
                "kv_offload_too_small",
                f"--kv-offload-disk-size {cfg.kv_offload_disk_size} holds "
                f"no block of {DiskTier.file_bytes(size)} bytes",
            )
        weights = weights_identity(cfg.model, cfg.load_format, cfg.seed)
        key = layout_key(
            fingerprint(cfg, loaded), weights, pool, cfg.rank, cfg.tensor_parallel_size, cfg.replica
        )
        try:
            disk = DiskTier(cfg.kv_offload_dir, key, size, capacity)
        except OSError as e:
            raise Refused(
                "kv_offload_dir_unusable",
                f"--kv-offload-dir {cfg.kv_offload_dir} cannot be written: {e.strerror or e}",
                folder=cfg.kv_offload_dir,
            ) from None
    if cfg.kv_offload_size and host < 1:
        raise Refused(
            "kv_offload_too_small",
            f"--kv-offload-size {cfg.kv_offload_size} holds no block of {size} bytes",
        )
    log.info(
        "kv_tiers",
        host_blocks=host,
        disk_blocks=disk.capacity if disk else 0,
        disk_held=len(disk.held()) if disk else 0,
        block_bytes=size,
    )
    return KvTierStore(pool, host, disk)


def fingerprint(cfg: WorkerConfig, loaded) -> str:
    """The model's fingerprint (config and weights' source) that every rank
    of a group must share.
    """
    return loaded.config.fingerprint(
        os.path.basename(os.path.normpath(cfg.model)) + cfg.load_format
    )
