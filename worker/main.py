"""pagedserve-worker: load a model, size the KV pool, connect to the scheduler and run its plans."""

from __future__ import annotations

import argparse
import os
import sys

import structlog

from deploy.logs import configure_logging

log = structlog.get_logger("worker.main")

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve-worker", description=__doc__)
    p.add_argument("--model", required=True, help="Hugging Face folder or .gguf file")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--scheduler", required=True, help="ZeroMQ endpoint of the scheduler, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the memory budget)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV pool memory budget on the CPU, e.g. 2GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: share of the GPU's memory this worker may use (weights, activations, KV pool)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the largest step the scheduler sends (sizes the profiling forward on CUDA)")
    p.add_argument("--attention-backend", default=None, choices=["triton", "torch"],
                   help="default: triton on CUDA, torch on CPU (triton on CPU needs TRITON_INTERPRET=1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--scheduler-timeout", type=float, default=30.0, help="exit when the scheduler is silent this long")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process=f"worker-{args.rank}")
    import torch

    from protos import wire_pb2
    from worker.attention import make_backend
    from worker.kv_pool import KVPool, bytes_per_block, parse_bytes
    from worker.runner import ModelRunner
    from worker.server import WorkerServer
    from worker.sizing import profile_gpu_blocks
    from worker.weights import load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, DTYPES[args.dtype] if args.dtype else ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, config = load_model(args.model, args.load_format, dtype, device, seed=args.seed)
    per_block = bytes_per_block(config, args.block_size, dtype)
    attn = make_backend(args.attention_backend, device)
    if args.num_blocks:
        num_blocks = args.num_blocks
    elif device.type == "cuda":
        num_blocks = profile_gpu_blocks(model, attn, device, dtype, args.block_size, args.max_num_batched_tokens,
                                        args.gpu_memory_utilization)
    else:
        num_blocks = parse_bytes(args.kv_cache_memory) // per_block
    if num_blocks < 1:
        log.error("kv_budget_too_small", kv_cache_memory=args.kv_cache_memory,
                  gpu_memory_utilization=args.gpu_memory_utilization, bytes_per_block=per_block)
        return 2
    pool = KVPool(config, num_blocks, args.block_size, dtype, device)
    runner = ModelRunner(model, pool, attn, device)
    handshake = wire_pb2.Handshake(
        rank=args.rank,
        world_size=args.world_size,
        num_blocks=num_blocks,
        block_size=args.block_size,
        model_fingerprint=config.fingerprint(os.path.basename(os.path.normpath(args.model)) + args.load_format),
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        bytes_per_block=per_block,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention_backend=attn.name,
        pid=os.getpid(),
    )
    log.info("model_loaded", model=args.model, device=str(device), dtype=handshake.dtype, num_blocks=num_blocks,
             attention_backend=attn.name)
    server = WorkerServer(args.scheduler, runner, handshake, scheduler_timeout=args.scheduler_timeout)
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
