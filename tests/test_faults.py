"""Failures: a worker that dies mid-request ends its requests with a clear error, never a hang, and the
supervisor brings a new one that serves again."""

import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local_server import greedy_request

pytestmark = pytest.mark.slow


def test_killed_worker_fails_requests_with_unavailable_and_is_replaced(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, "--block-size", "4", "--num-blocks", "64", "--heartbeat-timeout", "2",
                            "--max-model-len", "256")
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1
    first = threading.Event()
    box = {}

    def consume():
        try:
            for _ in server.stub.GenerateStream(greedy_request([3, 4, 5], 240), timeout=60):
                first.set()
            box["result"] = "finished"
        except grpc.RpcError as e:
            box["result"] = e

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(30)
    os.kill(int(children[0]), signal.SIGKILL)
    t0 = time.monotonic()
    t.join(30)
    assert not t.is_alive(), "the request hung after its worker died"
    err = box["result"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "worker" in err.details() and time.monotonic() - t0 < 15
    health = health_pb2_grpc.HealthStub(server.channel)
    deadline = time.monotonic() + 5
    while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    stats = server.stats()
    assert not stats.replicas[0].serving and "exited" in stats.replicas[0].status  # seen by its process
    deadline = time.monotonic() + 60  # the supervisor restarts the worker; its handshake brings the replica back
    while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    new_children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(new_children) == 1 and new_children != children
    again = server.stub.Generate(greedy_request([1, 2], 2), timeout=30)
    assert len(again.choices[0].token_ids) == 2
    stats = server.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks and not stats.requests


def test_full_queue_is_resource_exhausted(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, "--block-size", "4", "--num-blocks", "128",
                            "--max-num-seqs", "1", "--max-queue-len", "1")
    running = threading.Event()
    calls = []

    def consume(rid):
        call = server.stub.GenerateStream(greedy_request([1, 2, 3], 300, rid), timeout=60)
        calls.append(call)
        try:
            for _ in call:
                running.set()
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=consume, args=("long",))]
    threads[0].start()
    assert running.wait(30)
    threads.append(threading.Thread(target=consume, args=("queued",)))
    threads[1].start()
    deadline = time.monotonic() + 10
    while server.stats().num_waiting < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Generate(greedy_request([1, 2], 2), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in err.value.details()
    for call in calls:
        call.cancel()
    for t in threads:
        t.join(30)
    deadline = time.monotonic() + 5
    while (lambda st: st.num_free_blocks + st.num_cached_blocks)(server.stats()) != 128:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_pool_too_small_for_one_full_context_request_is_refused(tmp_path, tiny_model_dir):
    from deploy.local_server import ServerProcess

    server = ServerProcess(tiny_model_dir, tmp_path / "log", "--block-size", "4", "--num-blocks", "8", "--threads", "1")
    with pytest.raises(RuntimeError, match="exited") as err:
        server.start(timeout=120)
    server.stop()
    assert "cannot hold one request of the full 512-token context" in str(err.value)
    assert server.proc.returncode == 1
