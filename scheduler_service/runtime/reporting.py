"""What the engine reports of itself: the service's load (what a gateway balances on) and the pool's
accounting (GetCacheStats), summed over replicas, per replica and per live request."""

from __future__ import annotations


def service_load(engine) -> dict:
    """The service's load now, summed over serving replicas (what a gateway balances on)."""
    live = [s for r in engine.replicas if (s := r.pool_stats()) is not None]
    used = sum(s["num_used_blocks"] for s in live)
    blocks = sum(s["num_blocks"] for s in live)
    queries = sum(s["prefix_cache_queries"] for s in live)
    hits = sum(s["prefix_cache_hits"] for s in live)
    waiting_tokens = sum(r.prompt_len for r in engine.orphans) + sum(s["waiting_tokens"] for s in live)
    return {"running": sum(s["num_running"] for s in live),
            "waiting": sum(s["num_waiting"] for s in live) + len(engine.orphans), "used_blocks": used,
            "num_blocks": blocks, "block_size": engine.config.block_size,
            "token_usage": used / blocks if blocks else 0.0,
            "cache_hit_rate": hits / queries if queries else 0.0,
            "generated_tokens": sum(r.num_generated_tokens for r in engine.replicas),
            "waiting_tokens": waiting_tokens,
            "max_running": engine.config.max_num_seqs * len(engine.replicas)}


def cache_stats(engine) -> dict:
    """The pool's accounting (GetCacheStats): totals, each replica's row, each live request's blocks."""
    rows = [r.stats() for r in engine.replicas]
    live = [row for row in rows if "num_blocks" in row]
    total = {k: sum(row[k] for row in live) for k in (
        "num_blocks", "num_free_blocks", "num_cached_blocks", "used_bytes", "total_bytes",
        "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_running", "num_waiting",
        "num_shared_blocks")}
    for k in ("num_generated_tokens", "num_prompt_tokens_computed", "num_embeddings",  # down replicas' counts
              "num_draft_verifications", "num_draft_tokens", "num_accepted_draft_tokens"):  # stay
        total[k] = sum(row[k] for row in rows)
    per_request = [row for replica in engine.replicas for row in replica.request_rows()]
    used = total["num_blocks"] - total["num_free_blocks"] - total["num_cached_blocks"]
    return {
        "block_size": engine.config.block_size,
        **total,
        "bytes_per_block": live[0]["bytes_per_block"] if live else 0,
        "utilization": used / total["num_blocks"] if total["num_blocks"] else 0.0,
        "requests": per_request,
        "replicas": rows,
    }
