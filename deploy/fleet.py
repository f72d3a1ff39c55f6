"""`pagedserve deploy` / `make deploy`: the scheduler service and TP x DP worker processes under the
group-aware supervisor (deploy/supervisor.py), one log file per process under a run directory.

It waits for the service's health to be SERVING, prints the address, the processes and where their
logs are, then watches: a process that exits is restarted with its unit (a worker group restarts as
a whole, and when the scheduler restarts every group follows it). Ctrl-C or SIGTERM (`make
deploy-stop`) stops every process. With --workers-only it runs only worker groups, for another host,
connecting to a scheduler given by --scheduler.

--servers N runs N independent servers (each its own scheduler, workers and pool: the shape of a
fleet on N hosts), each in a folder of the run directory; --gateway puts SMG (deploy/gateway.py) in
front of them, its OpenAI-compatible HTTP on --gateway-host:--gateway-port, routing with
--gateway-policy (cache_aware: a request goes to the server whose cache holds the longest part of
its prompt). Stopping drains the schedulers first, the gateway still carrying their answers, then
stops the gateway and the workers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from deploy.gateway import gateway_metrics_port
from deploy.launcher import (
    pin_ports,
    scheduler_program,
    wait_bound,
    wait_serving,
    worker_units,
)
from deploy.prepare_model import model_folder
from deploy.supervisor import FatalExit, Program, Supervisor, Unit
from protos.base import EXIT_CONFIG, ConfigError
from protos.base.argtypes import PORT, Parser
from protos.base.logs import configure_logging
from scheduler_service.options import add_scheduler_args, check_model_folder
from worker.serve.main import add_worker_args

log = structlog.get_logger("deploy")

ROOT = Path(__file__).resolve().parent.parent


# every supervised process: lines written as they come, no colour codes in the log files
FLEET_ENV = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pagedserve deploy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_scheduler_args(p)
    add_worker_args(p)
    d = p.add_argument_group("deploy")
    d.add_argument("--run-dir", default="run/deploy", help="logs and the pid file go here")
    d.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for health SERVING"
    )
    d.add_argument(
        "--workers-only",
        action="store_true",
        help="run worker groups only (another host), connecting to --scheduler",
    )
    d.add_argument(
        "--scheduler", default=None, help="with --workers-only: the scheduler's ZeroMQ endpoint"
    )
    d.add_argument(
        "--replicas",
        default=None,
        help="comma-separated replicas whose workers run on this host (default: all; '' for none, "
        "when every worker runs elsewhere)",
    )
    d.add_argument(
        "--rendezvous-host",
        default="127.0.0.1",
        help="address of this host that the ranks of its tensor-parallel groups reach each other "
        "on",
    )
    d.add_argument(
        "--servers",
        type=int,
        default=1,
        help="independent servers (scheduler + workers each); more than one take consecutive gRPC "
        "and HTTP ports from --port and --http-port (8000), any free ones with --port 0",
    )
    g = p.add_argument_group("gateway (SMG in front: OpenAI-compatible HTTP)")
    g.add_argument("--gateway", action="store_true", help="start SMG in front of the servers")
    g.add_argument("--gateway-host", default="127.0.0.1", help="where the gateway listens")
    g.add_argument(
        "--gateway-port",
        type=PORT,
        default=8000,
        help="the gateway's HTTP port (each server's own OpenAI API then takes any free port)",
    )
    g.add_argument(
        "--gateway-policy",
        default="cache_aware",
        choices=[
            "cache_aware",
            "round_robin",
            "random",
            "power_of_two",
            "least_load",
            "prefix_hash",
            "consistent_hashing",
        ],
        help="how the gateway picks a server",
    )
    g.add_argument(
        "--gateway-metrics-port",
        type=int,
        default=None,
        help="the gateway's Prometheus port (default 29000, or any free port where 29000 is taken)",
    )
    return p


def stop_command(run_dir: Path) -> str:
    """The make command that stops the deployment running from run_dir."""
    try:
        where = str(run_dir.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        where = str(run_dir)
    return "make deploy-stop" + ("" if where == "run/deploy" else f" RUN_DIR={where}")


def summary(
    addresses: list[str],
    supervisor: Supervisor,
    run_dir: Path,
    gateway: list[str] | None = None,
    http_urls: list[str | None] | None = None,
) -> str:
    lines = list(gateway or [])
    for i, address in enumerate(addresses):
        lines += [
            f"pagedserve is serving on {address}",
            f'  try: .venv/bin/pagedserve generate --server {address} "What is the capital of '
            'France?"',
        ]
        url = (http_urls or [])[i] if i < len(http_urls or []) else None
        if url:
            lines.append(f"  OpenAI API: {url}   (curl {url}/models)")
    lines.append(f"processes (logs in {run_dir}/):")
    for unit in supervisor.units:
        for prog, proc in zip(unit.programs, unit.procs, strict=True):
            lines.append(f"  {prog.name:<14} pid {proc.pid:<8} {prog.log_path}")
    lines.append(f"stop: Ctrl-C, or `{stop_command(run_dir)}` (kill -TERM {os.getpid()})")
    return "\n".join(lines)


@dataclass
class Fleet:
    """A deployment's supervised processes: schedulers and the workers that follow each."""

    supervisor: Supervisor
    schedulers: list[Unit]
    dirs: list[Path]
    followers: dict[str, list[Unit]] = field(default_factory=dict)
    http_urls: list[str | None] = field(default_factory=list)  # each server's OpenAI API, as bound


def refuse_second_deployment(pid_file: Path) -> str | None:
    """Why this run folder cannot take another deployment, or None."""
    if not pid_file.exists():
        return None
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (ProcessLookupError, ValueError):
        return None  # a stale pid file
    return (
        f"a deployment is already running from {pid_file.parent} (pid "
        f"{pid_file.read_text().strip()}); stop it first (`{stop_command(pid_file.parent)}`)"
    )


def plan_fleet(args, run_dir: Path, replicas: list[int] | None) -> Fleet:
    """The first units: each scheduler, or under --workers-only this host's workers."""
    if args.workers_only:
        units = worker_units(args, args.scheduler, replicas, run_dir, args.rendezvous_host)
        return Fleet(Supervisor(units, env=FLEET_ENV, cwd=ROOT), [], [])
    # each scheduler starts first and says its ports; its workers follow, and a restart binds the
    # same ports so workers, clients and the gateway find it
    dirs = (
        [run_dir] if args.servers == 1 else [run_dir / f"server-{i}" for i in range(args.servers)]
    )
    units = []
    for i, folder in enumerate(dirs):
        folder.mkdir(parents=True, exist_ok=True)
        program = scheduler_program(args, args.worker_endpoint, folder, i)
        units.append(Unit(program.name, [program]))
    return Fleet(
        Supervisor(units, env=FLEET_ENV, cwd=ROOT), list(units), dirs, {u.name: [] for u in units}
    )


def start_servers(args, fleet: Fleet, replicas: list[int] | None) -> list[str]:
    """Start every unit, each scheduler's workers once it binds -> the servers' addresses."""
    for folder in fleet.dirs:
        # a file from an earlier run says nothing
        (folder / "scheduler.port").unlink(missing_ok=True)
    fleet.supervisor.start_all()
    addresses = []
    for sched, folder in zip(fleet.schedulers, fleet.dirs, strict=True):
        bound = wait_bound(folder / "scheduler.port", args.ready_timeout, fleet.supervisor)
        if bound is None:
            return []
        addresses.append(f"{args.host}:{bound['port']}")
        http = bound.get("http_port")
        fleet.http_urls.append(f"http://{args.host}:{http}/v1" if http else None)
        pin_ports(sched.programs[0], bound["port"], bound["worker_endpoint"])
        for unit in worker_units(
            args, bound["worker_endpoint"], replicas, folder, args.rendezvous_host
        ):
            if args.servers > 1:
                unit.name = f"{sched.name}/{unit.name}"
            fleet.followers[sched.name].append(unit)
            fleet.supervisor.units.append(unit)
            fleet.supervisor.start(unit)
    return addresses


def start_gateway(args, fleet: Fleet, addresses: list[str], run_dir: Path) -> list[str]:
    """SMG in front of the servers, supervised; raises if it does not come up."""
    from deploy.gateway import gateway_banner, smg_command, wait_ready
    from scheduler_service.core.config import ModelSpec
    from scheduler_service.main import served_names

    gateway = Program(
        "gateway",
        smg_command(
            addresses,
            args.gateway_host,
            args.gateway_port,
            args.model,
            args.gateway_policy,
            gateway_metrics_port(args),
        ),
        run_dir / "gateway.log",
    )
    unit = Unit("gateway", [gateway])
    fleet.supervisor.units.append(unit)
    fleet.supervisor.start(unit)
    base_url = f"http://{args.gateway_host}:{args.gateway_port}"
    wait_ready(
        base_url,
        len(addresses),
        args.ready_timeout,
        alive=lambda: (fleet.supervisor.poll(), unit.restarts == 0)[1],
    )
    # the one name the servers serve
    name = served_names(args, ModelSpec.from_folder(args.model))[0]
    return gateway_banner(base_url, name, len(addresses))


def watch(fleet: Fleet, stopping: dict) -> None:
    """Restart what exits until a signal; a restarted scheduler takes its workers with it."""
    restarts = {u.name: u.restarts for u in fleet.schedulers}
    while stopping["signal"] is None:
        fleet.supervisor.poll()
        for sched in fleet.schedulers:
            if sched.restarts != restarts[sched.name]:
                restarts[sched.name] = sched.restarts
                for unit in fleet.followers[sched.name]:
                    for proc in unit.procs:
                        proc.terminate()
        time.sleep(0.2)


def stop(args, fleet: Fleet) -> None:
    """Schedulers first (they drain with workers up), then gateway and workers."""
    drain = getattr(args, "drain_timeout", 30.0) + 15.0
    if args.workers_only:
        fleet.supervisor.wait_exit(drain)
    fleet.supervisor.stop_all(first=[u.name for u in fleet.schedulers], first_timeout=drain)


def check_fleet(args) -> None:
    """The model made a folder and checked; incompatible flags refused with ConfigError."""
    args.model = model_folder(args.model)
    check_model_folder(args.model)
    if args.gateway and args.api_key:
        raise ConfigError(
            "--api-key with --gateway: SMG 1.13 sends no key to the servers it drives over "
            "gRPC, so a keyed server cannot sit behind it; serve the fleet behind the gateway "
            "on loopback without a key (and guard the gateway's port), or give each server its "
            "key and no gateway"
        )


def main(argv: list[str] | None = None) -> int:

    # one function: a command read top to bottom: plan, start, watch, stop
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process="deploy", log_format=args.log_format)
    try:
        check_fleet(args)
    except ConfigError as e:
        sys.stderr.write(f"pagedserve deploy: error: {e}\n")
        return EXIT_CONFIG
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_file = run_dir / "deploy.pid"
    why = refuse_second_deployment(pid_file)
    if why:
        print(why, file=sys.stderr)
        return 1
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    replicas = (
        None if args.replicas is None else [int(x) for x in args.replicas.split(",") if x.strip()]
    )
    if args.servers < 1 or (args.servers > 1 and args.workers_only):
        print(
            "--servers must be at least 1 (and --workers-only runs the workers of one server)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if args.workers_only and not args.scheduler:
        print("--workers-only needs --scheduler tcp://HOST:PORT", file=sys.stderr)
        return EXIT_CONFIG
    fleet = plan_fleet(args, run_dir, replicas)
    pid_file.write_text(str(os.getpid()))
    code = 0
    try:
        addresses = start_servers(args, fleet, replicas)
        ready = args.workers_only or (
            len(addresses) == len(fleet.schedulers)
            and all(wait_serving(a, args.ready_timeout, fleet.supervisor) for a in addresses)
        )
        banner = None
        if ready and args.gateway and stopping["signal"] is None:
            try:
                banner = start_gateway(args, fleet, addresses, run_dir)
            except (RuntimeError, TimeoutError) as e:
                print(
                    f"the gateway did not come up: {e}; see {run_dir}/gateway.log", file=sys.stderr
                )
                code = 1
        if not ready and stopping["signal"] is None:
            print(
                f"the service did not become SERVING within {args.ready_timeout}s; see {run_dir}/",
                file=sys.stderr,
            )
            code = 1
        if code == 0 and stopping["signal"] is None:
            print(
                summary(addresses, fleet.supervisor, run_dir, banner, fleet.http_urls), flush=True
            )
            watch(fleet, stopping)
    except FatalExit as e:
        print(f"pagedserve deploy: {e}; see {run_dir}/", file=sys.stderr)
        code = 1
    finally:
        stop(args, fleet)
        pid_file.unlink(missing_ok=True)
    print("stopped: every process of the deployment has exited", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
