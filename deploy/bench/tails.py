"""Decoding streams beside long prompts, against the llama.cpp peers on the same GGUF: `make
bench-tails`.

--streams streams (4) decode --decode-tokens greedy tokens (400) from short prompts; once every one
of them is decoding, --prompts prompts (4) of --prompt-tokens token ids (2,500) arrive at once, 8
tokens each. Measured while any long prompt still waits for its first token: each stream's gaps
between tokens (p50, p99, the longest), and the long prompts' TTFT (mean, the longest). Each server
on its own in turn, --rounds rounds (new token ids each round: no prefix cache holds them):
pagedserve once per --gaps value (its --max-decode-gap-ms; 0: chunks fill the step's budget), and
llama.cpp's llama-server with a slot a request and continuous batching, and ik_llama.cpp's (-rtr)
where `make peer-ik` built it (--no-llama-cpp: no peer; --no-ik: not ik_llama.cpp).

    python -m deploy.bench.tails --model .models/smollm2-135m-instruct --gaps 0,500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from deploy.bench.llama_build import LlamaServer, Peer, peers
from deploy.prepare_model import find_embedded_gguf
from tests.support.server import ServerProcess


def pagedserve_stream(server: ServerProcess):
    """-> ask(prompt, max_tokens, times): each streamed token's arrival time appended to times."""
    from protos import generation_pb2

    def ask(prompt: list[int], max_tokens: int, times: list[float]) -> None:
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        for msg in server.stub.GenerateStream(req, timeout=3600):
            times += [time.perf_counter()] * len(msg.token_ids)

    return ask


def llama_stream(base_url: str):
    import httpx

    def ask(prompt: list[int], max_tokens: int, times: list[float]) -> None:
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "return_tokens": True,
        }
        with httpx.stream("POST", base_url + "/completion", json=body, timeout=3600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    chunk = json.loads(line[5:])
                    # llama.cpp's server lists each chunk's tokens; ik_llama.cpp's sends a chunk a
                    # token without the list
                    n = len(chunk.get("tokens") or ()) or int(bool(chunk.get("content")))
                    times += [time.perf_counter()] * n

    return ask


def one_round(ask, args, rng: random.Random) -> dict:
    """The streams, then the long prompts once every stream decodes; -> gaps and TTFTs."""
    streams: list[list[float]] = [[] for _ in range(args.streams)]
    answers: list[list[float]] = [[] for _ in range(args.prompts)]

    def run(into: list, prompt: list[int], n: int) -> None:
        ask(prompt, n, into)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    threads = [
        threading.Thread(target=run, args=(streams[i], ids(16), args.decode_tokens))
        for i in range(args.streams)
    ]
    for t in threads:
        t.start()
    while not all(len(s) >= 8 for s in streams):  # every stream is decoding
        time.sleep(0.01)
    sent = time.perf_counter()
    longs = [
        threading.Thread(target=run, args=(answers[i], ids(args.prompt_tokens), 8))
        for i in range(args.prompts)
    ]
    for t in longs:
        t.start()
    for t in longs + threads:
        t.join()
    answered = max(a[0] for a in answers)
    gaps = [
        b - a
        for s in streams
        for a, b in zip(s, s[1:], strict=False)
        if sent <= b and a <= answered
    ]
    return {"gaps": gaps, "ttfts": [a[0] - sent for a in answers]}


def report(name: str, rounds: list[dict]) -> dict:
    gaps = sorted(g for r in rounds for g in r["gaps"])
    ttfts = [t for r in rounds for t in r["ttfts"]]
    out = {
        "p50": gaps[len(gaps) // 2],
        "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "max": gaps[-1],
        "ttft": statistics.mean(ttfts),
        "ttft_max": max(ttfts),
    }
    print(
        f"{name:<26} gap p50 {out['p50']:6.3f} s  p99 {out['p99']:6.3f} s  longest "
        f"{out['max']:6.3f} s   long prompts' TTFT mean {out['ttft']:6.2f} s, longest "
        f"{out['ttft_max']:6.2f} s   ({len(gaps)} gaps)",
        flush=True,
    )
    return out


def context_len(args) -> int:
    return args.prompt_tokens + args.decode_tokens + 64


def measure_pagedserve(args, gap: int, log_dir: Path, name: str) -> dict:
    server = ServerProcess(
        Path(args.model),
        log_dir / f"gap{gap}.log",
        "--metrics-port",
        "0",
        "--max-decode-gap-ms",
        str(gap),
        "--max-model-len",
        str(context_len(args)),
    ).start(timeout=600)
    try:
        ask = pagedserve_stream(server)
        ask([1, 2, 3], 4, [])
        rng = random.Random(1)
        return report(name, [one_round(ask, args, rng) for _ in range(args.rounds)])
    finally:
        server.stop()


def measure_llama(args, log_dir: Path, peer: Peer, name: str) -> dict:
    slots = args.streams + args.prompts
    llama = LlamaServer(
        peer,
        args.gguf,
        slots,
        context_len(args),
        args.threads,
        log_dir / f"{peer.name}.log",
    ).wait()
    try:
        ask = llama_stream(llama.base_url)
        ask([1, 2, 3], 4, [])
        rng = random.Random(1)
        return report(name, [one_round(ask, args, rng) for _ in range(args.rounds)])
    finally:
        llama.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="the prepared folder of the GGUF below")
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded model's file")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=400)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=2500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gaps", default="0,500", help="pagedserve's --max-decode-gap-ms values")
    p.add_argument("--no-llama-cpp", action="store_true", help="no peer")
    p.add_argument("--no-ik", action="store_true", help="not ik_llama.cpp, where it is built")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)
    args.gguf = args.gguf or find_embedded_gguf()
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-tails-"))
    print(
        f"{args.streams} streams x {args.decode_tokens} tokens, then {args.prompts} prompts x "
        f"{args.prompt_tokens} tokens; {args.rounds} rounds; logs in {log_dir}",
        flush=True,
    )
    results = {}
    for gap in [int(g) for g in args.gaps.split(",")]:
        name = f"pagedserve gap {gap} ms"
        results[name] = measure_pagedserve(args, gap, log_dir, name)
    ours = dict(results)
    for peer in [] if args.no_llama_cpp else peers(ik=not args.no_ik):
        name = f"{peer.name} llama-server"
        theirs = results[name] = measure_llama(args, log_dir, peer, name)
        for label, r in ours.items():
            print(
                f"{label} / {peer.name}: p99 gap x{r['p99'] / theirs['p99']:.2f}, longest "
                f"x{r['max'] / theirs['max']:.2f}, long prompts' TTFT "
                f"x{r['ttft'] / theirs['ttft']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
