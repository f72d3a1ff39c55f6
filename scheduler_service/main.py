"""pagedserve-scheduler: the scheduler service (gRPC front door + engine), waiting for its workers.

Workers connect to --worker-endpoint; `pagedserve serve` (deploy/launcher.py) starts both at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable

import structlog

from deploy.logs import configure_logging
from scheduler_service.config import ModelSpec, SchedulerConfig
from scheduler_service.engine import Engine
from scheduler_service.server import build_server
from scheduler_service.tokenizer import Tokenizer
from scheduler_service.worker_client import WorkerClient

log = structlog.get_logger("scheduler.main")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (config.json + tokenizer files)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--worker-endpoint", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint workers connect to")
    p.add_argument("--world-size", type=int, default=1, help="number of worker ranks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill whole prompts in one step (needs --max-num-batched-tokens >= the context)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse computed blocks across requests")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the model's context")
    p.add_argument("--max-queue-len", type=int, default=1024)
    p.add_argument("--debug-invariants", action="store_true", help="check allocator invariants every step")
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds to wait for workers at start")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--log-level", default="info")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        max_queue_len=args.max_queue_len,
        debug_invariants=args.debug_invariants,
    )


async def serve(args: argparse.Namespace, on_bound: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Bind the worker socket, call on_bound(endpoint) (to start workers), wait for them, serve gRPC."""
    config = scheduler_config(args)
    spec = ModelSpec.from_folder(args.model, args.max_model_len)
    tokenizer = Tokenizer(args.model)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < spec.max_context:
        raise SystemExit("without chunked prefill --max-num-batched-tokens must be at least the context length")
    client = WorkerClient(args.worker_endpoint, args.world_size, args.heartbeat_timeout)
    endpoint = client.bind()
    log.info("worker_socket_bound", endpoint=endpoint)
    engine = Engine(config, spec, tokenizer, client)
    if args.metrics_port:
        engine.metrics.serve(args.metrics_port, args.host)
        log.info("metrics_serving", port=args.metrics_port)
    server, health, port = build_server(engine, f"{args.host}:{args.port}")
    await server.start()
    await health.set(False)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if on_bound is not None:
        on_bound(endpoint)
    try:
        await engine.start(args.worker_timeout)
    except Exception as e:  # noqa: BLE001
        log.error("workers_failed", error=str(e))
        await server.stop(0)
        await client.close()
        return 1
    await health.set(True)
    log.info("serving", address=f"{args.host}:{port}", model=spec.name, num_blocks=client.num_blocks,
             block_size=config.block_size, max_context=engine.limits.max_context)
    watcher = loop.create_task(_watch_health(engine, health, stop))
    await stop.wait()
    watcher.cancel()
    log.info("stopping")
    await health.set(False)
    await server.stop(grace=2.0)
    await engine.stop()
    return 0


async def _watch_health(engine: Engine, health, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.5)
        if not engine.is_serving:
            await health.set(False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-scheduler", description=__doc__)
    add_scheduler_args(p)
    args = p.parse_args(argv)
    configure_logging(args.log_level, process="scheduler")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
