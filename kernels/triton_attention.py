"""Triton kernels over the paged KV pool: write K/V at slots, and paged attention.

- `write_kv`: one program per (token, KV head) stores the token's K and V at its slot; slot -1 is
  padding and stores nothing.
- `paged_attention`: one entry point. When every sequence has one query (decode) it runs the split-KV
  (flash-decoding) kernel: one program per (sequence, KV head, split) holds all the query heads that
  share that KV head, so each KV tile is read once, then a second kernel merges the splits by their
  log-sum-exp. Otherwise it runs the variable-length prefill/extend kernel: one program per
  (sequence, query head, tile of queries), walking the block table up to the causal limit, so chunked
  prefill over a cached prefix and mixed batches need nothing special.

Every load outside a sequence's length or a padded head dimension is masked (never-written or poisoned
bytes are not read), block ids are widened to int64 before they multiply a stride, and non-power-of-two
head dims and GQA ratios are padded to the next power of two and masked.
Runs natively on CUDA and on the CPU under TRITON_INTERPRET=1 (fp32/fp16; the interpreter mishandles
bf16 dots).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Pointers to a step's small metadata arrays (read a value a program) are not specialized on alignment either:
# they come packed from the staging buffer or sliced (query_start_loc[1:]), 16-byte aligned on some steps and
# not others, and each change would compile the kernel again. The K/V pool, q and the outputs stay
# specialized: they are always whole allocations or row views of one, and wide loads need the alignment.
METADATA_POINTERS = {
    "_write_kv_kernel": ["slot_ptr"],
    "_decode_split_kernel": ["block_tables_ptr", "seq_lens_ptr"],
    "_decode_reduce_kernel": ["seq_lens_ptr"],
    "_prefill_kernel": ["block_tables_ptr", "seq_lens_ptr", "q_starts_ptr", "q_ends_ptr"],
}


@triton.jit(do_not_specialize_on_alignment=METADATA_POINTERS["_write_kv_kernel"])
def _write_kv_kernel(
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
    "_decode_split_kernel": ["stride_bts", "stride_mos", "stride_moh", "stride_mop", "stride_mls",
                             "stride_mlh", "split_len"],
    "_decode_reduce_kernel": ["stride_mos", "stride_moh", "stride_mop", "stride_mls", "stride_mlh",
                              "split_len"],
    "_prefill_kernel": ["stride_bts"],
}


@triton.jit(do_not_specialize=STEP_VARYING["_decode_split_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["_decode_split_kernel"])
def _decode_split_kernel(
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


@triton.jit(do_not_specialize=STEP_VARYING["_decode_reduce_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["_decode_reduce_kernel"])
def _decode_reduce_kernel(
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


@triton.jit(do_not_specialize=STEP_VARYING["_prefill_kernel"],
            do_not_specialize_on_alignment=METADATA_POINTERS["_prefill_kernel"])
def _prefill_kernel(
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


# --- launchers ---------------------------------------------------------------------------------------

def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 dots in full precision (the GPU default would be tf32); half types keep the default."""
    return "ieee" if dtype == torch.float32 else None


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


# Launch configurations. On a GPU the key tile is capped whatever the page size (a tile is gathered key by
# key through the block table, so it need not span whole pages): at --block-size 256 a 256-key tile held
# [256, head_dim] K and V in registers and spilled kilobytes a thread. Warps grow with head_dim so that no
# kernel spills at d64/d128/d256 (`make gpu-compile-report` compiles them all for sm_90 and counts).
# In the interpreter a tile is two pages, so the tests cover tiles that span pages.
# OVERRIDES lets deploy/bench/kernels.py --sweep time other configurations; the worker never sets it.
OVERRIDES: dict[str, dict] = {}


def override(kind: str, config: dict) -> None:
    """Launch the decode or prefill kernel with these tiles, warps and stages from now on (a sweep's next
    configuration), the variants compiled for the last one forgotten."""
    OVERRIDES[kind] = config
    (_decode_split_kernel if kind == "decode" else _prefill_kernel).device_caches.clear()


def decode_config(head_dim: int, group: int, block_size: int, on_gpu: bool) -> dict:
    """Constexprs and launch options of _decode_split_kernel. Chosen on an H100 (deploy/bench/kernels.py
    --sweep, docs/BENCHMARKS.md) among the configurations that spill under no Triton release we build with."""
    block_d = _pow2(head_dim, 16)
    if not on_gpu:
        return dict(TILE=2 * block_size, BLOCK_D=block_d, BLOCK_G=_pow2(group, 16))
    if block_d <= 64:
        cfg = dict(TILE=64, num_warps=4, num_stages=3)
    elif block_d <= 128:  # 64-key tiles at 4 warps spill 144 bytes a thread under newer Triton compilers
        cfg = dict(TILE=32, num_warps=4, num_stages=3)
    else:
        cfg = dict(TILE=32, num_warps=8, num_stages=2)
    return {**cfg, "BLOCK_D": block_d, "BLOCK_G": _pow2(group, 16), **OVERRIDES.get("decode", {})}


def prefill_config(head_dim: int, block_size: int, on_gpu: bool) -> dict:
    """Constexprs and launch options of _prefill_kernel, chosen on an H100 (deploy/bench/kernels.py --sweep,
    docs/BENCHMARKS.md) among the configurations that spill under no Triton release we build with. The kernel
    is bound by its matrix products: up to head_dim 128, 64-row query tiles on one warpgroup (4 warps, one
    64-row wgmma) against 64-key tiles run at 0.71x flash SDPA at d128 and 0.94x at d64, as fast as 128 x 128
    tiles on two warpgroups at d128 and far faster at d64."""
    block_d = _pow2(head_dim, 16)
    if not on_gpu:
        return dict(BLOCK_M=16, TILE=2 * block_size, BLOCK_D=block_d)
    if block_d <= 128:
        cfg = dict(BLOCK_M=64, TILE=64, num_warps=4, num_stages=2)
    else:  # [64, 256] queries against 32-key tiles on 8 warps; 4 warps or 64-key tiles spill at d256
        cfg = dict(BLOCK_M=64, TILE=32, num_warps=8, num_stages=2)
    return {**cfg, "BLOCK_D": block_d, **OVERRIDES.get("prefill", {})}


def reduce_config(head_dim: int, on_gpu: bool) -> dict:
    return dict(BLOCK_D=_pow2(head_dim, 16), SPLIT_TILE=16, **(dict(num_warps=4) if on_gpu else {}))


def write_kv(
    k: torch.Tensor,  # [num_tokens, n_kv_heads, head_dim], may be a strided view
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; -1 writes nothing
) -> None:
    num_tokens, n_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    _write_kv_kernel[(num_tokens, n_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        k_cache.shape[1], head_dim,
        BLOCK_D=_pow2(head_dim),
    )


def decode_workspace(num_seqs: int, n_heads: int, num_splits: int, head_dim: int,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the split results: partial outputs and their log-sum-exp (never read unwritten)."""
    mid_o = torch.empty((num_seqs, n_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((num_seqs, n_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The GPU's SM count, asked once (the properties query is not free, and this runs every step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# Keys a decode program attends at most on a GPU: a long sequence among short ones is split into many
# programs by its own length, not held to the batch's split count (one 8k sequence would otherwise run
# in one program while the rest of the GPU waits for it).
MAX_SPLIT_KEYS = 512
MAX_SPLITS = 1024  # past MAX_SPLIT_KEYS x MAX_SPLITS keys the splits grow instead


def default_num_splits(num_seqs: int, n_kv_heads: int, max_seq_len: int, block_size: int, device) -> int:
    """Splits of the longest sequence: at least enough programs to fill the GPU, and no split longer than
    MAX_SPLIT_KEYS keys; never more splits than blocks."""
    max_splits = triton.cdiv(max_seq_len, block_size)
    if device.type != "cuda":
        return min(2, max_splits)  # the interpreter: keep it small
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    to_fill = triton.cdiv(2 * sms, max(1, num_seqs * n_kv_heads))
    by_length = triton.cdiv(max_seq_len, MAX_SPLIT_KEYS)
    return max(1, min(max(to_fill, by_length), max_splits, MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    max_seq_len: int | None = None,  # pass it to avoid a device sync
    max_q_len: int | None = None,
    num_splits: int | None = None,
    decode_seqs: torch.Tensor | None = None,  # int64 [d]: in a mixed step, the sequences that decode...
    prefill_seqs: torch.Tensor | None = None,  # int64 [p]: ...and those with more than one query token
    workspace: dict | None = None,  # kept by the caller across a step's layers: split scratch allocated once
    # decode_seqs and prefill_seqs already gathered (split_mixed), once a step
    mixed: MixedStep | None = None,
    window: int = 0,  # > 0: a sliding-window layer (each query sees its last `window` keys)
    softcap: float = 0.0,  # > 0: scores soft-capped, softcap * tanh(s / softcap) (Gemma 2)
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention. Returns [num_tokens, n_heads, head_dim].

    A step of decodes only runs the split-KV decode kernels; one of prompt chunks only, the prefill kernel.
    A mixed step (chunked prefill admits prompts beside running decodes) given decode_seqs and prefill_seqs
    (built on the host from the plan, so no sync) sends each kind to its own kernel: decode rows get
    split-KV and GQA heads packed into one program instead of one row of a 64-row prefill tile each."""
    num_tokens, n_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    if num_tokens == num_seqs:  # every sequence decodes one token
        _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits, out, workspace,
                window, softcap)
        return out
    if mixed is None and decode_seqs is not None and prefill_seqs is not None and decode_seqs.numel():
        mixed = split_mixed(block_tables, seq_lens, query_start_loc, decode_seqs, prefill_seqs)
    if mixed is not None:
        dec_out = torch.empty((mixed.decode_rows.shape[0], n_heads, head_dim), dtype=q.dtype, device=q.device)
        _decode(q[mixed.decode_rows], k_cache, v_cache, mixed.decode_tables, mixed.decode_lens, scale,
                max_seq_len, num_splits, dec_out, workspace, window, softcap)
        out[mixed.decode_rows] = dec_out
        if mixed.prefill_lens.numel():
            _prefill(q, k_cache, v_cache, mixed.prefill_tables, mixed.prefill_lens, mixed.prefill_starts,
                     mixed.prefill_ends, scale, max_q_len, out, window, softcap)
        return out
    _prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc[:-1], query_start_loc[1:], scale,
             max_q_len, out, window, softcap)
    return out


@dataclass
class MixedStep:
    """A mixed step's decode rows and prompt chunks, gathered once per step (every layer reuses them)."""

    decode_rows: torch.Tensor  # int64 [d]: each decoding sequence's query token
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefill_tables: torch.Tensor
    prefill_lens: torch.Tensor
    prefill_starts: torch.Tensor
    prefill_ends: torch.Tensor


def split_mixed(block_tables, seq_lens, query_start_loc, decode_seqs, prefill_seqs) -> MixedStep:
    return MixedStep(
        decode_rows=query_start_loc[decode_seqs].to(torch.int64), decode_tables=block_tables[decode_seqs],
        decode_lens=seq_lens[decode_seqs], prefill_tables=block_tables[prefill_seqs],
        prefill_lens=seq_lens[prefill_seqs], prefill_starts=query_start_loc[prefill_seqs],
        prefill_ends=query_start_loc[prefill_seqs + 1])


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits, out,
            workspace: dict | None = None, window: int = 0, softcap: float = 0.0) -> None:
    num_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if window > 0:  # a sliding-window layer reads at most `window` keys of any sequence
        max_seq_len = min(max_seq_len, window)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, n_kv_heads, max_seq_len, block_size, q.device)
    cfg = decode_config(head_dim, group, block_size, _on_gpu(q.device))
    tile = cfg["TILE"]
    split_len = tile * triton.cdiv(triton.cdiv(max_seq_len, num_splits), tile)  # whole tiles per split
    num_splits = triton.cdiv(max_seq_len, split_len)
    key = (num_seqs, n_heads, num_splits, head_dim)
    if workspace is not None and workspace.get("key") == key:  # every layer of a step has the same shape
        mid_o, mid_lse = workspace["scratch"]
    else:
        mid_o, mid_lse = decode_workspace(num_seqs, n_heads, num_splits, head_dim, q.device)
        if workspace is not None:
            workspace["key"], workspace["scratch"] = key, (mid_o, mid_lse)
    _decode_split_kernel[(num_seqs, n_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scale, float(softcap),
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *mid_o.stride(), *mid_lse.stride(),
        head_dim, group, split_len, window,
        BLOCK_SIZE=block_size, PRECISION=_precision(q.dtype), SOFTCAP=softcap > 0, **cfg,
    )
    _decode_reduce_kernel[(num_seqs, n_heads)](
        mid_o, mid_lse, out, seq_lens,
        *mid_o.stride(), *mid_lse.stride(), *out.stride(),
        head_dim, split_len, window,
        **reduce_config(head_dim, _on_gpu(q.device)),
    )


def _prefill(q, k_cache, v_cache, block_tables, seq_lens, q_starts, q_ends, scale, max_q_len, out,
             window: int = 0, softcap: float = 0.0) -> None:
    _, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    if max_q_len is None:
        max_q_len = int((q_ends - q_starts).max())
    cfg = dict(EVEN_D=head_dim == _pow2(head_dim, 16), POOL_I32=k_cache.numel() < 2**31,
               **prefill_config(head_dim, block_size, _on_gpu(q.device)))
    _prefill_kernel[(seq_lens.shape[0], n_heads, triton.cdiv(max_q_len, cfg["BLOCK_M"]))](
        q, k_cache, v_cache, out, block_tables, seq_lens, q_starts, q_ends, scale, float(softcap),
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(),
        head_dim, n_heads // n_kv_heads, window,
        BLOCK_SIZE=block_size, PRECISION=_precision(q.dtype), SOFTCAP=softcap > 0, SLIDING=window > 0, **cfg,
    )


# --- what `make gpu-compile-report` compiles ------------------------------------------------------------

def launch_cases(head_dims, block_sizes, dtype: str = "bf16") -> list[dict]:
    """Each attention kernel at the GPU configuration its launcher picks, for each head_dim and block size:
    the argument types, constexprs and options kernels/compile_report.py compiles them with."""
    ptr = f"*{dtype}"
    cases = []

    def types(fn, pointers: dict, floats=("scale", "softcap")):
        return {n: pointers.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}

    def unit(fn):  # the strides that are 1 at every launch: the runtime compiles them in as constants
        return {
            n: 1 for n in _UNIT_STRIDES if n in fn.arg_names and n not in STEP_VARYING.get(fn.__name__, ())}

    for head_dim in head_dims:
        for block_size in block_sizes:
            for group in (4, 8):
                cfg = decode_config(head_dim, group, block_size, True)
                options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
                cases.append(dict(
                    name=f"decode_split d{head_dim} b{block_size} g{group}", fn=_decode_split_kernel,
                    signature=types(_decode_split_kernel, dict(
                        q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
                        seq_lens_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32")),
                    constexprs=dict(BLOCK_SIZE=block_size, PRECISION=None, SOFTCAP=False,
                                    **unit(_decode_split_kernel), **cfg),
                    aligned=_ALIGNED, **options))
            cfg = prefill_config(head_dim, block_size, True)
            options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            cases.append(dict(
                name=f"prefill d{head_dim} b{block_size}", fn=_prefill_kernel,
                signature=types(_prefill_kernel, dict(
                    q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, out_ptr=ptr, block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", q_starts_ptr="*i32", q_ends_ptr="*i32")),
                constexprs=dict(BLOCK_SIZE=block_size, PRECISION=None, SOFTCAP=False,
                                EVEN_D=head_dim == cfg["BLOCK_D"],
                                POOL_I32=True, SLIDING=False, **unit(_prefill_kernel), **cfg),
                aligned=_ALIGNED, **options))
        cfg = reduce_config(head_dim, True)
        options = dict(num_warps=cfg.pop("num_warps"), num_stages=3)
        cases.append(dict(
            name=f"decode_reduce d{head_dim}", fn=_decode_reduce_kernel,
            signature=types(_decode_reduce_kernel,
                            dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=ptr, seq_lens_ptr="*i32")),
            constexprs={**cfg, **unit(_decode_reduce_kernel)},
            aligned=("mid_o_ptr", "mid_lse_ptr", "out_ptr"), **options))
        cases.append(dict(
            name=f"write_kv d{head_dim}", fn=_write_kv_kernel,
            signature=types(_write_kv_kernel, dict(k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                                                   slot_ptr="*i64")),
            constexprs=dict(BLOCK_D=_pow2(head_dim), **unit(_write_kv_kernel)),
            aligned=("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"),
            num_warps=4, num_stages=3))
    return cases


# Unit strides (a head's elements, a table's entries, a split's partial output) are 1 on every launch, and the
# runtime compiles an integer argument equal to 1 in as a constant: the report does the same.
_UNIT_STRIDES = ("stride_qd", "stride_cd", "stride_od", "stride_kd", "stride_vd", "stride_btb", "stride_mod",
                 "stride_mlp")
# What the runtime specializes on a real launch: the pool, q and outputs are 16-byte aligned, and the pool's
# strides are multiples of 16.
_ALIGNED = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "mid_o_ptr", "mid_lse_ptr", "stride_qt",
            "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_ot", "stride_oh", "stride_mod")
