"""Triton paged KV: `write_kv` stores K/V at slots (-1: none); `paged_attention` runs split-KV
decode or variable-length prefill over block tables. Native on CUDA; on CPU under TRITON_INTERPRET=1
(fp32/fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.triton_configs import (
    decode_config,
    default_num_splits,
    pow2,
    prefill_config,
    reduce_config,
)
from kernels.triton_paged import (
    decode_reduce_kernel,
    decode_split_kernel,
    write_kv_kernel,
)
from kernels.triton_prefill import prefill_kernel

# --- launchers ------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 dots in full precision, not tf32."""
    return "ieee" if dtype == torch.float32 else None


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


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
    write_kv_kernel[(num_tokens, n_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        k_cache.shape[1],
        head_dim,
        BLOCK_D=pow2(head_dim),
    )


def decode_workspace(
    num_seqs: int, n_heads: int, num_splits: int, head_dim: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the split results: partial outputs and
    their log-sum-exp (never read unwritten).
    """
    mid_o = torch.empty(
        (num_seqs, n_heads, num_splits, head_dim), dtype=torch.float32, device=device
    )
    mid_lse = torch.empty((num_seqs, n_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


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
    # int64 [d]: in a mixed step, the sequences that decode...
    decode_seqs: torch.Tensor | None = None,
    # int64 [p]: ...and those with more than one query token
    prefill_seqs: torch.Tensor | None = None,
    # kept by the caller across a step's layers: split scratch allocated once
    workspace: dict | None = None,
    # decode_seqs and prefill_seqs already gathered (split_mixed), once a step
    mixed: MixedStep | None = None,
    window: int = 0,  # > 0: a sliding-window layer (each query sees its last `window` keys)
    softcap: float = 0.0,  # > 0: scores soft-capped, softcap * tanh(s / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [n_heads]: one more logit a head (gpt-oss)
) -> torch.Tensor:
    """As kernels.reference.paged_attention: decodes split-KV, prompts the varlen prefill kernel."""
    # one function: the dispatch of a step's rows, decode and prompt, read top to bottom
    num_tokens, n_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    if num_tokens == num_seqs:  # every sequence decodes one token
        _decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            max_seq_len,
            num_splits,
            out,
            workspace,
            window,
            softcap,
            sinks,
        )
        return out
    if (
        mixed is None
        and decode_seqs is not None
        and prefill_seqs is not None
        and decode_seqs.numel()
    ):
        mixed = split_mixed(block_tables, seq_lens, query_start_loc, decode_seqs, prefill_seqs)
    if mixed is not None:
        dec_out = torch.empty(
            (mixed.decode_rows.shape[0], n_heads, head_dim), dtype=q.dtype, device=q.device
        )
        _decode(
            q[mixed.decode_rows],
            k_cache,
            v_cache,
            mixed.decode_tables,
            mixed.decode_lens,
            scale,
            max_seq_len,
            num_splits,
            dec_out,
            workspace,
            window,
            softcap,
            sinks,
        )
        out[mixed.decode_rows] = dec_out
        if mixed.prefill_lens.numel():
            _prefill(
                q,
                k_cache,
                v_cache,
                mixed.prefill_tables,
                mixed.prefill_lens,
                mixed.prefill_starts,
                mixed.prefill_ends,
                scale,
                max_q_len,
                out,
                window,
                softcap,
                sinks,
            )
        return out
    _prefill(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc[:-1],
        query_start_loc[1:],
        scale,
        max_q_len,
        out,
        window,
        softcap,
        sinks,
    )
    return out


@dataclass
class MixedStep:
    """A mixed step's decode and prompt rows, gathered once a step for every layer."""

    decode_rows: torch.Tensor  # int64 [d]: each decoding sequence's query token
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefill_tables: torch.Tensor
    prefill_lens: torch.Tensor
    prefill_starts: torch.Tensor
    prefill_ends: torch.Tensor


def split_mixed(block_tables, seq_lens, query_start_loc, decode_seqs, prefill_seqs) -> MixedStep:
    return MixedStep(
        decode_rows=query_start_loc[decode_seqs].to(torch.int64),
        decode_tables=block_tables[decode_seqs],
        decode_lens=seq_lens[decode_seqs],
        prefill_tables=block_tables[prefill_seqs],
        prefill_lens=seq_lens[prefill_seqs],
        prefill_starts=query_start_loc[prefill_seqs],
        prefill_ends=query_start_loc[prefill_seqs + 1],
    )


def _decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    max_seq_len,
    num_splits,
    out,
    workspace: dict | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
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
    # whole tiles per split
    split_len = tile * triton.cdiv(triton.cdiv(max_seq_len, num_splits), tile)
    num_splits = triton.cdiv(max_seq_len, split_len)
    key = (num_seqs, n_heads, num_splits, head_dim)
    # every layer of a step has the same shape
    if workspace is not None and workspace.get("key") == key:
        mid_o, mid_lse = workspace["scratch"]
    else:
        mid_o, mid_lse = decode_workspace(num_seqs, n_heads, num_splits, head_dim, q.device)
        if workspace is not None:
            workspace["key"], workspace["scratch"] = key, (mid_o, mid_lse)
    decode_split_kernel[(num_seqs, n_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        scale,
        float(softcap),
        *q.stride(),
        *k_cache.stride(),
        *block_tables.stride(),
        *mid_o.stride(),
        *mid_lse.stride(),
        head_dim,
        group,
        split_len,
        window,
        BLOCK_SIZE=block_size,
        PRECISION=_precision(q.dtype),
        SOFTCAP=softcap > 0,
        **cfg,
    )
    decode_reduce_kernel[(num_seqs, n_heads)](
        mid_o,
        mid_lse,
        out,
        seq_lens,
        out if sinks is None else sinks,
        *mid_o.stride(),
        *mid_lse.stride(),
        *out.stride(),
        head_dim,
        split_len,
        window,
        HAS_SINKS=sinks is not None,
        **reduce_config(head_dim, _on_gpu(q.device)),
    )


def _prefill(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    q_starts,
    q_ends,
    scale,
    max_q_len,
    out,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    _, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    if max_q_len is None:
        max_q_len = int((q_ends - q_starts).max())
    cfg = dict(
        EVEN_D=head_dim == pow2(head_dim, 16),
        POOL_I32=k_cache.numel() < 2**31,
        **prefill_config(head_dim, block_size, _on_gpu(q.device)),
    )
    prefill_kernel[(seq_lens.shape[0], n_heads, triton.cdiv(max_q_len, cfg["BLOCK_M"]))](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        q_starts,
        q_ends,
        out if sinks is None else sinks,
        scale,
        float(softcap),
        *q.stride(),
        *k_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        head_dim,
        n_heads // n_kv_heads,
        window,
        BLOCK_SIZE=block_size,
        PRECISION=_precision(q.dtype),
        SOFTCAP=softcap > 0,
        SLIDING=window > 0,
        HAS_SINKS=sinks is not None,
        **cfg,
    )
