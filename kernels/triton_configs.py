"""Launch configurations of the paged-attention Triton kernels: tiles, warps and stages per head dim
(swept on an H100, docs/BENCHMARKS.md), split counts for decode, and the cases compile_report
compiles.
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels.triton_paged import (
    STEP_VARYING,
    decode_reduce_kernel,
    decode_split_kernel,
    write_kv_kernel,
)
from kernels.triton_prefill import prefill_kernel


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


# Launch configurations. The key tile is capped whatever the page size (it is gathered key by key):
# 256-key tiles spilled. Warps grow with head_dim so nothing spills at d64 to d512 (`make gpu-
# compile-report`). In the interpreter a tile is two pages, so tests cover tiles spanning pages.
# OVERRIDES is for --sweep only.
OVERRIDES: dict[str, dict] = {}


def override(kind: str, config: dict) -> None:
    """Launch with these tiles, warps and stages from now on (a sweep's next configuration)."""
    OVERRIDES[kind] = config
    (decode_split_kernel if kind == "decode" else prefill_kernel).device_caches.clear()


def decode_config(head_dim: int, group: int, block_size: int, on_gpu: bool) -> dict:
    """decode_split_kernel's launch, swept on an H100 among configurations that never spill."""
    block_d = pow2(head_dim, 16)
    if not on_gpu:
        return dict(TILE=2 * block_size, BLOCK_D=block_d, BLOCK_G=pow2(group, 16))
    if block_d <= 64:
        cfg = dict(TILE=64, num_warps=4, num_stages=3)
    # 64-key tiles at 4 warps spill 144 bytes a thread under newer Triton compilers
    elif block_d <= 128:
        cfg = dict(TILE=32, num_warps=4, num_stages=3)
    else:
        cfg = dict(TILE=32, num_warps=8, num_stages=2)
    return {**cfg, "BLOCK_D": block_d, "BLOCK_G": pow2(group, 16), **OVERRIDES.get("decode", {})}


def prefill_config(head_dim: int, block_size: int, on_gpu: bool) -> dict:
    """prefill_kernel's launch, swept on an H100 among configurations that never spill."""
    block_d = pow2(head_dim, 16)
    if not on_gpu:
        return dict(BLOCK_M=16, TILE=2 * block_size, BLOCK_D=block_d)
    if block_d <= 128:
        cfg = dict(BLOCK_M=64, TILE=64, num_warps=4, num_stages=2)
    # [64, 256] queries against 32-key tiles on 8 warps; 4 warps or 64-key tiles spill at d256
    elif block_d <= 256:
        cfg = dict(BLOCK_M=64, TILE=32, num_warps=8, num_stages=2)
    # Gemma 4's full layers (d512): 64 queries a program spill 320 bytes, 32 none
    else:
        cfg = dict(BLOCK_M=32, TILE=32, num_warps=8, num_stages=2)
    return {**cfg, "BLOCK_D": block_d, **OVERRIDES.get("prefill", {})}


def reduce_config(head_dim: int, on_gpu: bool) -> dict:
    return dict(BLOCK_D=pow2(head_dim, 16), SPLIT_TILE=16, **(dict(num_warps=4) if on_gpu else {}))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The SM count, asked once: the query is not free."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# Most keys a decode program attends on a GPU: a long sequence is split by its own length, so one 8k
# sequence does not hold the GPU up.
MAX_SPLIT_KEYS = 512


MAX_SPLITS = 1024  # past MAX_SPLIT_KEYS x MAX_SPLITS keys the splits grow instead


def default_num_splits(
    num_seqs: int, n_kv_heads: int, max_seq_len: int, block_size: int, device
) -> int:
    """Enough programs to fill the GPU, splits of at most MAX_SPLIT_KEYS keys."""
    max_splits = triton.cdiv(max_seq_len, block_size)
    if device.type != "cuda":
        return min(2, max_splits)  # the interpreter: keep it small
    sms = _multiprocessors(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    to_fill = triton.cdiv(2 * sms, max(1, num_seqs * n_kv_heads))
    by_length = triton.cdiv(max_seq_len, MAX_SPLIT_KEYS)
    return max(1, min(max(to_fill, by_length), max_splits, MAX_SPLITS))


def launch_cases(head_dims, block_sizes, dtype: str = "bf16") -> list[dict]:
    """Each attention kernel as its launcher configures it, per head_dim and block size, for
    compile_report.
    """
    # one function: a table of launches, one entry per kernel
    ptr = f"*{dtype}"
    cases = []

    def types(fn, pointers: dict, floats=("scale", "softcap")):
        return {n: pointers.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}

    # the strides that are 1 at every launch: the runtime compiles them in as constants
    def unit(
        fn,
    ):
        return {
            n: 1
            for n in _UNIT_STRIDES
            if n in fn.arg_names and n not in STEP_VARYING.get(fn.__name__, ())
        }

    for head_dim in head_dims:
        for block_size in block_sizes:
            for group in (4, 8):
                cfg = decode_config(head_dim, group, block_size, True)
                options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
                cases.append(
                    dict(
                        name=f"decode_split d{head_dim} b{block_size} g{group}",
                        fn=decode_split_kernel,
                        signature=types(
                            decode_split_kernel,
                            dict(
                                q_ptr=ptr,
                                k_cache_ptr=ptr,
                                v_cache_ptr=ptr,
                                block_tables_ptr="*i32",
                                seq_lens_ptr="*i32",
                                mid_o_ptr="*fp32",
                                mid_lse_ptr="*fp32",
                            ),
                        ),
                        constexprs=dict(
                            BLOCK_SIZE=block_size,
                            PRECISION=None,
                            SOFTCAP=False,
                            **unit(decode_split_kernel),
                            **cfg,
                        ),
                        aligned=_ALIGNED,
                        **options,
                    )
                )
            cfg = prefill_config(head_dim, block_size, True)
            options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            cases.append(
                dict(
                    name=f"prefill d{head_dim} b{block_size}",
                    fn=prefill_kernel,
                    signature=types(
                        prefill_kernel,
                        dict(
                            q_ptr=ptr,
                            k_cache_ptr=ptr,
                            v_cache_ptr=ptr,
                            out_ptr=ptr,
                            block_tables_ptr="*i32",
                            seq_lens_ptr="*i32",
                            q_starts_ptr="*i32",
                            q_ends_ptr="*i32",
                            sinks_ptr=ptr,
                        ),
                    ),
                    constexprs=dict(
                        BLOCK_SIZE=block_size,
                        PRECISION=None,
                        SOFTCAP=False,
                        EVEN_D=head_dim == cfg["BLOCK_D"],
                        POOL_I32=True,
                        SLIDING=False,
                        HAS_SINKS=False,
                        **unit(prefill_kernel),
                        **cfg,
                    ),
                    aligned=_ALIGNED,
                    **options,
                )
            )
        cfg = reduce_config(head_dim, True)
        options = dict(num_warps=cfg.pop("num_warps"), num_stages=3)
        cases.append(
            dict(
                name=f"decode_reduce d{head_dim}",
                fn=decode_reduce_kernel,
                signature=types(
                    decode_reduce_kernel,
                    dict(
                        mid_o_ptr="*fp32",
                        mid_lse_ptr="*fp32",
                        out_ptr=ptr,
                        seq_lens_ptr="*i32",
                        sinks_ptr=ptr,
                    ),
                ),
                constexprs={**cfg, "HAS_SINKS": False, **unit(decode_reduce_kernel)},
                aligned=("mid_o_ptr", "mid_lse_ptr", "out_ptr"),
                **options,
            )
        )
        cases.append(
            dict(
                name=f"write_kv d{head_dim}",
                fn=write_kv_kernel,
                signature=types(
                    write_kv_kernel,
                    dict(k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, slot_ptr="*i64"),
                ),
                constexprs=dict(BLOCK_D=pow2(head_dim), **unit(write_kv_kernel)),
                aligned=("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"),
                num_warps=4,
                num_stages=3,
            )
        )
    return cases


# Unit strides are 1 on every launch and the runtime compiles them in as constants: so does the
# report.
_UNIT_STRIDES = (
    "stride_qd",
    "stride_cd",
    "stride_od",
    "stride_kd",
    "stride_vd",
    "stride_btb",
    "stride_mod",
    "stride_mlp",
)


# As a real launch specializes: pool, q and outputs 16-byte aligned, pool strides multiples of 16.
_ALIGNED = (
    "q_ptr",
    "k_cache_ptr",
    "v_cache_ptr",
    "out_ptr",
    "mid_o_ptr",
    "mid_lse_ptr",
    "stride_qt",
    "stride_qh",
    "stride_cb",
    "stride_cs",
    "stride_ch",
    "stride_ot",
    "stride_oh",
    "stride_mod",
)
