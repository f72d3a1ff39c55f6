"""The Triton prefill kernel over the paged KV pool: variable-length causal attention of prompt
chunks over block tables, a cached prefix included (launched by kernels/triton_attention.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_paged import LOG2E, METADATA_POINTERS, STEP_VARYING


@triton.jit
def _prefill_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq,
    kv_head,
    pos0,
    kv_end,
    causal,
    d,
    d_mask,
    m,
    denom,
    acc,
    qk_scale,
    softcap,
    window,
    stride_bts,
    stride_btb,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    POOL_I32: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """One key tile in base-2 units; MASKED only where it crosses the diagonal, end or window."""
    pos = pos0 + tl.arange(0, TILE)
    pos_mask = pos < kv_end
    if MASKED:
        block = tl.load(
            block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb,
            mask=pos_mask,
            other=0,
        )
    else:
        block = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb)
    if not POOL_I32:
        block = block.to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [TILE]
    kv_off = row[:, None] + d[None, :] * stride_cd  # [TILE, BLOCK_D]
    if MASKED:
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    elif EVEN_D:  # inside the sequence and a whole head: nothing to mask
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    else:
        k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a pool narrower than the model's widens here
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, TILE], unscaled
    # softcap * tanh(s * scale / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1); then into base 2
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s * (qk_scale / LOG2E) / softcap) + 1.0)) * LOG2E
    else:
        s = s * qk_scale
    if MASKED:
        # a row's last visible key lies before kv_end for every stored row
        visible = pos[None, :] <= causal[:, None]
        if SLIDING:
            visible = visible & (pos[None, :] > causal[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row that has seen no key yet (its window starts past this tile) keeps m = -inf:
        if SLIDING:
            # subtract 0 then, so it stays at zero weight instead of exp(-inf + inf) = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # causal only: the first masked tile holds key 0 or follows an unmasked one, so m is finite
        else:
            m_safe = m_new
    else:  # every row sees every key of the tile: the new max is finite
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit(
    do_not_specialize=STEP_VARYING["prefill_kernel"],
    do_not_specialize_on_alignment=METADATA_POINTERS["prefill_kernel"],
)
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    q_starts_ptr,
    q_ends_ptr,
    sinks_ptr,
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
    stride_ot,
    stride_oh,
    stride_od,
    head_dim,
    group,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
    EVEN_D: tl.constexpr = False,
    POOL_I32: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    # one function: a Triton kernel, one program's work
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    # the last query tiles see the most keys: launched first, short ones fill the tail
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    # the sequence's query tokens: [start, end) of the step
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    q_len = (tl.load(q_ends_ptr + seq) - q_start).to(tl.int32)
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len  # keys already in the pool before this step's queries
        # 32-bit: the pool offsets stay 32-bit where POOL_I32 allows
        kv_head = tl.program_id(1) // group
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        row_mask = rows < q_len
        d_mask = d < head_dim
        # [BLOCK_M, BLOCK_D]
        q = tl.load(
            q_ptr
            + (q_start + rows)[:, None] * stride_qt
            + head * stride_qh
            + d[None, :] * stride_qd,
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        qk_scale = scale * LOG2E
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        causal = prefix + rows  # each row's last visible key
        # the causal limit of this tile's last row
        kv_end = prefix + tl.minimum(q_len, (tile + 1) * BLOCK_M)
        # keys up to the first row's own are seen by every row: whole tiles unmasked. Under a window
        # none are; the first row sees keys from prefix + tile * BLOCK_M - window + 1 on
        if SLIDING:
            kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
            full_end = kv_start
        else:
            kv_start = 0
            full_end = ((prefix + tile * BLOCK_M + 1) // TILE) * TILE
        for pos0 in range(kv_start, full_end, TILE):
            m, denom, acc = _prefill_tile(
                q,
                k_cache_ptr,
                v_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos0,
                kv_end,
                causal,
                d,
                d_mask,
                m,
                denom,
                acc,
                qk_scale,
                softcap,
                window,
                stride_bts,
                stride_btb,
                stride_cb,
                stride_cs,
                stride_ch,
                stride_cd,
                BLOCK_SIZE,
                TILE,
                False,
                EVEN_D,
                PRECISION,
                SOFTCAP,
                POOL_I32,
                SLIDING,
            )
        for pos0 in range(full_end, kv_end, TILE):
            m, denom, acc = _prefill_tile(
                q,
                k_cache_ptr,
                v_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos0,
                kv_end,
                causal,
                d,
                d_mask,
                m,
                denom,
                acc,
                qk_scale,
                softcap,
                window,
                stride_bts,
                stride_btb,
                stride_cb,
                stride_cs,
                stride_ch,
                stride_cd,
                BLOCK_SIZE,
                TILE,
                True,
                EVEN_D,
                PRECISION,
                SOFTCAP,
                POOL_I32,
                SLIDING,
            )
        if HAS_SINKS:  # gpt-oss: one more logit a row (base 2 here), its probability dropped
            denom += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * LOG2E - m)
        # rows past q_len in a window see no key (denom 0): not stored, not divided
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(
            out_ptr
            + (q_start + rows)[:, None] * stride_ot
            + head * stride_oh
            + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
