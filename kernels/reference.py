"""Pure-torch paged attention: the definition every kernel is checked against, written to be
obviously right. Slot of position p = block_table[p // block_size] * block_size + p % block_size.
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


def kv_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, width: int
) -> torch.Tensor:
    """int64 [seqs, width] pool slots; out-of-range positions point at the last key, never
    elsewhere.
    """
    pos = torch.arange(width, device=block_tables.device)
    blocks = block_tables.to(torch.int64)[
        :, (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    ]
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
    sinks: torch.Tensor | None = None,  # [n_heads]: one more logit a head, which adds no value
) -> torch.Tensor:
    """Causal attention of new queries over paged keys, with window, softcap and sinks ->
    [tokens, heads, head_dim].
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
        # [seq_len]
        slots = kv_slots(block_tables[i : i + 1], seq_lens[i : i + 1], block_size, seq_len)[0]
        keys = k_flat[slots].float().repeat_interleave(group, dim=1)  # [seq_len, n_heads, head_dim]
        values = v_flat[slots].float().repeat_interleave(group, dim=1)
        # [n_heads, q_len, seq_len]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(q_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos < seq_len - q_len + query_pos + 1  # [q_len, seq_len]
        if window > 0:
            visible &= key_pos > seq_len - q_len + query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(n_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


# Floats in [0, 1] span under 2^31 bit patterns, so 31 halvings end on the exact floor.
HALVINGS = 31


def top_p_floor_torch(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest kept probability under top_p, by bisection on float bits (no sort)."""
    rows = probs.shape[0]
    # mass above 0 is everything: >= top_p
    lo = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    hi = probs.amax(dim=-1).view(torch.int32)  # mass above the largest is 0: < top_p
    for _ in range(HALVINGS):
        mid = lo + (hi - lo) // 2
        mass = torch.where(probs > mid.view(torch.float32)[:, None], probs, 0.0).sum(dim=-1)
        below = mass < top_p
        hi = torch.where(below, mid, hi)
        lo = torch.where(below, lo, mid)
    return torch.where(top_p < 1.0, hi.view(torch.float32), 0.0)
