"""Faults: a worker that dies or stalls is replaced and its requests resume with identical output;
with no worker to come back they end with UNAVAILABLE, never a hang.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tests.support.server import greedy_request
from tests.support.serving import Streams, assert_all_blocks_back, children_of, sampled, wait_health
from tests.support.tiny import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fault_server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "128",
        "--heartbeat-timeout",
        "2",
        "--max-model-len",
        "256",
    )


def test_a_killed_worker_is_replaced_and_every_stream_completes_as_if_nothing_happened(
    fault_server, tiny_model_dir
):
    server = fault_server
    prompts = [[3, 4, 5], [9, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11], [20, 21]]
    reqs = [greedy_request(p, 120) for p in prompts]
    reqs += [sampled(p, 120, seed=40 + i) for i, p in enumerate(prompts)]
    reference = [list(server.stub.Generate(r, timeout=120).choices[0].token_ids) for r in reqs]
    assert reference[:3] == [hf_greedy(tiny_model_dir, p, 120) for p in prompts]
    (old,) = children_of(server.proc.pid)
    streams = Streams(server.stub, reqs)
    assert streams.started.wait(30)
    os.kill(int(old), signal.SIGKILL)
    wait_health(server, False, 5)  # the process is watched: seen well within a heartbeat timeout
    # the supervisor starts a new worker; its handshake brings the replica back
    wait_health(server, True, 60)
    streams.join()
    assert streams.errors == [None] * len(reqs)
    # nothing repeated, nothing skipped, same draws when sampling
    assert streams.tokens == reference
    (new,) = children_of(server.proc.pid)
    assert new != old
    assert_all_blocks_back(server)


def test_a_stall_past_the_deadline_is_fenced_and_replaced_and_a_short_one_changes_nothing(
    fault_server,
):
    server = fault_server
    reqs = [greedy_request([5, 6, 7, i], 100) for i in range(3)]
    reference = [list(server.stub.Generate(r, timeout=120).choices[0].token_ids) for r in reqs]
    (worker,) = children_of(server.proc.pid)
    streams = Streams(server.stub, reqs)
    assert streams.started.wait(30)
    os.kill(int(worker), signal.SIGSTOP)  # shorter than the 2 s heartbeat timeout
    time.sleep(0.8)
    os.kill(int(worker), signal.SIGCONT)
    streams.join()
    assert streams.errors == [None] * 3 and streams.tokens == reference
    assert children_of(server.proc.pid) == [worker], "a short stall replaced the worker"
    streams = Streams(server.stub, reqs)
    assert streams.started.wait(30)
    os.kill(int(worker), signal.SIGSTOP)  # past the deadline: declared lost, killed, replaced
    try:
        wait_health(server, False, 10)
        wait_health(server, True, 60)
    finally:
        if children_of(server.proc.pid) == [worker]:
            os.kill(int(worker), signal.SIGCONT)
    streams.join()
    assert streams.errors == [None] * 3 and streams.tokens == reference
    assert children_of(server.proc.pid) != [worker]
    assert_all_blocks_back(server)


@contextlib.contextmanager
def lone_scheduler(tmp_path, model_dir, scheduler_flags, worker_blocks):
    """A scheduler on its own (any free ports, said in its port file) and one worker started by
    hand, with no supervisor: yields (scheduler, worker, channel); whatever still runs at the end is
    killed.
    """
    from deploy.processes import ROOT, read_port_file

    log = open(tmp_path / "scheduler.log", "w")
    ports = tmp_path / "scheduler.port"
    sched = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler_service.main",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--port-file",
            str(ports),
            "--worker-endpoint",
            "tcp://127.0.0.1:0",
            "--block-size",
            "4",
            *scheduler_flags,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    worker = channel = None
    try:
        deadline = time.monotonic() + 60
        while (
            (bound := read_port_file(ports)) is None
            and sched.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert bound is not None, "the scheduler did not say which ports it bound"
        # nobody orders its stop
        env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_SUPERVISED"}
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.serve.main",
                "--model",
                str(model_dir),
                "--scheduler",
                bound["worker_endpoint"],
                "--block-size",
                "4",
                "--num-blocks",
                str(worker_blocks),
                "--threads",
                "1",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{bound['port']}")
        wait_health(type("S", (), {"channel": channel})(), True, 120)
        yield sched, worker, channel
    finally:
        if channel is not None:
            channel.close()
        for p in (worker, sched):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait()
        log.close()


def test_requests_end_unavailable_when_no_worker_comes_back_in_time(tmp_path, tiny_model_dir):
    """A scheduler on its own and a worker started by hand, with no supervisor to restart it."""
    from protos import generation_pb2_grpc

    flags = ["--worker-restart-timeout", "3", "--heartbeat-timeout", "2"]
    with lone_scheduler(tmp_path, tiny_model_dir, flags, 200) as (_, worker, channel):
        streams = Streams(
            generation_pb2_grpc.GenerationStub(channel), [greedy_request([3, 4, 5], 400)]
        )
        assert streams.started.wait(30)
        worker.kill()
        t0 = time.monotonic()
        streams.join(30)
        err = streams.errors[0]
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker came back within 3s" in err.details() and "exited" in err.details()
        assert 3 <= time.monotonic() - t0 < 10


def test_full_queue_is_resource_exhausted(server_factory, tiny_model_dir):
    server = server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "128",
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
    )
    calls = []

    def consume(rid):
        call = server.stub.GenerateStream(greedy_request([1, 2, 3], 300, rid), timeout=60)
        calls.append(call)
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    # The worker is held still before the first request arrives, so it is scheduled and cannot
    # finish (however fast the machine or its drafts) and the second one must wait; the hold is
    # shorter than the heartbeat deadline, and is released whatever happens.
    (worker,) = children_of(server.proc.pid)
    os.kill(int(worker), signal.SIGSTOP)
    threads = []
    try:
        for rid, stat in (("long", "num_running"), ("queued", "num_waiting")):
            threads.append(threading.Thread(target=consume, args=(rid,)))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while getattr(server.stats(), stat) < 1:
                assert time.monotonic() < deadline, f"{rid} never counted in {stat}"
                time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Generate(greedy_request([1, 2], 2), timeout=5)
    finally:
        os.kill(int(worker), signal.SIGCONT)
    assert (
        err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in err.value.details()
    )
    for call in calls:
        call.cancel()
    for t in threads:
        t.join(30)
    deadline = time.monotonic() + 5
    while (lambda st: st.num_free_blocks + st.num_cached_blocks)(server.stats()) != 128:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_checkpoint_that_cannot_load_is_refused_once_with_the_tensor_named(tmp_path):
    """A tensor missing (or one the model has no place for) fails every start the same way: the
    worker says which and exits EXIT_CONFIG, and the server stops rather than restart it in a loop.
    """
    from safetensors.torch import load_file, save_file

    from tests.support.server import ServerProcess
    from tests.support.tiny import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    server = ServerProcess(folder, tmp_path / "log", "--threads", "1")
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.start(timeout=120)
    finally:
        server.stop()
    assert time.monotonic() - t0 < 60
    log = (tmp_path / "log").read_text()
    assert "checkpoint_refused" in log and "model.norm.weight" in log
    assert log.count("checkpoint_refused") <= 2  # the one start, not a restart loop
    assert server.proc.returncode != 0


def test_a_pool_too_small_for_one_full_context_request_is_refused(tmp_path, tiny_model_dir):
    from tests.support.server import ServerProcess

    server = ServerProcess(
        tiny_model_dir, tmp_path / "log", "--block-size", "4", "--num-blocks", "8", "--threads", "1"
    )
    with pytest.raises(RuntimeError, match="exited") as err:
        server.start(timeout=120)
    server.stop()
    assert "cannot hold one request of the full 512-token context" in str(err.value)
    assert server.proc.returncode == 2  # a configuration that cannot work: one line, exit 2
    assert "error: worker refused: replica 0 rank 0: the KV pool" in str(err.value)


@pytest.mark.parametrize("drain,finishes", [(60, True), (15, False)])
def test_sigterm_drains_running_requests_then_every_process_exits(
    server_factory, tiny_model_dir, drain, finishes
):
    # the workers are held longer than the default heartbeat deadline: only the drain may end it;
    # no drafts: drafted from the reference's answer, the stream once ran its 400 tokens in 95 ms,
    # done before its workers were held
    server = server_factory(
        tiny_model_dir,
        *("--block-size", "4", "--num-blocks", "128", "--drain-timeout", str(drain)),
        *("--heartbeat-timeout", "60", "--speculative", "off"),
    )
    workers = children_of(server.proc.pid)
    reference = list(
        server.stub.Generate(greedy_request([8, 9, 10], 400), timeout=60).choices[0].token_ids
    )
    streams = Streams(server.stub, [greedy_request([8, 9, 10], 400)])
    assert streams.started.wait(30)
    # The workers are held still while the server is told to stop, so the stream is still running
    # when the drain begins (a token a step: 400 steps to go);
    # where the stream cannot finish, through the drain: the drain, not a lost worker, ends it
    # (the heartbeat deadline is set past it). The drain that cannot finish still lasts long enough
    # (15 s) for the refusal below to reach a port that is still open on a loaded machine (6 s
    # was not always: a health check there can itself take seconds).
    held = list(workers)
    for pid in held:
        os.kill(int(pid), signal.SIGSTOP)
    try:
        os.kill(server.proc.pid, signal.SIGTERM)
        # soon, with the port still open: within a third of the drain (2 s of the short one; a
        # loaded CI machine once took past 2 s to answer the health check of the long one)
        wait_health(server, False, min(10, drain / 3))
        with pytest.raises(grpc.RpcError) as refused:
            server.stub.Generate(greedy_request([1, 2], 2), timeout=10)
        assert (
            refused.value.code() == grpc.StatusCode.UNAVAILABLE
            and "draining" in refused.value.details()
        )
        if finishes:
            while held:
                os.kill(int(held.pop()), signal.SIGCONT)
        streams.join()
    finally:
        for pid in held:
            os.kill(int(pid), signal.SIGCONT)  # to be told to stop, as after any drain
    if finishes:
        assert streams.errors == [None] and streams.tokens[0] == reference
    else:
        err = streams.errors[0]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert f"did not finish within its {drain}s drain" in err.details()
        assert (
            0 < len(streams.tokens[0]) < 400
            and streams.tokens[0] == reference[: len(streams.tokens[0])]
        )
    assert server.proc.wait(timeout=30) == 0
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def test_a_worker_that_dies_while_idle_is_seen_within_seconds_and_replaced(fault_server):
    # a test before this one may have left its worker still coming back
    wait_health(fault_server, True, 60)
    deadline = time.monotonic() + 30
    while not fault_server.stats().replicas[0].worker_pids:
        assert time.monotonic() < deadline, "the replica never reported its worker"
        time.sleep(0.1)
    (pid,) = fault_server.stats().replicas[0].worker_pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_health(fault_server, False, 5)
    assert time.monotonic() - t0 < 2.5
    wait_health(fault_server, True, 60)
    assert fault_server.stats().replicas[0].worker_pids[0] != pid


def test_no_local_process_can_forge_results_or_heartbeats(fault_server):
    """Without CurveZMQ any local process reaches the wire; still, only the peer that shook hands
    counts.
    """
    import zmq

    from protos import WIRE_VERSION, wire_pb2

    endpoint = next(
        line.split('"endpoint": "')[1].split('"')[0]
        for line in fault_server.log_path.read_text().splitlines()
        if '"worker_socket_bound"' in line
    )
    reference = list(
        fault_server.stub.Generate(greedy_request([30, 31, 32], 60), timeout=60)
        .choices[0]
        .token_ids
    )
    ctx = zmq.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(endpoint)
    beats = ctx.socket(zmq.DEALER)
    beats.setsockopt(zmq.LINGER, 0)
    beats.connect(endpoint)
    stop = threading.Event()

    def forge():  # fake results for every plausible step, and heartbeats claiming to be rank 0
        step = 0
        while not stop.is_set():
            step += 1
            res = wire_pb2.StepResult(
                step_id=step, tp_rank=0, sampled_token_ids=(7).to_bytes(4, "little")
            )
            forger.send(wire_pb2.WireMessage(version=WIRE_VERSION, result=res).SerializeToString())
            beats.send(
                wire_pb2.WireMessage(
                    version=WIRE_VERSION, heartbeat=wire_pb2.Heartbeat(tp_rank=0)
                ).SerializeToString()
            )
            time.sleep(0.002)

    t = threading.Thread(target=forge)
    t.start()
    try:
        streams = Streams(fault_server.stub, [greedy_request([30, 31, 32], 60)])
        streams.join()
        assert streams.errors == [None] and streams.tokens == [reference], (
            "a forged result reached a client"
        )
        (pid,) = fault_server.stats().replicas[0].worker_pids
        os.kill(pid, signal.SIGSTOP)  # forged heartbeats must not keep a stopped worker alive
        try:
            wait_health(fault_server, False, 10)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait_health(fault_server, True, 60)
    finally:
        stop.set()
        t.join()
        forger.close()
        beats.close()
        ctx.term()
    assert_all_blocks_back(fault_server)


def test_a_worker_asked_to_stop_serves_its_draining_scheduler_to_the_end(tmp_path, tiny_model_dir):
    """Under Kubernetes every pod of a release gets SIGTERM at once. A worker (no supervisor) keeps
    serving until its scheduler — draining — tells it to shut down: the answer in flight ends whole,
    then both exit 0.
    """
    from protos import generation_pb2_grpc

    with lone_scheduler(tmp_path, tiny_model_dir, [], 300) as (sched, worker, channel):
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = greedy_request([3, 4, 5], 400)
        want = list(stub.Generate(request, timeout=60).choices[0].token_ids)
        streams = Streams(stub, [request])
        assert streams.started.wait(30)
        worker.send_signal(signal.SIGTERM)  # both at once, as a deleted release gets it
        sched.send_signal(signal.SIGTERM)
        streams.join(60)
        assert streams.errors == [None] and streams.tokens == [want]
        assert worker.wait(timeout=60) == 0 and sched.wait(timeout=60) == 0
