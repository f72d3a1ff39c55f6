"""The Triton kernels over the paged KV pool (kernels/triton_attention.py launches them): K/V written at
slots, split-KV decode and its log-sum-exp merge, and variable-length prefill over block tables. Every
load past a sequence's length or a padded head dimension is masked; block ids are widened to int64 before
they multiply a stride."""

from __future__ import annotations

import triton
import triton.language as tl

# Pointers to a step's small metadata arrays (read a value a program) are not specialized on alignment either:
# they come packed from the staging buffer or sliced (query_start_loc[1:]), 16-byte aligned on some steps and
# not others, and each change would compile the kernel again. The K/V pool, q and the outputs stay
# specialized: they are always whole allocations or row views of one, and wide loads need the alignment.
METADATA_POINTERS = {
    "write_kv_kernel": ["slot_ptr"],
    "decode_split_kernel": ["block_tables_ptr", "seq_lens_ptr"],
    "decode_reduce_kernel": ["seq_lens_ptr"],
    "prefill_kernel": ["block_tables_ptr", "seq_lens_ptr", "q_starts_ptr", "q_ends_ptr"],
}


@triton.jit(do_not_specialize_on_alignment=METADATA_POINTERS["write_kv_kernel"])
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    block_size, head_dim,
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
def _tile_offsets(block_tables_ptr, seq, pos, pos_mask, kv_head, d,
                  stride_bts, stride_btb, stride_cb, stride_cs, stride_ch, stride_cd,
                  BLOCK_SIZE: tl.constexpr):
    """Pool offsets [TILE, BLOCK_D] of key positions `pos` of one sequence, through its block table.
    Table entries are read only for positions inside the sequence; block ids are widened to int64."""
    block = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb, mask=pos_mask,
                    other=0)
    block = block.to(tl.int64)
    within = pos % BLOCK_SIZE
    return (block[:, None] * stride_cb + within[:, None] * stride_cs + kv_head * stride_ch
            + d[None, :] * stride_cd)


@triton.jit
def _attend_tile(q, k, v, visible, m, denom, acc, scale, softcap, PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One online-softmax step: fold a tile of keys/values into the running max, denominator and output.
    q [rows, D], k and v [TILE, D], visible [rows or 1, TILE]. SOFTCAP: scores become softcap * tanh(s /
    softcap) (Gemma 2), before the mask."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, TILE]
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflowing to inf gives 1)
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # a row that has seen no key yet (a sliding window starting past this tile) keeps m = -inf: subtract 0
    # then, so it stays at zero weight instead of exp(-inf + inf) = NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


# Integer arguments that change from step to step are not specialized: Triton would otherwise compile a
# new variant whenever one of them becomes 1 or a multiple of 16 (0.5-2 s stalls while serving). What
# remains specialized is fixed for a model and block size, and the worker warms it at start.
STEP_VARYING = {
    "decode_split_kernel": ["stride_bts", "stride_mos", "stride_moh", "stride_mop", "stride_mls",
                             "stride_mlh", "split_len"],
    "decode_reduce_kernel": ["stride_mos", "stride_moh", "stride_mop", "stride_mls", "stride_mlh",
                              "split_len"],
    "prefill_kernel": ["stride_bts"],
}


@triton.jit(do_not_specialize=STEP_VARYING["decode_split_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["decode_split_kernel"])
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    scale, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bts, stride_btb,
    stride_mos, stride_moh, stride_mop, stride_mod,
    stride_mls, stride_mlh, stride_mlp,
    head_dim, group, split_len, window,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
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
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        offs = tl.arange(0, TILE)  # a tile spans TILE // BLOCK_SIZE pages
        for pos0 in range(start, end, TILE):
            pos = pos0 + offs
            pos_mask = pos < end
            kv_off = _tile_offsets(block_tables_ptr, seq, pos, pos_mask, kv_head, d,
                                   stride_bts, stride_btb, stride_cb, stride_cs, stride_ch, stride_cd,
                                   BLOCK_SIZE)
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            # [TILE, BLOCK_D], in the queries' dtype (a pool narrower than the model's widens here)
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            m, denom, acc = _attend_tile(q, k, v, pos_mask[None, :], m, denom, acc, scale, softcap, PRECISION,
                                         SOFTCAP)
        out = acc / denom[:, None]
        o_off = seq * stride_mos + heads[:, None] * stride_moh + split * stride_mop + d[None, :] * stride_mod
        tl.store(mid_o_ptr + o_off, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse_ptr + seq * stride_mls + heads * stride_mlh + split * stride_mlp, m + tl.log(denom),
                 mask=g_mask)


@triton.jit(do_not_specialize=STEP_VARYING["decode_reduce_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["decode_reduce_kernel"])
def decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr,
    stride_mos, stride_moh, stride_mop, stride_mod,
    stride_mls, stride_mlh, stride_mlp,
    stride_ot, stride_oh, stride_od,
    head_dim, split_len, window,
    BLOCK_D: tl.constexpr, SPLIT_TILE: tl.constexpr,
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
    # SPLIT_TILE splits at a time: their log-sum-exps as one vector, their partial outputs as one tile
    for s0 in range(0, num_splits, SPLIT_TILE):
        splits = s0 + tl.arange(0, SPLIT_TILE)
        s_mask = splits < num_splits
        lse = tl.load(mid_lse_ptr + seq * stride_mls + head * stride_mlh + splits * stride_mlp, mask=s_mask,
                      other=float("-inf"))
        o = tl.load(mid_o_ptr + seq * stride_mos + head * stride_moh + splits[:, None] * stride_mop
                    + d[None, :] * stride_mod, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: every tile holds at least one written split
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)  # 0 for the masked splits
        acc = acc * alpha + tl.sum(o * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d * stride_od,
             (acc / denom).to(out_ptr.dtype.element_ty), mask=d_mask)


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


@triton.jit
def _prefill_tile(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos0, kv_end, causal, d,
                  d_mask, m, denom, acc, qk_scale, softcap, window,
                  stride_bts, stride_btb, stride_cb, stride_cs, stride_ch, stride_cd,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                  PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, POOL_I32: tl.constexpr,
                  SLIDING: tl.constexpr):
    """One key tile of the prefill kernel, in base-2 units: m is the running max of scores x log2(e) x scale.
    MASKED: the tile crosses the causal diagonal, the sequence's end or a sliding window's lower edge (causal
    is each row's last visible key); unmasked tiles are seen whole by every row, and pay for no comparison.
    POOL_I32: the pool has fewer than 2**31 elements, so offsets into it fit 32 bits."""
    pos = pos0 + tl.arange(0, TILE)
    pos_mask = pos < kv_end
    if MASKED:
        block = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb, mask=pos_mask,
                        other=0)
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
    if SOFTCAP:  # softcap * tanh(s * scale / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1); then into base 2
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s * (qk_scale / LOG2E) / softcap) + 1.0)) * LOG2E
    else:
        s = s * qk_scale
    if MASKED:
        # a row's last visible key lies before kv_end for every stored row (rows past q_len are never stored)
        visible = pos[None, :] <= causal[:, None]
        if SLIDING:
            visible = visible & (pos[None, :] > causal[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if SLIDING:  # a row that has seen no key yet (its window starts past this tile) keeps m = -inf:
            # subtract 0 then, so it stays at zero weight instead of exp(-inf + inf) = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # causal only: the first masked tile holds key 0 or follows an unmasked one, so m is finite
            m_safe = m_new
    else:  # every row sees every key of the tile: the new max is finite
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit(do_not_specialize=STEP_VARYING["prefill_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["prefill_kernel"])
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, q_starts_ptr, q_ends_ptr,
    scale, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    head_dim, group, window,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False, EVEN_D: tl.constexpr = False,
    POOL_I32: tl.constexpr = False, SLIDING: tl.constexpr = False,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    # the last query tiles see the most keys: they are launched first, so the short ones fill the tail
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    # the sequence's query tokens: [start, end) of the step
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    q_len = (tl.load(q_ends_ptr + seq) - q_start).to(tl.int32)
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len  # keys already in the pool before this step's queries
        kv_head = tl.program_id(1) // group  # 32-bit: the pool offsets stay 32-bit where POOL_I32 allows
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        row_mask = rows < q_len
        d_mask = d < head_dim
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        qk_scale = scale * LOG2E
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        causal = prefix + rows  # each row's last visible key
        kv_end = prefix + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # the causal limit of this tile's last row
        # keys up to the first row's own are seen by every row of the tile: whole tiles of them go unmasked.
        # Under a sliding window (whose lower edge moves with the row) none do, and the tile's first row sees
        # keys from prefix + tile * BLOCK_M - window + 1 on
        if SLIDING:
            kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
            full_end = kv_start
        else:
            kv_start = 0
            full_end = ((prefix + tile * BLOCK_M + 1) // TILE) * TILE
        for pos0 in range(kv_start, full_end, TILE):
            m, denom, acc = _prefill_tile(
                q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos0, kv_end, causal, d, d_mask,
                m, denom, acc, qk_scale, softcap, window,
                stride_bts, stride_btb, stride_cb, stride_cs, stride_ch, stride_cd,
                BLOCK_SIZE, TILE, False, EVEN_D, PRECISION, SOFTCAP, POOL_I32, SLIDING)
        for pos0 in range(full_end, kv_end, TILE):
            m, denom, acc = _prefill_tile(
                q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos0, kv_end, causal, d, d_mask,
                m, denom, acc, qk_scale, softcap, window,
                stride_bts, stride_btb, stride_cb, stride_cs, stride_ch, stride_cd,
                BLOCK_SIZE, TILE, True, EVEN_D, PRECISION, SOFTCAP, POOL_I32, SLIDING)
        # rows past q_len in a sliding window see no key (denom 0): they are not stored, and not divided by 0
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
