"""The worker process over its real ZeroMQ socket: handshake, plans, malformed input, shutdown.

A malformed or out-of-range plan gets an error result, never a crash, and never a write outside
the pool.
"""

import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from deploy.processes import ROOT
from protos import WIRE_VERSION, wire_pb2

pytestmark = pytest.mark.slow

NUM_BLOCKS, BLOCK = 8, 4


class Peer:
    """Plays the scheduler: a ROUTER socket, answering heartbeats."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.worker_id = None

    def recv(self, kind, timeout=120.0, echo_heartbeats=True):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = wire_pb2.WireMessage.FromString(frame)
            body = msg.WhichOneof("body")
            if body == "heartbeat":
                if echo_heartbeats:
                    self.sock.send_multipart([identity, frame])
                continue
            if body == kind:
                return identity, getattr(msg, body)
        raise TimeoutError(f"no {kind} within {timeout}s")

    def send(self, raw: bytes):
        self.sock.send_multipart([self.worker_id, raw])

    def send_msg(self, **body):
        self.send(wire_pb2.WireMessage(version=WIRE_VERSION, **body).SerializeToString())

    def close(self):
        if not self.sock.closed:
            self.sock.close()
            self.ctx.term()


@pytest.fixture
def worker(tiny_model_dir):
    peer = Peer()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.serve.main",
            "--model",
            str(tiny_model_dir),
            "--scheduler",
            peer.endpoint,
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK),
            "--threads",
            "1",
            "--scheduler-timeout",
            "3",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    identity, hs = peer.recv("handshake")
    peer.worker_id = identity
    assert (hs.num_blocks, hs.block_size, hs.vocab_size, hs.tp_rank, hs.tp_size) == (
        NUM_BLOCKS,
        BLOCK,
        384,
        0,
        1,
    )
    assert hs.model_fingerprint and hs.bytes_per_block == 2 * 3 * 2 * 16 * BLOCK * 4
    peer.send_msg(handshake_ack=wire_pb2.HandshakeAck(accepted=True, num_blocks=NUM_BLOCKS))
    yield peer, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    peer.close()


def plan(step_id=1, tokens=(5, 6, 7), blocks=(3,), **override):
    n = len(tokens)
    fields = dict(
        step_id=step_id,
        num_seqs=1,
        num_tokens=n,
        token_ids=np.array(tokens, "<i4").tobytes(),
        positions=np.arange(n, dtype="<i4").tobytes(),
        slot_mapping=(blocks[0] * BLOCK + np.arange(n, dtype="<i8")).tobytes(),
        block_tables=np.array(blocks, "<i4").tobytes(),
        max_blocks_per_seq=len(blocks),
        seq_lens=np.array([n], "<i4").tobytes(),
        query_start_loc=np.array([0, n], "<i4").tobytes(),
        do_sample=np.array([1], np.uint8).tobytes(),
        sample_index=np.array([0], "<i4").tobytes(),
        temperature=np.zeros(1, "<f4").tobytes(),
        top_p=np.ones(1, "<f4").tobytes(),
        top_k=np.zeros(1, "<i4").tobytes(),
        seed=np.zeros(1, "<u8").tobytes(),
    )
    fields.update(override)
    return wire_pb2.StepPlan(**fields)


BAD_PLANS = {
    "slot outside the pool": dict(
        slot_mapping=np.array([0, 1, NUM_BLOCKS * BLOCK], "<i8").tobytes()
    ),
    "block id outside the pool": dict(block_tables=np.array([NUM_BLOCKS], "<i4").tobytes()),
    "token outside the vocabulary": dict(token_ids=np.array([5, 6, 384], "<i4").tobytes()),
    "truncated array": dict(positions=b"\x00\x00"),
    "seq_lens beyond the table": dict(seq_lens=np.array([9], "<i4").tobytes()),
    "sampling parameters missing": dict(temperature=b""),
    "top_p out of range": dict(top_p=np.array([1.5], "<f4").tobytes()),
    "negative position": dict(positions=np.array([0, -1, 2], "<i4").tobytes()),
}


def test_bad_plans_and_frames_get_error_results_and_the_worker_keeps_serving(worker):
    peer, proc = worker
    peer.send_msg(plan=plan(step_id=1))
    _, good = peer.recv("result")
    assert not good.error and np.frombuffer(good.sampled_token_ids, "<i4").shape == (1,)
    for i, (name, override) in enumerate(BAD_PLANS.items(), start=2):
        peer.send_msg(plan=plan(step_id=i, **override))
        _, res = peer.recv("result")
        assert res.step_id == i and res.error.startswith("rejected plan"), name
    peer.send(b"\xff\xfe not a protobuf")
    _, res = peer.recv("result")
    assert "malformed" in res.error
    peer.send(
        wire_pb2.WireMessage(version=WIRE_VERSION + 1, plan=plan(step_id=50)).SerializeToString()
    )
    _, res = peer.recv("result")
    assert "wire version" in res.error
    peer.send_msg(plan=plan(step_id=99))  # still alive, and the same input gives the same token
    _, again = peer.recv("result")
    assert again.step_id == 99 and again.sampled_token_ids == good.sampled_token_ids
    assert proc.poll() is None
    peer.send_msg(shutdown=wire_pb2.Shutdown(reason="test over"))
    assert proc.wait(timeout=30) == 0


def test_a_busy_scheduler_that_stops_echoing_is_not_mistaken_for_a_lost_one(worker):
    peer, proc = worker
    # well past --scheduler-timeout 3: the connection itself is alive
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        if peer.sock.poll(100):
            # swallow heartbeats without echoing them, as a stalled loop would
            peer.sock.recv_multipart()
    assert proc.poll() is None, "the worker quit on a scheduler that was only busy"


def test_worker_exits_when_the_scheduler_is_gone(worker):
    peer, proc = worker
    peer.close()  # the scheduler process is gone: its socket closes
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("an orphaned worker kept running") from None


def test_worker_refuses_a_block_size_that_is_not_a_power_of_two(tiny_model_dir):
    """The kernels' tile arithmetic needs a power of two: refused at start with a configuration exit
    (the supervisor does not restart it) and a message naming the flag, before any model is loaded.
    """
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.serve.main",
            "--model",
            str(tiny_model_dir),
            "--scheduler",
            "tcp://127.0.0.1:9",
            "--block-size",
            "12",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--block-size must be a power of two" in proc.stdout + proc.stderr


def test_kv_pool_refuses_a_block_size_that_is_not_a_power_of_two():
    import torch

    from worker.model.config import ModelConfig
    from worker.model.kv_pool import KVPool

    config = ModelConfig.from_dict(
        dict(
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=8,
        )
    )
    with pytest.raises(ValueError, match="power of two, got 24"):
        KVPool(config, 4, 24, torch.float32, torch.device("cpu"))


def test_each_local_rank_owns_its_own_gpu():
    """The launchers pass one --device to every rank of a host; each rank must land on its own GPU
    (Triton launches on the current device, so two ranks on one GPU would also run each other's
    kernels there).
    """
    from worker.serve.choices import rank_device

    assert [rank_device(None, r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [rank_device("cuda", r, 2) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [rank_device("cuda:2", r, 4) for r in range(4)] == [
        "cuda:2",
        "cuda:3",
        "cuda:0",
        "cuda:1",
    ]
    assert rank_device(None, 3, 0) == "cpu" and rank_device("cpu", 1, 8) == "cpu"
    for bad, count, message in (
        ("cuda:4", 4, "GPUs 0-3"),
        ("cuda", 0, "has none"),
        ("cuda:x", 2, "cuda:N"),
    ):
        with pytest.raises(ValueError, match=message):
            rank_device(bad, 0, count)


def only(tokens: list[int], words: int = 12) -> np.ndarray:
    """A one-row bitmask allowing just `tokens` (384 tokens: 12 words)."""
    mask = np.zeros((1, words), dtype=np.uint32)
    for t in tokens:
        mask[0, t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def test_masks_that_follow_their_plan_are_awaited_after_the_forward(worker):
    """A plan sent with mask_follows runs its forward, then reads its StepMask off the socket before
    sampling; masks of refused plans are skipped; a shutdown while waiting ends the worker cleanly.
    """
    from protos.codec import encode_mask

    peer, proc = worker
    rows = np.zeros(1, "<i4").tobytes()
    peer.send_msg(plan=plan(step_id=1))
    _, free = peer.recv("result")
    chosen = int(np.frombuffer(free.sampled_token_ids, "<i4")[0])
    allowed = (chosen + 1) % 384  # anything but the model's own choice
    peer.send_msg(plan=plan(step_id=2, mask_rows=rows, mask_follows=True))
    with pytest.raises(TimeoutError):  # no result until the masks come
        peer.recv("result", timeout=2.0)
    peer.send_msg(mask=encode_mask(2, only([allowed])))
    _, res = peer.recv("result")
    assert not res.error and np.frombuffer(res.sampled_token_ids, "<i4").tolist() == [allowed]
    # a refused plan's masks arrive after it and are skipped, by the loop or by a later step's wait
    peer.send_msg(
        plan=plan(
            step_id=3, mask_rows=rows, mask_follows=True, top_p=np.array([7.0], "<f4").tobytes()
        )
    )
    _, refused = peer.recv("result")
    assert refused.error.startswith("rejected plan")
    peer.send_msg(plan=plan(step_id=4, mask_rows=rows, mask_follows=True))
    peer.send_msg(mask=encode_mask(3, only([1])))
    peer.send_msg(mask=encode_mask(4, only([allowed, 200])))
    _, res = peer.recv("result")
    assert res.step_id == 4 and np.frombuffer(res.sampled_token_ids, "<i4")[0] in (allowed, 200)
    # masks of the wrong size fail the step, not the worker
    peer.send_msg(plan=plan(step_id=5, mask_rows=rows, mask_follows=True))
    peer.send_msg(mask=encode_mask(5, only([1], words=3)))
    _, res = peer.recv("result")
    assert "masks" in res.error and proc.poll() is None
    peer.send_msg(plan=plan(step_id=6, mask_rows=rows, mask_follows=True))
    peer.send_msg(shutdown=wire_pb2.Shutdown(reason="test over"))
    assert proc.wait(timeout=30) == 0


def test_adapters_the_handshake_names_are_read_before_the_first_plan(tiny_model_dir, tmp_path):
    """A new or restarted worker reads the adapters the scheduler serves when it is accepted: a plan
    naming one is served from memory even once its folder is gone, while one it was not given must
    be read then.
    """
    import shutil

    from protos.codec import lora_identity
    from tests.support.lora import ALL, make_adapter

    folders = [
        make_adapter(tiny_model_dir, tmp_path / f"a{i}", r=4, targets=ALL, alpha=16, seed=i)
        for i in range(2)
    ]
    refs = [wire_pb2.LoraRef(identity=lora_identity(f), path=str(f)) for f in folders]
    peer = Peer()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.serve.main",
            "--model",
            str(tiny_model_dir),
            "--scheduler",
            peer.endpoint,
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK),
            "--threads",
            "1",
            "--scheduler-timeout",
            "3",
            "--max-cpu-loras",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        peer.worker_id, hs = peer.recv("handshake")
        assert hs.lora_slots == 2
        peer.send_msg(
            handshake_ack=wire_pb2.HandshakeAck(
                accepted=True, num_blocks=NUM_BLOCKS, loras=refs[:1]
            )
        )
        peer.send_msg(plan=plan(step_id=1))  # its result comes after the ack's adapters were read
        _, base = peer.recv("result")
        assert not base.error
        for f in folders:
            shutil.rmtree(f)
        one = np.array([0], "<i4").tobytes()
        peer.send_msg(plan=plan(step_id=2, loras=refs[:1], lora_index=one))
        _, held = peer.recv("result")
        assert not held.error, held.error
        peer.send_msg(plan=plan(step_id=3, loras=refs[1:], lora_index=one))
        _, missing = peer.recv("result")
        assert missing.error and "LoRA" in missing.error, missing.error
        peer.send_msg(shutdown=wire_pb2.Shutdown(reason="test over"))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        peer.close()
