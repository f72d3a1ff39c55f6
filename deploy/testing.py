"""Start a real pagedserve (scheduler + worker processes, gRPC + ZeroMQ on localhost) and wait until it
serves.

Used by the end-to-end tests and the benchmarks: the same launcher `make run` uses, in a child process."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.processes import ROOT, free_port, read_port_file, stop_group  # noqa: F401
from protos import generation_pb2, generation_pb2_grpc, wire_pb2
from protos.codec import decode_plan, resolve_tokens


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        """args: extra launcher flags (see `pagedserve serve --help`). The server binds any free port
        (--port 0) and writes the one it got to a file beside its log: no port is picked and hoped for."""
        self.model_dir = model_dir
        self.log_path = log_path
        self.args = list(args)
        self.port: int | None = None
        self.worker_endpoint: str | None = None  # the scheduler's ZeroMQ endpoint, as bound
        self.metrics_port: int | None = None  # where it serves Prometheus metrics, as bound
        self.http_port: int | None = None  # where it serves the OpenAI API, as bound
        self.port_file = Path(log_path).with_suffix(".port")
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.port_file.unlink(missing_ok=True)
        self.port = self.channel = None  # a restart binds a port of its own
        metrics = [] if "--metrics-port" in self.args else ["--metrics-port", "-1"]  # any free port, reported
        metrics += [] if "--http-port" in self.args else ["--http-port", "-1"]
        cmd = [sys.executable, "-m", "deploy.launcher", "--model", str(self.model_dir), "--port", "0",
               "--port-file", str(self.port_file), *metrics, *self.args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            bound = read_port_file(self.port_file) if self.channel is None else None
            if bound is not None:
                self.port, self.worker_endpoint = bound["port"], bound["worker_endpoint"]
                self.metrics_port = bound.get("metrics_port")
                self.http_port = bound.get("http_port")
                self.channel = grpc.insecure_channel(self.address)
                health = health_pb2_grpc.HealthStub(self.channel)
            if self.channel is not None:
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not serving within {timeout}s:\n{self.log_tail()}")

    @property
    def http_url(self) -> str:
        """The OpenAI API's base URL (…/v1)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def stats(self) -> generation_pb2.CacheStats:
        return self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=10)

    @contextlib.contextmanager
    def queued_in_order(self, n: int, gap: float = 0.05):
        """Yields n arrival delays, `gap` apart, while this server's workers are held still (SIGSTOP):
        requests sent at those delays all wait in the scheduler, in that order, before its next step, and
        the workers go on `gap` * n + 0.5 s after the block begins (far below the heartbeat deadline).
        Whether a small pool preempts then follows from the workload alone, not from how fast this machine
        ran the first arrivals before the last came."""
        deadline = time.monotonic() + 30
        while not (pids := [p for replica in self.stats().replicas for p in replica.worker_pids]):
            assert time.monotonic() < deadline, "the server never reported its workers"
            time.sleep(0.1)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        release = threading.Timer(gap * n + 0.5, resume)
        release.start()
        try:
            yield [gap * i for i in range(n)]
        finally:
            release.join()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        stop_group(self.proc, 20)
        if hasattr(self, "_log"):
            self._log.close()


def greedy_request(prompt: list[int], max_tokens: int,
                   request_id: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


# --- the simulated worker: a torch-free model whose output depends on every paging decision ---
VOCAB = 1000


def next_token(context: list[int], seed: int | None = None, index: int = 0) -> int:
    """Greedy (seed None): a function of the context. Sampled: also of the seed and the token's index,
    so samples of one prompt diverge, as they do with a real sampler."""
    key = list(context) if seed is None else list(context) + [seed, index]
    digest = hashlib.blake2b(np.asarray(key, dtype=np.uint64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def expected_output(prompt: list[int], max_tokens: int, seed: int | None = None,
                    window: int = 0) -> list[int]:
    """window > 0: a sliding-window model, each token a function of the last `window` tokens only."""
    ctx = list(prompt)
    for i in range(max_tokens):
        ctx.append(next_token(ctx[-window:] if window else ctx, seed, i))
    return ctx[len(prompt):]


class SimulatedWorker:
    def __init__(self, num_blocks: int, block_size: int, window: int = 0) -> None:
        """window > 0: the model reads only each token's last `window` positions (a sliding window), so the
        scheduler may give back blocks before it; reading one of those would change the output."""
        self.block_size = block_size
        self.window = window
        self.pool = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.num_steps = 0
        self.last_step_id = 0
        self.last_sampled: np.ndarray | None = None  # kept for the next plan's pending tokens (overlap)
        self.last_accepted: list[int] | None = None  # drafted tokens each row of the last step accepted
        # what the last step's pooling rows gave back: a hidden state of two values, [sum of the token ids
        # the row reads, how many]: a mean sums its own tokens, the last token reads its whole context, the
        # first token itself (a stand-in for a model whose last hidden state depends on the whole context)
        self.last_pooled: np.ndarray | None = None

    def step(self, sched, out) -> list:
        """Plan, run and apply one scheduler step (its drafts' acceptance included): the new tokens."""
        from protos.codec import encode_plan

        tokens = self.execute(encode_plan(sched.build_plan(out)))
        return sched.update(out, tokens, self.last_accepted, self.last_pooled)

    def execute(self, plan: wire_pb2.StepPlan) -> list[int]:
        """Run a plan as it comes off the wire; -1 for rows that do not sample. A drafting row's drafted
        tokens stand while each is the token the model gives at its position (`last_accepted` says how
        many), and its token is the one after them, as the worker's sampler does."""
        self.num_steps += 1
        p = decode_plan(plan)
        token_ids = resolve_tokens(p, self.last_step_id, self.last_sampled)
        bs = self.block_size
        tables, qsl = p.block_tables.astype(np.int64), p.query_start_loc
        assert (p.slot_mapping >= 0).all()
        for i in range(p.num_seqs):  # a slot is where the position's block table entry says
            pos = p.positions[qsl[i]:qsl[i + 1]].astype(np.int64)
            assert (p.slot_mapping[qsl[i]:qsl[i + 1]] == tables[i][pos // bs] * bs + pos % bs).all()
        for src, dst in p.block_copies:  # copy-on-write, before the step's writes
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        self.pool[p.slot_mapping] = token_ids
        out, accepted = [], [0] * p.num_seqs
        for i in range(p.num_seqs):
            if not p.do_sample[i]:
                out.append(-1)
                continue
            drafted = int(p.num_draft[i]) if p.num_draft is not None else 0
            seed = int(p.seed[i]) if p.temperature[i] > 0 else None
            for j in range(drafted + 1):  # each draft position in turn, then the token after the draft
                end = int(p.seq_lens[i]) - drafted + j
                token = next_token(self._context(tables[i], end), seed, int(p.sample_index[i]) - drafted + j)
                if j == drafted or token != token_ids[qsl[i + 1] - drafted + j]:
                    break
                accepted[i] += 1
            out.append(token)
        self.last_step_id, self.last_sampled = p.step_id, np.asarray(out, dtype=np.int32)
        self.last_accepted = accepted if p.num_draft is not None else None
        self.last_pooled = self._pool(p, tables, token_ids) if p.pooling is not None else None
        return out

    def _pool(self, p, tables: np.ndarray, token_ids: np.ndarray) -> np.ndarray | None:
        from protos.codec import POOL_FIRST, POOL_SUM

        rows = []
        for i in np.flatnonzero(p.pooling).tolist():
            start, end = int(p.query_start_loc[i]), int(p.query_start_loc[i + 1])
            if p.pooling[i] == POOL_SUM:
                ids = token_ids[start:end]
            elif p.pooling[i] == POOL_FIRST:
                ids = token_ids[start:start + 1]
            else:
                ids = np.asarray(self._context(tables[i], int(p.seq_lens[i])))
            rows.append([float(np.sum(ids)), float(len(ids))])
        return np.asarray(rows, dtype=np.float32) if rows else None

    def _context(self, table: np.ndarray, end: int) -> list[int]:
        """The tokens the model reads for the token at position `end` (its window's, with one)."""
        bs = self.block_size
        pos = np.arange(max(end - self.window, 0) if self.window else 0, end)
        assert (table[pos // bs] >= 0).all(), "a block the window reads was given back"
        ctx = self.pool[table[pos // bs] * bs + pos % bs]
        assert (ctx >= 0).all(), "read a slot that was never written"
        return ctx.tolist()


class Pipeline:
    """Drives a scheduler and a SimulatedWorker the way a replica's step loop does: with overlap, step N+1 is
    planned and sent before step N's result is applied (the worker keeps N's tokens for it)."""

    def __init__(self, sched, worker: SimulatedWorker, overlap: bool, on_token) -> None:
        """on_token(seq, token): the engine's part (stop checks; it may finish the sequence)."""
        self.sched, self.worker, self.on_token = sched, worker, on_token
        self.depth = 2 if overlap else 1
        self.inflight: list = []

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or self.sched.has_work

    def step(self) -> bool:
        """One turn of the loop; False when it could do nothing (no work, or nothing schedulable)."""
        from protos.codec import encode_plan

        launched = False
        if self.sched.has_work and len(self.inflight) < self.depth:
            out = self.sched.schedule()
            if not out.is_empty:
                tokens = self.worker.execute(encode_plan(self.sched.build_plan(out)))
                self.inflight.append((out, tokens, self.worker.last_accepted))
                launched = True
        if self.inflight and (len(self.inflight) == self.depth or not launched):
            out, tokens, accepted = self.inflight.pop(0)
            new = self.sched.update(out, tokens, accepted)
            for i, (seq, token) in enumerate(new):
                if seq.is_finished:  # by a stop among this step's tokens: the rest are not its
                    continue
                # on_token sees the sequence as it was when this token came (an accepted draft's tokens
                # come together), and if it ends the sequence, those after it are dropped
                later = sum(1 for s, _ in new[i + 1:] if s is seq)
                after = seq.token_ids[len(seq.token_ids) - later:]
                del seq.token_ids[len(seq.token_ids) - later:]
                self.on_token(seq, token)
                if not seq.is_finished:
                    seq.token_ids.extend(after)
            return True
        return launched


