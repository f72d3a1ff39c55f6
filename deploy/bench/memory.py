"""Memory-management benchmarks on the default model, each comparison in one run.

    python -m deploy.bench.memory --model .models/smollm2-135m-instruct            # both
    python -m deploy.bench.memory --model ... --only prefix | chunked

prefix:  32 requests sharing a 512-token system prompt, each with its own question, 16 output
         tokens, all sent at once; prefix caching on vs off. Prints prompt tokens computed,
         throughput, and whether the outputs are identical.
chunked: a few very long prompts among short chats; chunked prefill on (a small per-step budget) vs
         off (whole prompts in one step). Prints the short requests' gaps between tokens (p50, p99,
         max): a long prompt computed in one step stalls every decode beside it.
window:  the default model's shapes as a Mistral with a 256-key sliding window on every layer,
         beside its full-attention twin (the same config without the window), random weights
         (--load-format dummy): 8 sequences of 256 prompt + 1024 output tokens (5 windows). Prints
         the blocks held at the peak (sampled every 50 ms), tokens/s, and whether the windowed model
         finishes in a pool of a quarter of what full attention needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tests.support.server import ServerProcess


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _scrape(port: int, name: str) -> float:
    """The sum of a series over its labels (a replica's series carry the replica)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def _run(address: str, requests: list[tuple[list[int], int, float]]):
    """requests: (prompt ids, max_tokens, delay). Returns per request
    (tokens, token arrival times).
    """
    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt, max_tokens, delay):
            await asyncio.sleep(delay)
            req = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=generation_pb2.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                ),
            )
            tokens, times = [], []
            async for msg in stub.GenerateStream(req, timeout=3600):
                if msg.token_ids:
                    tokens.extend(msg.token_ids)
                    times.append(time.perf_counter())
            return tokens, times

        return await asyncio.gather(*(one(*r) for r in requests))


def _serve(model: str, *flags: str) -> tuple[ServerProcess, int]:
    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    server = ServerProcess(
        Path(model), log, "--metrics-port", "-1", "--kv-cache-memory", "2GiB", *flags
    ).start()
    return server, server.metrics_port


def bench_prefix(args) -> None:
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(512)]
    requests = [
        (system + [rng.randrange(100, 40000) for _ in range(rng.randint(12, 32))], 16, 0.0)
        for _ in range(32)
    ]
    total_prompt = sum(len(p) for p, _, _ in requests)
    print(
        f"\nshared prefix: 32 requests, 512-token shared system prompt + 12-32 own tokens "
        f"({total_prompt} prompt tokens), 16 output tokens each"
    )
    outputs = {}
    for label, flags in (
        ("prefix caching on", ()),
        ("prefix caching off", ("--no-prefix-caching",)),
    ):
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
        print(
            f"  {label:<20} prompt tokens computed {computed:7.0f}   cache hits "
            f"{stats.prefix_cache_hits:6d}   {tokens / wall:6.1f} output tok/s   "
            f"{len(requests) / wall:5.2f} req/s   wall {wall:5.1f} s"
        )
    on, off = outputs["prefix caching on"], outputs["prefix caching off"]
    print(f"  identical outputs: {on == off}")


def bench_chunked(args) -> None:
    rng = random.Random(1)
    long_reqs = [
        ([rng.randrange(100, 40000) for _ in range(3000)], 8, 1.0 + 4.0 * i) for i in range(3)
    ]
    short_reqs = [
        ([rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))], 48, 0.1 * i)
        for i in range(16)
    ]
    print(
        "\nmixed: 3 prompts of 3000 tokens (arriving at 1, 5, 9 s) among 16 short chats "
        "(20-60 prompt tokens, 48 output tokens)"
    )
    for label, flags in (
        ("chunked prefill on (budget 256)", ("--max-num-batched-tokens", "256")),
        ("chunked prefill off", ("--no-chunked-prefill", "--max-num-batched-tokens", "8192")),
    ):
        server, _ = _serve(args.model, *flags, "--max-model-len", "8192")
        try:
            t0 = time.perf_counter()
            results = asyncio.run(_run(server.address, short_reqs + long_reqs))
            wall = time.perf_counter() - t0
        finally:
            server.stop()
        gaps = sorted(
            b - a
            for _, times in results[: len(short_reqs)]
            for a, b in zip(times, times[1:], strict=False)
        )
        print(
            f"  {label:<32} short requests' gap between tokens: p50 "
            f"{percentile(gaps, 0.5) * 1e3:7.1f} ms   p99 {percentile(gaps, 0.99) * 1e3:7.1f} ms  "
            f" max {gaps[-1] * 1e3:7.1f} ms   (wall {wall:.1f} s)"
        )


def _twins(model: str, window: int) -> dict[str, Path]:
    """The default model's shapes as a Mistral, with and without a window (dummy weights)."""
    src = Path(model)
    config = json.loads((src / "config.json").read_text())
    out = {}
    for label, sliding in (("sliding window", window), ("full attention", None)):
        folder = Path(tempfile.mkdtemp(prefix="pagedserve-window-"))
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name in {
                "special_tokens_map.json",
                "generation_config.json",
            }:
                shutil.copy(f, folder / f.name)
        twin = {
            k: config[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "rms_norm_eps",
                "rope_theta",
                "tie_word_embeddings",
                "bos_token_id",
                "eos_token_id",
            )
            if k in config
        }
        twin.update(
            model_type="mistral",
            architectures=["MistralForCausalLM"],
            max_position_embeddings=2048,
            sliding_window=sliding,
            head_dim=config["hidden_size"] // config["num_attention_heads"],
        )
        (folder / "config.json").write_text(json.dumps(twin))
        out[label] = folder
    return out


def bench_window(args) -> None:
    window, block, seqs, prompt_len, out_len = 256, 16, 8, 256, 1024
    rng = random.Random(2)
    requests = [
        ([rng.randrange(100, 40000) for _ in range(prompt_len)], out_len, 0.0) for _ in range(seqs)
    ]
    full_blocks = seqs * -(-(prompt_len + out_len) // block)
    print(
        f"\nsliding window: {seqs} sequences of {prompt_len} prompt + {out_len} output tokens, a "
        f"{window}-key window on every layer, blocks of {block}, budget 256 tokens a step"
    )
    flags = (
        "--load-format",
        "dummy",
        "--block-size",
        str(block),
        "--max-num-batched-tokens",
        "256",
        "--max-num-seqs",
        str(seqs),
    )
    for label, folder in _twins(args.model, window).items():
        for pool in (full_blocks + 8, full_blocks // 4):
            server = ServerProcess(
                folder,
                Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log",
                "--metrics-port",
                "-1",
                "--num-blocks",
                str(pool),
                *flags,
            )
            try:
                server.start()
            except RuntimeError as e:
                print(
                    f"  {label:<15} pool {pool:5d} blocks: refused at start "
                    f"({str(e).splitlines()[0][:90]})"
                )
                continue
            peak, done = [0], threading.Event()

            def watch(server=server, peak=peak, done=done):
                while not done.wait(0.05):
                    st = server.stats()
                    peak[0] = max(
                        peak[0], st.num_blocks - st.num_free_blocks - st.num_cached_blocks
                    )

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                t0 = time.perf_counter()
                results = asyncio.run(_run(server.address, requests))
                wall = time.perf_counter() - t0
                stats = server.stats()
            finally:
                done.set()
                watcher.join()
                server.stop()
            tokens = sum(len(r[0]) for r in results)
            print(
                f"  {label:<15} pool {pool:5d} blocks: peak held {peak[0]:5d} blocks "
                f"({peak[0] * block:6d} tokens; full attention needs {full_blocks})   "
                f"{tokens / wall:6.1f} tok/s   preemptions {stats.num_preemptions}   wall "
                f"{wall:5.1f} s"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve-bench-memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--only", choices=["prefix", "chunked", "window"], default=None)
    args = p.parse_args(argv)
    if args.only in (None, "prefix"):
        bench_prefix(args)
    if args.only in (None, "chunked"):
        bench_chunked(args)
    if args.only in (None, "window"):
        bench_window(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
