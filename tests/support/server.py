"""A real pagedserve (scheduler + worker processes, gRPC + ZeroMQ on localhost) for the end-to-end
tests and the benchmarks: deploy/processes.py's LocalServer with what a test asks of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from deploy.processes import LocalServer
from protos import generation_pb2, generation_pb2_grpc


class ServerProcess(LocalServer):
    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def stats(self) -> generation_pb2.CacheStats:
        return self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=10)

    def worker_pids(self) -> list[int]:
        deadline = time.monotonic() + 30
        while not (pids := [p for replica in self.stats().replicas for p in replica.worker_pids]):
            assert time.monotonic() < deadline, "the server never reported its workers"
            time.sleep(0.1)
        return pids

    @contextlib.contextmanager
    def held_still(self, seconds: float, pids: list[int] | None = None):
        """This server's workers held still (SIGSTOP) from now for `seconds`, whatever the block
        does (keep it far below the heartbeat deadline): no step runs, so no request finishes
        meanwhile. `pids` read beforehand make the hold begin at once.
        """
        pids = pids or self.worker_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        release = threading.Timer(seconds, resume)
        release.start()
        try:
            yield
        finally:
            release.join()

    @contextlib.contextmanager
    def queued_in_order(self, n: int, gap: float = 0.05):
        """Yields n arrival delays, `gap` apart, while this server's workers are held still:
        requests sent at those delays all wait in the scheduler, in that order, before its next
        step, and the workers go on `gap` * n + 0.5 s after the block begins. Whether a small pool
        preempts then follows from the workload alone, not from how fast this machine ran the first
        arrivals before the last came.
        """
        with self.held_still(gap * n + 0.5):
            yield [gap * i for i in range(n)]


def greedy_request(
    prompt: list[int], max_tokens: int, request_id: str = ""
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def worker_main_code(model, *flags: str) -> int:
    """`pagedserve-worker --model model flags...` run in this process against no scheduler (a
    start-up that ends before it would connect): its exit code; its lines on the captured stderr.
    """
    import structlog

    import worker.serve.main as worker_main

    argv = ["--model", str(model), "--scheduler", "tcp://127.0.0.1:1", "--malloc", "glibc"]
    try:
        return worker_main.main([*argv, "--log-format", "json", *flags])
    finally:
        structlog.reset_defaults()  # main() pointed the logs at the test's captured stderr
