"""Whether a worker group that completed its handshake can serve: its vocabulary, and a pool that holds one
request of the full context (or of a sliding window and a step's tokens), and after start no less than the
pool the service promised its requests."""

from __future__ import annotations

from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.runtime.worker_client import WorkerGroup
from scheduler_service.text.limits import Limits


def workers_max_num_seqs(config: SchedulerConfig, groups: list[WorkerGroup]) -> int | None:
    """Where --max-num-seqs was left to the workers: the smallest they proposed (a GPU worker's comes from its
    KV capacity), within a step's tokens; None where it was not, or none proposed one."""
    proposed = [w.handshake.max_num_seqs for g in groups for w in g.workers.values()
                if w.handshake.max_num_seqs]
    if not config.auto_max_num_seqs or not proposed:
        return None
    return min(min(proposed), config.max_num_batched_tokens)


def context_limit(spec: ModelSpec, group: WorkerGroup) -> int:
    """The longest context a request may have: the model's, unless the workers hold less."""
    return min(spec.max_context, group.handshake.max_context)


def group_problem(group: WorkerGroup, spec: ModelSpec, config: SchedulerConfig, limits: Limits | None) -> str:
    """Why a complete worker group cannot serve this model, or ""."""
    hs = group.handshake
    if hs.vocab_size != spec.vocab_size:
        return f"worker vocabulary {hs.vocab_size} differs from the model config's {spec.vocab_size}"
    max_context = context_limit(spec, group)
    if limits is not None:
        max_context = limits.max_context
        if group.num_blocks < limits.num_blocks:
            return (f"its pool of {group.num_blocks} blocks is smaller than the {limits.num_blocks} "
                    "the service promised requests at start")
    pool_tokens = group.num_blocks * config.block_size
    what = f"the full {max_context}-token context"
    if hs.kv_window and hs.kv_window + config.max_num_batched_tokens + 2 * config.block_size \
            < max_context:  # a sequence holds its sliding window and a step's tokens at most
        max_context = hs.kv_window + config.max_num_batched_tokens + 2 * config.block_size
        what = f"a {hs.kv_window}-key sliding window and a step's tokens ({max_context} tokens)"
    if pool_tokens < max_context:
        return (f"the KV pool ({group.num_blocks} blocks x {config.block_size} = {pool_tokens} "
                f"tokens) cannot hold one request of {what}: give the workers more KV memory "
                "(--kv-cache-memory / --gpu-memory-utilization / --num-blocks) or lower --max-model-len")
    return ""
