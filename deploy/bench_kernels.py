"""Kernel benchmark (`make bench-kernels`): paged decode attention and the prefill kernel.

On a GPU: Llama-3-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16),
batch 1/8/64/256 x context 512/2048/8192. For each: median time (CUDA events), achieved GB/s (bytes
of K and V read + q + out), the ratio to a device-to-device copy measured in the same run, and torch's
scaled_dot_product_attention on the same keys laid out contiguously. Then the prefill kernel's
TFLOP/s at 1k and 4k tokens.

Without a GPU the kernels run in the Triton interpreter on tiny shapes: those figures only show that
the script works and are labelled so; they say nothing about speed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time


def _setup_interpreter() -> bool:
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return True


def _paged_inputs(batch, context, n_heads, n_kv, head_dim, block, dtype, device):
    import torch

    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block, n_kv, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)  # scattered blocks
    tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, n_heads, head_dim, dtype=dtype, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def _time_cuda(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def _time_cpu(fn, reps=3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_decode(args, interpreted: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.triton_attention import paged_attention

    device = "cpu" if interpreted else "cuda"
    dtype = torch.float16 if interpreted else torch.bfloat16
    n_heads, n_kv, head_dim, block = (4, 2, 64, 16) if interpreted else (32, 8, 128, 16)
    batches = [1, 2] if interpreted else [1, 8, 64, 256]
    contexts = [32, 64] if interpreted else [512, 2048, 8192]
    timer = _time_cpu if interpreted else _time_cuda
    label = "INTERPRETER, tiny shapes: not a speed figure" if interpreted else torch.cuda.get_device_name()
    print(f"\ndecode attention — {label}")
    print(f"heads {n_heads}/{n_kv}, head_dim {head_dim}, {str(dtype).removeprefix('torch.')}, block {block}")
    print(f"{'batch':>6} {'ctx':>6} {'paged ms':>9} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8} {'sdpa ms':>8} {'x sdpa':>7}")
    for batch in batches:
        for context in contexts:
            q, kc, vc, tables, lens, qsl = _paged_inputs(batch, context, n_heads, n_kv, head_dim, block, dtype, device)
            t_paged = timer(functools.partial(paged_attention, q, kc, vc, tables, lens, qsl, head_dim**-0.5,
                                              max_seq_len=context, max_q_len=1))
            elem = kc.element_size()
            kv_bytes = 2 * batch * context * n_kv * head_dim * elem
            moved = kv_bytes + 2 * q.numel() * elem
            src = torch.empty(kv_bytes // elem, dtype=dtype, device=device)
            dst = torch.empty_like(src)
            t_copy = timer(functools.partial(dst.copy_, src))
            copy_gbs = 2 * kv_bytes / t_copy / 1e9  # a copy reads and writes
            k = torch.randn(batch, n_kv, context, head_dim, dtype=dtype, device=device)
            v = torch.randn_like(k)
            qs = q.view(batch, n_heads, 1, head_dim)
            t_sdpa = timer(functools.partial(F.scaled_dot_product_attention, qs, k, v, enable_gqa=True))
            gbs = moved / t_paged / 1e9
            print(f"{batch:>6} {context:>6} {t_paged * 1e3:>9.3f} {gbs:>8.1f} {copy_gbs:>10.1f} "
                  f"{gbs / copy_gbs:>7.0%} {t_sdpa * 1e3:>8.3f} {t_sdpa / t_paged:>7.2f}")
            del kc, vc, k, v, src, dst


def bench_prefill(args, interpreted: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.triton_attention import paged_attention

    device = "cpu" if interpreted else "cuda"
    dtype = torch.float16 if interpreted else torch.bfloat16
    n_heads, n_kv, head_dim, block = (4, 2, 64, 16) if interpreted else (32, 8, 128, 16)
    lengths = [64] if interpreted else [1024, 4096]
    timer = _time_cpu if interpreted else _time_cuda
    label = "INTERPRETER, tiny shapes: not a speed figure" if interpreted else torch.cuda.get_device_name()
    print(f"\nprefill attention (one sequence, causal) — {label}")
    print(f"{'tokens':>7} {'ms':>9} {'TFLOP/s':>8} {'sdpa ms':>8} {'sdpa TF/s':>9} {'x sdpa':>7}")
    for n in lengths:
        q, kc, vc, tables, _, _ = _paged_inputs(1, n, n_heads, n_kv, head_dim, block, dtype, device)
        q = torch.randn(n, n_heads, head_dim, dtype=dtype, device=device)
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        t = timer(functools.partial(paged_attention, q, kc, vc, tables, lens, qsl, head_dim**-0.5,
                                    max_seq_len=n, max_q_len=n))
        flops = 4 * n * n * n_heads * head_dim / 2  # QK^T and PV, causal half
        # torch's fused SDPA (flash on a GPU) over the same keys laid out contiguously
        qs = q.transpose(0, 1)[None]
        k = torch.randn(1, n_kv, n, head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        t_sdpa = timer(functools.partial(F.scaled_dot_product_attention, qs, k, v, is_causal=True, enable_gqa=True))
        print(f"{n:>7} {t * 1e3:>9.3f} {flops / t / 1e12:>8.2f} {t_sdpa * 1e3:>8.3f} {flops / t_sdpa / 1e12:>9.2f} "
              f"{t_sdpa / t:>7.2f}")


def sweep(args) -> None:
    """Time other launch configurations of the decode and prefill kernels at the GPU shapes (tuning)."""
    import torch

    from kernels import triton_attention as ta
    from kernels.compile_report import runtime_report

    dtype, (n_heads, n_kv, head_dim, block) = torch.bfloat16, (32, 8, 128, 16)
    print(f"\nsweep — {torch.cuda.get_device_name()}, heads {n_heads}/{n_kv}, head_dim {head_dim}, bf16")
    decode_cases = [(64, 2048), (8, 8192), (256, 2048)]
    configs = [dict(TILE=t, num_warps=w, num_stages=st) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    print(f"{'kernel':<8} {'config':<36} {'regs':>5} {'spills':>6} " + " ".join(f"{b}x{c:>5}" for b, c in decode_cases))
    inputs = [_paged_inputs(b, c, n_heads, n_kv, head_dim, block, dtype, "cuda") for b, c in decode_cases]
    for cfg in configs:
        ta.OVERRIDES["decode"] = cfg
        ta._decode_split_kernel.device_caches.clear()
        times = []
        for (q, kc, vc, tables, lens, qsl), (_, c) in zip(inputs, decode_cases, strict=True):
            times.append(_time_cuda(functools.partial(ta.paged_attention, q, kc, vc, tables, lens, qsl,
                                                      head_dim**-0.5, max_seq_len=c, max_q_len=1)))
        v = runtime_report()["_decode_split_kernel"][0]
        label = ",".join(f"{k}={x}" for k, x in cfg.items())
        print(f"{'decode':<8} {label:<36} {v['regs']!s:>5} {v['spills']!s:>6} "
              + " ".join(f"{t * 1e3:>8.3f}" for t in times))
    ta.OVERRIDES.pop("decode", None)
    del inputs
    n = 4096
    q, kc, vc, tables, _, _ = _paged_inputs(1, n, n_heads, n_kv, head_dim, block, dtype, "cuda")
    q = torch.randn(n, n_heads, head_dim, dtype=dtype, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    flops = 4 * n * n * n_heads * head_dim / 2
    for bm in (64, 128):
        for tile in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3):
                    ta.OVERRIDES["prefill"] = dict(BLOCK_M=bm, TILE=tile, num_warps=w, num_stages=st)
                    ta._prefill_kernel.device_caches.clear()
                    try:
                        t = _time_cuda(functools.partial(ta.paged_attention, q, kc, vc, tables, lens, qsl,
                                                         head_dim**-0.5, max_seq_len=n, max_q_len=n))
                    except Exception as e:  # noqa: BLE001 - out of shared memory, say
                        print(f"prefill  BLOCK_M={bm},TILE={tile},warps={w},stages={st}: {type(e).__name__}")
                        continue
                    v = runtime_report()["_prefill_kernel"][0]
                    print(f"{'prefill':<8} {f'BLOCK_M={bm},TILE={tile},warps={w},stages={st}':<36} {v['regs']!s:>5} "
                          f"{v['spills']!s:>6} {t * 1e3:>8.3f} ms {flops / t / 1e12:>7.1f} TFLOP/s")
    ta.OVERRIDES.pop("prefill", None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-bench-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument("--sweep", action="store_true", help="GPU: time other tile/warp/stage choices (tuning)")
    args = p.parse_args(argv)
    interpreted = _setup_interpreter()
    if args.sweep:
        if interpreted:
            print("--sweep times kernels on a GPU", file=sys.stderr)
            return 2
        sweep(args)
        return 0
    if args.only in (None, "decode"):
        bench_decode(args, interpreted)
    if args.only in (None, "prefill"):
        bench_prefill(args, interpreted)
    if not interpreted:
        from kernels.compile_report import print_runtime_report

        print("\nTriton kernels compiled by this run (one row a version):")
        print_runtime_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
