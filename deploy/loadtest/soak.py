"""A soak with faults (`make soak MINUTES=N`): a server of its own under mixed streaming load for N
minutes over all three doors (pagedserve's gRPC, the engine protocol, OpenAI HTTP chat and
completions; long and short prompts behind a shared prefix, n=2, a fifth cancelled mid-stream)
while a worker is SIGKILLed every --kill-every minutes. Prints the server's resident memory over
time (scheduler and workers apart), its slope after warm-up, the figure once idle against the
warmed-up one, leaked blocks, and every request's fate; exits 1 if a request failed with anything
but the client's own cancel or a block was left held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from deploy.processes import LocalServer
from protos import generation_pb2, generation_pb2_grpc
from protos.base.argtypes import Parser

MIB = 1024 * 1024
SHARED = (
    "You are a careful assistant who answers in plain words. Paged attention keeps keys and values "
    "in fixed-size blocks, so memory is allocated as sequences grow and freed when they end. "
)
KINDS = ("grpc", "engine", "chat", "completion")
GREEDY_TOKENS = 24


def tree(pid: int) -> dict[int, str]:
    """Every process under pid (itself included): its role, worker or scheduler."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            out[p] = "worker" if b"worker.serve" in cmd else "scheduler"
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sample(root: int) -> dict[str, float]:
    """Resident MiB by role, and in all."""
    by = Counter()
    for pid, role in tree(root).items():
        by[role] += rss(pid)
    return {
        "scheduler": by["scheduler"] / MIB,
        "worker": by["worker"] / MIB,
        "total": (by["scheduler"] + by["worker"]) / MIB,
    }


def sampling(q: dict) -> dict:
    """A request's sampling fields, the same through every door: greedy to length, or sampled."""
    greedy = q["greedy"] is not None
    return {
        "max_tokens": q["max_tokens"],
        "temperature": 0.0 if greedy else 0.8,
        "n": q["n"],
        "ignore_eos": greedy,
    }


def planned_mib(log: Path) -> float:
    """What the workers said at start they would hold (weights, KV pool, buffers): the KV pool's
    pages become resident only as blocks are first written, so RSS rises to this in the first
    minutes without being a leak."""
    latest: dict[str, float] = {}  # each worker's latest start
    for line in Path(log).read_text(errors="replace").splitlines():
        if '"host_memory"' in line and "planned_bytes" in line:
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                latest[event.get("process", "")] = event["planned_bytes"] / MIB
    return sum(latest.values())


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MiB per minute of (seconds, MiB) points."""
    if len(points) < 3:
        return float("nan")
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / den if den else float("nan")


class Soak:
    def __init__(self, server: LocalServer, args) -> None:
        self.server, self.args = server, args
        self.rng = random.Random(args.seed)
        self.fates: list[dict] = []
        self.samples: list[dict] = []
        self.kills: list[float] = []
        self.greedy: dict[tuple[str, int], str] = {}
        self.mismatches = 0
        self.t0 = time.monotonic()
        self.until = self.t0 + args.minutes * 60

    def now(self) -> float:
        return time.monotonic() - self.t0

    def request(self, i: int) -> dict:
        """What request i asks: a kind, a prompt (a shared prefix, a short or long tail), n."""
        r = self.rng
        long = r.random() < 0.25
        words = ("blocks", "tokens", "pages", "memory", "steps")
        tail = " ".join(
            r.choice(words) for _ in range(r.randint(400, 700) if long else r.randint(5, 40))
        )
        greedy = r.random() < 0.2  # a fixed prompt whose greedy answer must repeat
        prompt = self.shared + (f"Question {i % 4}: what is a block?" if greedy else tail)
        while len(self.tokenizer.encode(prompt)) > self.max_prompt:  # a small model's context
            prompt = prompt[: len(prompt) * 3 // 4]
        return {
            "kind": KINDS[i % len(KINDS)],
            "prompt": prompt,
            "greedy": i % 4 if greedy else None,
            "max_tokens": GREEDY_TOKENS if greedy else r.randint(8, 64),
            "n": 2 if (not greedy and r.random() < 0.2) else 1,
            "cancel_after": r.randint(1, 6) if (not greedy and r.random() < 0.2) else None,
        }

    async def grpc_stream(self, q: dict):
        stub = generation_pb2_grpc.GenerationStub(self.aio)
        params = generation_pb2.SamplingParams(**sampling(q))
        call = stub.GenerateStream(
            generation_pb2.GenerateRequest(prompt=q["prompt"], sampling=params, raw_prompt=True),
            timeout=self.args.timeout,
        )
        try:
            async for msg in call:
                yield list(msg.token_ids), msg.index
        finally:
            call.cancel()

    async def engine_stream(self, q: dict):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(self.aio)
        sp = vllm_engine_pb2.SamplingParams(**sampling(q))
        req = vllm_engine_pb2.GenerateRequest(
            request_id=f"soak-{self.rng.getrandbits(64):x}",
            tokenized=vllm_engine_pb2.TokenizedInput(
                original_text=q["prompt"], input_ids=self.tokenizer.encode(q["prompt"])
            ),
            sampling_params=sp,
            stream=True,
        )
        call = stub.Generate(req, timeout=self.args.timeout)
        try:
            async for msg in call:
                part = msg.chunk if msg.HasField("chunk") else msg.complete
                yield list(part.token_ids) if msg.HasField("chunk") else [], part.index
        finally:
            call.cancel()

    async def http_stream(self, q: dict):
        body = {**sampling(q), "stream": True}
        if q["kind"] == "chat":
            path, body["messages"] = (
                "/v1/chat/completions",
                [{"role": "user", "content": q["prompt"]}],
            )
        else:
            path, body["prompt"] = "/v1/completions", q["prompt"]
        async with self.http.stream("POST", self.base + path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                        yield list(text), c.get("index", 0)

    async def one(self, i: int) -> None:
        q = self.request(i)
        stream = {"grpc": self.grpc_stream, "engine": self.engine_stream}.get(
            q["kind"], self.http_stream
        )(q)
        fate = {"kind": q["kind"], "t": round(self.now(), 1), "n": q["n"], "outcome": "completed"}
        parts: dict[int, list] = {}
        chunks = 0
        try:
            async for pieces, index in stream:
                parts.setdefault(index, []).extend(pieces)
                chunks += 1
                if q["cancel_after"] is not None and chunks >= q["cancel_after"]:
                    fate["outcome"] = "cancelled"
                    break
        except grpc.aio.AioRpcError as e:
            fate.update(outcome="failed", status=e.code().name, details=e.details()[:200])
        except (httpx.HTTPError, RuntimeError) as e:
            fate.update(outcome="failed", status=type(e).__name__, details=str(e)[:200])
        finally:
            await stream.aclose()
        if fate["outcome"] == "completed" and q["greedy"] is not None:
            answer = repr(parts.get(0))
            key = (q["kind"], q["greedy"])
            if self.greedy.setdefault(key, answer) != answer:
                self.mismatches += 1
        self.fates.append(fate)

    async def client(self, k: int) -> None:
        i = k
        while time.monotonic() < self.until:
            await self.one(i)
            i += self.args.streams

    async def sampler(self) -> None:
        while True:
            self.samples.append({"t": round(self.now(), 1), **sample(self.server.proc.pid)})
            await asyncio.sleep(self.args.sample_s)

    async def killer(self) -> None:
        every = self.args.kill_every * 60
        while every > 0 and self.now() + every < self.args.minutes * 60:
            await asyncio.sleep(every)
            workers = [p for p, role in tree(self.server.proc.pid).items() if role == "worker"]
            if workers:
                os.kill(self.rng.choice(workers), signal.SIGKILL)
                self.kills.append(round(self.now(), 1))
                print(f"  {self.now() / 60:5.1f} min  worker SIGKILLed", flush=True)

    async def run(self) -> dict:
        from scheduler_service.text.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(str(self.server.model_dir))
        info = generation_pb2_grpc.GenerationStub(self.server.channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=30
        )
        self.max_prompt = info.max_context - 100  # room for a chat template and the answer
        # the shared prefix: a third of the context at most
        reps = max(1, min(6, info.max_context // 3 // len(self.tokenizer.encode(SHARED))))
        self.shared = SHARED * reps
        self.aio = grpc.aio.insecure_channel(self.server.address)
        self.base = self.server.http_url.removesuffix("/v1")
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.args.timeout, connect=30.0))
        sampler = asyncio.create_task(self.sampler())
        killer = asyncio.create_task(self.killer())
        reporter = asyncio.create_task(self.report_every_minute())
        await asyncio.gather(*(self.client(k) for k in range(self.args.streams)))
        killer.cancel()
        reporter.cancel()
        loaded = self.now()
        await asyncio.sleep(self.args.idle_s)  # idle: what memory goes back to
        sampler.cancel()
        self.samples.append({"t": round(self.now(), 1), **sample(self.server.proc.pid)})
        stats = generation_pb2_grpc.GenerationStub(self.server.channel).GetCacheStats(
            generation_pb2.GetCacheStatsRequest(), timeout=30
        )
        await self.http.aclose()
        await self.aio.close()
        return self.summary(loaded, stats)

    async def report_every_minute(self) -> None:
        print(
            f"{'min':>5} {'total MiB':>10} {'scheduler':>10} {'workers':>8} {'done':>6}", flush=True
        )
        while True:
            await asyncio.sleep(60)
            s = self.samples[-1]
            print(
                f"{self.now() / 60:5.1f} {s['total']:10.0f} {s['scheduler']:10.0f} "
                f"{s['worker']:8.0f} {len(self.fates):6d}",
                flush=True,
            )

    def summary(self, loaded: float, stats) -> dict:
        outcomes = Counter((f["kind"], f["outcome"], f.get("status", "")) for f in self.fates)
        return {
            "minutes": self.args.minutes,
            "kills_at_s": self.kills,
            "requests": len(self.fates),
            "fates": {" ".join(x for x in k if x): v for k, v in sorted(outcomes.items())},
            "failed": [f for f in self.fates if f["outcome"] == "failed"][:20],
            "greedy_mismatches": self.mismatches,
            "leaked_blocks": stats.num_blocks - stats.num_free_blocks - stats.num_cached_blocks,
            "running_after": stats.num_running + stats.num_waiting,
            **memory_figures(self.samples, self.kills, self.args.warmup * 60, loaded),
            "worker_planned_mib": round(planned_mib(self.server.log_path)),
            "samples": self.samples,
        }


def memory_figures(samples: list[dict], kills: list[float], warm: float, loaded: float) -> dict:
    """RSS at warm-up, minute 5, the end of the load and idle; the slope after warm-up. A killed
    worker starts again from its weights and writes its pool afresh, so with kills the slope is
    taken over the figures just before each kill (the level the server had grown to each time)."""

    def at(t: float) -> dict:  # the last sample taken by t
        return ([s for s in samples if s["t"] <= t] or samples[:1])[-1]

    if kills:
        points = [at(t - 1) for t in [*kills, loaded] if t >= warm]
        points = [p for p in points if p["worker"] > 0]  # a sample may fall between the two
    else:
        points = [s for s in samples if warm <= s["t"] <= loaded]
    idle, warmed, minute_5 = samples[-1], at(warm), at(300)
    return {
        "rss_mib": {
            "at_warmup": round(warmed["total"]),
            "at_minute_5": round(minute_5["total"]),
            "end_of_load": round(at(loaded)["total"]),
            "idle": round(idle["total"]),
            "idle_vs_warmup": round(idle["total"] / warmed["total"], 3),
            "idle_vs_minute_5": round(idle["total"] / minute_5["total"], 3),
            "peak": round(max(s["total"] for s in samples)),
            "before_each_kill": [round(at(k - 1)["total"]) for k in kills],
        },
        "slope_mib_per_min": {
            role: round(slope([(p["t"], p[role]) for p in points]), 2)
            for role in ("total", "scheduler", "worker")
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pagedserve-loadtest soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=".models/smollm2-135m-instruct", help="the model folder")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument(
        "--kill-every", type=float, default=5.0, help="minutes between worker SIGKILLs (0: none)"
    )
    p.add_argument("--streams", type=int, default=12, help="clients, each one request at a time")
    p.add_argument("--warmup", type=float, default=5.0, help="minutes before the slope is taken")
    p.add_argument("--idle-s", type=float, default=60.0, help="seconds idle before the last sample")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the figures and samples as JSON here")
    p.add_argument("--log", default="run/soak/server.log", help="the server's log")
    p.add_argument("server_args", nargs="*", help="after --: flags for the server")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        print(
            f"soak: no model folder at {args.model} (make setup prepares the default)",
            file=sys.stderr,
        )
        return 2
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    server = LocalServer(Path(args.model), Path(args.log), *args.server_args).start()
    try:
        result = asyncio.run(Soak(server, args).run())
    finally:
        server.stop()
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    shown = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(shown, indent=1))
    bad = (
        result["leaked_blocks"]
        or result["running_after"]
        or any("failed" in k for k in result["fates"])
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
