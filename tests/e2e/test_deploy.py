"""`make deploy`: the scheduler and TP x DP workers under the supervisor, one log per process, ready
when health is SERVING, and stopped whole by `make deploy-stop` (SIGTERM) or Ctrl-C (SIGINT).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from deploy.processes import ROOT
from protos import generation_pb2, generation_pb2_grpc
from tests.support.server import greedy_request

pytestmark = pytest.mark.slow


def start_deploy(tmp_path, model_dir, *extra):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deploy.fleet",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        "--threads",
        "1",
        "--block-size",
        "4",
        "--num-blocks",
        "200",
        "--ready-timeout",
        "180",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines = []
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        # the port the scheduler bound (--port 0), as the deployment says it
        if line.startswith("stop:"):
            port = int(re.search(r"serving on 127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
            return proc, port, run_dir, "".join(lines)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("deploy did not report ready:\n" + "".join(lines))


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("how", ["deploy-stop", "ctrl-c"])
def test_deploy_serves_with_a_log_per_process_and_stops_everything(tmp_path, tiny_model_dir, how):
    tp, dp = ("2", "1") if how == "deploy-stop" else ("1", "2")
    proc, port, run_dir, banner = start_deploy(tmp_path, tiny_model_dir, "--tp", tp, "--dp", dp)
    try:
        pids = [int(p) for p in re.findall(r"pid (\d+)", banner)]
        assert f"serving on 127.0.0.1:{port}" in banner and len(pids) == 3  # scheduler + 2 workers
        for name in ("scheduler", "worker-0.0", "worker-0.1" if tp == "2" else "worker-1.0"):
            assert f"{run_dir}/{name}.log" in banner and (run_dir / f"{name}.log").exists()
        assert (run_dir / "deploy.pid").read_text() == str(proc.pid)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert (info.tensor_parallel_size, info.data_parallel_size) == (int(tp), int(dp))
            assert (
                len(stub.Generate(greedy_request([5, 6, 7], 4), timeout=60).choices[0].token_ids)
                == 4
            )
        assert '"event": "serving"' in (run_dir / "scheduler.log").read_text()
        if how == "deploy-stop":
            subprocess.run(
                ["make", "-s", "deploy-stop", f"RUN_DIR={run_dir}"],
                cwd=ROOT,
                check=True,
                timeout=60,
            )
        else:
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "every process of the deployment has exited" in proc.stdout.read()
        assert not [p for p in pids if alive(p)], "a process outlived the deployment"
        assert not (run_dir / "deploy.pid").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("dp,how", [("1", "sigterm"), ("2", "sigterm"), ("2", "ctrl-c")])
def test_stopping_a_deployment_lets_the_answers_in_flight_finish(tmp_path, tiny_model_dir, dp, how):
    """SIGTERM to `make deploy` (or Ctrl-C, which reaches the terminal's whole process group) with
    streams in flight: the scheduler is stopped first and drains with its workers still up, so every
    stream ends with its normal finish reason and the greedy text it would have had; then every
    process exits.
    """
    import threading

    proc, port, run_dir, banner = start_deploy(tmp_path, tiny_model_dir, "--dp", dp)
    pids = [int(p) for p in re.findall(r"pid (\d+)", banner)]
    requests = [greedy_request([5 + i, 6, 7], 400) for i in range(4)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            want = [list(stub.Generate(r, timeout=120).choices[0].token_ids) for r in requests]
            got = [[] for _ in requests]
            finish = [None] * len(requests)
            errors = [None] * len(requests)
            flowing = [threading.Event() for _ in requests]  # every stream admitted and answering

            def stream(i):
                try:
                    for msg in stub.GenerateStream(requests[i], timeout=120):
                        got[i].extend(msg.token_ids)
                        if len(got[i]) >= 3:
                            flowing[i].set()
                        if msg.finish_reason:
                            finish[i] = msg.finish_reason
                except grpc.RpcError as e:
                    errors[i] = e

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            assert all(f.wait(60) for f in flowing)
            if how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            for t in threads:
                t.join(90)
        assert errors == [None] * len(requests), [e.details() for e in errors if e is not None]
        assert got == want and finish == [generation_pb2.LENGTH] * len(requests)
        assert proc.wait(timeout=90) == 0
        assert not [p for p in pids if alive(p)], "a process outlived the deployment"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_restarted_scheduler_serves_again_on_the_ports_it_first_bound(tmp_path, tiny_model_dir):
    """Started on any free ports (--port 0, worker endpoint on port 0), the scheduler is killed: the
    supervisor starts it again on the same gRPC port and worker endpoint, its workers follow, and
    clients that knew the address are served again.
    """
    proc, port, run_dir, banner = start_deploy(tmp_path, tiny_model_dir)
    try:
        sched_pid = int(re.search(r"scheduler\s+pid (\d+)", banner).group(1))
        endpoint = json.loads((run_dir / "scheduler.port").read_text())["worker_endpoint"]
        os.kill(sched_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while True:
                try:
                    out = stub.Generate(greedy_request([5, 6, 7], 4), timeout=10)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "not served again on the same port"
                    time.sleep(0.5)
        assert len(out.choices[0].token_ids) == 4
        assert json.loads((run_dir / "scheduler.port").read_text())["worker_endpoint"] == endpoint
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_two_servers_behind_the_gateway_serve_openai_and_stop_together(tmp_path, tiny_model_dir):
    """`make deploy SERVERS=2 GATEWAY=1`: two independent servers, SMG in front, one banner, one
    stop.
    """
    from openai import OpenAI

    from deploy.processes import free_port

    http_port = free_port()
    proc, port, run_dir, banner = start_deploy(
        tmp_path,
        tiny_model_dir,
        "--servers",
        "2",
        "--gateway",
        "--gateway-port",
        str(http_port),
        "--gateway-metrics-port",
        str(free_port()),
        "--metrics-port",
        "0",
    )
    try:
        assert f"on http://127.0.0.1:{http_port}/v1 (in front of 2 pagedserve servers)" in banner
        assert "curl http://" in banner and "OpenAI(base_url=" in banner
        pids = [int(p) for p in re.findall(r"pid (\d+)", banner)]
        assert len(pids) == 5  # two schedulers, two workers, the gateway
        addresses = re.findall(r"serving on (127\.0\.0\.1:\d+)", banner)
        assert len(set(addresses)) == 2
        for i in range(2):
            assert (run_dir / f"server-{i}" / "scheduler.log").exists()
            assert (run_dir / f"server-{i}" / "worker-0.0.log").exists()
        client = OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=60
        )
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "the fox"}],
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"
        # an answer streaming through the gateway when the deployment is told to stop still ends
        # whole
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "the dog"}],
            max_tokens=120,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        proc.send_signal(signal.SIGTERM)
        finish, usage = None, None
        for chunk in chunks:
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            usage = chunk.usage or usage
        assert finish == "length" and usage.completion_tokens == 120
        assert proc.wait(timeout=90) == 0
        assert "every process of the deployment has exited" in proc.stdout.read()
        assert not [p for p in pids if alive(p)], "a process outlived the deployment"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_run_writes_its_logs_anew_and_a_restart_goes_on_after_the_lines_it_follows(tmp_path):
    """A deployment started again does not append to the last run's logs; a unit the supervisor
    restarts within a run keeps what its earlier life wrote.
    """
    from deploy.supervisor import Program, Supervisor, Unit

    log = tmp_path / "worker.log"
    log.write_text("a line from yesterday's run\n")

    def unit() -> Unit:
        return Unit("u", [Program("p", [sys.executable, "-c", "print('started')"], log)])

    first = Supervisor([unit()])
    first.start(first.units[0])
    first.units[0].procs[0].wait(30)
    assert log.read_text() == "started\n"
    first.units[0].restarts = 1  # as the supervisor's poll counts a restart before starting again
    first.start(first.units[0])
    first.units[0].procs[0].wait(30)
    assert log.read_text() == "started\nstarted\n"
    first.stop_all()
