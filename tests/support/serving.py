"""What the end-to-end and fault tests do to a live server: workloads, streams read to the end, the
pool checked clean, health awaited, a worker's children found.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2
from tests.support.server import greedy_request


def workload(n, seed, vocab=384):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 60))]
        out.append((f"req-{seed}-{i}", prompt, rng.randint(4, 40), rng.uniform(0, 0.6)))
    return out


def run_stream(stub, req):
    tokens, text, finish, usage = {}, {}, {}, None
    for msg in stub.GenerateStream(req, timeout=120):
        tokens.setdefault(msg.index, []).extend(msg.token_ids)
        text[msg.index] = text.get(msg.index, "") + msg.text
        if msg.finish_reason:
            finish[msg.index] = msg.finish_reason
        if msg.HasField("usage"):
            usage = msg.usage
    return tokens, text, finish, usage


def submit_all(server, items, stream):
    """items: (id, prompt, max_tokens, delay); requests arrive at their delay, all in flight
    together.
    """

    def one(item):
        rid, prompt, max_tokens, delay = item
        time.sleep(delay)
        req = greedy_request(prompt, max_tokens, rid)
        if stream:
            tokens, text, finish, usage = run_stream(server.stub, req)
            return rid, tokens[0], text[0], finish[0], usage
        resp = server.stub.Generate(req, timeout=120)
        c = resp.choices[0]
        return rid, list(c.token_ids), c.text, c.finish_reason, resp.usage

    with ThreadPoolExecutor(len(items)) as pool:
        return {r[0]: r[1:] for r in pool.map(one, items)}


def assert_all_blocks_back(server):
    """Every block free or cached, no request live (within 5 s of the last one ending)."""
    deadline = time.monotonic() + 5
    while True:
        stats = server.stats()
        if (
            stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
            and not stats.requests
        ):
            break
        assert time.monotonic() < deadline, f"blocks still held: {stats}"
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.used_bytes == 0


def sampled_request(prompt, max_tokens, seed, n=1, request_id="", **controls):
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=seed,
            n=n,
            ignore_eos=True,
            **controls,
        ),
    )


# Request controls that read the context (penalties), add biases, filter (min_p) and report
# (logprobs).
CONTROLS = dict(
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.6,
    min_p=0.02,
    logit_bias={5: 2.0, 6: -100.0},
    logprobs=2,
)


def children_of(pid):
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


def sampled(prompt, max_tokens, seed):
    from protos import generation_pb2

    return generation_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True
        ),
    )


class Streams:
    """Streaming calls in threads; each collects its token deltas in order, or the error."""

    def __init__(self, stub, requests):
        self.tokens = [[] for _ in requests]
        self.errors = [None] * len(requests)
        self.started = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(stub, i, r)) for i, r in enumerate(requests)
        ]
        for t in self.threads:
            t.start()

    def _run(self, stub, i, req):
        try:
            for msg in stub.GenerateStream(req, timeout=120):
                self.tokens[i].extend(msg.token_ids)
                if len(self.tokens[i]) >= 3:
                    self.started.set()
        except grpc.RpcError as e:
            self.errors[i] = e

    def join(self, timeout=90):
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a request hung after its worker died"


def wait_health(server, serving, timeout):
    health = health_pb2_grpc.HealthStub(server.channel)
    want = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == want:
                return
        except grpc.RpcError:  # not listening yet
            pass
        assert time.monotonic() < deadline, (
            f"health never became {'SERVING' if serving else 'NOT_SERVING'}"
        )
        time.sleep(0.05)
