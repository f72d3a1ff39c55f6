"""pagedserve-scheduler: the scheduler service (gRPC front door + engine), waiting for its workers.

Workers connect to --worker-endpoint: --data-parallel-size replicas of --tensor-parallel-size ranks each.
`pagedserve serve` (deploy/launcher.py) starts the scheduler and its workers at once; `pagedserve deploy`
runs them all under a supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import structlog

from protos.base import EXIT_CONFIG, ConfigError
from protos.base.argtypes import Parser
from protos.base.logs import configure_logging, human_bytes
from scheduler_service.api.http_server import HttpServer, bind
from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.core.pooling import PoolingConfigError
from scheduler_service.options import (
    DEFAULT_HTTP_PORT,
    add_scheduler_args,
    check_model_folder,
    lora_registry,
    scheduler_config,
)
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.metrics import DEFAULT_METRICS_PORT
from scheduler_service.runtime.worker_client import WorkerClient
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("scheduler.main")







def tune_gc() -> None:
    """The scheduler process's garbage collector, once serving: what start-up built (tokenizer, model spec,
    modules) moves out of the collector's sight for good, and a young-generation collection waits for
    100k new container objects instead of 700. A step at a thousand streams allocates thousands (deltas,
    futures, handles), and with the defaults the collections walking every live sequence cost as much as
    the step's own work (docs/BENCHMARKS.md, the overlap benchmark)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


async def serve(args: argparse.Namespace, on_bound: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Phases: check the flags and read the model, bind the worker socket and every port, call
    on_bound(endpoint) (to start workers, which load while the rest starts), start HTTP and gRPC
    (NOT_SERVING), wait for the workers, serve until stopped, drain."""
    config, spec, tokenizer = prepare(args)
    names = served_names(args, spec)
    aliases = [spec.name] if spec.name not in names else []  # the config's own name is accepted too
    spec = replace(spec, name=names[0])
    adapters = lora_registry(args, tuple(names + aliases))
    client, endpoint = bind_workers(args, config)
    engine = Engine(config, spec, tokenizer, client, worker_restart_timeout=args.worker_restart_timeout)
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
        log.error("workers_failed", error=error)
        await server.stop(0)
        if isinstance(http, HttpServer):
            await http.stop()
        await client.close()
        return 1
    await health.set(True)
    tune_gc()
    log.info("serving", address=f"{args.host}:{port}", model=spec.name, task=spec.task,
             num_blocks=[g.num_blocks for g in client.groups], block_size=config.block_size,
             max_context=engine.limits.max_context, tensor_parallel_size=args.tensor_parallel_size,
             data_parallel_size=args.data_parallel_size)
    # one write: the log file is shared
    sys.stdout.write(ready_line(engine, args.host, port, http, args.api_key) + "\n")
    sys.stdout.flush()
    watcher = loop.create_task(_watch_health(engine, health, stop))  # engine.start reported SERVING
    await stop.wait()
    watcher.cancel()
    # Drain: NOT_SERVING at once (load balancers stop sending), the port stays open, running requests get
    # --drain-timeout to finish, then the rest end with UNAVAILABLE and a message.
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
    """The flags checked together, the model's spec and tokenizer read (the tokenizer warms in a thread)."""
    if args.num_speculative_tokens < 1 or args.speculative_max_rows < 0:
        raise ConfigError("--num-speculative-tokens must be at least 1 and --speculative-max-rows at least 0")
    if not 0.0 < args.embed_slowdown <= 1.0:
        raise ConfigError(f"--embed-slowdown must lie in (0, 1], got {args.embed_slowdown}")
    config = scheduler_config(args)
    check_model_folder(args.model)
    try:
        spec = ModelSpec.from_folder(args.model, args.max_model_len, args.task, args.pooling)
    except PoolingConfigError as e:
        raise ConfigError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:  # a config.json that is not JSON, or not a model's
        raise ConfigError(f"{args.model}/config.json cannot be read as a model's configuration: {e}") \
            from None
    if args.embed_step_tokens < 0:
        raise ConfigError("--embed-step-tokens must be 0 or positive")
    if not spec.generates:  # nothing to wait behind embeddings: they take the whole budget
        config = replace(config, embed_step_tokens=0)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < spec.max_context:
        raise ConfigError("without chunked prefill --max-num-batched-tokens must be at least the context "
                         "length")
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
        args.worker_endpoint, args.data_parallel_size, args.tensor_parallel_size, args.heartbeat_timeout,
        expected={"block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens},
        curve_keys=args.curve_keys, insecure_wire=args.insecure_wire,
        step_timeout=args.step_timeout, step_timeout_per_token=args.step_timeout_per_token,
    )
    try:
        endpoint = client.bind()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("worker_socket_bound", endpoint=endpoint)
    return client, endpoint




def served_names(args: argparse.Namespace, spec: ModelSpec) -> list[str]:
    """The names the model is served as (`model` in OpenAI requests; the first in the ready line, `info` and
    /v1/models): --served-model-name, else the folder's name, less the hash suffix of a folder prepared
    from a GGUF file (`llama8b-q4km`, not `llama8b-q4km-aade0a0acd1d`)."""
    if args.served_model_name:
        return args.served_model_name
    folder = Path(spec.path or args.model)
    if (folder / "pagedserve_model.json").is_file():
        return [re.sub(r"-[0-9a-f]{12}$", "", folder.name)]
    return [folder.name]


def bind_http(args: argparse.Namespace) -> socket.socket | str:
    """The OpenAI API's socket, bound, or why there is none. Where the default port is taken the service goes
    on without it, saying so; a port given with --http-port that is taken is a ConfigError."""
    if args.http_port == 0:
        return "off (--http-port 0)"
    port = DEFAULT_HTTP_PORT if args.http_port is None else max(args.http_port, 0)
    try:
        return bind(args.host, port)
    except OSError as e:
        if args.http_port is not None:
            raise ConfigError(f"cannot serve HTTP on {args.host}:{port}: {e.strerror or e} (another "
                              "process holds it? --http-port N, or 0 for no HTTP)") from None
        log.warning("http_off", port=port, error=str(e), fix="--http-port N (or -1 for any free port)")
        return f"off: {args.host}:{port} is taken by another process (--http-port N serves it elsewhere)"


async def start_http(engine: Engine, names: list[str], aliases: list[str], args: argparse.Namespace,
                     bound: socket.socket | str) -> HttpServer | str:
    """The OpenAI-compatible HTTP server on its bound socket, listening (it answers 503 until the workers
    join), or why there is none."""
    if isinstance(bound, str):
        return bound
    # the routes' modules (pydantic models, Starlette; half a second) load while the workers start
    from scheduler_service.api.openai_routes import OpenAIServer

    tls = (args.tls_key, args.tls_cert) if args.tls_cert else None
    http = HttpServer(OpenAIServer(engine, names, args.api_key or None, aliases).app, bound, tls)
    await http.start()
    log.info("http_serving", port=http.port, models=names, api_key=bool(args.api_key), tls=bool(tls))
    return http


def warn_if_open(args: argparse.Namespace) -> None:
    """A server reachable beyond this machine with no key: said once, at start."""
    if not args.api_key and not is_loopback(args.host):
        log.warning("serving_without_api_key", host=args.host,
                    fix="--api-key KEY (or $PAGEDSERVE_API_KEY): anyone who reaches this host can use it")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_grpc_port(args: argparse.Namespace) -> None:
    """A gRPC port that is taken, said plainly before gRPC tries (its own failure is a C-core log line and a
    vague error)."""
    if args.port:
        try:
            bind(args.host, args.port).close()
        except OSError as e:
            raise ConfigError(f"cannot serve gRPC on {args.host}:{args.port}: {e.strerror or e} (another "
                              "process holds it? --port N, or 0 for any free port)") from None


async def start_grpc(args: argparse.Namespace, engine: Engine, endpoint: str, metrics_port: int | None,
                     http: HttpServer | str | None = None):
    """The gRPC server started, NOT_SERVING until the workers join; the port file written. -> (server,
    health, port)."""
    try:
        tls = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes()) if args.tls_cert else None
    except OSError as e:
        raise ConfigError(f"cannot read the TLS key or certificate: {e}") from None
    # grpc's modules, loaded while the workers start
    from scheduler_service.api.grpc_server import build_server

    try:
        server, health, port = build_server(engine, f"{args.host}:{args.port}", args.expose_request_ids, tls,
                                            model_dir=args.model, api_key=args.api_key or None)
    except RuntimeError as e:
        raise ConfigError(f"cannot serve gRPC on {args.host}:{args.port}: {e}") from None
    await server.start()
    if args.port_file:
        write_port_file(Path(args.port_file), port, endpoint, metrics_port,
                        http.port if isinstance(http, HttpServer) else None)
    await health.set(False)
    return server, health, port


async def wait_for_workers(engine: Engine, timeout: float, stop: asyncio.Event) -> str | None:
    """The engine started (every group shook hands), or why not: None on success."""
    loop = asyncio.get_running_loop()
    starting = loop.create_task(engine.start(timeout))
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not starting.done():  # stopped (a signal, or the workers' supervisor gave up) before workers joined
        starting.cancel()
        return "stopped before the workers joined"
    if starting.exception() is not None:
        return str(starting.exception())
    return None


def start_metrics(engine: Engine, args: argparse.Namespace) -> int | None:
    """Serve Prometheus metrics: on --metrics-port (-1: any free port); on 9090 when not given, and where
    another process holds 9090 the service goes on without them, saying so. Returns the port, or None."""
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if port == 0:
        return None
    try:
        bound = engine.metrics.serve(max(port, 0), args.host)
    except OSError as e:
        if args.metrics_port is not None:
            raise ConfigError(f"pagedserve-scheduler: cannot serve metrics on port {port}: {e}") from e
        log.warning("metrics_off", port=port, error=str(e), fix="--metrics-port N (or -1 for any free port)")
        return None
    log.info("metrics_serving", port=bound)
    return bound


def write_port_file(path: Path, port: int, worker_endpoint: str, metrics_port: int | None = None,
                    http_port: int | None = None) -> None:
    """What this server bound, written whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "worker_endpoint": worker_endpoint,
                               "metrics_port": metrics_port, "http_port": http_port}) + "\n")
    os.replace(tmp, path)


def ready_line(engine: Engine, host: str, port: int, http: HttpServer | str | None = None,
               api_key: str | None = None) -> str:
    """The lines that end start-up (stdout; the logs go to stderr): where each API serves and how to try it,
    or why it does not serve."""
    info = engine.model_info()
    pool_bytes = sum(g.num_blocks * g.bytes_per_block for g in engine.client.groups if g.is_ready)
    where = f"{host}:{port}"
    server = "" if where == "127.0.0.1:50051" else f" --server {where}"
    layout = ""
    if info["tensor_parallel_size"] > 1 or info["data_parallel_size"] > 1:
        layout = f", {info['data_parallel_size']} replica(s) x {info['tensor_parallel_size']} rank(s)"
    command = cli_command()
    cap = engine.config.default_max_tokens
    weights = f", {info['weights']}" if info["weights"] else ""
    keyed = "   (the key: export PAGEDSERVE_API_KEY=...)" if api_key else ""
    lines = [f"pagedserve is serving {info['model_name']} ({info['dtype']}{weights}, context "
             f"{info['max_context']:,} tokens{layout}; KV pool {info['num_blocks']:,} blocks x "
             f"{info['block_size']} tokens = "
             f"{human_bytes(pool_bytes)}; requests without max_tokens stop at "
             f"{f'{cap:,} tokens' if cap else 'the end of the context'})",
             f"  gRPC     {where}    try: {command} generate{server} \"Write a haiku about the sea\"   "
             f"(watch: {command} top{server}){keyed}"]
    if isinstance(http, HttpServer):
        scheme = "https" if http.tls else "http"
        base = f"{scheme}://{host}:{http.port}/v1"
        auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if api_key else ""
        lines.append(f"  OpenAI   {base}    try: curl {base}/chat/completions -H 'Content-Type: "
                     f"application/json'{auth} -d '{{\"messages\": [{{\"role\": \"user\", \"content\": "
                     "\"Hi\"}], \"max_tokens\": 50}'   (also /v1/completions, /v1/responses, /v1/messages)")
    elif http:
        lines.append(f"  OpenAI   {http}")
    return "\n".join(lines)


def cli_command() -> str:
    """How to type the `pagedserve` command here: its name when it is on PATH, else the path of the one
    beside this interpreter (a virtual environment that is not activated), relative when it is below."""
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
    """SERVING while any replica serves; NOT_SERVING while none does (and SERVING again when a group
    rejoins). Every change the engine reports is applied, however short."""
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
