"""Chaos, bounded: a load with random client cancels while one worker is killed and its replacement
is stalled past the deadline. Every request that finished equals an uninterrupted run, every
cancelled one saw a prefix of it, and every block is back afterwards.
"""

import os
import random
import signal
import threading
import time

import grpc
import pytest

from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, children_of, sampled, wait_health

pytestmark = pytest.mark.slow


def test_cancels_a_kill_and_a_stall_under_load_lose_nothing(server_factory, tiny_model_dir):
    server = server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "96",
        "--heartbeat-timeout",
        "2",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "64",
    )
    rng = random.Random(2026)
    reqs = []
    for i in range(24):
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(3, 40))]
        n = rng.randint(20, 90)
        reqs.append(greedy_request(prompt, n) if i % 2 else sampled(prompt, n, seed=1000 + i))
    reference = [list(server.stub.Generate(r, timeout=120).choices[0].token_ids) for r in reqs]
    # tokens before the client leaves
    cancel_after = {i: rng.randint(1, 15) for i in rng.sample(range(24), 6)}
    got = [[] for _ in reqs]
    errors = [None] * len(reqs)

    def client(i):
        time.sleep(rng.uniform(0, 4))
        call = server.stub.GenerateStream(reqs[i], timeout=180)
        try:
            for msg in call:
                got[i].extend(msg.token_ids)
                if i in cancel_after and len(got[i]) >= cancel_after[i]:
                    call.cancel()
                    return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                errors[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    time.sleep(1.5)
    (first,) = server.stats().replicas[0].worker_pids
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    # until the replacement has joined
    while server.stats().replicas[0].worker_pids in (
        [],
        [first],
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    (second,) = server.stats().replicas[0].worker_pids
    os.kill(second, signal.SIGSTOP)  # past the 2 s heartbeat deadline: fenced and replaced
    try:
        wait_health(server, False, 10)
        wait_health(server, True, 60)
    finally:
        if str(second) in children_of(server.proc.pid):
            os.kill(second, signal.SIGCONT)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert errors == [None] * len(reqs)
    for i, tokens in enumerate(got):
        if i in cancel_after and len(tokens) < len(reference[i]):
            assert tokens == reference[i][: len(tokens)], i
        else:
            assert tokens == reference[i], i
    assert server.stats().replicas[0].worker_pids[0] not in (first, second)
    assert_all_blocks_back(server)
    stats = server.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
