"""Pure-torch paged attention: the definition every Triton kernel is checked against.

Pool layout (block-tensor): k_cache, v_cache are [num_blocks, block_size, n_kv_heads, head_dim].
The slot of position p of a sequence is block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,  # [num_tokens, n_kv_heads, head_dim], may be a strided view
    v: torch.Tensor,  # [num_tokens, n_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] integer; -1 is padding and writes nothing
) -> None:
    """Store each token's K and V at its slot, in place."""
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    flat_k = k_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))


class AttentionIndex:
    """Per-step indexing shared by every layer: which row of which sequence each query token is,
    which keys each query may see. Built once per step, used by all layers."""

    def __init__(
        self,
        block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
        seq_lens: torch.Tensor,  # int32 [num_seqs]
        query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
        block_size: int,
        device: torch.device | str,
    ) -> None:
        qsl = query_start_loc.to(device=device, dtype=torch.int64)
        q_lens = qsl[1:] - qsl[:-1]  # [num_seqs]
        kv_lens = seq_lens.to(device=device, dtype=torch.int64)  # [num_seqs]
        self.num_seqs = int(kv_lens.shape[0])
        self.num_tokens = int(qsl[-1])
        self.max_q = int(q_lens.max()) if self.num_seqs else 0
        self.max_kv = int(kv_lens.max()) if self.num_seqs else 0
        num_kv_blocks = (self.max_kv + block_size - 1) // block_size
        # Unused (-1) entries point at block 0; the key mask below hides whatever they hold.
        self.tables = block_tables[:, :num_kv_blocks].to(device=device, dtype=torch.int64).clamp(min=0)
        key_pos = torch.arange(self.max_kv, device=device)
        self.key_valid = key_pos[None, :] < kv_lens[:, None]  # [num_seqs, max_kv]
        self.seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), q_lens)
        self.row_of_token = torch.arange(self.num_tokens, device=device) - qsl[self.seq_of_token]
        query_pos = torch.arange(self.max_q, device=device)
        limit = kv_lens[:, None] - q_lens[:, None] + query_pos[None, :] + 1  # [num_seqs, max_q]
        self.visible = key_pos[None, None, :] < limit[:, :, None]  # [num_seqs, max_q, max_kv]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]; unused entries are ignored
    seq_lens: torch.Tensor,  # int32 [num_seqs]: KV length including this step's tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys.

    Query i of a sequence with q_len queries and seq_len keys sees keys j < seq_len - q_len + i + 1.
    One entry point for prefill, prefill over a cached prefix, and decode. Softmax in fp32; keys
    beyond seq_len (stale or poisoned bytes) never reach the output.
    Returns [num_tokens, n_heads, head_dim] in q's dtype.
    """
    index = AttentionIndex(block_tables, seq_lens, query_start_loc, k_cache.shape[1], q.device)
    return paged_attention_indexed(q, k_cache, v_cache, index, scale)


def paged_attention_indexed(
    q: torch.Tensor,  # [num_tokens, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,
    index: AttentionIndex,
    scale: float,
) -> torch.Tensor:
    """paged_attention with the per-step indexing already built (the worker builds it once per step)."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads
    if num_tokens == 0:
        return torch.empty_like(q)
    num_seqs, max_q, max_kv = index.num_seqs, index.max_q, index.max_kv

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, n_kv_heads, max_kv, head_dim]
        paged = cache[index.tables].reshape(num_seqs, -1, n_kv_heads, head_dim)[:, :max_kv]
        paged = torch.where(index.key_valid[:, :, None, None], paged.float(), 0.0)
        return paged.permute(0, 2, 1, 3)

    q_pad = q.new_zeros((num_seqs, max_q, n_heads, head_dim), dtype=torch.float32)
    q_pad[index.seq_of_token, index.row_of_token] = q.float()
    # [num_seqs, n_kv_heads, group, max_q, head_dim]: the query heads that share one KV head
    q_g = q_pad.view(num_seqs, max_q, n_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(q_g, gather(k_cache).unsqueeze(2).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~index.visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    out = torch.matmul(probs, gather(v_cache).unsqueeze(2))  # [num_seqs, n_kv_heads, group, max_q, head_dim]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, n_heads, head_dim)
    return out[index.seq_of_token, index.row_of_token].to(q.dtype)
