"""Start a scheduler and its workers on one machine: `pagedserve serve` / `make run`.

The scheduler runs in this process; each worker rank is a child process that connects to the
scheduler's ZeroMQ endpoint. Stopping the launcher (Ctrl-C, SIGTERM) stops the workers too.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import structlog

from deploy.logs import configure_logging
from scheduler_service.main import add_scheduler_args, serve

log = structlog.get_logger("launcher")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    g.add_argument("--dtype", default=None)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", default="2GiB", help="KV pool budget on the CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="on CUDA: share of GPU memory to use")
    g.add_argument("--attention-backend", default=None, choices=["triton", "torch"],
                   help="default: triton on CUDA, torch on CPU")
    g.add_argument("--threads", type=int, default=None)


def worker_command(args: argparse.Namespace, endpoint: str, rank: int) -> list[str]:
    cmd = [sys.executable, "-m", "worker.main", "--model", args.model, "--scheduler", endpoint,
           "--rank", str(rank), "--world-size", str(args.world_size), "--block-size", str(args.block_size),
           "--load-format", args.load_format, "--kv-cache-memory", args.kv_cache_memory,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--log-level", args.log_level]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype), ("--num-blocks", args.num_blocks),
                        ("--attention-backend", args.attention_backend), ("--threads", args.threads)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


async def launch(args: argparse.Namespace) -> int:
    workers: list[subprocess.Popen] = []

    def start_workers(endpoint: str) -> None:
        for rank in range(args.world_size):
            cmd = worker_command(args, endpoint, rank)
            workers.append(subprocess.Popen(cmd))
            log.info("worker_started", rank=rank, pid=workers[-1].pid)

    try:
        return await serve(args, on_bound=start_workers)
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve serve", description=__doc__)
    add_scheduler_args(p)
    add_worker_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process="scheduler")
    return asyncio.run(launch(args))


if __name__ == "__main__":
    sys.exit(main())
