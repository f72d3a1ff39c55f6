"""Decode-step benchmark (`make bench-step`): one worker's whole decode step, in process, against
its roofline.

A worker is built as `pagedserve-worker` builds it (weights drawn on the device with `--load-format
dummy`, the default attention backend and matmul, the KV pool, warm-up, decode graphs unless
--enforce-eager), then fed decode plans of `batch` sequences at `context` keys each, as the
scheduler would send them (encoded, decoded, validated, staged, forward, LM head, greedy sampling,
tokens back on the host). Each step writes one new token per sequence; every sequence has its own
blocks, scattered through the pool.

Printed per (batch, context): milliseconds a step run one after the other (launch, read back:
`serial`) and pipelined as the worker serves them (step N+1 launched before step N is read back:
`piped`), the device's forward time (CUDA events), tokens/s (pipelined), and the roofline: the bytes
a decode step must read at least — every weight once and every sequence's keys and values — over the
device-to-device copy bandwidth measured in the same run. `of roof` is roofline time / pipelined
time.

    python -m deploy.bench.step --shape llama3-8b --batch 1 16 64 256 --context 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # Llama-3-8B
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # SmolLM2-135M, the embedded default model
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-0.5B-like shapes: 14/2 heads x 64
    "qwen-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def copy_bandwidth(torch, device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    if device.type != "cuda":
        t = time.perf_counter()
        dst.copy_(src)
        return 2 * nbytes / (time.perf_counter() - t)
    from triton.testing import do_bench

    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def decode_plans(
    batch: int,
    context: int,
    block_size: int,
    width: int,
    first_block: int,
    rng,
    vocab: int,
    steps: int,
    first_step: int,
) -> list:
    """`steps` decode plans reading the previous step's tokens, as overlap sends them."""
    from protos.codec import PlanArrays, encode_plan

    blocks = -(-(context + 1) // block_size)
    ids = first_block + rng.permutation(batch * width)[: batch * blocks].astype(np.int32)
    tables = ids.reshape(batch, blocks)
    pos = np.full(batch, context, dtype=np.int32)
    slots = (
        tables[np.arange(batch), pos // block_size].astype(np.int64) * block_size + pos % block_size
    )
    plans = []
    for i in range(steps):
        step_id = first_step + i
        plans.append(
            encode_plan(
                PlanArrays(
                    step_id=step_id,
                    token_ids=rng.integers(0, vocab, batch).astype(np.int32),
                    positions=pos,
                    slot_mapping=slots,
                    block_tables=tables,
                    seq_lens=pos + 1,
                    query_start_loc=np.arange(batch + 1, dtype=np.int32),
                    do_sample=np.ones(batch, dtype=bool),
                    sample_index=np.zeros(batch, dtype=np.int32),
                    temperature=np.zeros(batch, dtype=np.float32),
                    top_p=np.ones(batch, dtype=np.float32),
                    top_k=np.zeros(batch, dtype=np.int32),
                    seed=np.zeros(batch, dtype=np.uint64),
                    block_copies=np.zeros((0, 2), dtype=np.int32),
                    prev_step_id=step_id - 1 if i else 0,
                    prev_rows=np.arange(batch, dtype=np.int32) if i else None,
                )
            )
        )
    return plans


def run_steps(runner, plans, pipelined: bool) -> tuple[float, float]:
    """(seconds a step, median forward) run one by one, or pipelined as the worker serves."""
    forward = []
    t0 = time.perf_counter()
    before = None
    for wire in plans:
        launched = runner.launch(wire)
        if not hasattr(launched, "clock"):  # a rejected plan: the benchmark's own mistake
            raise SystemExit(f"plan rejected: {launched.error}")
        if pipelined:
            if before is not None:
                forward.append(runner.land(before).time_forward)
            before = launched
        else:
            forward.append(runner.land(launched).time_forward)
    if before is not None:
        forward.append(runner.land(before).time_forward)
    return (time.perf_counter() - t0) / len(plans), statistics.median(forward)


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        prog="pagedserve-bench-step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument(
        "--model",
        default=None,
        help="a model folder instead of --shape (its config; dummy weights)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[2048])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--device", default=None, help="default: cuda (cpu: a smoke run of the script)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)

    import torch

    from worker.model.attention_native import make_backend
    from worker.model.kv_pool import KVPool, bytes_per_block
    from worker.step.graphs import DecodeGraphs
    from worker.step.runner import ModelRunner
    from worker.step.warm_up import warm_up
    from worker.weights.loader import load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        print(
            "bench-step measures a GPU worker: on a CPU it only checks that the script runs",
            file=sys.stderr,
        )
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            cfg = dict(SHAPES[args.shape], model_type="llama", architectures=["LlamaForCausalLM"])
            (folder / "config.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        model, config = load_model(str(folder), "dummy", dtype, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    attn = make_backend(None, device)
    per_block = bytes_per_block(config, args.block_size, dtype)
    max_batch, max_ctx = max(args.batch), max(args.context)
    width = -(-(max_ctx + 1) // args.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        fits = int(
            (free - (total * (1 - args.gpu_memory_utilization)) - 6 * (1 << 30)) // per_block
        )
    else:
        fits = (2 << 30) // per_block
    num_blocks = min(1 + max_batch * width, fits)
    pool = KVPool(config, num_blocks, args.block_size, dtype, device)
    for t in pool.k + pool.v:  # real-looking keys and values, never zeros
        t.normal_()
    runner = ModelRunner(model, pool, attn, device)
    warm_up(runner)
    if not args.enforce_eager and device.type == "cuda":
        runner.graphs = DecodeGraphs(
            model,
            pool,
            attn,
            device,
            max_rows=max_batch,
            max_context=min(config.max_position_embeddings, max(8192, max_ctx + 1)),
        )
        runner.graphs.capture_all()
    bw = copy_bandwidth(torch, device)
    name = args.model or args.shape
    device_name = (
        torch.cuda.get_device_name() if device.type == "cuda" else "CPU (not a speed figure)"
    )
    print(
        f"\ndecode step — {device_name}, {name}, {args.dtype}, block {args.block_size}, "
        f"torch {torch.__version__}, graphs {'off' if args.enforce_eager else 'on'}"
    )
    print(
        f"weights {weight_bytes / 1e9:.2f} GB (drawn on the device in {load_s:.1f} s), pool "
        f"{num_blocks} blocks ({num_blocks * per_block / 1e9:.1f} GB), copy bandwidth "
        f"{bw / 1e12:.2f} TB/s"
    )
    print(
        f"{'batch':>6} {'ctx':>6} {'serial ms':>9} {'piped ms':>9} {'fwd ms':>7} {'tok/s':>9} "
        f"{'roof ms':>8} {'of roof':>8}"
    )
    rows = []
    rng = np.random.default_rng(0)
    step_id = 1
    for batch in args.batch:
        for context in args.context:
            blocks = -(-(context + 1) // args.block_size)
            if 1 + batch * blocks > num_blocks:
                print(
                    f"{batch:>6} {context:>6}  skipped: needs {batch * blocks} blocks, the pool "
                    f"has {num_blocks}"
                )
                continue
            plans = decode_plans(
                batch,
                context,
                args.block_size,
                (num_blocks - 1) // batch,
                1,
                rng,
                config.vocab_size,
                args.steps + 3,
                step_id,
            )
            step_id += len(plans) + 1
            run_steps(runner, plans[:3], pipelined=True)  # warm
            serial, _ = run_steps(runner, plans[3:], pipelined=False)
            plans = decode_plans(
                batch,
                context,
                args.block_size,
                (num_blocks - 1) // batch,
                1,
                rng,
                config.vocab_size,
                args.steps,
                step_id,
            )
            step_id += len(plans) + 1
            piped, fwd = run_steps(runner, plans, pipelined=True)
            kv_bytes = batch * (context + 1) * per_block / args.block_size
            roof = (weight_bytes + kv_bytes) / bw
            row = dict(
                batch=batch,
                context=context,
                serial_ms=serial * 1e3,
                step_ms=piped * 1e3,
                forward_ms=fwd * 1e3,
                tok_s=batch / piped,
                roofline_ms=roof * 1e3,
                of_roofline=roof / piped,
            )
            rows.append(row)
            print(
                f"{batch:>6} {context:>6} {row['serial_ms']:>9.2f} {row['step_ms']:>9.2f} "
                f"{row['forward_ms']:>7.2f} {row['tok_s']:>9.0f} {row['roofline_ms']:>8.2f} "
                f"{row['of_roofline']:>8.0%}"
            )
    if device.type != "cuda":
        return 0
    from kernels.compile_report import print_runtime_report

    print("\nTriton kernels compiled by this run (one row a version):")
    print_runtime_report()
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    device=device_name,
                    shape=name,
                    rows=rows,
                    copy_tb_s=bw / 1e12,
                    weight_gb=weight_bytes / 1e9,
                )
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
