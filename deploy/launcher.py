"""Start a scheduler and its workers on one machine: `pagedserve serve` / `make run`.

The scheduler runs in this process; the workers are --data-parallel-size groups of
--tensor-parallel-size ranks, each rank a child process under the group-aware supervisor
(deploy/supervisor.py): a group any rank of which exits is restarted as a whole. Stopping the
launcher (Ctrl-C, SIGTERM) stops every worker.

Worker flags are defined once, by the worker (worker/serve/main.py); the launchers pass them
through.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.prepare_model import model_folder
from deploy.processes import read_port_file
from deploy.supervisor import FatalExit, Program, Supervisor, Unit
from protos.base import EXIT_CONFIG, ConfigError
from protos.base.argtypes import Parser
from protos.base.logs import configure_logging
from scheduler_service.main import serve
from scheduler_service.options import DEFAULT_HTTP_PORT, add_scheduler_args
from worker.serve.main import add_worker_args
from worker.serve.main import build_parser as worker_parser

log = structlog.get_logger("launcher")

# Worker flags the launchers set per rank rather than pass through.
_PER_RANK = {
    "model",
    "scheduler",
    "replica",
    "rank",
    "rendezvous",
    "rendezvous_file",
    "local_rank",
    "curve_keys",
    "log_level",
    "log_format",
}


def passthrough(
    parser: argparse.ArgumentParser, args: argparse.Namespace, skip: set[str]
) -> list[str]:
    """The flags of `parser` whose values in `args` differ from the parser's defaults."""
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(value, list):  # nargs="+": --lora-modules a=/x b=/y
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def worker_units(
    args: argparse.Namespace,
    endpoint: str,
    replicas: list[int] | None = None,
    log_dir: Path | None = None,
    rendezvous_host: str = "127.0.0.1",
) -> list[Unit]:
    """One unit per replica, each rank told its replica, rank and rendezvous."""
    flags = passthrough(worker_parser(), args, _PER_RANK)
    # one an adapter, to --max-loras
    if getattr(args, "lora_modules", None) and args.max_cpu_loras is None:
        flags += ["--max-cpu-loras", str(min(args.max_loras, len(args.lora_modules)))]
    tp = args.tensor_parallel_size
    units = []
    for local_group, d in enumerate(
        replicas if replicas is not None else range(args.data_parallel_size)
    ):
        # rank 0 writes its free port to a file (removed before each start, so none reads a stale
        # one)
        rendezvous = f"tcp://{rendezvous_host}:0" if tp > 1 else ""
        meeting_dir = log_dir or Path(tempfile.gettempdir()) / f"pagedserve-{os.getpid()}"
        meeting = meeting_dir / f"rendezvous-{d}.json"
        programs = []
        for r in range(tp):
            argv = [
                sys.executable,
                "-m",
                "worker.serve.main",
                "--model",
                args.model,
                "--scheduler",
                endpoint,
                "--replica",
                str(d),
                "--rank",
                str(r),
                "--local-rank",
                str(local_group * tp + r),
                "--log-level",
                args.log_level,
                *flags,
            ]
            # JSON logs to a file; a worker on the terminal follows the scheduler
            argv += ["--log-format", "json" if log_dir else getattr(args, "log_format", "auto")]
            if rendezvous:
                argv += ["--rendezvous", rendezvous, "--rendezvous-file", str(meeting)]
            if args.curve_keys:
                argv += ["--curve-keys", args.curve_keys]
            name = f"worker-{d}.{r}"
            programs.append(Program(name, argv, log_dir / f"{name}.log" if log_dir else None))
        units.append(Unit(f"replica-{d}", programs, cleanup=[meeting] if rendezvous else []))
    return units


async def supervise(
    supervisor: Supervisor, stop: asyncio.Event, interval: float = 0.2, failed: list | None = None
) -> None:
    """Poll until stopped; a configuration error stops the service."""
    try:
        while not stop.is_set():
            supervisor.poll()
            await asyncio.sleep(interval)
    except FatalExit as e:
        log.error("worker_config_error", error=str(e))
        if failed is not None:
            failed.append(str(e))
        stop.set()


def warn_if_oversubscribed(args: argparse.Namespace) -> None:
    """More CPU ranks than cores run slower than one rank."""
    from worker.serve.startup import nvidia_gpu_present

    ranks = args.tensor_parallel_size * args.data_parallel_size
    cores = len(os.sched_getaffinity(0))
    on_cpu = args.device == "cpu" or (args.device is None and not nvidia_gpu_present())
    if on_cpu and ranks > cores:
        log.warning(
            "more_ranks_than_cores",
            ranks=ranks,
            cores=cores,
            fix=f"--tp x --dp of at most {cores}: one rank already uses every core",
        )


async def launch(args: argparse.Namespace) -> int:
    warn_if_oversubscribed(args)
    stop = asyncio.Event()
    state: dict = {}

    def start_workers(endpoint: str) -> None:
        supervisor = Supervisor(worker_units(args, endpoint))
        supervisor.start_all()
        state["supervisor"] = supervisor
        state["task"] = asyncio.get_running_loop().create_task(
            supervise(supervisor, stop, failed=failed)
        )

    failed: list[str] = []
    try:
        code = await serve(args, on_bound=start_workers, stop=stop)
        if failed:  # a worker refused its flags or this machine: its own line says why, above
            raise ConfigError(
                f"a worker could not start ({failed[0]}); its reason is in the line above"
            )
        return code
    finally:
        if "task" in state:
            state["task"].cancel()
        if "supervisor" in state:
            state["supervisor"].stop_all()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pagedserve serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_scheduler_args(p)
    add_worker_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process="scheduler", log_format=args.log_format)
    try:
        # a .gguf file: its prepared folder, served on its blocks
        args.model = model_folder(args.model)
        return asyncio.run(launch(args))
    except ConfigError as e:
        sys.stderr.write(f"pagedserve serve: error: {e}\n")
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())


def scheduler_program(
    args: argparse.Namespace, endpoint: str, log_dir: Path, index: int = 0
) -> Program:
    """Server `index`'s scheduler; with several, each binds free ports."""
    from scheduler_service.main import build_parser as scheduler_parser

    flags = passthrough(
        scheduler_parser(),
        args,
        {"worker_endpoint", "model", "port_file", "port", "metrics_port", "http_port"},
    )
    port = args.port if args.servers == 1 or not args.port else args.port + index  # 0: any free one
    metrics = args.metrics_port
    # a port each: any free one, or the one given plus the server's index (0: off)
    if args.servers > 1:
        metrics = -1 if metrics is None or metrics < 0 else (metrics + index if metrics else 0)
    argv = [
        sys.executable,
        "-m",
        "scheduler_service.main",
        "--model",
        args.model,
        "--worker-endpoint",
        endpoint if args.servers == 1 else "tcp://127.0.0.1:0",
        "--port",
        str(port),
        "--port-file",
        str(log_dir / "scheduler.port"),
        *flags,
    ]
    if metrics is not None:
        argv += ["--metrics-port", str(metrics)]
    http = args.http_port
    if http is None and args.gateway:  # the gateway has the default port
        http = -1
    elif http is None and args.servers > 1:
        http = DEFAULT_HTTP_PORT + index
    elif http is not None and args.servers > 1 and http > 0:
        http += index
    if http is not None:
        argv += ["--http-port", str(http)]
    return Program(
        "scheduler" if args.servers == 1 else f"scheduler-{index}", argv, log_dir / "scheduler.log"
    )


def wait_bound(port_file: Path, timeout: float, supervisor: Supervisor) -> dict | None:
    """The ports the scheduler bound (its --port-file), or None after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.poll()
        bound = read_port_file(port_file)
        if bound is not None:
            return bound
        time.sleep(0.2)
    return None


def pin_ports(program: Program, port: int, worker_endpoint: str) -> None:
    """Make a restart of the scheduler bind what its first start bound."""
    argv = program.argv
    for flag, value in (("--port", str(port)), ("--worker-endpoint", worker_endpoint)):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]


def wait_serving(address: str, timeout: float, supervisor: Supervisor) -> bool:
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            supervisor.poll()
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        return False
    finally:
        channel.close()
