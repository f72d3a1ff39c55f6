"""Many workers through real processes: tensor-parallel groups (gloo), data-parallel replicas under
one scheduler, the group-aware supervisor, and the wire's handshake and security rules.
"""

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos import generation_pb2
from tests.support.server import ServerProcess, greedy_request
from tests.support.serving import assert_all_blocks_back, submit_all, workload
from tests.support.tiny import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir,
        "--data-parallel-size",
        "2",
        "--block-size",
        "4",
        "--num-blocks",
        "160",
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "8",
        "--task",
        "both",
        "--pooling",
        "mean",
    )


@pytest.fixture(scope="module")
def tp_server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir,
        "--tensor-parallel-size",
        "2",
        "--block-size",
        "4",
        "--num-blocks",
        "160",
        "--max-num-batched-tokens",
        "64",
        "--heartbeat-timeout",
        "3",
        "--task",
        "both",
        "--pooling",
        "mean",
    )


def test_tensor_parallel_group_outputs_equal_transformers(tp_server, tiny_model_dir):
    info = tp_server.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.tensor_parallel_size, info.data_parallel_size, info.num_workers) == (2, 1, 2)
    items = workload(6, seed=31)
    results = submit_all(tp_server, items, stream=True)
    for rid, prompt, max_tokens, _ in items:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
    stats = tp_server.stats()
    # each rank holds one of the model's two KV heads: a block over the group is the whole model's
    # block
    assert stats.bytes_per_block == 2 * 3 * 2 * 16 * 4 * 4
    assert len(stats.replicas) == 1 and len(stats.replicas[0].worker_pids) == 2
    assert_all_blocks_back(tp_server)


def test_embeddings_over_tensor_and_data_parallel_equal_transformers(
    tp_server, dp_server, tiny_model_dir
):
    """Both servers embed too (--task both --pooling mean): the mean of the decoder's last hidden
    states, unit length, as transformers' own model computes them, whichever rank or replica ran
    them.
    """
    import numpy as np
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_model_dir)).eval()
    rng = random.Random(5)
    inputs = [[rng.randrange(3, 380) for _ in range(rng.randint(5, 90))] for _ in range(8)]
    with torch.no_grad():
        ref = np.stack(
            [model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy() for ids in inputs]
        )
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    request = generation_pb2.EmbedRequest(
        inputs=[generation_pb2.TokenIds(ids=ids) for ids in inputs]
    )
    for server in (tp_server, dp_server):
        response = server.stub.Embed(request, timeout=60)
        got = np.array([list(d.values) for d in response.data], dtype=np.float32)
        np.testing.assert_allclose(got, ref, atol=1e-4)
        assert_all_blocks_back(server)
    assert all(r.num_embeddings for r in dp_server.stats().replicas), (
        "one replica embedded everything"
    )


def test_tensor_parallel_applies_request_controls_like_one_rank(tp_server, dp_server):
    """Every rank of a group applies the same controls to the same logits and draws the same token:
    the group answers seeded requests with penalties, biases, min_p and logprobs as a single rank
    does.
    """
    from tests.support.serving import CONTROLS, sampled_request

    for i, prompt in enumerate(([3, 4, 5, 6], list(range(40, 75)), [9] * 12)):
        req = sampled_request(prompt, 16, seed=100 + i, **CONTROLS)
        a = tp_server.stub.Generate(req, timeout=120).choices[0]
        b = dp_server.stub.Generate(req, timeout=120).choices[0]
        assert list(a.token_ids) == list(b.token_ids)
        assert [x.logprob for x in a.logprobs] == pytest.approx(
            [x.logprob for x in b.logprobs], abs=1e-3
        )
        assert 6 not in a.token_ids


def test_data_parallel_outputs_equal_and_distinct_requests_use_both_replicas(
    dp_server, tiny_model_dir
):
    info = dp_server.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.tensor_parallel_size, info.data_parallel_size, info.num_blocks) == (1, 2, 320)
    before = [r.num_requests for r in dp_server.stats().replicas]
    items = workload(8, seed=32)
    results = submit_all(dp_server, items, stream=True)
    for rid, prompt, max_tokens, _ in items:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
    stats = dp_server.stats()
    routed = [r.num_requests - b for r, b in zip(stats.replicas, before, strict=True)]
    assert sum(routed) == 8 and min(routed) >= 2, routed
    assert all(r.serving and r.num_blocks == 160 for r in stats.replicas)
    assert stats.num_blocks == 320 and stats.num_free_blocks + stats.num_cached_blocks == 320
    assert_all_blocks_back(dp_server)


def test_a_shared_prefix_goes_to_the_replica_that_caches_it(dp_server):
    rng = random.Random(33)
    prefix = [rng.randrange(3, 384) for _ in range(40)]  # ten full blocks of 4
    before = {r.replica: r.num_requests for r in dp_server.stats().replicas}
    first = dp_server.stub.Generate(greedy_request(prefix + [5, 6], 4, "prefix-a"), timeout=60)
    assert first.usage.cached_prompt_tokens == 0
    holder = [r.replica for r in dp_server.stats().replicas if r.num_requests > before[r.replica]]
    assert len(holder) == 1
    for i in range(4):  # one after another: each lands where the prefix is cached
        before = {r.replica: r.num_requests for r in dp_server.stats().replicas}
        resp = dp_server.stub.Generate(
            greedy_request(prefix + [7 + i, 8], 4, f"prefix-{i}"), timeout=60
        )
        assert resp.usage.cached_prompt_tokens >= 40
        after = {r.replica: r.num_requests for r in dp_server.stats().replicas}
        assert after[holder[0]] == before[holder[0]] + 1
    assert_all_blocks_back(dp_server)


def test_abort_and_cancel_find_requests_on_any_replica(dp_server):
    calls = [
        dp_server.stub.GenerateStream(greedy_request([9, 8, 7, i], 300, f"long-{i}"), timeout=60)
        for i in range(4)
    ]
    firsts = [next(iter(c)) for c in calls]  # all four are running
    assert all(len(f.token_ids) for f in firsts)
    rows = {r.request_id: r.replica for r in dp_server.stats().requests}
    assert {rows[f"long-{i}"] for i in range(4)} == {0, 1}
    for i in (0, 1):
        assert dp_server.stub.Abort(
            generation_pb2.AbortRequest(request_id=f"long-{i}"), timeout=10
        ).aborted
    for c in calls[2:]:
        c.cancel()
    deadline = time.monotonic() + 10
    while dp_server.stats().requests:
        assert time.monotonic() < deadline, "aborted or cancelled requests kept their blocks"
        time.sleep(0.05)
    assert_all_blocks_back(dp_server)


def test_a_killed_rank_takes_its_group_down_and_the_group_comes_back_and_resumes(
    tp_server, tiny_model_dir
):
    from tests.support.serving import Streams, wait_health

    reqs = [greedy_request([5, 6, 7, i], 80) for i in range(3)]
    reference = [hf_greedy(tiny_model_dir, list(r.prompt_token_ids), 80) for r in reqs]
    pids = list(tp_server.stats().replicas[0].worker_pids)
    streams = Streams(tp_server.stub, reqs)
    assert streams.started.wait(30)
    os.kill(pids[1], signal.SIGKILL)
    wait_health(tp_server, False, 5)
    wait_health(tp_server, True, 120)  # the whole group restarts, shakes hands and serves again
    streams.join()
    assert streams.errors == [None] * 3 and streams.tokens == reference
    new_pids = list(tp_server.stats().replicas[0].worker_pids)
    assert len(new_pids) == 2 and not set(new_pids) & set(pids), (
        "both ranks of the group are new processes"
    )
    for pid in pids:
        assert not _alive(pid)
    assert_all_blocks_back(tp_server)


def test_a_lost_replicas_requests_move_to_the_other_one(dp_server, tiny_model_dir):
    from tests.support.serving import Streams

    reqs = [greedy_request([40, 41, 42, i], 100, f"move-{i}") for i in range(4)]
    reference = [hf_greedy(tiny_model_dir, list(r.prompt_token_ids), 100) for r in reqs]
    # both replicas serving (one may still be back from an earlier test)
    deadline = time.monotonic() + 60
    while not all(r.serving for r in dp_server.stats().replicas):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pids = dp_server.worker_pids()
    victim = dp_server.stats().replicas[0].worker_pids[0]
    # No step runs while the requests arrive and the worker dies: each is live, on either replica,
    # when its replica is lost, however fast this machine would have finished one before the last
    # arrived.
    with dp_server.held_still(5.0, pids):
        streams = Streams(dp_server.stub, reqs)
        deadline = time.monotonic() + 4.5
        while len((stats := dp_server.stats()).requests) < len(reqs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert {r.replica for r in stats.requests} == {0, 1}
        os.kill(victim, signal.SIGKILL)
    streams.join()
    assert streams.errors == [None] * 4 and streams.tokens == reference
    deadline = time.monotonic() + 60  # and replica 0 comes back
    while not all(r.serving for r in dp_server.stats().replicas):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert_all_blocks_back(dp_server)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def test_a_size_that_cannot_split_the_model_stops_the_service_with_the_numbers(
    tmp_path, tiny_model_dir
):
    server = ServerProcess(
        tiny_model_dir,
        tmp_path / "log",
        "--tensor-parallel-size",
        "3",
        "--threads",
        "1",
        "--num-blocks",
        "200",
        "--block-size",
        "4",
    )
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.start(timeout=120)
    finally:
        server.stop()
    assert (
        "tensor-parallel size 3 cannot split the model's 4 query heads evenly"
    ) in server.log_path.read_text()


def test_curve_keys_encrypt_the_wire_and_a_peer_without_them_is_never_heard(
    tmp_path, tiny_model_dir
):
    import zmq

    from protos import WIRE_VERSION, wire_pb2
    from protos.curve import make_keys

    keys = make_keys(tmp_path / "keys")
    server = ServerProcess(
        tiny_model_dir,
        tmp_path / "log",
        "--threads",
        "1",
        "--num-blocks",
        "200",
        "--block-size",
        "4",
        "--curve-keys",
        str(keys),
        "--worker-endpoint",
        "tcp://127.0.0.1:0",
    )
    try:
        server.start(timeout=120)
        ok = server.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30)
        assert len(ok.choices[0].token_ids) == 3
        # a plain (unauthenticated) peer offers itself as the group's rank and forges a result
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"w.intruder")
        sock.connect(server.worker_endpoint)  # the endpoint the scheduler bound
        hs = wire_pb2.Handshake(
            tp_rank=0, tp_size=1, num_blocks=200, block_size=4, max_num_batched_tokens=2048
        )
        sock.send(wire_pb2.WireMessage(version=WIRE_VERSION, handshake=hs).SerializeToString())
        sock.send(
            wire_pb2.WireMessage(
                version=WIRE_VERSION, result=wire_pb2.StepResult(step_id=1, error="forged")
            ).SerializeToString()
        )
        assert not sock.poll(1500), "the scheduler answered a peer without keys"
        sock.close()
        ctx.term()
        assert server.stats().replicas[0].serving
        again = server.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30)
        assert list(again.choices[0].token_ids) == list(ok.choices[0].token_ids)
    finally:
        server.stop()


def test_a_non_loopback_endpoint_needs_keys_or_an_explicit_insecure_flag(tmp_path, tiny_model_dir):
    server = ServerProcess(
        tiny_model_dir, tmp_path / "log", "--threads", "1", "--worker-endpoint", "tcp://0.0.0.0:0"
    )
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.start(timeout=60)
    finally:
        server.stop()
    assert (
        "--curve-keys" in server.log_path.read_text()
        and "--insecure-wire" in server.log_path.read_text()
    )


def test_concurrent_load_on_both_replicas_keeps_every_output(dp_server, tiny_model_dir):
    items = [(rid + "-c", p, m, 0.0) for rid, p, m, _ in workload(12, seed=34)]
    with ThreadPoolExecutor(2) as pool:  # two rounds at once, all in flight together
        a, b = pool.map(
            lambda part: submit_all(dp_server, part, stream=False), (items[:6], items[6:])
        )
    results = {**a, **b}
    for rid, prompt, max_tokens, _ in items:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
    assert_all_blocks_back(dp_server)
