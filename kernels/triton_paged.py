"""The Triton kernels over the paged KV pool (launched by kernels/triton_attention.py). Loads past a
length or padded head dim are masked; block ids are widened to int64 before multiplying a stride.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Metadata pointers are not specialized on alignment (it varies step to step and would recompile);
# the pool, q and outputs are, since wide loads need it.
METADATA_POINTERS = {
    "write_kv_kernel": ["slot_ptr"],
    "decode_split_kernel": ["block_tables_ptr", "seq_lens_ptr"],
    "decode_reduce_kernel": ["seq_lens_ptr", "sinks_ptr"],
    "prefill_kernel": [
        "block_tables_ptr",
        "seq_lens_ptr",
        "q_starts_ptr",
        "q_ends_ptr",
        "sinks_ptr",
    ],
}

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


@triton.jit(do_not_specialize_on_alignment=METADATA_POINTERS["write_kv_kernel"])
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    block_size,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    limit = tl.where(slot >= 0, head_dim, 0)  # a padding slot (-1) masks every lane
    slot = tl.maximum(slot, 0)
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = d < limit
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + d * stride_cd
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_offsets(
    block_tables_ptr,
    seq,
    pos,
    pos_mask,
    kv_head,
    d,
    stride_bts,
    stride_btb,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
):
    """Pool offsets [TILE, BLOCK_D] of positions `pos` through the block table (int64 block ids)."""
    block = tl.load(
        block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb,
        mask=pos_mask,
        other=0,
    )
    block = block.to(tl.int64)
    within = pos % BLOCK_SIZE
    return (
        block[:, None] * stride_cb
        + within[:, None] * stride_cs
        + kv_head * stride_ch
        + d[None, :] * stride_cd
    )


@triton.jit
def _attend_tile(
    q, k, v, visible, m, denom, acc, scale, softcap, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr
):
    """Fold a tile of keys and values into the running max, sum and output."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, TILE]
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflowing to inf gives 1)
    if SOFTCAP:
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # a row with no key yet keeps m = -inf: subtract 0, not exp(-inf + inf) = NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


# Step-varying integers are not specialized: a value becoming 1 or a multiple of 16 would recompile
# (0.5-2 s stalls). The rest is fixed per model and warmed at start.
STEP_VARYING = {
    "decode_split_kernel": [
        "stride_bts",
        "stride_mos",
        "stride_moh",
        "stride_mop",
        "stride_mls",
        "stride_mlh",
        "split_len",
    ],
    "decode_reduce_kernel": [
        "stride_mos",
        "stride_moh",
        "stride_mop",
        "stride_mls",
        "stride_mlh",
        "split_len",
    ],
    "prefill_kernel": ["stride_bts"],
}


@triton.jit(
    do_not_specialize=STEP_VARYING["decode_split_kernel"],
    do_not_specialize_on_alignment=METADATA_POINTERS["decode_split_kernel"],
)
def decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bts,
    stride_btb,
    stride_mos,
    stride_moh,
    stride_mop,
    stride_mod,
    stride_mls,
    stride_mlh,
    stride_mlp,
    head_dim,
    group,
    split_len,
    window,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    # one function: a Triton kernel, one program's work
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # a sliding window's first key
    start = first + split * split_len
    if start < seq_len:
        end = tl.minimum(start + split_len, seq_len)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_mask = g < group
        d_mask = d < head_dim
        heads = kv_head * group + g  # the query heads that share this KV head
        # [BLOCK_G, BLOCK_D]
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        offs = tl.arange(0, TILE)  # a tile spans TILE // BLOCK_SIZE pages
        for pos0 in range(start, end, TILE):
            pos = pos0 + offs
            pos_mask = pos < end
            kv_off = _tile_offsets(
                block_tables_ptr,
                seq,
                pos,
                pos_mask,
                kv_head,
                d,
                stride_bts,
                stride_btb,
                stride_cb,
                stride_cs,
                stride_ch,
                stride_cd,
                BLOCK_SIZE,
            )
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            # [TILE, BLOCK_D], in the queries' dtype (a pool narrower than the model's widens here)
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            m, denom, acc = _attend_tile(
                q, k, v, pos_mask[None, :], m, denom, acc, scale, softcap, PRECISION, SOFTCAP
            )
        out = acc / denom[:, None]
        o_off = (
            seq * stride_mos
            + heads[:, None] * stride_moh
            + split * stride_mop
            + d[None, :] * stride_mod
        )
        tl.store(mid_o_ptr + o_off, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(
            mid_lse_ptr + seq * stride_mls + heads * stride_mlh + split * stride_mlp,
            m + tl.log(denom),
            mask=g_mask,
        )


@triton.jit(
    do_not_specialize=STEP_VARYING["decode_reduce_kernel"],
    do_not_specialize_on_alignment=METADATA_POINTERS["decode_reduce_kernel"],
)
def decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    sinks_ptr,
    stride_mos,
    stride_moh,
    stride_mop,
    stride_mod,
    stride_mls,
    stride_mlh,
    stride_mlp,
    stride_ot,
    stride_oh,
    stride_od,
    head_dim,
    split_len,
    window,
    BLOCK_D: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    num_splits = tl.cdiv(seq_len - first, split_len)  # only splits that were written are read
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    # SPLIT_TILE splits at a time: their log-sum-exps as one vector, their partial outputs as one
    # tile
    for s0 in range(0, num_splits, SPLIT_TILE):
        splits = s0 + tl.arange(0, SPLIT_TILE)
        s_mask = splits < num_splits
        lse = tl.load(
            mid_lse_ptr + seq * stride_mls + head * stride_mlh + splits * stride_mlp,
            mask=s_mask,
            other=float("-inf"),
        )
        o = tl.load(
            mid_o_ptr
            + seq * stride_mos
            + head * stride_moh
            + splits[:, None] * stride_mop
            + d[None, :] * stride_mod,
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # finite: every tile holds at least one written split
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)  # 0 for the masked splits
        acc = acc * alpha + tl.sum(o * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    if HAS_SINKS:  # gpt-oss: one more logit a head, its probability dropped
        denom += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d * stride_od,
        (acc / denom).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )
