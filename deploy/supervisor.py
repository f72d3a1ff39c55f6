"""A process supervisor that knows worker groups: a unit (a TP group, the scheduler) starts, stops
and restarts as a whole with doubling backoff; exit EXIT_CONFIG (2) is not restarted, EXIT_LOAD (4,
a model that failed to load) only a few times in a row.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from protos.base import EXIT_CONFIG, EXIT_LOAD

log = structlog.get_logger("supervisor")


@dataclass
class Program:
    name: str
    argv: list[str]
    log_path: Path | None = None  # None: inherit the supervisor's stdout/stderr


@dataclass
class Unit:
    name: str
    programs: list[Program]
    procs: list[subprocess.Popen] = field(default_factory=list)
    restarts: int = 0
    load_failures: int = 0  # exits with EXIT_LOAD since the unit last loaded its model
    backoff: float = 0.0
    next_start: float = 0.0
    started_at: float = 0.0
    # files removed before every start (a rendezvous file)
    cleanup: list[Path] = field(default_factory=list)

    @property
    def is_running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


SUPERVISED = "PAGEDSERVE_SUPERVISED"


class FatalExit(RuntimeError):
    """A process exited with EXIT_CONFIG; restarting it would fail the same way."""


class Supervisor:
    """Any process of a unit exiting restarts the unit (1 s doubling to 30 s), which supervisord and
    circus cannot do.
    """

    def __init__(
        self,
        units: list[Unit],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        min_backoff: float = 1.0,
        max_backoff: float = 30.0,
        stable_after: float = 60.0,
        stop_timeout: float = 15.0,
        max_load_failures: int = 3,
    ) -> None:
        self.units = units
        # SUPERVISED: a child leaves Ctrl-C to its supervisor, which stops units in order, and stops
        # on its SIGTERM.
        self.env = {**os.environ, **(env or {}), SUPERVISED: "1"}
        self.cwd = cwd
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.stable_after = stable_after
        self.stop_timeout = stop_timeout
        self.max_load_failures = max_load_failures
        self._logs: list = []

    def start(self, unit: Unit) -> None:
        unit.procs = []
        for path in unit.cleanup:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        for prog in unit.programs:
            out = None
            if prog.log_path is not None:
                prog.log_path.parent.mkdir(parents=True, exist_ok=True)
                # a run's first start writes its log anew; a restart goes on after the lines it
                # follows
                out = open(prog.log_path, "ab" if unit.restarts else "wb")
                self._logs.append(out)
            unit.procs.append(
                subprocess.Popen(
                    prog.argv,
                    cwd=self.cwd,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                )
            )
        unit.started_at = time.monotonic()
        log.info("unit_started", unit=unit.name, pids=unit.pids, restarts=unit.restarts)

    def start_all(self) -> None:
        for unit in self.units:
            self.start(unit)

    def poll(self) -> None:
        """Restart units a process of which exited; raises FatalExit on a configuration error."""
        now = time.monotonic()
        for unit in self.units:
            if not unit.procs:  # waiting out its backoff
                if now >= unit.next_start:
                    self.start(unit)
                continue
            codes = [p.poll() for p in unit.procs]
            if all(c is None for c in codes):
                continue
            exited = {
                prog.name: c for prog, c in zip(unit.programs, codes, strict=True) if c is not None
            }
            self._stop_unit(unit)
            codes_said = ", ".join(f"{n} exited with {c}" for n, c in exited.items())
            if EXIT_CONFIG in exited.values():
                raise FatalExit(f"{unit.name}: {codes_said}")
            # a model that fails to load fails the same way next time, but a full disk or a moment
            # without memory may pass: a few tries, then the service stops rather than loop forever
            unit.load_failures = unit.load_failures + 1 if EXIT_LOAD in exited.values() else 0
            if unit.load_failures >= self.max_load_failures:
                raise FatalExit(
                    f"{unit.name}: the model failed to load {unit.load_failures} times in a row"
                    f" ({codes_said})"
                )
            ran = now - unit.started_at
            unit.backoff = (
                self.min_backoff
                if ran >= self.stable_after or not unit.backoff
                else min(self.max_backoff, unit.backoff * 2)
            )
            unit.restarts += 1
            unit.next_start = now + unit.backoff
            log.warning(
                "unit_exited",
                unit=unit.name,
                exit_codes=exited,
                ran_s=round(ran, 1),
                restart_in_s=unit.backoff,
                restarts=unit.restarts,
            )

    def _stop_unit(self, unit: Unit, timeout: float | None = None) -> None:
        for p in unit.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + (self.stop_timeout if timeout is None else timeout)
        for p in unit.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        unit.procs = []

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to `timeout` for every process to exit on its own; True if all did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.poll() is not None for unit in self.units for p in unit.procs):
                return True
            time.sleep(0.2)
        return False

    def stop_all(
        self, first: str | list[str] | None = None, first_timeout: float | None = None
    ) -> None:
        """Units in `first` first (schedulers drain with workers up), then the rest, last started
        first.
        """
        names = {first} if isinstance(first, str) else set(first or ())
        leading = [u for u in self.units if u.name in names]
        for unit in leading:
            for p in unit.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        for unit in leading:
            self._stop_unit(unit, first_timeout)
        for unit in reversed(self.units):
            if unit.name not in names:
                self._stop_unit(unit)
        for f in self._logs:
            f.close()
        self._logs.clear()
        log.info("supervisor_stopped")
