"""A model that fails to load in a way no check foresaw: the worker says so in one line and exits
EXIT_LOAD; its supervisor tries again a few times, then stops the service instead of restarting it
forever while nothing serves.
"""

from __future__ import annotations

import sys
import time

import pytest

from protos.base import EXIT_LOAD


def test_an_unforeseen_load_fault_is_one_line_and_exit_load(monkeypatch, capsys, tiny_model_dir):
    import worker.serve.main as worker_main
    from tests.support.server import worker_main_code

    def broken_loader(*args, **kwargs):
        raise KeyError("blk.7.attn_q.weight")

    monkeypatch.setattr(worker_main, "load", broken_loader)
    code = worker_main_code(tiny_model_dir, "--device", "cpu")
    assert code == EXIT_LOAD
    err = capsys.readouterr().err
    assert "could not be loaded: KeyError: 'blk.7.attn_q.weight'" in err
    assert "Traceback" not in err


def run_until_fatal(supervisor, timeout: float = 30.0) -> str:
    from deploy.supervisor import FatalExit

    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            supervisor.poll()
            time.sleep(0.01)
    except FatalExit as e:
        return str(e)
    finally:
        supervisor.stop_all()
    raise AssertionError("the supervisor kept restarting a unit that cannot load")


@pytest.mark.parametrize(
    "codes,starts",
    [
        ([EXIT_LOAD] * 3, 3),  # three loads failed in a row: given up
        ([EXIT_LOAD, EXIT_LOAD, 1, EXIT_LOAD, EXIT_LOAD, EXIT_LOAD], 6),  # a crash after loading
    ],
)
def test_the_supervisor_gives_up_on_a_unit_that_cannot_load(tmp_path, codes, starts):
    """Each start of the unit exits with the next code in turn; another exit between load failures
    (the worker loaded, served and died) starts the count again.
    """
    from deploy.supervisor import Program, Supervisor, Unit

    count = tmp_path / "starts"
    script = (
        "import pathlib, sys\n"
        f"f = pathlib.Path({str(count)!r})\n"
        "n = int(f.read_text()) if f.exists() else 0\n"
        "f.write_text(str(n + 1))\n"
        f"sys.exit({codes!r}[min(n, {len(codes) - 1})])\n"
    )
    unit = Unit("replica-0", [Program("worker-0.0", [sys.executable, "-c", script])])
    supervisor = Supervisor([unit], min_backoff=0.01, max_backoff=0.05)
    supervisor.start_all()
    said = run_until_fatal(supervisor)
    assert int(count.read_text()) == starts
    assert said == (
        f"replica-0: the model failed to load 3 times in a row (worker-0.0 exited with {EXIT_LOAD})"
    )
