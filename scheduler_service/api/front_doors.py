"""The front doors, bound before the workers load: HTTP, gRPC, metrics, the port file. A taken port
given by flag is a ConfigError; a taken default is skipped with a word.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
from pathlib import Path

import structlog

from protos.base import ConfigError
from scheduler_service.api.http_server import HttpServer, bind
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.metrics import DEFAULT_METRICS_PORT

log = structlog.get_logger("scheduler.main")

DEFAULT_HTTP_PORT = 8000


def bind_http(args: argparse.Namespace) -> socket.socket | str:
    """The HTTP socket, or why none: a taken default port is skipped, a taken --http-port fails."""
    if args.http_port == 0:
        return "off (--http-port 0)"
    port = DEFAULT_HTTP_PORT if args.http_port is None else max(args.http_port, 0)
    try:
        return bind(args.host, port)
    except OSError as e:
        if args.http_port is not None:
            raise ConfigError(
                f"cannot serve HTTP on {args.host}:{port}: {e.strerror or e} (another "
                "process holds it? --http-port N, or 0 for no HTTP)"
            ) from None
        log.warning(
            "http_off", port=port, error=str(e), fix="--http-port N (or -1 for any free port)"
        )
        return (
            f"off: {args.host}:{port} is taken by another process (--http-port N serves it "
            "elsewhere)"
        )


async def start_http(
    engine: Engine,
    names: list[str],
    aliases: list[str],
    args: argparse.Namespace,
    bound: socket.socket | str,
) -> HttpServer | str:
    """The OpenAI server on its socket, answering 503 until the workers join."""
    if isinstance(bound, str):
        return bound
    # the routes' modules (pydantic models, Starlette; half a second) load while the workers start
    from scheduler_service.api.openai_routes import OpenAIServer

    tls = (args.tls_key, args.tls_cert) if args.tls_cert else None
    http = HttpServer(OpenAIServer(engine, names, args.api_key or None, aliases).app, bound, tls)
    await http.start()
    log.info(
        "http_serving", port=http.port, models=names, api_key=bool(args.api_key), tls=bool(tls)
    )
    return http


def warn_if_open(args: argparse.Namespace) -> None:
    """A server reachable beyond this machine with no key: said once, at start."""
    if not args.api_key and not is_loopback(args.host):
        log.warning(
            "serving_without_api_key",
            host=args.host,
            fix="--api-key KEY (or $PAGEDSERVE_API_KEY): anyone who reaches this host can use it",
        )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_grpc_port(args: argparse.Namespace) -> None:
    """A taken gRPC port said plainly: gRPC's own failure is vague."""
    if args.port:
        try:
            bind(args.host, args.port).close()
        except OSError as e:
            raise ConfigError(
                f"cannot serve gRPC on {args.host}:{args.port}: {e.strerror or e} (another "
                "process holds it? --port N, or 0 for any free port)"
            ) from None


async def start_grpc(
    args: argparse.Namespace,
    engine: Engine,
    endpoint: str,
    metrics_port: int | None,
    http: HttpServer | str | None = None,
):
    """The gRPC server, NOT_SERVING until the workers join -> (server, health, port)."""
    try:
        tls = (
            (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
            if args.tls_cert
            else None
        )
    except OSError as e:
        raise ConfigError(f"cannot read the TLS key or certificate: {e}") from None
    # grpc's modules, loaded while the workers start
    from scheduler_service.api.grpc_server import build_server

    try:
        server, health, port = build_server(
            engine,
            f"{args.host}:{args.port}",
            args.expose_request_ids,
            tls,
            model_dir=args.model,
            api_key=args.api_key or None,
        )
    except RuntimeError as e:
        raise ConfigError(f"cannot serve gRPC on {args.host}:{args.port}: {e}") from None
    await server.start()
    if args.port_file:
        write_port_file(
            Path(args.port_file),
            port,
            endpoint,
            metrics_port,
            http.port if isinstance(http, HttpServer) else None,
        )
    await health.set(False)
    return server, health, port


def start_metrics(engine: Engine, args: argparse.Namespace) -> int | None:
    """Prometheus on --metrics-port (-1: any), else 9090 if free; the port or None."""
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if port == 0:
        return None
    try:
        bound = engine.metrics.serve(max(port, 0), args.host)
    except OSError as e:
        if args.metrics_port is not None:
            raise ConfigError(
                f"pagedserve-scheduler: cannot serve metrics on port {port}: {e}"
            ) from e
        log.warning(
            "metrics_off", port=port, error=str(e), fix="--metrics-port N (or -1 for any free port)"
        )
        return None
    log.info("metrics_serving", port=bound)
    return bound


def write_port_file(
    path: Path,
    port: int,
    worker_endpoint: str,
    metrics_port: int | None = None,
    http_port: int | None = None,
) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "port": port,
                "worker_endpoint": worker_endpoint,
                "metrics_port": metrics_port,
                "http_port": http_port,
            }
        )
        + "\n"
    )
    os.replace(tmp, path)
