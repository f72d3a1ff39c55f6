"""Kernel benchmark (`make bench-kernels`): paged decode attention and the prefill kernel.

On a GPU: Llama-3-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16),
batch 1/8/64/256 x context 512/2048/8192. For each: median time (CUDA events), achieved GB/s (bytes
of K and V read + q + out), the ratio to a device-to-device copy measured in the same run, and
torch's scaled_dot_product_attention on the same keys laid out contiguously. Then the prefill
kernel's TFLOP/s at 1k and 4k tokens.

Without a GPU the kernels run in the Triton interpreter on tiny shapes: those figures only show that
the script works and are labelled so; they say nothing about speed. `--cpu` times the native CPU
kernels instead, over an fp32 and a bf16 KV pool (--kv-cache-dtype).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from deploy.bench.harness import median_time, paged_inputs, time_cuda
from deploy.bench.kernel_sweep import sweep


def _setup_interpreter() -> bool:
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return True


def bench_decode(args, interpreted: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.triton_attention import paged_attention

    device = "cpu" if interpreted else "cuda"
    dtype = torch.float16 if interpreted else torch.bfloat16
    n_heads, n_kv, head_dim, block = (4, 2, 64, 16) if interpreted else (32, 8, 128, 16)
    batches = [1, 2] if interpreted else [1, 8, 64, 256]
    contexts = [32, 64] if interpreted else [512, 2048, 8192]
    timer = median_time if interpreted else time_cuda
    label = (
        "INTERPRETER, tiny shapes: not a speed figure"
        if interpreted
        else torch.cuda.get_device_name()
    )
    print(f"\ndecode attention — {label}")
    print(
        f"heads {n_heads}/{n_kv}, head_dim {head_dim}, {str(dtype).removeprefix('torch.')}, block "
        f"{block}"
    )
    print(
        f"{'batch':>6} {'ctx':>6} {'paged ms':>9} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8} "
        f"{'sdpa ms':>8} {'x sdpa':>7}"
    )
    for batch in batches:
        for context in contexts:
            q, kc, vc, tables, lens, qsl = paged_inputs(
                batch, context, n_heads, n_kv, head_dim, block, dtype, device
            )
            t_paged = timer(
                functools.partial(
                    paged_attention,
                    q,
                    kc,
                    vc,
                    tables,
                    lens,
                    qsl,
                    head_dim**-0.5,
                    max_seq_len=context,
                    max_q_len=1,
                )
            )
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
            t_sdpa = timer(
                functools.partial(F.scaled_dot_product_attention, qs, k, v, enable_gqa=True)
            )
            gbs = moved / t_paged / 1e9
            print(
                f"{batch:>6} {context:>6} {t_paged * 1e3:>9.3f} {gbs:>8.1f} {copy_gbs:>10.1f} "
                f"{gbs / copy_gbs:>7.0%} {t_sdpa * 1e3:>8.3f} {t_sdpa / t_paged:>7.2f}"
            )
            del kc, vc, k, v, src, dst


def bench_prefill(args, interpreted: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.triton_attention import paged_attention

    device = "cpu" if interpreted else "cuda"
    dtype = torch.float16 if interpreted else torch.bfloat16
    n_heads, n_kv, head_dim, block = (4, 2, 64, 16) if interpreted else (32, 8, 128, 16)
    lengths = [64] if interpreted else [1024, 4096]
    timer = median_time if interpreted else time_cuda
    label = (
        "INTERPRETER, tiny shapes: not a speed figure"
        if interpreted
        else torch.cuda.get_device_name()
    )
    print(f"\nprefill attention (one sequence, causal) — {label}")
    print(f"{'tokens':>7} {'ms':>9} {'TFLOP/s':>8} {'sdpa ms':>8} {'sdpa TF/s':>9} {'x sdpa':>7}")
    for n in lengths:
        q, kc, vc, tables, _, _ = paged_inputs(1, n, n_heads, n_kv, head_dim, block, dtype, device)
        q = torch.randn(n, n_heads, head_dim, dtype=dtype, device=device)
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        t = timer(
            functools.partial(
                paged_attention,
                q,
                kc,
                vc,
                tables,
                lens,
                qsl,
                head_dim**-0.5,
                max_seq_len=n,
                max_q_len=n,
            )
        )
        flops = 4 * n * n * n_heads * head_dim / 2  # QK^T and PV, causal half
        # torch's fused SDPA (flash on a GPU) over the same keys laid out contiguously
        qs = q.transpose(0, 1)[None]
        k = torch.randn(1, n_kv, n, head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        t_sdpa = timer(
            functools.partial(
                F.scaled_dot_product_attention, qs, k, v, is_causal=True, enable_gqa=True
            )
        )
        print(
            f"{n:>7} {t * 1e3:>9.3f} {flops / t / 1e12:>8.2f} {t_sdpa * 1e3:>8.3f} "
            f"{flops / t_sdpa / 1e12:>9.2f} {t_sdpa / t:>7.2f}"
        )


def bench_cpu_pool(args) -> None:
    """Native attention over fp32 and bf16 pools: decode at 1B and 8B heads, a 512-token chunk."""
    import torch

    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        print("native CPU kernels not built", file=sys.stderr)
        return
    print(
        f"CPU: {native.isa}-bit vectors, {torch.get_num_threads()} threads; median of 5, one layer"
    )
    print(
        f"{'shape':<14} {'batch':>5} {'context':>7} {'fp32 ms':>8} {'GB/s':>6} {'bf16 ms':>8} "
        f"{'GB/s':>6} {'fp32/bf16':>9}"
    )
    for name, head_dim in (("1B (hd 64)", 64), ("8B (hd 128)", 128)):
        for batch, context in ((1, 2048), (1, 8192), (16, 2048), (64, 512), (64, 2048)):
            q, k, v, tables, lens, _ = paged_inputs(
                batch, context, 32, 8, head_dim, 16, torch.float32, "cpu"
            )
            rows = torch.arange(batch, dtype=torch.int64)
            out = torch.empty_like(q)
            cols = []
            for pool in ((k, v), (k.to(torch.bfloat16), v.to(torch.bfloat16))):
                run = functools.partial(
                    native.paged_decode, q, *pool, out, rows, tables, lens, head_dim**-0.5
                )
                run()
                t = median_time(run, reps=5)
                cols.append(
                    (t, 2 * batch * context * 8 * head_dim * pool[0].element_size() / t / 1e9)
                )
            print(
                f"{name:<14} {batch:>5} {context:>7} {cols[0][0] * 1e3:>8.2f} {cols[0][1]:>6.1f} "
                f"{cols[1][0] * 1e3:>8.2f} {cols[1][1]:>6.1f} {cols[0][0] / cols[1][0]:>9.2f}",
                flush=True,
            )
            del q, k, v
    for head_dim in (64, 128, 256):  # a 512-token chunk after 1536 cached tokens
        _cpu_prefill_chunk(native, head_dim)


def _cpu_prefill_chunk(native, head_dim: int) -> None:
    """A 512-token chunk after 1536 cached: fp32 pool, bf16 pool, bf16 dots."""
    import torch

    _, k, v, tables, lens, _ = paged_inputs(1, 2048, 32, 8, head_dim, 16, torch.float32, "cpu")
    qc = torch.randn(512, 32, head_dim)
    out = torch.empty_like(qc)
    args_ = (
        torch.zeros(1, dtype=torch.int64),
        torch.tensor([512], dtype=torch.int32),
        lens,
        tables,
        head_dim**-0.5,
    )
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    tiles = native.prefill_tiles()
    runs = {"fp32": ((k, v), False, False), "bf16 pool": ((k16, v16), False, False)}
    if native.prefill_bf16_dots:
        runs["bf16 dots, vectors"] = ((k16, v16), True, False)
    if tiles:
        runs["bf16 dots, AMX tiles"] = ((k16, v16), True, True)
    times = {}
    try:
        for name, (pool, dots, on_tiles) in runs.items():
            native.prefill_tiles(on_tiles)
            run = functools.partial(native.paged_prefill, qc, *pool, out, *args_, bf16_dots=dots)
            run()
            times[name] = median_time(run, reps=5)
    finally:
        native.prefill_tiles(tiles)
    cols = ", ".join(f"{n} {t * 1e3:.1f} ms (x{times['fp32'] / t:.2f})" for n, t in times.items())
    flops = 4 * head_dim * 32 * sum(1536 + i + 1 for i in range(512))  # QK and PV, causal
    gflops = flops / times["fp32"] / 1e9
    print(f"prefill chunk 512 over 2048, head_dim {head_dim}: {cols}; fp32 {gflops:.0f} GFLOP/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve-bench-kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument(
        "--sweep", action="store_true", help="GPU: time other tile/warp/stage choices (tuning)"
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the native CPU attention kernels over an fp32 and a bf16 KV pool (--kv-cache-dtype)",
    )
    args = p.parse_args(argv)
    if args.cpu:
        bench_cpu_pool(args)
        return 0
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
