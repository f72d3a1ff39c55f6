"""How many KV blocks a worker can hold: from a byte budget on a CPU; on CUDA after measuring all
else it will hold (weights, largest step, prompt logprobs, sampler, graphs), so what is left is
really left.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.model.attention import AttentionBackend
from worker.model.kv_pool import KVPool
from worker.model.llama import LlamaModel, StepInputs

# --max-num-seqs left to the workers: on a CPU more sequences run no faster a token; on a GPU it is
# sized so every sequence can reach TOKENS_PER_SEQ tokens in the pool, within the bounds.
CPU_MAX_NUM_SEQS = 64
GPU_MAX_NUM_SEQS = (64, 512)
TOKENS_PER_SEQ = 1024


def default_max_num_seqs(
    device_type: str, num_blocks: int, block_size: int, max_num_batched_tokens: int
) -> int:
    """The sequence limit proposed without --max-num-seqs, never above the token budget."""
    if device_type != "cuda":
        chosen = CPU_MAX_NUM_SEQS
    else:
        low, high = GPU_MAX_NUM_SEQS
        chosen = max(low, min(high, num_blocks * block_size // TOKENS_PER_SEQ))
    return max(1, min(chosen, max_num_batched_tokens))


def blocks_for_gpu_budget(
    total: int, utilization: float, non_kv_peak: int, other_processes: int, per_block: int
) -> int:
    """Blocks in utilization x total, less this process's peak and others' memory."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must lie in (0, 1], got {utilization}")
    budget = int(total * utilization) - non_kv_peak - other_processes
    return max(0, budget // per_block)


@torch.inference_mode()
def profile_gpu_peak(
    model: LlamaModel,
    attn: AttentionBackend,
    device: torch.device,
    kv_dtype: torch.dtype,
    block_size: int,
    max_num_batched_tokens: int,
    max_sample_rows: int,
) -> int:
    """Measured peak bytes besides the pool, weights included."""
    from worker.step.controls import top_logprobs
    from worker.step.sampler import SamplingBatch, sample_async

    config = model.config
    num_tokens = min(max_num_batched_tokens, config.max_position_embeddings)
    temp_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    pool = KVPool(config, temp_blocks, block_size, kv_dtype, device, model.shard.size)
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
    # prompt logprobs of every token of the step (the largest logits a step computes)
    targets = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    top_logprobs(model.compute_logits(hidden), targets, np.full(num_tokens, 20, dtype=np.int64))
    rows = max(1, min(max_sample_rows, max_num_batched_tokens))
    logits = model.compute_logits(hidden[:1].expand(rows, -1).contiguous())
    batch = SamplingBatch(
        temperature=torch.ones(rows),
        top_p=torch.full((rows,), 0.9),
        top_k=torch.full((rows,), 50, dtype=torch.int64),
        seeds=list(range(rows)),
        sample_index=[0] * rows,
        min_p=torch.full((rows,), 0.01),
    )
    sample_async(logits, batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    temp_pool_bytes = temp_blocks * pool.bytes_per_block
    del pool, hidden, step, logits
    torch.cuda.empty_cache()
    return peak - temp_pool_bytes


def measure_graph_bytes(
    model: LlamaModel,
    attn: AttentionBackend,
    device: torch.device,
    kv_dtype: torch.dtype,
    block_size: int,
    max_rows: int,
    max_context: int,
) -> int:
    """GPU memory the decode graphs hold, measured by capturing them once over a one-block pool."""
    from worker.step.graphs import DecodeGraphs

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    pool = KVPool(model.config, 1, block_size, kv_dtype, device, model.shard.size)
    graphs = DecodeGraphs(model, pool, attn, device, max_rows=max_rows, max_context=max_context)
    graphs.capture_all()
    used = torch.cuda.memory_reserved(device) - before - pool.bytes_per_block
    del graphs, pool
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, used)


def gpu_blocks(device: torch.device, utilization: float, non_kv_bytes: int, per_block: int) -> int:
    """Blocks that fit after the measured peak, graphs and other processes."""
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return blocks_for_gpu_budget(total, utilization, non_kv_bytes, other, per_block)


def lora_reserve(cfg, config, shard, dtype: torch.dtype) -> int:
    """LoRA slots' bytes (twice: stacked too), set aside so LoRA never runs out of memory."""
    from worker.weights.lora import lora_bytes

    if not cfg.max_cpu_loras:
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.max_cpu_loras * lora_bytes(config, shard, cfg.max_lora_rank, itemsize)


def lora_cache(cfg, config, shard, dtype: torch.dtype, device: torch.device):
    """The runner's LoRA adapters (model/lora.py LoraCache), read from
    their folders on first use.
    """
    from worker.model.lora import LoraCache
    from worker.weights.lora import read_lora

    def read(identity: str, path: str):
        return read_lora(path, identity, config, shard, dtype, device, cfg.max_lora_rank)

    return LoraCache(cfg.max_cpu_loras, cfg.max_lora_rank, read)
