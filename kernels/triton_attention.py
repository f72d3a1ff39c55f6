"""Triton kernels over the paged KV pool: `write_kv` stores each token's K and V at its slot (-1: padding,
nothing stored), and `paged_attention` attends through the block tables (split-KV decode, or variable-length
prefill over a cached prefix). Every load past a sequence's length or a padded head dim is masked. Runs
natively on CUDA and on the CPU under TRITON_INTERPRET=1 (fp32/fp16; the interpreter mishandles bf16 dots)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.triton_paged import (
    STEP_VARYING,
    decode_reduce_kernel,
    decode_split_kernel,
    prefill_kernel,
    write_kv_kernel,
)

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
    (decode_split_kernel if kind == "decode" else prefill_kernel).device_caches.clear()


def decode_config(head_dim: int, group: int, block_size: int, on_gpu: bool) -> dict:
    """Constexprs and launch options of decode_split_kernel. Chosen on an H100 (deploy/bench/kernels.py
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
    """Constexprs and launch options of prefill_kernel, chosen on an H100 (deploy/bench/kernels.py --sweep,
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
    write_kv_kernel[(num_tokens, n_kv_heads)](
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
    """When every sequence has one query (decode) it runs the split-KV (flash-decoding) kernel: one program
    per (sequence, KV head, split) holds all the query heads that share that KV head, so each KV tile is
    read once, then a second kernel merges the splits by their log-sum-exp. Otherwise it runs the
    variable-length prefill/extend kernel: one program per (sequence, query head, tile of queries),
    walking the block table up to the causal limit, so chunked prefill over a cached prefix and mixed
    batches need nothing special. Block ids are widened to int64 before they multiply a stride; non-power-
    of-two head dims and GQA ratios are padded to the next power of two and masked.

    Same contract as kernels.reference.paged_attention. Returns [num_tokens, n_heads, head_dim].

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
    decode_split_kernel[(num_seqs, n_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scale, float(softcap),
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *mid_o.stride(), *mid_lse.stride(),
        head_dim, group, split_len, window,
        BLOCK_SIZE=block_size, PRECISION=_precision(q.dtype), SOFTCAP=softcap > 0, **cfg,
    )
    decode_reduce_kernel[(num_seqs, n_heads)](
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
    prefill_kernel[(seq_lens.shape[0], n_heads, triton.cdiv(max_q_len, cfg["BLOCK_M"]))](
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
                    name=f"decode_split d{head_dim} b{block_size} g{group}", fn=decode_split_kernel,
                    signature=types(decode_split_kernel, dict(
                        q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
                        seq_lens_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32")),
                    constexprs=dict(BLOCK_SIZE=block_size, PRECISION=None, SOFTCAP=False,
                                    **unit(decode_split_kernel), **cfg),
                    aligned=_ALIGNED, **options))
            cfg = prefill_config(head_dim, block_size, True)
            options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            cases.append(dict(
                name=f"prefill d{head_dim} b{block_size}", fn=prefill_kernel,
                signature=types(prefill_kernel, dict(
                    q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, out_ptr=ptr, block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", q_starts_ptr="*i32", q_ends_ptr="*i32")),
                constexprs=dict(BLOCK_SIZE=block_size, PRECISION=None, SOFTCAP=False,
                                EVEN_D=head_dim == cfg["BLOCK_D"],
                                POOL_I32=True, SLIDING=False, **unit(prefill_kernel), **cfg),
                aligned=_ALIGNED, **options))
        cfg = reduce_config(head_dim, True)
        options = dict(num_warps=cfg.pop("num_warps"), num_stages=3)
        cases.append(dict(
            name=f"decode_reduce d{head_dim}", fn=decode_reduce_kernel,
            signature=types(decode_reduce_kernel,
                            dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=ptr, seq_lens_ptr="*i32")),
            constexprs={**cfg, **unit(decode_reduce_kernel)},
            aligned=("mid_o_ptr", "mid_lse_ptr", "out_ptr"), **options))
        cases.append(dict(
            name=f"write_kv d{head_dim}", fn=write_kv_kernel,
            signature=types(write_kv_kernel, dict(k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                                                   slot_ptr="*i64")),
            constexprs=dict(BLOCK_D=_pow2(head_dim), **unit(write_kv_kernel)),
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
