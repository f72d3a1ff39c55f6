"""Kernel benchmark (`make bench-kernels`): paged decode attention and the prefill kernel.

On a GPU: Llama-3-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16),
batch 1/8/64/256 x context 512/2048/8192. For each: median time (CUDA events), achieved GB/s (bytes
of K and V read + q + out), the ratio to a device-to-device copy measured in the same run, and torch's
scaled_dot_product_attention on the same keys laid out contiguously. Then the prefill kernel's
TFLOP/s at 1k and 4k tokens.

Without a GPU the kernels run in the Triton interpreter on tiny shapes: those figures only show that
the script works and are labelled so; they say nothing about speed. `--cpu` times the native CPU kernels
instead, over an fp32 and a bf16 KV pool (--kv-cache-dtype).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from deploy.bench.harness import median_time


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


def bench_decode(args, interpreted: bool) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.triton_attention import paged_attention

    device = "cpu" if interpreted else "cuda"
    dtype = torch.float16 if interpreted else torch.bfloat16
    n_heads, n_kv, head_dim, block = (4, 2, 64, 16) if interpreted else (32, 8, 128, 16)
    batches = [1, 2] if interpreted else [1, 8, 64, 256]
    contexts = [32, 64] if interpreted else [512, 2048, 8192]
    timer = median_time if interpreted else _time_cuda
    label = "INTERPRETER, tiny shapes: not a speed figure" if interpreted else torch.cuda.get_device_name()
    print(f"\ndecode attention — {label}")
    print(f"heads {n_heads}/{n_kv}, head_dim {head_dim}, {str(dtype).removeprefix('torch.')}, block {block}")
    print(f"{'batch':>6} {'ctx':>6} {'paged ms':>9} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8} "
          f"{'sdpa ms':>8} {'x sdpa':>7}")
    for batch in batches:
        for context in contexts:
            q, kc, vc, tables, lens, qsl = _paged_inputs(
                batch, context, n_heads, n_kv, head_dim, block, dtype, device)
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
    timer = median_time if interpreted else _time_cuda
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
        t_sdpa = timer(functools.partial(F.scaled_dot_product_attention, qs, k, v, is_causal=True,
                                         enable_gqa=True))
        print(f"{n:>7} {t * 1e3:>9.3f} {flops / t / 1e12:>8.2f} {t_sdpa * 1e3:>8.3f} "
              f"{flops / t_sdpa / 1e12:>9.2f} {t_sdpa / t:>7.2f}")


def sweep(args) -> None:
    """Time other launch configurations of the decode and prefill kernels at the GPU shapes (tuning)."""
    import torch

    print(f"\nsweep — {torch.cuda.get_device_name()}, bf16, pages of 16")
    if args.only in (None, "decode"):
        _sweep_decode()
    if args.only in (None, "prefill"):
        square = [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 128, 8)]
        _sweep_prefill(32, 8, 128, square + [(64, 32, 8), (64, 128, 8)])  # Llama-3-8B's heads
        _sweep_prefill(32, 8, 64, square)  # Llama-3.2-1B's
        _sweep_prefill(16, 8, 256,
                       [(32, 16, 8), (32, 32, 8), (32, 32, 4), (64, 16, 8), (64, 32, 8), (32, 64, 8)])


def _sweep_decode() -> None:
    import torch

    from kernels import triton_attention as ta
    from kernels import triton_configs as tc
    from kernels.compile_report import runtime_report

    dtype, (n_heads, n_kv, head_dim, block) = torch.bfloat16, (32, 8, 128, 16)
    print(f"\ndecode, heads {n_heads}/{n_kv}, head_dim {head_dim}")
    decode_cases = [(64, 2048), (8, 8192), (256, 2048)]
    configs = [dict(TILE=t, num_warps=w, num_stages=st)
               for t in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    cases = " ".join(f"{b}x{c:>5}" for b, c in decode_cases)
    print(f"{'kernel':<8} {'config':<36} {'regs':>5} {'spills':>6} " + cases)
    inputs = [_paged_inputs(b, c, n_heads, n_kv, head_dim, block, dtype, "cuda") for b, c in decode_cases]
    for cfg in configs:
        tc.override("decode", cfg)
        times = []
        for (q, kc, vc, tables, lens, qsl), (_, c) in zip(inputs, decode_cases, strict=True):
            times.append(_time_cuda(functools.partial(ta.paged_attention, q, kc, vc, tables, lens, qsl,
                                                      head_dim**-0.5, max_seq_len=c, max_q_len=1)))
        v = runtime_report()["decode_split_kernel"][0]
        label = ",".join(f"{k}={x}" for k, x in cfg.items())
        print(f"{'decode':<8} {label:<36} {v['regs']!s:>5} {v['spills']!s:>6} "
              + " ".join(f"{t * 1e3:>8.3f}" for t in times))
    tc.OVERRIDES.pop("decode", None)


def _sweep_prefill(n_heads: int, n_kv: int, head_dim: int, shapes) -> None:
    """Each shape (query rows, key tile, warps) at 2 and 3 stages, checked against flash SDPA on the same keys
    (relative error) before it is timed, at 1k and 4k tokens; the SDPA times measured in the same run."""
    import torch
    import torch.nn.functional as F

    from kernels import triton_attention as ta
    from kernels import triton_configs as tc
    from kernels.compile_report import runtime_report

    dtype, block = torch.bfloat16, 16
    print(f"\nprefill, heads {n_heads}/{n_kv}, head_dim {head_dim}")
    cases = []
    for n in (1024, 4096):
        _, kc, vc, tables, _, _ = _paged_inputs(1, n, n_heads, n_kv, head_dim, block, dtype, "cuda")
        q = torch.randn(n, n_heads, head_dim, dtype=dtype, device="cuda")
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        # the same keys laid out contiguously, in sequence order, for SDPA
        k = kc[tables[0].long()].reshape(n, n_kv, head_dim).transpose(0, 1)[None].contiguous()
        v = vc[tables[0].long()].reshape(n, n_kv, head_dim).transpose(0, 1)[None].contiguous()
        qs = q.transpose(0, 1)[None].contiguous()
        sdpa = functools.partial(F.scaled_dot_product_attention, qs, k, v, is_causal=True, enable_gqa=True)
        ref = sdpa()[0].transpose(0, 1).float()
        cases.append((n, q, kc, vc, tables, lens, qsl, ref, _time_cuda(sdpa)))
    print("flash SDPA: " + ", ".join(f"{n} tokens {t * 1e3:.3f} ms "
                                     f"({4 * n * n * n_heads * head_dim / 2 / t / 1e12:.0f} "
                                     "TFLOP/s)" for n, *_, t in cases))
    configs = [dict(BLOCK_M=bm, TILE=tile, num_warps=w, num_stages=st)
               for bm, tile, w in shapes for st in (2, 3)]
    names = " ".join(f"{n:>6} ms x sdpa" for n, *_ in cases)
    print(f"{'config':<58} {'regs':>5} {'spills':>6} {'err':>8} " + names)
    for cfg in configs:
        tc.override("prefill", cfg)
        label = ",".join(f"{k}={x}" for k, x in cfg.items())
        cols = []
        try:
            err = 0.0
            for n, q, kc, vc, tables, lens, qsl, ref, t_sdpa in cases:
                run = functools.partial(ta.paged_attention, q, kc, vc, tables, lens, qsl, head_dim**-0.5,
                                        max_seq_len=n, max_q_len=n)
                out = run().float()
                err = max(err, float((out - ref).norm() / ref.norm()))
                t = _time_cuda(run)
                cols.append(f"{t * 1e3:>9.3f} {t_sdpa / t:>6.2f}")
        except Exception as e:  # noqa: BLE001 - out of shared memory, a compiler refusal
            print(f"{label:<58} {type(e).__name__}: {str(e)[:80]}")
            continue
        v = runtime_report()["prefill_kernel"][0]
        print(f"{label:<58} {v['regs']!s:>5} {v['spills']!s:>6} {err:>8.1e} " + " ".join(cols), flush=True)
    tc.OVERRIDES.pop("prefill", None)


def bench_cpu_pool(args) -> None:
    """The native CPU kernels (kernels/cpu/paged_decode.c, paged_prefill.c) over an fp32 and a bf16 KV pool
    (--kv-cache-dtype), same keys, same run: decode at Llama-3.2-1B's heads (32 query, 8 KV, head_dim 64) and
    Llama-3.1-8B's (head_dim 128), one layer; then one 512-token prompt chunk over a cached prefix."""
    import torch

    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        print("native CPU kernels not built", file=sys.stderr)
        return
    print(f"CPU: {native.isa}-bit vectors, {torch.get_num_threads()} threads; median of 5, one layer")
    print(f"{'shape':<14} {'batch':>5} {'context':>7} {'fp32 ms':>8} {'GB/s':>6} {'bf16 ms':>8} {'GB/s':>6} "
          f"{'fp32/bf16':>9}")
    for name, head_dim in (("1B (hd 64)", 64), ("8B (hd 128)", 128)):
        for batch, context in ((1, 2048), (1, 8192), (16, 2048), (64, 512), (64, 2048)):
            q, k, v, tables, lens, _ = _paged_inputs(batch, context, 32, 8, head_dim, 16, torch.float32,
                                                     "cpu")
            rows = torch.arange(batch, dtype=torch.int64)
            out = torch.empty_like(q)
            cols = []
            for pool in ((k, v), (k.to(torch.bfloat16), v.to(torch.bfloat16))):
                run = functools.partial(native.paged_decode, q, *pool, out, rows, tables, lens,
                                        head_dim**-0.5)
                run()
                t = median_time(run, reps=5)
                cols.append((t, 2 * batch * context * 8 * head_dim * pool[0].element_size() / t / 1e9))
            print(f"{name:<14} {batch:>5} {context:>7} {cols[0][0] * 1e3:>8.2f} {cols[0][1]:>6.1f} "
                  f"{cols[1][0] * 1e3:>8.2f} {cols[1][1]:>6.1f} {cols[0][0] / cols[1][0]:>9.2f}", flush=True)
            del q, k, v
    for head_dim in (64, 128):  # a 512-token chunk after 1536 cached tokens
        _cpu_prefill_chunk(native, head_dim)


def _cpu_prefill_chunk(native, head_dim: int) -> None:
    """One 512-token prompt chunk after 1536 cached tokens at 32 query and 8 KV heads: over an fp32 pool, a
    bf16 pool in fp32 arithmetic, and a bf16 pool in bf16 dot products (a model served in bf16) on vector
    registers and, where the CPU and the OS have them, on AMX tiles."""
    import torch

    _, k, v, tables, lens, _ = _paged_inputs(1, 2048, 32, 8, head_dim, 16, torch.float32, "cpu")
    qc = torch.randn(512, 32, head_dim)
    out = torch.empty_like(qc)
    args_ = (torch.zeros(1, dtype=torch.int64), torch.tensor([512], dtype=torch.int32), lens, tables,
             head_dim**-0.5)
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
    print(f"prefill chunk 512 over 2048, head_dim {head_dim}: {cols}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-bench-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument("--sweep", action="store_true", help="GPU: time other tile/warp/stage choices (tuning)")
    p.add_argument("--cpu", action="store_true",
                   help="the native CPU attention kernels over an fp32 and a bf16 KV pool (--kv-cache-dtype)")
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
