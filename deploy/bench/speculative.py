"""Speculative decoding, same run: `make bench-spec`.

One stream at a time over an edit workload (deploy/bench/edit_workload.json: code edits,
corrections, rewrites, answers quoting a passage, JSON that echoes its input; the chat template
applied, greedy, end of sequence allowed, --max-tokens each): decode tokens/s from each answer's
first token to its last, summed over the workload (tokens - 1 over seconds), for
  - pagedserve with --speculative off, ngram and auto;
  - llama.cpp's llama-server on the same Q4_1 GGUF without speculation and with each n-gram
    --spec-type (built once from the llama-cpp-python sdist, as `make bench-cpu-peers` does);
then 64 streams of random token prompts (the shared workload's lengths, new tokens each round), all
at once, pagedserve with each mode: output tokens/s. Each round starts every server afresh (n-grams
learned in a round never draft the next: both engines keep some across requests), and within it the
servers take each prompt in turn, the first one rotating, so a slow moment of a noisy machine falls
on all of them alike; medians over rounds, ratios per round. Prompts go to both as the same token
ids.

    python -m deploy.bench.speculative --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, http_pass, load_workload
from deploy.bench.llama_build import LlamaServer, llama_cpp
from deploy.prepare_model import find_embedded_gguf
from tests.support.server import ServerProcess

EDIT_WORKLOAD = Path(__file__).with_name("edit_workload.json")
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


class Ours:
    def __init__(self, model: Path, mode: str, threads: int) -> None:
        self.name = f"pagedserve --speculative {mode}"
        log = Path(tempfile.mkdtemp(prefix="pagedserve-spec-")) / "server.log"
        self.server = ServerProcess(
            model, log, "--metrics-port", "0", "--threads", str(threads), "--speculative", mode
        ).start(timeout=600)

    def one(self, prompt: list[int], max_tokens: int) -> tuple[int, float]:
        """(tokens, seconds from the first token to the last) of one greedy answer."""
        from protos import generation_pb2

        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
        )
        first = last = None
        n = 0
        for msg in self.server.stub.GenerateStream(req, timeout=600):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                n += len(msg.token_ids)
        return n, last - first

    def many(self, prompts: list[list[int]], max_tokens: int) -> float:
        wall, _, tokens = asyncio.run(drive(self.server.address, prompts, max_tokens))
        return tokens / wall

    def drafts(self) -> str:
        st = self.server.stats()
        if not st.num_draft_verifications:
            return "no drafts"
        return (
            f"{st.num_accepted_draft_tokens / st.num_draft_tokens:.0%} of {st.num_draft_tokens} "
            "drafted tokens accepted, "
            f"{1 + st.num_accepted_draft_tokens / st.num_draft_verifications:.2f} tokens a "
            "verifying step"
        )

    def stop(self) -> None:
        self.server.stop()


class Llama:
    def __init__(self, gguf: Path, spec: str, threads: int) -> None:
        self.name = f"llama-server --spec-type {spec}"
        extra = [] if spec == "none" else ["--spec-type", spec]
        folder = Path(tempfile.mkdtemp(prefix="pagedserve-peer-llama-"))
        self.server = LlamaServer(
            llama_cpp(), gguf, 1, 4096, threads, folder / "llama-server.log", *extra
        ).wait()

    def one(self, prompt: list[int], max_tokens: int) -> tuple[int, float]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_prompt": False,
        }
        r = asyncio.run(http_pass(self.server.base_url, [body], "/v1/completions"))
        return r["tokens"], r["wall_s"] - r["ttfts"][0]

    def drafts(self) -> str:
        return ""

    def stop(self) -> None:
        self.server.stop()


def edit_prompts(model: Path) -> list[list[int]]:
    from scheduler_service.text.tokenizer import Tokenizer

    tok = Tokenizer(model)
    return [tok.encode_chat(item["messages"]) for item in json.loads(EDIT_WORKLOAD.read_text())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, type=Path, help="the prepared folder of the default model"
    )
    p.add_argument(
        "--gguf", type=Path, default=None, help="llama.cpp's file (default: the embedded Q4_1)"
    )
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2, help="passes over the edit workload")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--modes", default="off,ngram,auto", help="pagedserve's --speculative modes")
    p.add_argument(
        "--llama-spec",
        default="none," + ",".join(LLAMA_SPEC_TYPES),
        help="llama-server's --spec-type values ('none': without); empty: skip llama.cpp",
    )
    p.add_argument(
        "--workload", type=Path, default=DEFAULT_WORKLOAD, help="the many-stream workload"
    )
    p.add_argument("--streams", type=int, default=64, help="0: skip the many-stream part")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--stream-rounds", type=int, default=4)
    args = p.parse_args(argv)
    gguf = args.gguf or find_embedded_gguf()
    prompts = edit_prompts(args.model)
    modes = [m for m in args.modes.split(",") if m]
    makers = [lambda m=m: Ours(args.model, m, args.threads) for m in modes]
    makers += [lambda s=s: Llama(gguf, s, args.threads) for s in args.llama_spec.split(",") if s]
    rates, drafts, kinds = {}, {}, {}
    # every server started afresh each round: nothing learned from the last one
    for _ in range(args.rounds):
        servers = []
        try:
            for make in makers:
                servers.append(make())
            tokens, seconds = [0] * len(servers), [0.0] * len(servers)
            # the servers in turn on each prompt (the first one rotating), so
            for i, q in enumerate(prompts):
                # that a slow moment of a noisy machine falls on all of them
                for j in range(len(servers)):
                    at = (i + j) % len(servers)
                    n, sec = servers[at].one(q, args.max_tokens)
                    tokens[at] += n - 1
                    seconds[at] += sec
            for t, n, sec in zip(servers, tokens, seconds, strict=True):
                drafts[t.name], kinds[t.name] = t.drafts(), type(t)
                rates.setdefault(t.name, []).append(n / sec)
                print(
                    f"  {t.name}: {rates[t.name][-1]:.1f} tok/s ({n + len(prompts)} tokens) "
                    f"{drafts[t.name]}",
                    flush=True,
                )
        finally:
            for t in servers:
                t.stop()
    many = many_streams(args, modes) if args.streams and args.stream_rounds > 0 else {}
    report(rates, drafts, kinds, many, args)
    return 0


def many_streams(args, modes: list[str]) -> dict[str, list[float]]:
    """Output tok/s of `--streams` prompts, each mode's server fresh every round, modes in turn."""
    import random

    lengths = [len(p) for p in load_workload(args.workload)[: args.streams]]
    many: dict[str, list[float]] = {}
    for r in range(args.stream_rounds):
        rng = random.Random(r)
        prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            ours = Ours(args.model, mode, args.threads)
            try:
                rate = ours.many(prompts, args.stream_tokens)
                many.setdefault(ours.name, []).append(rate)
                print(
                    f"  {args.streams} streams, round {r + 1}: {ours.name}: {rate:.1f} tok/s "
                    f"{ours.drafts()}",
                    flush=True,
                )
            finally:
                ours.stop()
    return {f"pagedserve --speculative {m}": many[f"pagedserve --speculative {m}"] for m in modes}


def report(rates: dict, drafts: dict, kinds: dict, many: dict, args) -> None:
    med = statistics.median
    if any(many.values()):
        first = next(iter(many))
        print(
            f"\n{args.streams} random streams x {args.stream_tokens} tokens, output tok/s "
            f"({args.stream_rounds} rounds; ratios per round, their median):"
        )
        for name, r in many.items():
            ratios = [a / b for a, b in zip(r, many[first], strict=True)]
            print(
                f"  {name:38} {med(r):7.1f}  x{med(ratios):.3f} vs {first.split()[-1]}  "
                f"({', '.join(f'x{x:.3f}' for x in ratios)})"
            )
    if not rates:
        return
    base = next(iter(rates))
    llama = [name for name in rates if kinds[name] is Llama]
    best_llama = max(llama, key=lambda n: med(rates[n])) if llama else None
    print(
        f"\none stream, edit workload ({len(json.loads(EDIT_WORKLOAD.read_text()))} prompts, "
        f"{args.rounds} rounds), decode tok/s:"
    )
    for name, r in rates.items():
        cols = (
            f" x{med(a / b for a, b in zip(r, rates[base], strict=True)):.2f} vs {base.split()[-1]}"
        )
        if best_llama:
            vs = med(a / b for a, b in zip(r, rates[best_llama], strict=True))
            cols += f"  x{vs:.2f} vs best llama.cpp"
        print(f"  {name:38} {med(r):7.1f}{cols}  {drafts[name]}")
    if best_llama:
        print(f"  best llama.cpp mode: {best_llama}")


if __name__ == "__main__":
    sys.exit(main())
