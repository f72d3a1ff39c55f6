"""pagedserve-scheduler: the scheduler service (gRPC front door + engine), waiting for its workers.

Workers connect to --worker-endpoint: --data-parallel-size replicas of --tensor-parallel-size ranks
each. `pagedserve serve` (deploy/launcher.py) starts the scheduler and its workers at once;
`pagedserve deploy` runs them all under a supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import structlog

from protos.base import EXIT_CONFIG, ConfigError
from protos.base.argtypes import Parser
from protos.base.logs import configure_logging, human_bytes
from scheduler_service.api.front_doors import (
    bind_http,
    check_grpc_port,
    start_grpc,
    start_http,
    start_metrics,
    warn_if_open,
)
from scheduler_service.api.http_server import HttpServer
from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.core.pooling import PoolingConfigError
from scheduler_service.options import (
    add_scheduler_args,
    check_model_folder,
    lora_registry,
    scheduler_config,
    served_names,
)
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.worker_client import WorkerClient
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("scheduler.main")


def tune_gc() -> None:
    """Start-up's objects frozen and young collections every 100k objects: a thousand-stream step
    spent as much on collection as on work.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


async def serve(
    args: argparse.Namespace,
    on_bound: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Flags, bind every port, start workers, serve as NOT_SERVING until they join, serve, drain."""

    # one function: the service's life read top to bottom: bind, start, serve, drain
    config, spec, tokenizer = prepare(args)
    names = served_names(args, spec)
    aliases = [spec.name] if spec.name not in names else []  # the config's own name is accepted too
    spec = replace(spec, name=names[0])
    adapters = lora_registry(args, tuple(names + aliases))
    client, endpoint = bind_workers(args, config)
    engine = Engine(
        config, spec, tokenizer, client, worker_restart_timeout=args.worker_restart_timeout
    )
    engine.adapters = adapters
    metrics_port = start_metrics(engine, args)
    warn_if_open(args)
    http_socket = bind_http(args)
    check_grpc_port(args)
    if on_bound is not None:  # every port is ours: the workers load the model while the APIs start
        on_bound(endpoint)
    http = await start_http(engine, names, aliases, args, http_socket)
    server, health, port = await start_grpc(args, engine, endpoint, metrics_port, http)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    error = await wait_for_workers(engine, args.worker_timeout, stop)
    if error is not None:
        log.error("workers_failed", error=str(error))
        await server.stop(0)
        if isinstance(http, HttpServer):
            await http.stop()
        await client.close()
        if isinstance(error, ConfigError):  # a worker refused these flags: one line, exit 2
            raise error
        return 1
    await health.set(True)
    tune_gc()
    log.info(
        "serving",
        address=f"{args.host}:{port}",
        model=spec.name,
        task=spec.task,
        num_blocks=[g.num_blocks for g in client.groups],
        block_size=config.block_size,
        max_context=engine.limits.max_context,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    # one write: the log file is shared
    sys.stdout.write(ready_line(engine, args.host, port, http, args.api_key) + "\n")
    sys.stdout.flush()
    watcher = loop.create_task(_watch_health(engine, health, stop))  # engine.start reported SERVING
    await stop.wait()
    watcher.cancel()
    # Drain: NOT_SERVING at once, running requests get --drain-timeout, then end UNAVAILABLE.
    await health.set(False)
    log.info("draining", requests=len(engine.streams), timeout_s=args.drain_timeout)
    finished = await engine.drain(args.drain_timeout)
    log.info("stopping", drained=finished)
    await server.stop(grace=2.0)
    if isinstance(http, HttpServer):
        await http.stop()
    await engine.stop()
    return 0


def prepare(args: argparse.Namespace) -> tuple[SchedulerConfig, ModelSpec, Tokenizer]:
    """Flags checked together; spec and tokenizer read (the tokenizer warms in a thread)."""
    if args.num_speculative_tokens < 1 or args.speculative_max_rows < 0:
        raise ConfigError(
            "--num-speculative-tokens must be at least 1 and --speculative-max-rows at least 0"
        )
    if not 0.0 < args.embed_slowdown <= 1.0:
        raise ConfigError(f"--embed-slowdown must lie in (0, 1], got {args.embed_slowdown}")
    config = scheduler_config(args)
    check_model_folder(args.model)
    try:
        spec = ModelSpec.from_folder(args.model, args.max_model_len, args.task, args.pooling)
    except PoolingConfigError as e:
        raise ConfigError(str(e)) from None
    # a config.json that is not JSON, or not a model's
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{args.model}/config.json cannot be read as a model's configuration: {e}"
        ) from None
    if args.embed_step_tokens < 0:
        raise ConfigError("--embed-step-tokens must be 0 or positive")
    if not spec.generates:  # nothing to wait behind embeddings: they take the whole budget
        config = replace(config, embed_step_tokens=0)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < spec.max_context:
        raise ConfigError(
            "without chunked prefill --max-num-batched-tokens must be at least the context length"
        )
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        raise ConfigError("--tensor-parallel-size and --data-parallel-size must be at least 1")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    try:
        tokenizer = Tokenizer(args.model)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own kinds
        raise ConfigError(f"{args.model}: the tokenizer cannot be read: {e}") from None
    threading.Thread(target=tokenizer.warm, name="tokenizer-warm", daemon=True).start()
    return config, spec, tokenizer


def bind_workers(args: argparse.Namespace, config: SchedulerConfig) -> tuple[WorkerClient, str]:
    """The ROUTER socket every rank connects to, bound; -> (client, the endpoint bound)."""
    client = WorkerClient(
        args.worker_endpoint,
        args.data_parallel_size,
        args.tensor_parallel_size,
        args.heartbeat_timeout,
        expected={
            "block_size": config.block_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
        },
        curve_keys=args.curve_keys,
        insecure_wire=args.insecure_wire,
        step_timeout=args.step_timeout,
        step_timeout_per_token=args.step_timeout_per_token,
    )
    try:
        endpoint = client.bind()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("worker_socket_bound", endpoint=endpoint)
    return client, endpoint


async def wait_for_workers(
    engine: Engine, timeout: float, stop: asyncio.Event
) -> str | Exception | None:
    """The engine started (every group shook hands), or why not: None on success."""
    loop = asyncio.get_running_loop()
    starting = loop.create_task(engine.start(timeout))
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    # stopped (a signal, or the workers' supervisor gave up) before workers joined
    if not starting.done():
        starting.cancel()
        return "stopped before the workers joined"
    return starting.exception()


def ready_line(
    engine: Engine,
    host: str,
    port: int,
    http: HttpServer | str | None = None,
    api_key: str | None = None,
) -> str:
    """The lines ending start-up on stdout: where each API serves, or why it does not."""
    info = engine.model_info()
    pool_bytes = sum(g.num_blocks * g.bytes_per_block for g in engine.client.groups if g.is_ready)
    where = f"{host}:{port}"
    server = "" if where == "127.0.0.1:50051" else f" --server {where}"
    layout = ""
    if info["tensor_parallel_size"] > 1 or info["data_parallel_size"] > 1:
        layout = (
            f", {info['data_parallel_size']} replica(s) x {info['tensor_parallel_size']} rank(s)"
        )
    command = cli_command()
    cap = engine.config.default_max_tokens
    weights = f", {info['weights']}" if info["weights"] else ""
    keyed = "   (the key: export PAGEDSERVE_API_KEY=...)" if api_key else ""
    lines = [
        f"pagedserve is serving {info['model_name']} ({info['dtype']}{weights}, context "
        f"{info['max_context']:,} tokens{layout}; KV pool {info['num_blocks']:,} blocks x "
        f"{info['block_size']} tokens = "
        f"{human_bytes(pool_bytes)}; requests without max_tokens stop at "
        f"{f'{cap:,} tokens' if cap else 'the end of the context'}{gap_note(engine)}"
        f"{hybrid_note(engine)})",
        f'  gRPC     {where}    try: {command} generate{server} "Write a haiku about the sea"   '
        f"(watch: {command} top{server}){keyed}",
    ]
    if isinstance(http, HttpServer):
        scheme = "https" if http.tls else "http"
        base = f"{scheme}://{host}:{http.port}/v1"
        auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if api_key else ""
        lines.append(
            f"  OpenAI   {base}    try: curl {base}/chat/completions -H 'Content-Type: "
            f'application/json\'{auth} -d \'{{"messages": [{{"role": "user", "content": '
            '"Hi"}], "max_tokens": 50}\'   (also /v1/completions, /v1/responses, /v1/messages)'
        )
    elif http:
        lines.append(f"  OpenAI   {http}")
    return "\n".join(lines)


def gap_note(engine: Engine) -> str:
    """What the ready line says of decodes beside prompts (--max-decode-gap-ms)."""
    c = engine.config
    if not c.max_decode_gap or not c.enable_chunked_prefill:
        return ""
    return f"; a decoding stream waits at most ~{c.max_decode_gap * 1000:.0f} ms beside prompts"


def hybrid_note(engine: Engine) -> str:
    """What the ready line says of a hybrid's state pool and what it turns off."""
    slots = engine.config.state_slots
    if not slots:
        return ""
    per_slot = min(
        sum(w.handshake.bytes_per_state_slot for w in g.workers.values())
        for g in engine.client.groups
    )
    c = engine.config
    prefixes = (
        f"prefix snapshots in {slots - c.max_num_seqs} of them"
        if c.enable_prefix_caching and slots > c.max_num_seqs
        else "no prefix reused"
    )
    return (
        f"; recurrent state {slots} slots x {human_bytes(per_slot)}, {prefixes}; a hybrid: "
        "served without speculative decoding"
    )


def cli_command() -> str:
    """`pagedserve` if on PATH, else the path beside this interpreter."""
    if shutil.which("pagedserve"):
        return "pagedserve"
    beside = Path(sys.executable).parent / "pagedserve"
    if not beside.exists():
        return "pagedserve"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


async def _watch_health(engine: Engine, health, stop: asyncio.Event) -> None:
    """SERVING while any replica serves; every change applied, however short."""
    while not stop.is_set():
        serving = await engine.health_changes.get()
        await health.set(serving)
        log.warning("health_changed", serving=serving, reason=engine.unavailable_reason)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pagedserve-scheduler", description=__doc__)
    add_scheduler_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process="scheduler", log_format=args.log_format)
    try:
        return asyncio.run(serve(args))
    except ConfigError as e:
        sys.stderr.write(f"pagedserve-scheduler: error: {e}\n")
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
