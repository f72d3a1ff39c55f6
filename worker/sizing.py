"""How many KV blocks a worker can hold: from a byte budget on the CPU, from the GPU's memory on CUDA
(measured after the weights are loaded and a profiling forward at the largest step has run)."""

from __future__ import annotations

import torch

from worker.attention import AttentionBackend
from worker.kv_pool import KVPool, bytes_per_block
from worker.model import LlamaModel, StepInputs


def blocks_for_gpu_budget(total: int, utilization: float, non_kv_peak: int, other_processes: int,
                          per_block: int) -> int:
    """Blocks that fit in utilization x total once this process's peak without the pool (weights,
    activations) and other processes' memory are set aside."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must lie in (0, 1], got {utilization}")
    budget = int(total * utilization) - non_kv_peak - other_processes
    return max(0, budget // per_block)


@torch.inference_mode()
def profile_gpu_blocks(model: LlamaModel, attn: AttentionBackend, device: torch.device, dtype: torch.dtype,
                       block_size: int, max_num_batched_tokens: int, utilization: float) -> int:
    """Run one forward at the largest step the scheduler may send, then size the pool from what is left."""
    config = model.config
    num_tokens = min(max_num_batched_tokens, config.max_position_embeddings)
    temp_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    heads = model.shard.num_kv_heads
    pool = KVPool(config, temp_blocks, block_size, dtype, device, heads)
    tables = torch.arange(temp_blocks, dtype=torch.int32, device=device)[None, :]
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    step = StepInputs(
        token_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.arange(num_tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        attn_meta=attn.prepare(tables, lens, qsl, block_size, num_tokens, num_tokens),
    )
    hidden = model(step, pool, attn)
    model.compute_logits(hidden[-256:])  # the sampler's largest logits batch, roughly
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    temp_pool_bytes = temp_blocks * pool.bytes_per_block
    del pool, hidden, step
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return blocks_for_gpu_budget(total, utilization, peak - temp_pool_bytes, other,
                                 bytes_per_block(config, block_size, dtype, heads))
