"""Memory-management benchmarks on the default model, each comparison in one run.

    python -m deploy.bench_memory --model .models/smollm2-135m-instruct            # both
    python -m deploy.bench_memory --model ... --only prefix | chunked

prefix:  32 requests sharing a 512-token system prompt, each with its own question, 16 output tokens,
         all sent at once; prefix caching on vs off. Prints prompt tokens computed, throughput, and
         whether the outputs are identical.
chunked: a few very long prompts among short chats; chunked prefill on (a small per-step budget) vs
         off (whole prompts in one step). Prints the short requests' gaps between tokens (p50, p99,
         max): a long prompt computed in one step stalls every decode beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from deploy.local_server import ServerProcess


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _scrape(port: int, name: str) -> float:
    """The sum of a series over its labels (a replica's series carry the replica)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def _run(address: str, requests: list[tuple[list[int], int, float]]):
    """requests: (prompt ids, max_tokens, delay). Returns per request (tokens, token arrival times)."""
    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt, max_tokens, delay):
            await asyncio.sleep(delay)
            req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            tokens, times = [], []
            async for msg in stub.GenerateStream(req, timeout=3600):
                if msg.token_ids:
                    tokens.extend(msg.token_ids)
                    times.append(time.perf_counter())
            return tokens, times

        return await asyncio.gather(*(one(*r) for r in requests))


def _serve(model: str, *flags: str) -> tuple[ServerProcess, int]:
    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    server = ServerProcess(Path(model), log, "--metrics-port", "-1", "--kv-cache-memory", "2GiB", *flags).start()
    return server, server.metrics_port


def bench_prefix(args) -> None:
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(512)]
    requests = [(system + [rng.randrange(100, 40000) for _ in range(rng.randint(12, 32))], 16, 0.0)
                for _ in range(32)]
    total_prompt = sum(len(p) for p, _, _ in requests)
    print(f"\nshared prefix: 32 requests, 512-token shared system prompt + 12-32 own tokens "
          f"({total_prompt} prompt tokens), 16 output tokens each")
    outputs = {}
    for label, flags in (("prefix caching on", ()), ("prefix caching off", ("--no-prefix-caching",))):
        server, port = _serve(args.model, *flags)
        try:
            t0 = time.perf_counter()
            results = asyncio.run(_run(server.address, requests))
            wall = time.perf_counter() - t0
            computed = _scrape(port, "pagedserve_prefill_tokens_computed_total")
            stats = server.stats()
        finally:
            server.stop()
        outputs[label] = [r[0] for r in results]
        tokens = sum(len(r[0]) for r in results)
        print(f"  {label:<20} prompt tokens computed {computed:7.0f}   cache hits {stats.prefix_cache_hits:6d}   "
              f"{tokens / wall:6.1f} output tok/s   {len(requests) / wall:5.2f} req/s   wall {wall:5.1f} s")
    on, off = outputs["prefix caching on"], outputs["prefix caching off"]
    print(f"  identical outputs: {on == off}")


def bench_chunked(args) -> None:
    rng = random.Random(1)
    long_reqs = [([rng.randrange(100, 40000) for _ in range(3000)], 8, 1.0 + 4.0 * i) for i in range(3)]
    short_reqs = [([rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))], 48, 0.1 * i) for i in range(16)]
    print("\nmixed: 3 prompts of 3000 tokens (arriving at 1, 5, 9 s) among 16 short chats "
          "(20-60 prompt tokens, 48 output tokens)")
    for label, flags in (("chunked prefill on (budget 256)", ("--max-num-batched-tokens", "256")),
                         ("chunked prefill off", ("--no-chunked-prefill", "--max-num-batched-tokens", "8192"))):
        server, _ = _serve(args.model, *flags, "--max-model-len", "8192")
        try:
            t0 = time.perf_counter()
            results = asyncio.run(_run(server.address, short_reqs + long_reqs))
            wall = time.perf_counter() - t0
        finally:
            server.stop()
        gaps = sorted(b - a for _, times in results[: len(short_reqs)] for a, b in zip(times, times[1:], strict=False))
        print(f"  {label:<32} short requests' gap between tokens: p50 {percentile(gaps, 0.5) * 1e3:7.1f} ms   "
              f"p99 {percentile(gaps, 0.99) * 1e3:7.1f} ms   max {gaps[-1] * 1e3:7.1f} ms   (wall {wall:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-bench-memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--only", choices=["prefix", "chunked"], default=None)
    args = p.parse_args(argv)
    if args.only in (None, "prefix"):
        bench_prefix(args)
    if args.only in (None, "chunked"):
        bench_chunked(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
