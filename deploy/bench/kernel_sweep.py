"""`make bench-kernels ARGS=--sweep` on a GPU: other tile, warp and stage choices of the decode and
prefill kernels timed against the shipped ones and flash SDPA, to tune kernels/triton_configs.py."""

from __future__ import annotations

import functools

import torch

from deploy.bench.harness import paged_inputs, time_cuda


def sweep(args) -> None:
    """Time other launch configurations of the decode and prefill kernels at the GPU shapes
    (tuning).
    """

    print(f"\nsweep — {torch.cuda.get_device_name()}, bf16, pages of 16")
    if args.only in (None, "decode"):
        _sweep_decode()
    if args.only in (None, "prefill"):
        square = [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 128, 8)]
        _sweep_prefill(32, 8, 128, square + [(64, 32, 8), (64, 128, 8)])  # Llama-3-8B's heads
        _sweep_prefill(32, 8, 64, square)  # Llama-3.2-1B's
        _sweep_prefill(
            16,
            8,
            256,
            [(32, 16, 8), (32, 32, 8), (32, 32, 4), (64, 16, 8), (64, 32, 8), (32, 64, 8)],
        )


def _sweep_decode() -> None:

    from kernels import triton_attention as ta
    from kernels import triton_configs as tc
    from kernels.compile_report import runtime_report

    dtype, (n_heads, n_kv, head_dim, block) = torch.bfloat16, (32, 8, 128, 16)
    print(f"\ndecode, heads {n_heads}/{n_kv}, head_dim {head_dim}")
    decode_cases = [(64, 2048), (8, 8192), (256, 2048)]
    configs = [
        dict(TILE=t, num_warps=w, num_stages=st)
        for t in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3)
    ]
    cases = " ".join(f"{b}x{c:>5}" for b, c in decode_cases)
    print(f"{'kernel':<8} {'config':<36} {'regs':>5} {'spills':>6} " + cases)
    inputs = [
        paged_inputs(b, c, n_heads, n_kv, head_dim, block, dtype, "cuda") for b, c in decode_cases
    ]
    for cfg in configs:
        tc.override("decode", cfg)
        times = []
        for (q, kc, vc, tables, lens, qsl), (_, c) in zip(inputs, decode_cases, strict=True):
            times.append(
                time_cuda(
                    functools.partial(
                        ta.paged_attention,
                        q,
                        kc,
                        vc,
                        tables,
                        lens,
                        qsl,
                        head_dim**-0.5,
                        max_seq_len=c,
                        max_q_len=1,
                    )
                )
            )
        v = runtime_report()["decode_split_kernel"][0]
        label = ",".join(f"{k}={x}" for k, x in cfg.items())
        print(
            f"{'decode':<8} {label:<36} {v['regs']!s:>5} {v['spills']!s:>6} "
            + " ".join(f"{t * 1e3:>8.3f}" for t in times)
        )
    tc.OVERRIDES.pop("decode", None)


def _sweep_prefill(n_heads: int, n_kv: int, head_dim: int, shapes) -> None:
    """Each shape at 2 and 3 stages, checked against flash SDPA, then timed beside it."""
    import torch.nn.functional as F

    from kernels import triton_attention as ta
    from kernels import triton_configs as tc
    from kernels.compile_report import runtime_report

    dtype, block = torch.bfloat16, 16
    print(f"\nprefill, heads {n_heads}/{n_kv}, head_dim {head_dim}")
    cases = []
    for n in (1024, 4096):
        _, kc, vc, tables, _, _ = paged_inputs(1, n, n_heads, n_kv, head_dim, block, dtype, "cuda")
        q = torch.randn(n, n_heads, head_dim, dtype=dtype, device="cuda")
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        # the same keys laid out contiguously, in sequence order, for SDPA
        k = kc[tables[0].long()].reshape(n, n_kv, head_dim).transpose(0, 1)[None].contiguous()
        v = vc[tables[0].long()].reshape(n, n_kv, head_dim).transpose(0, 1)[None].contiguous()
        qs = q.transpose(0, 1)[None].contiguous()
        sdpa = functools.partial(
            F.scaled_dot_product_attention, qs, k, v, is_causal=True, enable_gqa=True
        )
        ref = sdpa()[0].transpose(0, 1).float()
        cases.append((n, q, kc, vc, tables, lens, qsl, ref, time_cuda(sdpa)))
    print(
        "flash SDPA: "
        + ", ".join(
            f"{n} tokens {t * 1e3:.3f} ms "
            f"({4 * n * n * n_heads * head_dim / 2 / t / 1e12:.0f} "
            "TFLOP/s)"
            for n, *_, t in cases
        )
    )
    configs = [
        dict(BLOCK_M=bm, TILE=tile, num_warps=w, num_stages=st)
        for bm, tile, w in shapes
        for st in (2, 3)
    ]
    names = " ".join(f"{n:>6} ms x sdpa" for n, *_ in cases)
    print(f"{'config':<58} {'regs':>5} {'spills':>6} {'err':>8} " + names)
    for cfg in configs:
        tc.override("prefill", cfg)
        label = ",".join(f"{k}={x}" for k, x in cfg.items())
        cols = []
        try:
            err = 0.0
            for n, q, kc, vc, tables, lens, qsl, ref, t_sdpa in cases:
                run = functools.partial(
                    ta.paged_attention,
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
                out = run().float()
                err = max(err, float((out - ref).norm() / ref.norm()))
                t = time_cuda(run)
                cols.append(f"{t * 1e3:>9.3f} {t_sdpa / t:>6.2f}")
        except Exception as e:  # noqa: BLE001 - out of shared memory, a compiler refusal
            print(f"{label:<58} {type(e).__name__}: {str(e)[:80]}")
            continue
        v = runtime_report()["prefill_kernel"][0]
        print(
            f"{label:<58} {v['regs']!s:>5} {v['spills']!s:>6} {err:>8.1e} " + " ".join(cols),
            flush=True,
        )
    tc.OVERRIDES.pop("prefill", None)
