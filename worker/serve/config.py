"""Everything a worker's flags say, built once from the command line (`WorkerConfig.from_args`) and
handed to every start-up phase; frozen, so no phase changes what another reads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    scheduler: str
    replica: int = 0
    rank: int = 0
    rendezvous: str = ""
    rendezvous_file: str | None = None
    local_rank: int = 0
    curve_keys: str | None = None
    log_level: str = "info"
    log_format: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    load_format: str = "auto"
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    num_blocks: int | None = None
    kv_cache_memory: str | None = None  # a size ("2GiB"), checked when parsed
    kv_offload_size: str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_size: str = "16GiB"
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None
    dequantize: bool = False
    quantized_prefill: str = "auto"
    quantized_activations: str = "auto"
    cpu_decode: str = "fused"
    matmul: str = "auto"
    threads: int | None = None
    enforce_eager: bool = False
    graph_max_context: int = 8192
    malloc: str | None = None
    state_snapshots: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    seed: int = 0
    scheduler_timeout: float = 30.0
    stop_timeout: float = 60.0
    collective_timeout: float = 300.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size


class Refused(Exception):
    """Start-up cannot go on with these flags on this machine: logged, `message` printed, exit
    EXIT_CONFIG.
    """

    def __init__(self, event: str, message: str = "", **fields) -> None:
        super().__init__(message or event)
        self.event, self.message, self.fields = event, message, fields
