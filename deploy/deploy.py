"""`pagedserve deploy` / `make deploy`: the scheduler service and TP x DP worker processes under the
group-aware supervisor (deploy/supervisor.py), one log file per process under a run directory.

It waits for the service's health to be SERVING, prints the address, the processes and where their logs
are, then watches: a process that exits is restarted with its unit (a worker group restarts as a whole,
and when the scheduler restarts every group follows it). Ctrl-C or SIGTERM (`make deploy-stop`) stops
every process. With --workers-only it runs only worker groups, for another host, connecting to a
scheduler given by --scheduler.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.launcher import passthrough, worker_units
from deploy.local_server import read_port_file
from deploy.supervisor import FatalExit, Program, Supervisor, Unit
from protos.logs import configure_logging
from scheduler_service.main import add_scheduler_args
from worker.main import add_worker_args

log = structlog.get_logger("deploy")

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve deploy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scheduler_args(p)
    add_worker_args(p)
    d = p.add_argument_group("deploy")
    d.add_argument("--run-dir", default="run/deploy", help="logs and the pid file go here")
    d.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for health SERVING")
    d.add_argument("--workers-only", action="store_true",
                   help="run worker groups only (another host), connecting to --scheduler")
    d.add_argument("--scheduler", default=None, help="with --workers-only: the scheduler's ZeroMQ endpoint")
    d.add_argument("--replicas", default=None,
                   help="comma-separated replicas whose workers run on this host (default: all; '' for none, when "
                        "every worker runs elsewhere)")
    d.add_argument("--rendezvous-host", default="127.0.0.1",
                   help="address of this host that the ranks of its tensor-parallel groups reach each other on")
    return p


def scheduler_program(args: argparse.Namespace, endpoint: str, log_dir: Path) -> Program:
    from scheduler_service.main import build_parser as scheduler_parser

    flags = passthrough(scheduler_parser(), args, {"worker_endpoint", "model", "port_file"})
    argv = [sys.executable, "-m", "scheduler_service.main", "--model", args.model, "--worker-endpoint", endpoint,
            "--port-file", str(log_dir / "scheduler.port"), *flags]
    return Program("scheduler", argv, log_dir / "scheduler.log")


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
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        return False
    finally:
        channel.close()


def summary(address: str | None, supervisor: Supervisor, run_dir: Path) -> str:
    lines = []
    if address:
        lines += [f"pagedserve is serving on {address}",
                  f"  try: .venv/bin/pagedserve generate --server {address} \"What is the capital of France?\""]
    lines.append(f"processes (logs in {run_dir}/):")
    for unit in supervisor.units:
        for prog, proc in zip(unit.programs, unit.procs, strict=True):
            lines.append(f"  {prog.name:<14} pid {proc.pid:<8} {prog.log_path}")
    lines.append(f"stop: Ctrl-C, or `make deploy-stop` (kill -TERM {os.getpid()})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, process="deploy", log_format=args.log_format)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_file = run_dir / "deploy.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            print(f"a deployment is already running from {run_dir} (pid {pid_file.read_text().strip()}); "
                  "stop it first (`make deploy-stop`)", file=sys.stderr)
            return 1
        except (ProcessLookupError, ValueError):
            pass  # a stale pid file
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    replicas = None if args.replicas is None else [int(x) for x in args.replicas.split(",") if x.strip()]
    if args.workers_only:
        if not args.scheduler:
            print("--workers-only needs --scheduler tcp://HOST:PORT", file=sys.stderr)
            return 2
        units = worker_units(args, args.scheduler, replicas, run_dir, args.rendezvous_host)
        address = None
    else:
        # the scheduler starts first and says which ports it bound (any free one where the flag says 0); its
        # workers start once it has, and a restarted scheduler binds the same ports again, so restarted
        # workers and clients find it
        units = [Unit("scheduler", [scheduler_program(args, args.worker_endpoint, run_dir)])]
        address = f"{args.host}:{args.port}"
    supervisor = Supervisor(units, env={"PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    pid_file.write_text(str(os.getpid()))
    code = 0
    try:
        (run_dir / "scheduler.port").unlink(missing_ok=True)  # a file from an earlier run says nothing
        supervisor.start_all()
        if not args.workers_only:
            bound = wait_bound(run_dir / "scheduler.port", args.ready_timeout, supervisor)
            address = None
            if bound is not None:
                address = f"{args.host}:{bound['port']}"
                pin_ports(units[0].programs[0], bound["port"], bound["worker_endpoint"])
                for unit in worker_units(args, bound["worker_endpoint"], replicas, run_dir, args.rendezvous_host):
                    supervisor.units.append(unit)
                    supervisor.start(unit)
        if (address is None and not args.workers_only) or (
                address is not None and not wait_serving(address, args.ready_timeout, supervisor)):
            if stopping["signal"] is None:
                print(f"the service did not become SERVING within {args.ready_timeout}s; see {run_dir}/",
                      file=sys.stderr)
                code = 1
        if code == 0 and stopping["signal"] is None:
            print(summary(address, supervisor, run_dir), flush=True)
            scheduler_restarts = 0
            while stopping["signal"] is None:
                supervisor.poll()
                sched = units[0] if units[0].name == "scheduler" else None
                if sched is not None and sched.restarts != scheduler_restarts:  # workers follow their scheduler
                    scheduler_restarts = sched.restarts
                    for unit in units[1:]:
                        for proc in unit.procs:
                            proc.terminate()
                time.sleep(0.2)
    except FatalExit as e:
        print(f"pagedserve deploy: {e}; see {run_dir}/", file=sys.stderr)
        code = 1
    finally:
        # the scheduler first: it stops admitting and finishes what it holds (--drain-timeout) with its workers
        # still up; the workers only then. Under --workers-only the scheduler is elsewhere: the workers go when
        # it tells them (it is draining too) or is gone, or after its drain time
        if args.workers_only:
            supervisor.wait_exit(getattr(args, "drain_timeout", 30.0) + 15.0)
        supervisor.stop_all(first="scheduler", first_timeout=getattr(args, "drain_timeout", 30.0) + 15.0)
        pid_file.unlink(missing_ok=True)
    print("stopped: every process of the deployment has exited", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
