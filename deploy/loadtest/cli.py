"""pagedserve-loadtest: load-test any pagedserve endpoint, the way vLLM's `bench serve` does, plus
what a gRPC server with cache accounting allows (KV utilization, preemptions, prefix hits, leaked
blocks).

    pagedserve-loadtest --target localhost:50051 --num-requests 200 --rate 4 --input-len 256 \\
        --output-len 128
    pagedserve-loadtest --target HOST:PORT --sweep 6 --output sweep.json --plot plots/
    pagedserve-loadtest --target HOST:PORT --dataset ../shared/bench/cpu-workload-prompts.json \\
        --concurrency 64
    pagedserve-loadtest --target http://127.0.0.1:8000 --concurrency 16   # any OpenAI server
    pagedserve-loadtest --target HOST:PORT --endpoint embeddings --input-len 512 --concurrency 32

An http(s):// target is driven through its OpenAI API (/v1/completions, streamed): synthetic prompts
go as token-id lists, or with --tokenizer FOLDER as their text (SMG takes text only; the prompt
length is then what the server counts); the same client-side figures; the server-side ones (KV
utilization, preemptions, prefix hits, leaked blocks) need pagedserve's own gRPC and are left out.

Closed loop (--concurrency C: C clients, each sends its next request when the last one ends), open
loop (--rate R requests/s: Poisson arrivals when --burstiness is 1, gamma-distributed gaps
otherwise, CV^2 = 1/G), or a sweep (a synchronous pass, a saturating pass, then K-2 open-loop rates
evenly between their request rates). A run stops at --num-requests or --duration, whichever comes
first; Ctrl-C ends it with the partial result written.

Definitions (vLLM's): TTFT from send to the first token; TPOT = (E2EL - TTFT) / (output tokens - 1);
ITL = gaps between consecutive messages that carry tokens; E2EL from send to the last message.
Cancelled (--abort-fraction) requests count apart and are not in the latency figures. Times are
milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from pathlib import Path

import grpc

from deploy.loadtest.report import compare, parse_slo, plot, summarize, table
from deploy.loadtest.run import Run, Settings
from deploy.loadtest.targets import GrpcTarget, OpenAITarget
from deploy.loadtest.workload import Item, load_dataset, synthetic
from protos.base.argtypes import Parser


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pagedserve-loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        default=None,
        help="HOST:PORT of a pagedserve, or http(s)://HOST:PORT of any OpenAI-compatible server "
        "(default: start a pagedserve, see --model)",
    )
    p.add_argument(
        "--served-model",
        default=None,
        help="with an http target: the model name to ask for "
        "(default: the first of its /v1/models)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="with an http target: synthetic prompts draw "
        "token ids below this (every common vocabulary has at least 32000)",
    )
    p.add_argument("--api-key", default=None, help="with an http target: sent as a bearer token")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with an http target: a model folder whose tokenizer turns "
        "synthetic prompts into text (needed where the server takes no token ids, as SMG)",
    )
    p.add_argument(
        "--model", default=None, help="with no --target: serve this model folder for the run"
    )
    p.add_argument(
        "--server-args", default="", help="with no --target: extra flags for the server it starts"
    )
    p.add_argument(
        "--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM)"
    )
    p.add_argument("--num-requests", type=int, default=100, help="requests to send in all")
    p.add_argument(
        "--duration", type=float, default=600.0, help="stop sending after this many seconds"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients")
    load.add_argument(
        "--rate", type=float, default=None, help="open loop: requests per second (inf: all at once)"
    )
    load.add_argument(
        "--sweep", type=int, default=None, help="K runs: synchronous, saturating, K-2 rates between"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)"
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "embeddings"),
        default="completions",
        help="what each request asks: generated tokens, or one input's embedding (Embed, "
        "/v1/embeddings; latency is the whole call's, throughput inputs and their tokens)",
    )
    p.add_argument(
        "--input-len", type=int, default=256, help="prompt tokens of a synthetic request"
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of a request")
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-X), L(1+X)]"
    )
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="JSON/JSONL prompts (text or token ids, output_len)",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="every prompt starts with the same P tokens",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the requests")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate max_tokens whatever the model says (every request the same length)",
    )
    p.add_argument(
        "--abort-fraction", type=float, default=0.0, help="cancel this fraction of requests mid-way"
    )
    p.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50")
    p.add_argument(
        "--output", type=Path, default=None, help="write the result (a list for a sweep) as JSON"
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="draw latency CDFs, timelines and the sweep curve here",
    )
    p.add_argument(
        "--compare", type=Path, default=None, help="print the change against an earlier --output"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="requests sent one at a time (from the same workload) before measuring, not counted",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


async def run_all(args: argparse.Namespace, target: str, results: list[dict]) -> None:
    """Runs the plan, appending each run's result to `results` (so
    Ctrl-C keeps what was measured).
    """
    if target.startswith(("http://", "https://")):
        http = OpenAITarget(
            target, args.served_model, args.vocab_size, args.api_key, args.tokenizer or args.model
        )
        try:
            await run_plan(args, http, results)
        finally:
            await http.close()
        return
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        channel = grpc.aio.secure_channel(target, creds)
    else:
        channel = grpc.aio.insecure_channel(target)
    async with channel:
        await run_plan(args, GrpcTarget(channel), results)


async def run_plan(args: argparse.Namespace, target, results: list[dict]) -> None:
    model_name, vocab_size = await target.info()

    def workload(k: int) -> list[Item]:
        """Synthetic prompts fresh every run; a dataset as it is."""
        if args.dataset:
            rows = load_dataset(
                args.dataset, args.output_len, args.shared_prefix_len, vocab_size, args.seed
            )
            return (rows * math.ceil(args.num_requests / len(rows)))[: args.num_requests]
        return synthetic(
            args.num_requests,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.shared_prefix_len,
            vocab_size,
            args.seed + 7919 * k,
        )

    items = workload(0)
    settings = Settings(
        args.temperature, args.seed, args.ignore_eos, args.abort_fraction, endpoint=args.endpoint
    )
    slo = parse_slo(args.slo)
    if args.warmup:  # first requests pay one-time costs (allocations, kernel choices): not measured
        warm = (
            synthetic(
                args.warmup,
                args.input_len,
                args.output_len,
                args.range_ratio,
                0,
                vocab_size,
                args.seed - 1,
            )
            if not args.dataset
            else items[: args.warmup]
        )
        await Run(
            target,
            warm,
            Settings(args.temperature, args.seed, endpoint=args.endpoint),
            "warm-up",
            progress=False,
        ).execute("concurrency", 1, 1.0, args.duration)
    if args.sweep:
        if args.sweep < 2:
            raise SystemExit("--sweep needs at least 2 points (synchronous and saturating)")
        plan = [("concurrency", 1.0, "synchronous"), ("rate", math.inf, "saturating")]
    elif args.concurrency:
        plan = [("concurrency", float(args.concurrency), f"concurrency {args.concurrency}")]
    else:
        rate = args.rate if args.rate is not None else math.inf
        plan = [("rate", rate, f"rate {rate:g}/s" if not math.isinf(rate) else "all at once")]
    i = 0
    while i < len(plan):
        mode, value, label = plan[i]
        run = Run(target, workload(i), settings, label, progress=not args.no_progress)
        try:
            duration = await run.execute(mode, value, args.burstiness, args.duration)
        except asyncio.CancelledError:  # Ctrl-C: keep what was measured
            duration = time.perf_counter() - run.t0
            results.append(finish(run, duration, slo, None, mode, value, args, model_name))
            raise
        leaked = await target.leaked_blocks()
        results.append(finish(run, duration, slo, leaked, mode, value, args, model_name))
        # K-2 open-loop rates evenly between the two passes' request rates
        if args.sweep and i == 1:
            lo, hi = results[0]["request_throughput"], results[1]["request_throughput"]
            for k in range(1, args.sweep - 1):
                r = lo + (hi - lo) * k / (args.sweep - 1)
                plan.append(("rate", r, f"rate {r:.2f}/s"))
        i += 1


def finish(run: Run, duration: float, slo, leaked, mode, value, args, model_name: str) -> dict:
    extra = {
        "label": run.label,
        "target_model": model_name,
        "mode": mode,
        "value": None if math.isinf(value) else value,
        "burstiness": args.burstiness,
    }
    result = summarize(run, duration, slo, leaked, extra)
    done = [o for o in run.outcomes if o.e2el is not None and not o.error and not o.aborted]
    result["samples_ms"] = {
        "ttft_ms": [o.ttft * 1000 for o in done],
        "e2el_ms": [o.e2el * 1000 for o in done],
        "tpot_ms": [
            (o.e2el - o.ttft) / (o.output_tokens - 1) * 1000 for o in done if o.output_tokens > 1
        ],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = None
    target = args.target
    if target is None:
        if not args.model:
            raise SystemExit("give --target HOST:PORT, or --model FOLDER to serve one for the run")
        import shlex
        import tempfile

        from deploy.processes import LocalServer

        log = Path(tempfile.mkdtemp(prefix="pagedserve-loadtest-")) / "server.log"
        print(f"starting a server on {args.model} (log: {log})", file=sys.stderr)
        server = LocalServer(Path(args.model), log, *shlex.split(args.server_args)).start(
            timeout=600
        )
        target = server.address
    results: list[dict] = []
    loop = asyncio.new_event_loop()
    task = loop.create_task(run_all(args, target, results))
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    interrupted = False
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        interrupted = True
        print("\ninterrupted: writing the partial result", file=sys.stderr)
    finally:
        loop.close()
        if server is not None:
            server.stop()
    if interrupted and not results:
        return 130
    print(table(results))
    if args.output:
        args.output.write_text(json.dumps(results if args.sweep else results[0], indent=1))
        print(f"result written to {args.output}")
    if args.plot:
        for path in plot(results, args.plot):
            print(f"plot written to {path}")
    if args.compare:
        print(compare(results, args.compare))
    return 130 if interrupted else 0
