"""Watchdogs that need no model: the scheduler's step deadline against a worker that beats but never
answers, and a worker that exits on a device error instead of answering every later plan with it."""

import asyncio
import threading
import time

import numpy as np
import pytest
import zmq

from protos import WIRE_VERSION, wire_pb2
from protos.codec import PlanArrays, encode_plan
from scheduler_service.runtime.worker_client import WorkerClient, WorkerLost


class BeatingButHung:
    """A worker that shakes hands and keeps its heartbeats going, but never finishes a step."""

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self.stop = threading.Event()
        self.got_plan = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        ctx = zmq.Context()
        main, beat = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock, name in ((main, b"w.hung"), (beat, b"hb.hung")):
            sock.setsockopt(zmq.IDENTITY, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
        hs = wire_pb2.Handshake(
            tp_rank=0,
            tp_size=1,
            num_blocks=64,
            block_size=4,
            max_num_batched_tokens=64,
            vocab_size=100,
            max_context=512,
            pid=1,
        )
        main.send(wire_pb2.WireMessage(version=WIRE_VERSION, handshake=hs).SerializeToString())
        while not self.stop.is_set():
            beat.send(
                wire_pb2.WireMessage(
                    version=WIRE_VERSION, heartbeat=wire_pb2.Heartbeat()
                ).SerializeToString()
            )
            if main.poll(100):
                msg = wire_pb2.WireMessage.FromString(main.recv())
                if msg.WhichOneof("body") == "plan":
                    self.got_plan.set()  # ... and never answer
            while beat.poll(0):
                beat.recv()
        main.close()
        beat.close()
        ctx.term()


def one_token_plan(step_id):
    one = np.ones(1, "<i4")
    return encode_plan(
        PlanArrays(
            step_id=step_id,
            token_ids=one,
            positions=np.zeros(1, "<i4"),
            slot_mapping=np.zeros(1, "<i8"),
            block_tables=np.zeros((1, 1), "<i4"),
            seq_lens=one,
            query_start_loc=np.array([0, 1], "<i4"),
            do_sample=np.ones(1, bool),
            sample_index=np.zeros(1, "<i4"),
            temperature=np.zeros(1, "<f4"),
            top_p=np.ones(1, "<f4"),
            top_k=np.zeros(1, "<i4"),
            seed=np.zeros(1, "<u8"),
            block_copies=np.empty((0, 2), "<i4"),
        )
    )


def test_a_step_past_its_deadline_loses_the_worker_even_while_it_beats():
    async def run():
        client = WorkerClient(
            "tcp://127.0.0.1:0", heartbeat_timeout=5.0, step_timeout=1.0, step_timeout_per_token=0.5
        )
        endpoint = client.bind()
        worker = BeatingButHung(endpoint)
        try:
            await client.wait_for_workers(10)
            t0 = time.monotonic()
            with pytest.raises(
                WorkerLost, match=r"did not finish step 1 \(1 tokens\) within its 1.5s deadline"
            ):
                await client.execute(0, one_token_plan(1))
            assert worker.got_plan.is_set() and 1.5 <= time.monotonic() - t0 < 4
            # its heartbeats were fresh all along: only the deadline caught it
            client.check_alive(0)
        finally:
            worker.stop.set()
            await client.close()

    asyncio.run(run())


class FailingRunner:
    def __init__(self, error):
        self.error = error
        self.calls = 0
        self.num_blocks = 8

    def launch(self, plan, await_mask=None):
        self.calls += 1
        raise self.error


class Sent:
    def __init__(self):
        self.frames = []

    def send(self, frame):
        self.frames.append(wire_pb2.WireMessage.FromString(frame))


@pytest.mark.parametrize(
    "error,exits",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (ValueError("an ordinary bug in one step"), False),
    ],
)
def test_a_device_error_makes_the_worker_report_and_exit(error, exits):
    from protos.base import EXIT_FAILED
    from worker.serve.step_server import WorkerServer

    server = WorkerServer(
        "tcp://127.0.0.1:1", FailingRunner(error), wire_pb2.Handshake(tp_rank=0, tp_size=1)
    )
    sock = Sent()
    frame = wire_pb2.WireMessage(version=WIRE_VERSION, plan=one_token_plan(7)).SerializeToString()
    code = server._handle(sock, frame)
    assert sock.frames[-1].result.step_id == 7 and "step failed" in sock.frames[-1].result.error
    assert code == (EXIT_FAILED if exits else None)
    server._ctx.term()


class _Clock:
    def __init__(self, done):
        self._done = done

    def done(self):
        return self._done


class PipelinedRunner:
    """Records launches and finishes; steps stay 'running' on the device until finished."""

    def __init__(self, fail_finish=None):
        self.events = []
        self.num_blocks = 8
        self.fail_finish = fail_finish

    def launch(self, plan, await_mask=None):
        self.events.append(("launch", plan.step_id))
        if plan.mask_follows:
            await_mask(plan.step_id)
            self.events.append(("masks", plan.step_id))
        from types import SimpleNamespace

        return SimpleNamespace(step_id=plan.step_id, clock=_Clock(False))

    def land(self, f):
        self.events.append(("land", f.step_id))
        if self.fail_finish is not None:
            raise self.fail_finish
        return wire_pb2.StepResult(step_id=f.step_id)


def _plan_frame(step_id, **kw):
    plan = one_token_plan(step_id)
    for k, v in kw.items():
        setattr(plan, k, v)
    return wire_pb2.WireMessage(version=WIRE_VERSION, plan=plan).SerializeToString()


def test_a_plan_that_arrives_while_a_step_runs_is_launched_before_that_step_is_read_back():
    """The device never waits on the host between steps: step 2 is queued behind step 1 before step
    1's tokens are read, and the results still go out in order.
    """
    from worker.serve.step_server import WorkerServer

    runner = PipelinedRunner()
    server = WorkerServer("tcp://127.0.0.1:1", runner, wire_pb2.Handshake(tp_rank=0, tp_size=1))
    sock = Sent()
    assert server._handle(sock, _plan_frame(1)) is None
    assert runner.events == [("launch", 1)] and not sock.frames  # in flight, not answered yet
    assert server._handle(sock, _plan_frame(2)) is None
    assert runner.events == [("launch", 1), ("launch", 2), ("land", 1)]
    assert [f.result.step_id for f in sock.frames] == [1]
    assert server._land(sock) is None
    assert [f.result.step_id for f in sock.frames] == [1, 2]
    server._ctx.term()


def test_a_plan_whose_masks_follow_answers_the_step_before_it_first():
    """The scheduler computes a step's masks from the previous step's tokens: the worker answers
    that step before it waits for the masks, or both would wait forever.
    """
    from worker.serve.step_server import WorkerServer

    runner = PipelinedRunner()
    server = WorkerServer("tcp://127.0.0.1:1", runner, wire_pb2.Handshake(tp_rank=0, tp_size=1))
    sock = Sent()
    server._await_mask = lambda s, step_id: (sock.frames.append("waited"), None)[1]
    server._handle(sock, _plan_frame(1))
    server._handle(sock, _plan_frame(2, mask_follows=True))
    assert runner.events == [("launch", 1), ("launch", 2), ("land", 1), ("masks", 2)]
    assert sock.frames[0].result.step_id == 1 and sock.frames[1] == "waited"
    server._ctx.term()


@pytest.mark.parametrize(
    "error,exits",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (ValueError("no finite logits"), False),
    ],
)
def test_a_step_that_fails_when_read_back_is_reported(error, exits):
    from protos.base import EXIT_FAILED
    from worker.serve.step_server import WorkerServer

    server = WorkerServer(
        "tcp://127.0.0.1:1",
        PipelinedRunner(fail_finish=error),
        wire_pb2.Handshake(tp_rank=0, tp_size=1),
    )
    sock = Sent()
    server._handle(sock, _plan_frame(4))
    code = server._land(sock)
    assert sock.frames[-1].result.step_id == 4 and "step failed" in sock.frames[-1].result.error
    assert code == (EXIT_FAILED if exits else None)
    server._ctx.term()


def test_a_handshake_done_before_the_worker_looks_still_counts_as_connected(monkeypatch):
    """The heartbeat thread learns that its connection is up from libzmq's handshake event. A
    connect that completes before the thread looks (a loaded machine) must not read as a scheduler
    that never came: the worker stays up past its timeout against a scheduler that holds the
    connection but never echoes.
    """
    from worker.serve.step_server import WorkerServer

    peer_ctx = zmq.Context()
    peer = peer_ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.bind("tcp://127.0.0.1:0")
    connect = zmq.Socket.connect

    def connect_then_stall(sock, addr):
        out = connect(sock, addr)
        time.sleep(0.3)  # the I/O thread finishes the handshake meanwhile
        return out

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_stall)
    server = WorkerServer(
        peer.getsockopt_string(zmq.LAST_ENDPOINT),
        PipelinedRunner(),
        wire_pb2.Handshake(tp_rank=0, tp_size=1),
        heartbeat_interval=0.1,
        scheduler_timeout=0.8,
    )
    beats = threading.Thread(target=server._heartbeats, daemon=True)
    beats.start()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline and not server._stop.is_set():
        if peer.poll(50):
            peer.recv_multipart()  # held, never echoed
    lost = server._stop.is_set()
    server._stop.set()
    beats.join(5)
    peer.close()
    peer_ctx.term()
    server._ctx.term()
    assert not lost, "the worker took a live connection for a lost scheduler"
