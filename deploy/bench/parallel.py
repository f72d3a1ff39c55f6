"""Parallel benchmark (`make bench-parallel`): data parallelism on the shared CPU workload, and
tensor parallelism on a random model shape that divides, each against its one-group baseline in the
same run.

    python -m deploy.bench.parallel --model .models/smollm2-135m-instruct    # both parts
    python -m deploy.bench.parallel --model ... --part dp --num-requests 32  # a shorter DP run

DP: the workload through DP=1 (one worker, all threads) and DP=2 (two workers, threads split).
TP: the same prompts through TP=1 and TP=2 (gloo, threads split) on random weights of a Llama shape
(--tp-shape), greedy, ignore_eos. Prints output tok/s, mean TTFT and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, load_workload

# hidden, heads, kv heads, intermediate, layers: TP=2 divides it, matmuls dominate
TP_SHAPES = {
    "small": (1024, 16, 8, 4096, 8),
    "medium": (2048, 16, 8, 5632, 8),
}


def run_server(model: Path, prompts, max_tokens: int, flags: list[str], name: str) -> dict:
    from tests.support.server import ServerProcess

    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    server = ServerProcess(model, log, *flags).start(timeout=600)
    try:
        asyncio.run(drive(server.address, prompts[:2], 4))  # warm-up
        wall, ttfts, tokens = asyncio.run(drive(server.address, prompts, max_tokens))
        stats = server.stats()
    finally:
        server.stop()
    routed = [r.num_requests for r in stats.replicas]
    return {
        "name": name,
        "tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(ttfts),
        "wall_s": wall,
        "tokens": tokens,
        "routed": routed,
    }


def report(rows: list[dict]) -> None:
    base = rows[0]
    for r in rows:
        print(
            f"  {r['name']:<34} {r['tok_s']:8.1f} output tok/s  x{r['tok_s'] / base['tok_s']:.2f} "
            f"  mean TTFT {r['mean_ttft_s']:6.2f} s  "
            f"x{r['mean_ttft_s'] / base['mean_ttft_s']:.2f}   requests per replica {r['routed']}",
            flush=True,
        )


def dummy_model(model_dir: Path, shape: tuple[int, int, int, int, int]) -> Path:
    """The default tokenizer with a config of the given shape (dummy weights)."""
    hidden, heads, kv, inter, layers = shape
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-tp-shape-"))
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, folder / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        num_hidden_layers=layers,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench-parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--part", choices=["dp", "tp", "both"], default="both")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="DP part: the first N prompts (default all 64)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tp-requests", type=int, default=32)
    p.add_argument("--tp-max-tokens", type=int, default=64)
    p.add_argument("--tp-shape", choices=sorted(TP_SHAPES), default="small")
    p.add_argument("--cores", type=int, default=2, help="threads to share out among the workers")
    args = p.parse_args(argv)
    prompts = load_workload(args.workload)
    model = Path(args.model)
    common = ["--kv-cache-memory", "1GiB"]
    c = args.cores
    if args.part in ("dp", "both"):
        dp_prompts = prompts[: args.num_requests]
        print(
            f"DP: {len(dp_prompts)} requests x {args.max_tokens} tokens, default model, {c} cores",
            flush=True,
        )
        report(
            [
                run_server(
                    model,
                    dp_prompts,
                    args.max_tokens,
                    [*common, "--threads", str(c)],
                    f"DP=1, one worker x {c} threads",
                ),
                run_server(
                    model,
                    dp_prompts,
                    args.max_tokens,
                    [*common, "--dp", "2", "--threads", str(max(1, c // 2))],
                    f"DP=2, two workers x {max(1, c // 2)} thread(s)",
                ),
            ]
        )
    if args.part in ("tp", "both"):
        shape = TP_SHAPES[args.tp_shape]
        folder = dummy_model(model, shape)
        tp_prompts = prompts[: args.tp_requests]
        print(
            f"TP: {len(tp_prompts)} requests x {args.tp_max_tokens} tokens, random weights of "
            f"shape hidden {shape[0]}, {shape[1]} heads / {shape[2]} KV heads, MLP {shape[3]}, "
            f"{shape[4]} layers, vocab 49152",
            flush=True,
        )
        flags = [*common, "--load-format", "dummy"]
        report(
            [
                run_server(
                    folder,
                    tp_prompts,
                    args.tp_max_tokens,
                    [*flags, "--threads", str(c)],
                    f"TP=1, one worker x {c} threads",
                ),
                run_server(
                    folder,
                    tp_prompts,
                    args.tp_max_tokens,
                    [*flags, "--tp", "2", "--threads", str(max(1, c // 2))],
                    f"TP=2, two ranks x {max(1, c // 2)} thread(s)",
                ),
            ]
        )
        shutil.rmtree(folder, ignore_errors=True)
    print(f"date {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
