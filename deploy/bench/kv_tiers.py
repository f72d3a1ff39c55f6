"""KV tiers under the pool against none, and against llama.cpp's prompt cache in RAM: `make
bench-kv-tiers`.

A multi-turn chat workload (SGLang's bench_multiturn shape): --conversations conversations, each a
random document of --doc-tokens tokens, then --turns turns, each a question of --question-tokens
tokens and an answer of --answer-tokens greedy tokens appended to the context (a turn's prompt
starts with the whole turn before it). Turns go round the conversations, --clients at a time, so
every conversation's blocks have left a pool sized to a quarter of the conversations' contexts (the
working set is 4x the pool) before it comes back. Passes, each on a fresh server on the same file:
  recompute no prefix cache at all (every turn computed whole; only with --passes);
  off       no tiers (the prefix cache only: a hybrid model's turns resume from state snapshots);
  host      --kv-offload-size large enough for the working set;
  disk      --kv-offload-dir, a fresh folder;
  restart   a new server on the folder the disk pass filled: its returning turns (2 on) only, beside
  cold      a server without tiers on the same turns;
  llama.cpp llama-server with its default --cache-ram, one slot a client (--no-llama-cpp: none).
Prints each pass's mean TTFT of first and returning turns, decode tokens/s a stream, and the ratios.
--passes picks passes (recompute,off: a hybrid with no prefix reuse against its snapshots).

    python -m deploy.bench.kv_tiers --doc-tokens 6000 --conversations 8
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.server import ServerProcess


def context_tokens(args) -> int:
    return args.doc_tokens + args.turns * (args.question_tokens + args.answer_tokens)


def pool_bytes(args, per_token: int) -> int:
    """A quarter of the conversations' contexts, and no less than one context a client."""
    return max(args.conversations // 4, args.clients) * (context_tokens(args) + 64) * per_token


class Conversations:
    """Every conversation's context so far, and each turn's timings."""

    def __init__(self, args, seed: int) -> None:
        rng = random.Random(seed)
        self.args = args
        self.context = [
            [rng.randrange(100, 40000) for _ in range(args.doc_tokens)]
            for _ in range(args.conversations)
        ]
        self.questions = [
            [
                [rng.randrange(100, 40000) for _ in range(args.question_tokens)]
                for _ in range(args.turns)
            ]
            for _ in range(args.conversations)
        ]
        self.prompts: dict[tuple[int, int], list[int]] = {}

    def run(self, ask, turns: range, clients: int, prompts=None) -> dict:
        """Every conversation's turns, `clients` at a time; `prompts` replays recorded ones."""
        ttft = {t: [] for t in turns}
        rates = []
        for t in turns:

            def one(c, t=t):
                prompt = prompts[(c, t)] if prompts else self.context[c] + self.questions[c][t]
                first, rate, answer = ask(prompt)
                self.prompts[(c, t)] = prompt
                self.context[c] = prompt + answer
                return first, rate

            with ThreadPoolExecutor(clients) as pool:
                for first, rate in pool.map(one, range(self.args.conversations)):
                    ttft[t].append(first)
                    rates.append(rate)
        return {"ttft": ttft, "rate": statistics.mean(rates)}


def ask_pagedserve(server: ServerProcess, answer_tokens: int):
    from protos import generation_pb2

    def ask(prompt):
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(
                max_tokens=answer_tokens, temperature=0, ignore_eos=True
            ),
        )
        t0 = time.perf_counter()
        first, tokens = None, []
        for msg in server.stub.GenerateStream(req, timeout=3600):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            tokens += msg.token_ids
        end = time.perf_counter()
        return first - t0, (len(tokens) - 1) / max(end - first, 1e-9), tokens

    return ask


def ask_llama(base_url: str, answer_tokens: int):
    import httpx

    def ask(prompt):
        body = {
            "prompt": prompt,
            "n_predict": answer_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": True,
            "stream": True,
            "return_tokens": True,
        }
        t0 = time.perf_counter()
        first, tokens = None, []
        with httpx.stream("POST", base_url + "/completion", json=body, timeout=3600) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("tokens"):
                    first = first or time.perf_counter()
                    tokens += chunk["tokens"]
        end = time.perf_counter()
        return first - t0, (len(tokens) - 1) / max(end - first, 1e-9), tokens

    return ask


def serve(args, log_dir: Path, name: str, *flags: str) -> ServerProcess:
    return ServerProcess(
        Path(args.model),
        log_dir / f"{name}.log",
        "--metrics-port",
        "0",
        "--max-num-seqs",
        str(max(args.clients, 4)),
        "--max-model-len",
        str(context_tokens(args) + 16),
        *flags,
    ).start(timeout=600)


def summary(name: str, r: dict, base: dict | None) -> str:
    turns = sorted(r["ttft"])
    first = statistics.mean(r["ttft"][turns[0]]) if turns[0] == 0 else None
    back = [x for t in turns if t > 0 for x in r["ttft"][t]]
    ret = statistics.mean(back) if back else None
    line = (
        f"{name:<10} first-turn TTFT {first or 0:7.3f} s  returning TTFT {ret or 0:7.3f} s  "
        f"decode {r['rate']:6.1f} tok/s a stream"
    )
    if base is not None:
        bt = sorted(base["ttft"])
        bret = statistics.mean([x for t in bt if t > 0 for x in base["ttft"][t]])
        line += f"   returning TTFT x{bret / ret:.1f} lower, decode x{r['rate'] / base['rate']:.2f}"
        if first and bt[0] == 0:
            line += f", first turn x{statistics.mean(base['ttft'][0]) / first:.2f}"
    return line


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=".models/smollm2-135m-instruct", help="a folder or GGUF")
    p.add_argument(
        "--gguf", default=None, help="llama.cpp's file (default: the model folder's GGUF)"
    )
    p.add_argument("--doc-tokens", type=int, default=6000)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument(
        "--bytes-per-token",
        type=int,
        default=46080,
        help="the model's KV bytes a token (the default model's, fp32)",
    )
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument(
        "--passes",
        default="off,host,disk,restart",
        help="comma-separated: recompute, off, host, disk, restart (restart needs disk)",
    )
    args = p.parse_args(argv)
    passes = set(args.passes.split(","))
    model = Path(args.model)
    pool = pool_bytes(args, args.bytes_per_token)
    host = 8 * pool
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-kv-tiers-"))
    folder = log_dir / "kv"
    sized = ("--kv-cache-memory", f"{pool}")
    every, later = range(args.turns), range(1, args.turns)
    print(
        f"{args.conversations} conversations x {args.turns} turns, document {args.doc_tokens} "
        f"tokens, {args.clients} at a time; KV pool {pool / 2**20:.0f} MiB (a quarter of the "
        f"working set); logs in {log_dir}",
        flush=True,
    )
    results = {}
    for name, flags in (
        ("recompute", ("--no-prefix-caching",)),
        ("off", ()),
        ("host", ("--kv-offload-size", f"{host}")),
        ("disk", ("--kv-offload-dir", str(folder), "--kv-offload-disk-size", f"{host}")),
    ):
        if name not in passes:
            continue
        server = serve(args, log_dir, name, *sized, *flags)
        try:
            convs = Conversations(args, seed=1)
            results[name] = convs.run(
                ask_pagedserve(server, args.answer_tokens), every, args.clients
            )
            stats = server.stats()
            base = results.get("recompute" if name == "off" else "off")
            print(
                summary(name, results[name], base)
                + f"   loaded {stats.host_tier_loaded + stats.disk_tier_loaded} blocks",
                flush=True,
            )
            if name == "disk":
                replay = dict(convs.prompts)
        finally:
            server.stop()
    for name, flags in (
        ("restart", ("--kv-offload-dir", str(folder), "--kv-offload-disk-size", f"{host}")),
        ("cold", ()),
    ):
        if "restart" not in passes:
            break
        server = serve(args, log_dir, name, *sized, *flags)
        try:
            results[name] = Conversations(args, seed=1).run(
                ask_pagedserve(server, args.answer_tokens), later, args.clients, replay
            )
            print(summary(name, results[name], results.get("cold")), flush=True)
        finally:
            server.stop()
    if "restart" in passes:
        print(summary("restart", results["restart"], results["cold"]) + "   (a cold server's)")
    if not args.no_llama_cpp:
        gguf = (
            Path(args.gguf)
            if args.gguf
            else (
                Path(json.loads((model / "pagedserve_model.json").read_text())["gguf"])
                if model.is_dir()
                else model
            )
        )
        from deploy.bench.llama_build import LlamaServer, llama_cpp

        context = context_tokens(args) + 64
        llama = LlamaServer(
            llama_cpp(), gguf, args.clients, context, 2, log_dir / "llama-server.log"
        ).wait()
        try:
            results["llama.cpp"] = Conversations(args, seed=1).run(
                ask_llama(llama.base_url, args.answer_tokens), every, args.clients
            )
        finally:
            llama.stop()
        print(summary("llama.cpp", results["llama.cpp"], results.get("off")))
        for name in [n for n in ("off", "host", "disk") if n in results]:
            print(summary(name, results[name], results["llama.cpp"]) + "   (against llama.cpp)")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
