"""pagedserve against llama.cpp's server on the same GGUF, same run: `make bench-cpu-peers`.

llama.cpp is built from the `llama-cpp-python` source distribution on PyPI (it vendors llama.cpp):
the sdist is fetched with pip once, `llama-server` built with cmake for this machine, both cached
under ~/.cache/pagedserve-peers. ik_llama.cpp runs beside it, with -rtr, where `make peer-ik` has
built it (--no-ik: not). All servers serve the default model's own Q4_1 GGUF on both cores
(with --precision fp32: llama.cpp an F32 copy of it, pagedserve the same values with --dequantize):
  - one stream: the workload's first prompt (64 tokens) in the first round, its second in the next,
    and so on, 128 greedy tokens, ignore_eos (the same prompt again would have pagedserve's
    speculation draft the answer it gave before, from the n-grams it keeps of earlier requests: a
    replay, not a decode rate);
  - many streams: the first 8, then all 64 prompts of the fixed CPU workload (64-256 token ids, 128
    tokens each, all at once); llama.cpp gets 64 slots with continuous batching;
  - with --with-layers, pagedserve again with --cpu-decode layers (no fused decode step), for the
    change; with --variant NAME=FLAGS, again with any serve flags (repeatable).
  - prompt processing: one prompt of --prompt-tokens (512) token ids, one output token: prompt
    tokens/s over the request;
  - peak resident memory of each server's processes (VmHWM, the scheduler and workers summed for
    pagedserve).
All servers are up at once and measured in rounds, each round taking every server in turn, so a slow
spell of a noisy machine falls on all of them alike: medians over rounds, ratios per round. With
--alone (a model only one server at a time holds: gpt-oss-20b on 24 GiB) each server is started,
measured and stopped in turn, --passes times over.
Prompts go to both as the same token ids (pagedserve.v1 over gRPC; llama.cpp's /v1/completions takes
token-id prompts). Prints output tokens/s and mean TTFT, and each ratio pagedserve / llama.cpp.

    python -m deploy.bench.cpu_peers --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, http_pass, load_workload
from deploy.bench.llama_build import LlamaServer, Peer, f32_gguf, peers
from deploy.prepare_model import find_embedded_gguf
from tests.support.server import ServerProcess


def peak_rss(pid: int) -> int:
    """The peak resident bytes (VmHWM) of a process and every process under it, summed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            hwm = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
            total += int(hwm.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,
    }


class CannotRead(RuntimeError):
    """A peer that does not read this file's architecture: left out of the run, which goes on."""


class LlamaTarget:
    """A llama-server on the GGUF, driven over /v1/completions with token-id prompts."""

    def __init__(self, args, peer: Peer) -> None:
        folder = Path(tempfile.mkdtemp(prefix="pagedserve-peer-llama-"))
        self.peer = peer.name
        self.name = f"{peer.name} llama-server ({args.gguf_label} GGUF)"
        log = folder / f"{peer.name}.log"
        server = LlamaServer(
            peer, args.gguf, args.slots, max(384, args.prompt_tokens + 64), args.threads, log
        )
        try:
            self.server = server.wait()
        except (RuntimeError, TimeoutError):
            server.stop()  # whatever is left of it
            text = log.read_text(errors="replace")
            if "unknown model architecture" in text:
                arch = text.split("unknown model architecture:")[1].split("\n")[0].strip()
                raise CannotRead(f"{peer.name} does not read {arch}: left out") from None
            raise
        asyncio.run(http_pass(self.server.base_url, [_body([1, 2, 3], 4)], "/v1/completions"))

    def one(self, prompt: list[int], max_tokens: int) -> float:
        r = asyncio.run(
            http_pass(self.server.base_url, [_body(prompt, max_tokens)], "/v1/completions")
        )
        return (r["tokens"] - 1) / (r["wall_s"] - r["ttfts"][0])

    def many(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        r = asyncio.run(
            http_pass(
                self.server.base_url, [_body(p, max_tokens) for p in prompts], "/v1/completions"
            )
        )
        return r["tokens"] / r["wall_s"], statistics.mean(r["ttfts"])

    def prefill(self, prompt: list[int]) -> float:
        r = asyncio.run(http_pass(self.server.base_url, [_body(prompt, 1)], "/v1/completions"))
        return len(prompt) / r["wall_s"]  # one output token: the request is its prefill

    def peak_rss(self) -> int:
        return peak_rss(self.server.proc.pid)

    def stop(self) -> None:
        self.server.stop()


class PagedserveTarget:
    """A pagedserve server on the model folder (make run's defaults), over gRPC with token-id
    prompts.
    """

    def __init__(self, args, name: str, *extra: str) -> None:
        self.name = name
        log = Path(tempfile.mkdtemp(prefix="pagedserve-peer-")) / "server.log"
        self.server = ServerProcess(Path(args.model), log, "--metrics-port", "0", *extra).start(
            timeout=600
        )
        asyncio.run(drive(self.server.address, [[1, 2, 3], [4, 5, 6]], 4))

    def one(self, prompt: list[int], max_tokens: int) -> float:
        from protos import generation_pb2

        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        first, n = None, 0
        for msg in self.server.stub.GenerateStream(req, timeout=600):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            n += len(msg.token_ids)
        return (n - 1) / (time.perf_counter() - first)

    def many(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        wall, ttfts, tokens = asyncio.run(drive(self.server.address, prompts, max_tokens))
        return tokens / wall, statistics.mean(ttfts)

    def prefill(self, prompt: list[int]) -> float:
        wall, _, _ = asyncio.run(drive(self.server.address, [prompt], 1))
        return len(prompt) / wall  # one output token: the request is its prefill

    def peak_rss(self) -> int:
        return peak_rss(self.server.proc.pid)

    def stop(self) -> None:
        self.server.stop()


def measure(targets, prompts, args) -> dict:
    """Rounds, each server in turn, so a slow spell falls on all; medians and per-round ratios."""
    res = {t.name: {"one": [], "prefill": [], **{n: [] for n in args.streams}} for t in targets}
    for r in range(args.repeats):  # a prompt not seen before each round (module docstring)
        for t in targets:
            res[t.name]["one"].append(t.one(prompts[r % len(prompts)], args.max_tokens))
    if args.prompt_tokens:  # distinct ids each round: no prefix cache on either side holds it
        for r in range(args.prefill_rounds):
            long = [(7 * i + 1000 * r + 11) % 30000 + 100 for i in range(args.prompt_tokens)]
            for t in targets:
                res[t.name]["prefill"].append(t.prefill(long))
    for n in args.streams:
        for _ in range(args.rounds):
            for t in targets:
                res[t.name][n].append(t.many(prompts[:n], args.max_tokens))
    for t in targets:
        res[t.name]["rss"] = t.peak_rss()
    return res


def run_targets(makers, prompts, args) -> tuple[list, dict]:
    """Every server measured: all up at once, or (--alone) each up alone in turn, pass by pass."""
    targets: list = []
    if not args.alone:
        try:
            for make in makers:  # each appended once up: stopped whatever follows
                try:
                    targets.append(make())
                except CannotRead as e:
                    print(e, flush=True)
            return targets, measure(targets, prompts, args)
        finally:
            for t in targets:
                t.stop()
    res: dict = {}
    for turn in range(args.passes):
        for make in list(makers):
            try:
                t = make()
            except CannotRead as e:
                print(e, flush=True)
                makers.remove(make)
                continue
            try:
                got = measure([t], prompts, args)[t.name]
            finally:
                t.stop()
            if turn == 0:
                targets.append(t)
                res[t.name] = got
                continue
            for key, values in got.items():
                mine = res[t.name]
                mine[key] = max(mine[key], values) if key == "rss" else mine[key] + values
    return targets, res


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="the prepared folder of the GGUF below")
    p.add_argument(
        "--gguf", type=Path, default=None, help="default: the embedded model's Q4_1 file"
    )
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="rounds of the one-stream measurement")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each many-stream measurement")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--streams",
        default="8,64",
        help="concurrencies of the workload's first prompts, all at once",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        help="prompt processing: one prompt this long (0: skip)",
    )
    p.add_argument("--prefill-rounds", type=int, default=2)
    p.add_argument(
        "--precision",
        default="gguf",
        choices=["gguf", "fp32"],
        help="gguf: both servers on the file's blocks; fp32: llama.cpp on an F32 copy of the file "
        "(made once, cached) and pagedserve on the dequantized weights (--dequantize)",
    )
    p.add_argument(
        "--with-layers",
        action="store_true",
        help="also pagedserve with --cpu-decode layers (every decode step layer by layer), same "
        "run",
    )
    p.add_argument(
        "--serve-flags",
        default="",
        metavar="FLAGS",
        help="serve flags of the first pagedserve too (where one server at a time is all the "
        "memory holds beside llama.cpp: an 8B model), e.g. '--quantized-activations int8'",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also pagedserve started with these serve flags, same run (repeatable), e.g. "
        "'int8 activations=--quantized-activations int8'",
    )
    p.add_argument("--no-ik", action="store_true", help="leave ik_llama.cpp out where it is built")
    p.add_argument(
        "--alone",
        action="store_true",
        help="one server up at a time: each started, measured and stopped in turn",
    )
    p.add_argument("--passes", type=int, default=2, help="with --alone: turns over the servers")
    args = p.parse_args(argv)
    args.gguf = args.gguf or find_embedded_gguf()
    ours = []
    args.gguf_label = args.gguf.stem.rsplit(".", 1)[-1]
    # both at full precision: llama.cpp on the F32 file, pagedserve dequantized
    if args.precision == "fp32":
        args.gguf, args.gguf_label, ours = f32_gguf(args.gguf), "F32", ["--dequantize"]
    args.streams = [int(n) for n in args.streams.split(",") if n]
    prompts = load_workload(args.workload)
    first = "pagedserve (fp32, --dequantize)" if ours else "pagedserve (the GGUF's blocks)"
    if args.serve_flags:
        first = f"{first[:-1]}, {args.serve_flags})"
    makers = [lambda: PagedserveTarget(args, first, *ours, *shlex.split(args.serve_flags))]
    if args.with_layers:
        layers = "pagedserve, --cpu-decode layers"
        makers.append(lambda: PagedserveTarget(args, layers, *ours, "--cpu-decode", "layers"))
    for v in args.variant:
        name, _, flags = v.partition("=")
        makers.append(
            lambda n=name, f=flags: PagedserveTarget(
                args, f"pagedserve, {n.strip()}", *ours, *shlex.split(f)
            )
        )
    for peer in peers(ik=not args.no_ik):
        makers.append(lambda peer=peer: LlamaTarget(args, peer))
    targets, res = run_targets(makers, prompts, args)
    report(targets, res, args)
    return 0


def report(targets, res, args) -> None:
    """Each server's medians, then each pagedserve's ratio to each peer, round by round."""
    med = statistics.median
    pp = bool(args.prompt_tokens and args.prefill_rounds)  # --prefill-rounds 0: none measured
    keys = ["one", *args.streams, *(["prefill"] if pp else [])]
    head = "".join(f" {f'{n} streams':>11} {'TTFT':>7}" for n in args.streams)
    head += f" {f'prompt {args.prompt_tokens}':>11}" if pp else ""
    print(f"{'':38} {'1 stream decode':>16}{head} {'peak RSS':>9}")
    for t in targets:
        r = res[t.name]
        cols = "".join(
            f" {med(x[0] for x in r[n]):11.1f} {med(x[1] for x in r[n]):6.2f}s"
            for n in args.streams
        )
        cols += f" {med(r['prefill']):7.1f} t/s" if pp else ""
        print(f"{t.name:38} {med(r['one']):10.1f} tok/s{cols} {r['rss'] / 2**30:6.2f} GiB")
    ours = [t for t in targets if not isinstance(t, LlamaTarget)]
    theirs = [t for t in targets if isinstance(t, LlamaTarget)]

    def per_round(k, r, q):
        return [
            (a[0] / b[0]) if isinstance(a, tuple) else a / b
            for a, b in zip(r[k], q[k], strict=True)
        ]

    for peer in theirs:
        q = res[peer.name]
        for t in ours:
            r = res[t.name]
            cols = "".join(
                f" {med(per_round(n, r, q)):11.2f}"
                f" {med(a[1] / b[1] for a, b in zip(r[n], q[n], strict=True)):7.2f}"
                for n in args.streams
            )
            cols += f" {med(per_round('prefill', r, q)):11.2f}" if pp else ""
            label = f"{t.name[:22]} / {peer.peer}"
            print(
                f"{label:38} {med(per_round('one', r, q)):16.2f}{cols} {r['rss'] / q['rss']:9.2f}"
            )
    for peer in theirs:  # the spread behind each median ratio: its rounds' ratios
        for t in ours:
            print(
                f"{t.name[:24]} / {peer.peer}, each round's ratio: "
                + "; ".join(
                    f"{'1 stream' if k == 'one' else k if k == 'prefill' else f'{k} streams'} "
                    + ", ".join(f"{x:.2f}" for x in per_round(k, res[t.name], res[peer.name]))
                    for k in keys
                )
            )
    print(
        "one stream, every round (tok/s): "
        + "; ".join(
            f"{t.name.split(' (')[0]}: " + ", ".join(f"{x:.1f}" for x in res[t.name]["one"])
            for t in targets
        )
    )


if __name__ == "__main__":
    sys.exit(main())
