"""The scheduler's handshake rules: a group is accepted only when every rank agrees with the
scheduler's settings and with each other; the endpoint binds to loopback unless the wire is
authenticated.
"""

import asyncio

import pytest

from protos import wire_pb2
from scheduler_service.runtime.worker_client import (
    InsecureEndpoint,
    WorkerClient,
    WorkerInfo,
    is_loopback_endpoint,
)


def hs(**over):
    fields = dict(
        tp_rank=0,
        tp_size=2,
        replica=0,
        num_blocks=100,
        block_size=16,
        max_num_batched_tokens=2048,
        model_fingerprint="abc",
        vocab_size=384,
        max_context=512,
        dtype="float32",
        rendezvous="tcp://127.0.0.1:9000",
        pid=1,
    )
    fields.update(over)
    return wire_pb2.Handshake(**fields)


@pytest.fixture
def client():
    return WorkerClient(
        "tcp://127.0.0.1:0",
        num_replicas=2,
        tp_size=2,
        expected={"block_size": 16, "max_num_batched_tokens": 2048},
    )


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(block_size=32), "block_size is 32, the scheduler's is 16"),
        (
            dict(max_num_batched_tokens=512),
            "max_num_batched_tokens is 512, the scheduler's is 2048",
        ),
        (dict(tp_size=3), "tensor-parallel size 3, the scheduler expects 2"),
        (dict(replica=2), "replica 2 is out of range"),
        (dict(tp_rank=2), "rank 2 is out of range"),
    ],
)
def test_a_rank_that_disagrees_with_the_scheduler_is_refused(client, over, needle):
    assert needle in client._refuse_reason(hs(**over))


def test_ranks_must_agree_with_their_group_and_replicas_with_each_other(client):
    async def run():
        client.groups[0].workers[0] = WorkerInfo(0, 0, b"w.a", b"hb.a", hs())
        assert client._refuse_reason(hs(tp_rank=1)) == ""
        assert "rendezvous" in client._refuse_reason(
            hs(tp_rank=1, rendezvous="tcp://127.0.0.1:9001")
        )
        assert "model_fingerprint" in client._refuse_reason(
            hs(tp_rank=1, model_fingerprint="other")
        )
        client.groups[0].is_ready = True
        # another replica has its own rendezvous but must serve the same model
        assert client._refuse_reason(hs(replica=1, rendezvous="tcp://127.0.0.1:9100")) == ""
        assert "vocab_size" in client._refuse_reason(hs(replica=1, vocab_size=500))
        assert "already connected" in client._refuse_reason(hs(tp_rank=1))

    asyncio.run(run())


@pytest.mark.parametrize(
    "endpoint,local",
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://localhost:0", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/pagedserve.sock", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False),
        ("tcp://10.1.2.3:5557", False),
        ("tcp://scheduler.internal:5557", False),
    ],
)
def test_which_endpoints_count_as_loopback(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local


def test_binding_beyond_loopback_needs_keys_or_the_insecure_flag():
    async def run():
        with pytest.raises(InsecureEndpoint, match="--curve-keys"):
            WorkerClient("tcp://0.0.0.0:0").bind()
        client = WorkerClient("tcp://0.0.0.0:0", insecure_wire=True)
        assert client.bind().startswith("tcp://0.0.0.0:")
        await client.close()

    asyncio.run(run())
