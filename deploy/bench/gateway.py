"""What the gateway costs, and what cache-aware routing buys: `make bench-gateway`.

Part 1 (the gateway's cost): one server on the default model; the fixed CPU workload
(../shared/bench: 64 token-id prompts, 128 tokens each, greedy, ignore_eos, all at once) sent four
ways in the same run: straight to pagedserve.v1 over gRPC, to the server's own OpenAI
/v1/completions (the same token ids, streamed), through SMG's /generate (the same token ids), and
through SMG's OpenAI /v1/completions (the prompts' text: the gateway tokenizes). The prefix cache is
flushed before each pass (the engine protocol's FlushCache), so no pass finds another's prompts.

Part 2 (routing): two servers behind SMG; a shared-prefix workload (G groups, each a long common
prefix plus a short tail of its own, interleaved) at a fixed concurrency, once with --policy
cache_aware and once with round_robin, on fresh servers each time. The pools are sized to hold about
half the groups' prefixes each: routing a group to one server lets the two pools split the prefixes;
spreading it makes each pool want all of them. Reports output tokens/s, mean TTFT, and the prompt
tokens the servers computed (prefix-cache hits are not computed).

    python -m deploy.bench.gateway --model .models/smollm2-135m-instruct            # both parts
    python -m deploy.bench.gateway --model ... --only routing --groups 8 --prefix-len 384
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, http_pass, load_workload
from deploy.gateway import GatewayProcess
from deploy.processes import free_port
from tests.support.server import ServerProcess


def _flush(server: ServerProcess) -> None:
    from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

    stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel)
    resp = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=60)
    if not resp.success:
        raise RuntimeError(f"FlushCache: {resp.message}")


def _row(name: str, wall: float, ttfts: list[float], tokens: int) -> dict:
    return {
        "name": name,
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": statistics.median(ttfts),
    }


def gateway_cost(args) -> list[dict]:
    from scheduler_service.text.tokenizer import Tokenizer

    prompts = load_workload(args.workload)[: args.num_requests]
    tok = Tokenizer(args.model)
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-bench-gateway-"))
    server = ServerProcess(
        Path(args.model),
        folder / "server.log",
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--metrics-port",
        "0",
    ).start(timeout=600)
    gateway = None
    rows = []
    try:
        own = server.http_url.removesuffix("/v1")
        asyncio.run(drive(server.address, prompts[:2], 4))  # warm-up, every path
        asyncio.run(http_pass(own, [_completion_body(prompts[0], 4)], "/v1/completions"))
        if {"generate", "openai"} & set(args.order):
            gateway = GatewayProcess(
                [server.address], args.model, folder / "smg.log", free_port()
            ).start(timeout=120)
            model = gateway_model(gateway)
            asyncio.run(
                http_pass(gateway.base_url, [_generate_body(model, prompts[0], 4)], "/generate")
            )
        for name in args.order:
            _flush(server)
            if name == "grpc":
                wall, ttfts, tokens = asyncio.run(drive(server.address, prompts, args.max_tokens))
                rows.append(_row("pagedserve.v1 gRPC, direct", wall, ttfts, tokens))
            elif name == "http":
                r = asyncio.run(
                    http_pass(
                        own,
                        [_completion_body(p, args.max_tokens) for p in prompts],
                        "/v1/completions",
                    )
                )
                rows.append(
                    _row(
                        "pagedserve's own OpenAI /v1/completions (same token ids)",
                        r["wall_s"],
                        r["ttfts"],
                        r["tokens"],
                    )
                )
            elif name == "generate":
                r = asyncio.run(
                    http_pass(
                        gateway.base_url,
                        [_generate_body(model, p, args.max_tokens) for p in prompts],
                        "/generate",
                    )
                )
                rows.append(
                    _row("SMG /generate (same token ids)", r["wall_s"], r["ttfts"], r["tokens"])
                )
            else:
                bodies = [
                    {
                        "model": model,
                        "prompt": tok.decode(p),
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    for p in prompts
                ]
                r = asyncio.run(http_pass(gateway.base_url, bodies, "/v1/completions"))
                rows.append(
                    _row("SMG OpenAI /v1/completions (text)", r["wall_s"], r["ttfts"], r["tokens"])
                )
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
    return rows


def gateway_model(gateway: GatewayProcess) -> str:
    from deploy.gateway import registered_models

    return registered_models(gateway.base_url)[0]


def _completion_body(ids: list[int], max_tokens: int) -> dict:
    return {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _generate_body(model: str, ids: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }


def shared_prefix_workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.groups)
    ]
    return [
        prefixes[g] + [rng.randrange(100, 40000) for _ in range(args.suffix_len)]
        for _ in range(args.per_group)
        for g in range(args.groups)
    ]


def routing(args) -> list[dict]:
    prompts = shared_prefix_workload(args)
    rows = []
    for policy in args.policies:
        folder = Path(tempfile.mkdtemp(prefix=f"pagedserve-bench-{policy}-"))
        servers, gateway = [], None
        try:
            for i in range(2):
                servers.append(
                    ServerProcess(
                        Path(args.model),
                        folder / f"server-{i}.log",
                        "--num-blocks",
                        str(args.num_blocks),
                        "--max-model-len",
                        str(args.max_model_len),
                        "--threads",
                        "1",
                        "--metrics-port",
                        "0",
                    ).start(timeout=600)
                )
            gateway = GatewayProcess(
                [s.address for s in servers], args.model, folder / "smg.log", free_port(), policy
            ).start(timeout=120)
            model = gateway_model(gateway)
            before = [s.stats() for s in servers]
            r = asyncio.run(
                http_pass(
                    gateway.base_url,
                    [_generate_body(model, p, args.output_len) for p in prompts],
                    "/generate",
                    concurrency=args.concurrency,
                )
            )
            after = [s.stats() for s in servers]
            computed = sum(
                a.num_prompt_tokens_computed - b.num_prompt_tokens_computed
                for a, b in zip(after, before, strict=True)
            )
            hits = sum(
                a.prefix_cache_hits - b.prefix_cache_hits
                for a, b in zip(after, before, strict=True)
            )
            queries = sum(
                a.prefix_cache_queries - b.prefix_cache_queries
                for a, b in zip(after, before, strict=True)
            )
            row = _row(f"2 servers, {policy}", r["wall_s"], r["ttfts"], r["tokens"])
            row.update(
                prompt_tokens=sum(len(p) for p in prompts),
                prompt_tokens_computed=computed,
                prefix_hit_rate=hits / queries if queries else 0.0,
                requests_per_server=[
                    a.replicas[0].num_requests - b.replicas[0].num_requests
                    for a, b in zip(after, before, strict=True)
                ],
            )
            rows.append(row)
        finally:
            if gateway is not None:
                gateway.stop()
            for s in servers:
                s.stop()
    return rows


def table(rows: list[dict], base: dict) -> str:
    lines = [f"{'':40} {'tok/s':>8} {'mean TTFT':>10} {'x tok/s':>8} {'x TTFT':>7}"]
    for r in rows:
        lines.append(
            f"{r['name']:40} {r['tok_s']:8.1f} {r['mean_ttft_s']:9.2f}s "
            f"{r['tok_s'] / base['tok_s']:8.2f} {r['mean_ttft_s'] / base['mean_ttft_s']:7.2f}"
            + (
                f"   prompt tokens computed {r['prompt_tokens_computed']}/{r['prompt_tokens']}, "
                f"hit rate {r['prefix_hit_rate']:.2f}, requests per server "
                f"{r['requests_per_server']}"
                if "prompt_tokens_computed" in r
                else ""
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--only", choices=["cost", "routing"], default=None)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument(
        "--order",
        nargs="+",
        default=["grpc", "http", "generate", "openai"],
        choices=["grpc", "http", "generate", "openai"],
        help="the passes of part 1, in this order (a pass may repeat: grpc http grpc http ...); "
        "http is the server's own OpenAI API, generate and openai go through SMG",
    )
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--num-blocks", type=int, default=256, help="each server's pool (blocks of 16 tokens)"
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    out = {}
    if args.only in (None, "cost"):
        rows = gateway_cost(args)
        print("the gateway's cost (same server, same run; x: against direct gRPC)")
        print(table(rows, next(r for r in rows if "direct" in r["name"])))
        out["cost"] = rows
    if args.only in (None, "routing"):
        rows = routing(args)
        print(
            f"two servers behind SMG: {args.groups} groups x {args.per_group} requests, "
            f"{args.prefix_len}-token shared prefixes, concurrency {args.concurrency} (x: against "
            f"{rows[-1]['name']})"
        )
        print(table(rows, rows[-1]))
        out["routing"] = rows
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as e:
        sys.exit(f"error: {e.code().name}: {e.details()}")
