"""The default model on its own GGUF blocks against the same model dequantized to fp32: `make
bench-quantized`.

Same run, one server after the other on the same machine:
  - one stream: the workload's first prompt (64 tokens), 128 tokens greedy, ignore_eos, a few times;
    decode tokens/s = (tokens - 1) / (end - first token), and the whole request's tokens/s;
  - 64 streams: the fixed CPU workload (../shared/bench), all at once: output tokens/s and mean
    TTFT;
  - agreement: the first 16 greedy answers of each server compared with fp32's token by token
    (identical answers, and where the others first differ), with the logprob of each chosen token
    compared where both agree.

    python -m deploy.bench.quantized --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, load_workload
from protos import generation_pb2
from tests.support.server import ServerProcess


def one_stream(
    server: ServerProcess, prompts: list[list[int]], max_tokens: int, repeats: int
) -> dict:
    """A new prompt each repeat: a repeated one would draft its earlier answer."""
    decode, whole = [], []
    for r in range(repeats):
        sampling = generation_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompts[r % len(prompts)], sampling=sampling
        )
        t0 = time.perf_counter()
        first = None
        n = 0
        for msg in server.stub.GenerateStream(req, timeout=600):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            n += len(msg.token_ids)
        end = time.perf_counter()
        decode.append((n - 1) / (end - first))
        whole.append(n / (end - t0))
    return {"decode_tok_s": statistics.median(decode), "request_tok_s": statistics.median(whole)}


def answers(server: ServerProcess, prompts: list[list[int]], max_tokens: int) -> list:
    out = []
    for p in prompts:
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=p,
            sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0
            ),
        )
        c = server.stub.Generate(req, timeout=600).choices[0]
        out.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
    return out


def measure(args, name: str, extra: list[str], prompts) -> dict:
    log = Path(tempfile.mkdtemp(prefix=f"pagedserve-bench-{name}-")) / "server.log"
    server = ServerProcess(
        Path(args.model),
        log,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--metrics-port",
        "0",
        *extra,
    ).start(timeout=600)
    try:
        asyncio.run(drive(server.address, prompts[:2], 4))  # warm-up
        row = {"name": name, **one_stream(server, prompts, args.max_tokens, args.repeats)}
        wall, ttfts, tokens = asyncio.run(drive(server.address, prompts, args.max_tokens))
        row.update(many_tok_s=tokens / wall, many_mean_ttft_s=statistics.mean(ttfts))
        row["answers"] = answers(server, prompts[: args.agreement], args.agreement_tokens)
        row["log"] = str(log)
    finally:
        server.stop()
    return row


def agreement(a: list, b: list) -> dict:
    same = sum(x[0] == y[0] for x, y in zip(a, b, strict=True))
    firsts = [
        next(i for i, (s, t) in enumerate(zip(x[0], y[0], strict=True)) if s != t)
        for x, y in zip(a, b, strict=True)
        if x[0] != y[0]
    ]
    diffs = [
        abs(u - v)
        for x, y in zip(a, b, strict=True)
        for s, t, u, v in zip(x[0], y[0], x[1], y[1], strict=True)
        if s == t
    ]
    return {
        "identical": same,
        "of": len(a),
        "first_difference_at": sorted(firsts),
        "max_abs_logprob_difference": max(diffs, default=0.0),
        "mean_abs_logprob_difference": statistics.mean(diffs) if diffs else 0.0,
    }


def kernel_bandwidth(
    types=("Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"), rows: int = 1, reps: int = 30
) -> None:
    """GB/s of the quantized kernels on 8192 x 2048 matrices, packed and not, beside a read."""
    import numpy as np
    import torch

    from deploy.bench.harness import median_time
    from kernels import cpu_native
    from worker.model.quant_weights import QUANT_TYPES, QuantWeight
    from worker.model.quantized import QuantizedMatmul

    kernels = cpu_native.load()
    lib = QuantizedMatmul(kernels, dense=None, max_kernel_rows=1 << 20, packing=True, pack_q8=True)
    lib8 = QuantizedMatmul(
        kernels,
        dense=None,
        max_kernel_rows=1 << 20,
        packing=True,
        pack_q8=True,
        int8_activations=True,
    )

    def timed(fn) -> float:  # one untimed call (first touch), then the median
        fn()
        return median_time(fn, reps)

    big = torch.randn(64 << 20)
    print(
        f"native ISA {kernels.isa}, packed fast {kernels.packed_fast}, {torch.get_num_threads()} "
        f"threads; a plain read: {big.numel() * 4 / timed(big.sum) / 1e9:.1f} GB/s"
    )
    print(
        f"{'type':6} {'packed ms':>10} {'GB/s':>6} {'8-bit x ms':>11} {'GB/s':>6} "
        f"{'file layout ms':>15} {'GB/s':>6}"
    )
    rng = np.random.default_rng(0)
    x = torch.randn(rows, 2048)
    for qtype in types:
        _, values, bb = QUANT_TYPES[qtype]
        mats = []
        for _ in range(12):
            blocks = rng.integers(0, 256, (8192, 2048 // values, bb), dtype=np.uint8)
            # finite fp16 scales where the type keeps them
            scale = np.array([0.01], dtype=np.float16).view(np.uint8)
            if qtype == "Q6_K":
                blocks[..., 208:210] = scale
            else:
                blocks[..., 0:2] = scale
                if qtype in ("Q4_K", "Q5_K", "Q4_1"):
                    blocks[..., 2:4] = scale
            w = QuantWeight(torch.from_numpy(blocks.reshape(8192, -1)), qtype, 2048)
            mats.append((w, lib.pack(w)))
        t_packed = timed(lambda mats=mats: [lib.kernel(x, p) for _, p in mats])
        t_8 = timed(lambda mats=mats: [lib8.kernel(x, p) for _, p in mats])
        t_file = timed(lambda mats=mats: [lib.kernel(x, w) for w, _ in mats])
        n_packed = sum(p.nbytes for _, p in mats)
        n_file = sum(w.nbytes for w, _ in mats)
        print(
            f"{qtype:6} {t_packed * 1e3:>10.2f} {n_packed / t_packed / 1e9:>6.1f} "
            f"{t_8 * 1e3:>11.2f} {n_packed / t_8 / 1e9:>6.1f} {t_file * 1e3:>15.2f} "
            f"{n_file / t_file / 1e9:>6.1f}"
        )


def kernel_ab(
    against: str,
    types=("Q4_K", "Q5_K", "Q6_K", "Q4_1", "MXFP4"),
    rows: int = 1,
    passes: int = 40,
    bits=(16, 8),
) -> None:
    """This tree's kernels against another build's, one process, alternating passes."""
    import ctypes

    import numpy as np
    import torch

    from kernels import cpu_native
    from worker.model.quant_weights import QUANT_TYPES, QuantWeight
    from worker.model.quantized import QuantizedMatmul

    builds = [cpu_native.load(), cpu_native.NativeKernels(ctypes.CDLL(against), Path(against))]
    rng = np.random.default_rng(0)
    x = torch.randn(rows, 2048)
    print(f"{rows} activation rows, {torch.get_num_threads()} threads; GB/s: this tree / {against}")
    for qtype in types:
        _, values, bb = QUANT_TYPES[qtype]
        blocks = rng.integers(0, 256, (24, 8192, 2048 // values, bb), dtype=np.uint8)
        scale = np.array([0.01], dtype=np.float16).view(np.uint8)  # finite fp16 scales
        if qtype == "MXFP4":  # an E8M0 exponent byte: 2^-7
            blocks[..., 0] = 120
        for at in () if qtype == "MXFP4" else (208,) if qtype == "Q6_K" else (0, 2):
            blocks[..., at : at + 2] = scale
        for nbits in bits:
            libs = [
                QuantizedMatmul(
                    k,
                    dense=None,
                    max_kernel_rows=1 << 20,
                    packing=True,
                    pack_q8=True,
                    int8_activations=nbits == 8,
                )
                for k in builds
            ]
            mats = [
                libs[0].pack(QuantWeight(torch.from_numpy(b.reshape(8192, -1)), qtype, 2048))
                for b in blocks
            ]
            ys = [[lib.kernel(x, m) for m in mats] for lib in libs]
            diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(*ys, strict=True))
            times: list[list[float]] = [[], []]
            for p in range(passes):
                for i in (0, 1) if p % 2 else (1, 0):
                    t = time.perf_counter()
                    for m in mats:
                        libs[i].kernel(x, m)
                    times[i].append(time.perf_counter() - t)
            nbytes = sum(m.nbytes for m in mats)
            a, b = (statistics.median(t[2:]) for t in times)
            same = "the same" if diff == 0 else f"apart by {diff:.1e} of the largest"
            macs = len(mats) * 8192 * 2048 * rows / 1e9  # multiply-adds a pass
            print(
                f"{qtype:5} {nbits:2}-bit  {nbytes / a / 1e9:6.1f} / {nbytes / b / 1e9:6.1f} GB/s"
                f"  {macs / a:6.1f} / {macs / b:6.1f} GMAC/s  x{b / a:.2f}  outputs {same}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="only the quantized kernels' own speed, per type (GB/s)",
    )
    p.add_argument("--rows", type=int, default=1, help="with --kernels: activation rows")
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q4_1,MXFP4", help="with --against")
    p.add_argument("--bits", default="16,8", help="with --against: activation widths")
    p.add_argument(
        "--passes", type=int, default=40, help="with --against (the first two warm up, uncounted)"
    )
    p.add_argument(
        "--against",
        metavar="LIB",
        help="with --kernels: this tree's packed kernels against "
        "another build's native library, in alternating passes",
    )
    p.add_argument("--model")
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--agreement", type=int, default=16, help="prompts whose greedy answers are compared"
    )
    p.add_argument("--agreement-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument(
        "--with-int8", action="store_true", help="a third server with --quantized-activations int8"
    )
    args = p.parse_args(argv)
    if args.passes < 3:
        p.error("--passes: at least 3 (the first two passes warm up and are not counted)")
    if args.kernels and args.against:
        kernel_ab(
            args.against,
            types=tuple(args.types.split(",")),
            rows=args.rows,
            passes=args.passes,
            bits=tuple(int(b) for b in args.bits.split(",")),
        )
        return 0
    if args.kernels:
        kernel_bandwidth(rows=args.rows)
        return 0
    if not args.model:
        p.error("--model is required (or --kernels)")
    prompts = load_workload(args.workload)
    rows = [
        measure(args, "fp32 (dequantized)", ["--dequantize"], prompts),
        measure(args, "GGUF blocks (Q4_1, head Q8_0)", [], prompts),
    ]
    if args.with_int8:
        rows.append(
            measure(
                args, "GGUF blocks, int8 activations", ["--quantized-activations", "int8"], prompts
            )
        )
    base = rows[0]
    print(
        f"{'':32} {'1 stream decode':>16} {'1 stream request':>17} {'64 streams':>11} "
        f"{'mean TTFT':>10}"
    )
    for r in rows:
        print(
            f"{r['name']:32} {r['decode_tok_s']:11.1f} tok/s {r['request_tok_s']:12.1f} tok/s "
            f"{r['many_tok_s']:11.1f} {r['many_mean_ttft_s']:9.2f}s   "
            f"x{r['decode_tok_s'] / base['decode_tok_s']:.2f} one stream, "
            f"x{r['many_tok_s'] / base['many_tok_s']:.2f} many"
        )
    for other in rows[1:]:
        agree = agreement(rows[0]["answers"], other["answers"])
        print(
            f"{other['name']} against fp32, greedy over {args.agreement_tokens} tokens: "
            f"{agree['identical']}/{agree['of']} identical answers; others first differ at "
            f"{agree['first_difference_at']}; chosen-token logprob difference max "
            f"{agree['max_abs_logprob_difference']:.2e}, mean "
            f"{agree['mean_abs_logprob_difference']:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
