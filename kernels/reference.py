"""Pure-torch paged attention: the definition every kernel is checked against.

Pool layout (block-tensor): k_cache, v_cache are [num_blocks, block_size, n_kv_heads, head_dim].
The slot of position p of a sequence is block_table[p // block_size] * block_size + p % block_size.
Written plainly (gather through the block table, repeat KV heads, masked softmax in fp32) so that it is
obviously right; speed is the kernels' business.
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


def kv_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """int64 [num_seqs, width]: the pool slot of each key position of each sequence.

    Positions at or beyond a sequence's length, and those whose block was given back (a table entry of -1:
    keys before every sliding window), point at the sequence's last key, a slot that is always written,
    so a gather never touches a block the sequence does not own (unused table entries and never-written
    slots may hold anything, NaN included); the attention mask hides them.
    """
    pos = torch.arange(width, device=block_tables.device)
    blocks = block_tables.to(torch.int64)[:, (pos // block_size).clamp(max=block_tables.shape[1] - 1)]
    slots = blocks * block_size + pos % block_size  # [num_seqs, width]
    lens = seq_lens.to(torch.int64)[:, None]
    valid = (pos[None, :] < lens) & (blocks >= 0)
    last = (lens - 1).clamp(min=0, max=max(width - 1, 0))
    return torch.where(valid, slots, slots.gather(1, last)) if width else slots


def paged_attention(
    q: torch.Tensor,  # [num_tokens, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]; unused entries are ignored
    seq_lens: torch.Tensor,  # int32 [num_seqs]: KV length including this step's tokens
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys.

    Query i of a sequence with q_len queries and seq_len keys sees keys j < seq_len - q_len + i + 1, and with
    a sliding window (window > 0) only the last `window` of those: j > seq_len - q_len + i - window.
    With softcap > 0 every score (after scaling) becomes softcap * tanh(score / softcap) before the softmax
    (Gemma 2's attention-logit soft-capping). One entry point for prefill, prefill over a cached prefix, and
    decode.
    Returns [num_tokens, n_heads, head_dim] in q's dtype.
    """
    num_tokens, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    out = torch.zeros_like(q)
    k_flat = k_cache.reshape(num_blocks * block_size, n_kv_heads, head_dim)
    v_flat = v_cache.reshape(num_blocks * block_size, n_kv_heads, head_dim)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        slots = kv_slots(block_tables[i : i + 1], seq_lens[i : i + 1], block_size, seq_len)[0]  # [seq_len]
        keys = k_flat[slots].float().repeat_interleave(group, dim=1)  # [seq_len, n_heads, head_dim]
        values = v_flat[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [n_heads, q_len, seq_len]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(q_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos < seq_len - q_len + query_pos + 1  # [q_len, seq_len]
        if window > 0:
            visible &= key_pos > seq_len - q_len + query_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


# Bisection steps of the top-p floor: bit patterns of floats in [0, 1] span fewer than 2^31 values, so 31
# halvings end on the exact floor.
HALVINGS = 31


def top_p_floor_torch(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs fp32 [rows, vocab], top_p fp32 [rows] -> the smallest probability each row keeps: token i stays
    when the mass strictly above p_i is below top_p, which holds exactly for p_i >= one floor, itself one of
    the row's probabilities. Found by bisection on the float bits (positive floats order as their bit
    patterns), each step a masked sum: no sort. 0 where top_p is 1."""
    rows = probs.shape[0]
    lo = torch.zeros(rows, dtype=torch.int32, device=probs.device)  # mass above 0 is everything: >= top_p
    hi = probs.amax(dim=-1).view(torch.int32)  # mass above the largest is 0: < top_p
    for _ in range(HALVINGS):
        mid = lo + (hi - lo) // 2
        mass = torch.where(probs > mid.view(torch.float32)[:, None], probs, 0.0).sum(dim=-1)
        below = mass < top_p
        hi = torch.where(below, mid, hi)
        lo = torch.where(below, lo, mid)
    return torch.where(top_p < 1.0, hi.view(torch.float32), 0.0)
