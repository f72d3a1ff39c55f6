"""Tensor parallelism: how a model is split over a group's ranks (`make_shard`) and its collectives.
Every rank ends a step with the same full logits, so every rank draws the same token.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch


class ParallelConfigError(ValueError):
    """The tensor-parallel size cannot split this model; the message names the numbers."""


@dataclass(frozen=True)
class Shard:
    """One rank's slices (half-open) of each projection, as vLLM splits them."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    # rows of the embedding / LM head this rank holds (the last shard may be short)
    vocab: tuple[int, int]
    vocab_shard_size: int  # ceil(vocab / size): every rank's shard is padded to this many rows
    # each expert's intermediate slice (mixture of experts)
    expert_intermediate: tuple[int, int] = (0, 0)
    # a hybrid's Gated DeltaNet key and value heads
    linear_k_heads: tuple[int, int] = (0, 0)
    linear_v_heads: tuple[int, int] = (0, 0)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]


def make_shard(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    rank: int = 0,
    size: int = 1,
    expert_intermediate_size: int = 0,
    linear_heads: tuple[int, int] = (0, 0),
) -> Shard:
    """Rank's slices, or ParallelConfigError when `size` cannot split the model."""
    if size < 1 or not 0 <= rank < size:
        raise ParallelConfigError(f"tensor-parallel rank {rank} is outside a group of size {size}")
    if num_heads % size:
        raise ParallelConfigError(
            f"tensor-parallel size {size} cannot split the model's {num_heads} query heads evenly"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        raise ParallelConfigError(
            f"tensor-parallel size {size} cannot split the model's {num_kv_heads} KV heads evenly"
        )
    if num_kv_heads < size and size % num_kv_heads:
        raise ParallelConfigError(
            f"tensor-parallel size {size} is not a multiple of the model's {num_kv_heads} "
            "KV heads, so they cannot be replicated evenly"
        )
    if intermediate_size % size:
        raise ParallelConfigError(
            f"tensor-parallel size {size} cannot split the model's MLP intermediate size "
            f"{intermediate_size}"
        )
    q = num_heads // size
    kv_range = kv_head_range(num_kv_heads, rank, size)
    if expert_intermediate_size % size:
        raise ParallelConfigError(
            f"tensor-parallel size {size} cannot split the experts' intermediate size "
            f"{expert_intermediate_size}"
        )
    for what, n in zip(("key", "value"), linear_heads, strict=True):
        if n % size:
            raise ParallelConfigError(
                f"tensor-parallel size {size} cannot split the model's {n} Gated DeltaNet {what} "
                "heads evenly"
            )
    lk, lv = (n // size for n in linear_heads)
    inter = intermediate_size // size
    einter = expert_intermediate_size // size
    vshard = -(-vocab_size // size)
    return Shard(
        rank=rank,
        size=size,
        q_heads=(rank * q, (rank + 1) * q),
        kv_heads=kv_range,
        intermediate=(rank * inter, (rank + 1) * inter),
        vocab=(min(rank * vshard, vocab_size), min((rank + 1) * vshard, vocab_size)),
        vocab_shard_size=vshard,
        expert_intermediate=(rank * einter, (rank + 1) * einter),
        linear_k_heads=(rank * lk, (rank + 1) * lk),
        linear_v_heads=(rank * lv, (rank + 1) * lv),
    )


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads a rank holds: its slice, or where there are fewer heads than ranks, one
    replicated (ranks r*k .. r*k+k-1, k = size / num_kv_heads, all hold head r).
    """
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return rank * kv, (rank + 1) * kv
    head = rank // (size // num_kv_heads)
    return head, head + 1


class Collectives:
    """All-reduce and all-gather; identities with one rank."""

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_group(
    rendezvous: str,
    rank: int,
    size: int,
    device: torch.device,
    timeout_s: float,
    rendezvous_file: str | None = None,
) -> Collectives:
    """Join the TP group (gloo or NCCL); rank 0 writes its free port to rendezvous_file, so none is
    taken beforehand.
    """
    if size == 1:
        return Collectives(1)
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=timeout_s)
    if rendezvous_file:
        store = _store_through_file(rendezvous, rank, size, Path(rendezvous_file), timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs
        )
    else:
        dist.init_process_group(
            backend, init_method=rendezvous, rank=rank, world_size=size, timeout=timeout, **kwargs
        )
    return Collectives(size)


def _store_through_file(rendezvous: str, rank: int, size: int, path: Path, timeout: timedelta):
    """Rank 0 writes the TCPStore address atomically; others read and connect, past a stale file."""
    import torch.distributed as dist

    host = urlparse(rendezvous).hostname or "127.0.0.1"
    if rank == 0:
        store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"host": host, "port": store.port}))
        os.replace(tmp, path)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            where = json.loads(path.read_text())
            return dist.TCPStore(
                where["host"], int(where["port"]), size, False, timeout=timedelta(seconds=5)
            )
        except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank} found no rendezvous through {path} within "
                    f"{timeout.total_seconds():g}s: {e}"
                ) from e
            time.sleep(0.2)
