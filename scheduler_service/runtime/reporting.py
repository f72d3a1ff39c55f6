"""What the engine reports: the service's load (for gateways) and the pool's accounting
(GetCacheStats).
"""

from __future__ import annotations

from scheduler_service.core.stats import TIER_FIELDS
from scheduler_service.runtime.step_loop import StepLoop


def service_load(engine) -> dict:
    """The service's load now, summed over serving replicas (what a gateway balances on)."""
    live = [s for r in engine.replicas if (s := r.pool_stats()) is not None]
    used = sum(s.num_used_blocks for s in live)
    blocks = sum(s.num_blocks for s in live)
    queries = sum(s.prefix_cache_queries for s in live)
    hits = sum(s.prefix_cache_hits for s in live)
    waiting_tokens = sum(r.prompt_len for r in engine.orphans) + sum(s.waiting_tokens for s in live)
    return {
        "running": sum(s.num_running for s in live),
        "waiting": sum(s.num_waiting for s in live) + len(engine.orphans),
        "used_blocks": used,
        "num_blocks": blocks,
        "block_size": engine.config.block_size,
        "token_usage": used / blocks if blocks else 0.0,
        "cache_hit_rate": hits / queries if queries else 0.0,
        "generated_tokens": sum(r.num_generated_tokens for r in engine.replicas),
        "waiting_tokens": waiting_tokens,
        "max_running": engine.config.max_num_seqs * len(engine.replicas),
    }


def cache_stats(engine) -> dict:
    """The pool's accounting (GetCacheStats): totals, each replica's row, each live request's
    blocks.
    """
    rows = [replica_row(r) for r in engine.replicas]
    live = [row for row in rows if "num_blocks" in row]
    total = {
        k: sum(row[k] for row in live)
        for k in (
            "num_blocks",
            "num_free_blocks",
            "num_cached_blocks",
            "used_bytes",
            "total_bytes",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "num_preemptions",
            "num_running",
            "num_waiting",
            "num_shared_blocks",
            "num_state_slots",
            "num_used_state_slots",
            "num_state_snapshots",
        )
    }
    # down replicas' counts stay
    for k in (
        "num_generated_tokens",
        "num_prompt_tokens_computed",
        "num_embeddings",
        "num_draft_verifications",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
    ):
        total[k] = sum(row[k] for row in rows)
    for k in TIER_FIELDS:
        total[k] = sum(row.get(k, 0) for row in live)
    per_request = [row for replica in engine.replicas for row in replica.request_rows()]
    used = total["num_blocks"] - total["num_free_blocks"] - total["num_cached_blocks"]
    return {
        "block_size": engine.config.block_size,
        **total,
        "bytes_per_block": live[0]["bytes_per_block"] if live else 0,
        "bytes_per_state_slot": live[0].get("bytes_per_state_slot", 0) if live else 0,
        "utilization": used / total["num_blocks"] if total["num_blocks"] else 0.0,
        "requests": per_request,
        "replicas": rows,
    }


def replica_row(loop: StepLoop) -> dict:
    """One replica's row of GetCacheStats: its pool accounting (zeros while it is down) and
    counters.
    """
    s = loop.pool_stats()
    group = loop.group
    bpb = group.bytes_per_block if group.is_ready else 0
    row = {
        "replica": loop.index,
        "serving": loop.is_serving,
        "status": loop.down_reason or "serving",
        "num_requests": loop.num_routed,
        "worker_pids": group.pids if group.is_ready else [],
        "bytes_per_block": bpb,
        "num_generated_tokens": loop.num_generated_tokens,
        "num_embeddings": loop.num_embeddings,
        "num_prompt_tokens_computed": loop.num_prompt_tokens_computed,
        "num_draft_verifications": loop.num_draft_rows,
        "num_draft_tokens": loop.num_drafted_tokens,
        "num_accepted_draft_tokens": loop.num_accepted_tokens,
    }
    if s is None:
        return row
    row.update(
        num_blocks=s.num_blocks,
        num_free_blocks=s.num_free_blocks,
        num_cached_blocks=s.num_cached_blocks,
        num_shared_blocks=s.num_shared_blocks,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        used_bytes=s.num_used_blocks * bpb,
        total_bytes=s.num_blocks * bpb,
        utilization=s.num_used_blocks / s.num_blocks,
        num_state_slots=s.num_state_slots,
        num_used_state_slots=s.num_used_state_slots,
        num_state_snapshots=s.num_state_snapshots,
        bytes_per_state_slot=sum(w.handshake.bytes_per_state_slot for w in group.workers.values())
        if group.is_ready
        else 0,
    )
    if s.tiers is not None:
        row.update(s.tiers.as_fields())
    return row


def model_info(engine) -> dict:
    """What GetModelInfo answers: the model, its pool and the service's shape."""
    groups = [g for g in engine.client.groups if g.is_ready]
    pooling = engine.spec.pooling
    return {
        "model_name": engine.spec.name,
        "max_context": engine.limits.max_context,
        "vocab_size": engine.spec.vocab_size,
        "eos_token_ids": list(engine.spec.eos_token_ids),
        "block_size": engine.config.block_size,
        "num_blocks": sum(g.num_blocks for g in groups),
        "dtype": groups[0].handshake.dtype if groups else "",
        "num_workers": engine.client.num_workers,
        "kv_cache_dtype": groups[0].handshake.kv_cache_dtype if groups else "",
        "weights": groups[0].handshake.weights if groups else "",
        "tensor_parallel_size": engine.client.tp_size,
        "data_parallel_size": len(engine.replicas),
        "task": engine.spec.task,
        "pooling": pooling.pooling if pooling else "",
        "embedding_dimension": engine.spec.hidden_size if pooling else 0,
        "normalized": bool(pooling and pooling.normalize),
        "prompt_names": sorted(pooling.prompts) if pooling else [],
    }
