"""Throughput benchmark: the fixed CPU workload against a pagedserve it starts, and transformers'
static batching on the same prompts, in the same run.

    python -m deploy.bench --model .models/smollm2-135m-instruct          # both, then the ratio
    python -m deploy.bench --model ... --only server --profile-step        # plus a profile of one step

Workload (../shared/bench/README.md): 64 requests of 64-256 prompt tokens, 128 output tokens each,
greedy, ignore_eos, all submitted at once. Prints output tokens/s and mean time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "bench" / "cpu-workload-prompts.json"


def load_workload(path: Path) -> list[list[int]]:
    if not path.exists():
        raise SystemExit(f"workload {path} not found (pass --workload)")
    return json.loads(path.read_text())


# --- the server ----------------------------------------------------------------------------------
async def _drive(address: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], int]:
    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()

        async def one(prompt):
            req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            ttft, n = None, 0
            async for msg in stub.GenerateStream(req, timeout=3600):
                if msg.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(msg.token_ids)
            return ttft, n

        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return wall, [r[0] for r in results], sum(r[1] for r in results)


def bench_server(args, prompts) -> dict:
    from deploy.local_server import ServerProcess

    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--kv-cache-memory", args.kv_cache_memory]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    server = ServerProcess(Path(args.model), log, *extra)
    server.start()
    try:
        asyncio.run(_drive(server.address, prompts[:2], 4))  # warm-up
        wall, ttfts, tokens = asyncio.run(_drive(server.address, prompts, args.max_tokens))
        time.sleep(6)  # let the engine log its cumulative step profile
    finally:
        server.stop()
    profile = None
    for line in log.read_text().splitlines():
        if '"step_profile"' in line:
            profile = json.loads(line)
    return {"name": "pagedserve", "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts), "profile": profile}


# --- transformers static batching ------------------------------------------------------------------
def bench_static(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    class FirstToken(StoppingCriteria):
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.at is None:
                self.at = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ttfts, tokens = [], 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.static_batch):
        batch = prompts[i : i + args.static_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        first = FirstToken()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                 do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([first]))
        tokens += (out.shape[1] - width) * len(batch)
        ttfts += [first.at - t0] * len(batch)
    wall = time.perf_counter() - t0
    return {"name": f"transformers static batches of {args.static_batch}", "wall_s": wall, "tokens": tokens,
            "tok_s": tokens / wall, "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts)}


# --- one step, profiled ------------------------------------------------------------------------------
def profile_one_step(args, prompts) -> None:
    """Run one decode step of the whole workload in-process under torch.profiler; print the top ops."""
    import numpy as np
    import torch

    from protos.codec import PlanArrays, encode_plan
    from worker.attention import make_backend
    from worker.kv_pool import KVPool
    from worker.linear import choose as choose_matmul
    from worker.runner import ModelRunner
    from worker.weights import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    block = 16
    model, config = load_model(args.model, "auto", torch.float32, torch.device("cpu"))
    model.use_matmul(choose_matmul("auto", model.matmul_shapes(), torch.device("cpu"), torch.float32))
    lens = [len(p) + args.max_tokens // 2 for p in prompts]  # mid-way through decoding
    need = [-(-n // block) for n in lens]
    pool = KVPool(config, sum(need), block, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, pool, make_backend(None, torch.device("cpu")), torch.device("cpu"))
    tables = np.full((len(prompts), max(need)), -1, dtype="<i4")
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = np.arange(start, start + n)
        start += n
    seq_lens = np.array(lens, dtype="<i4")
    pos = seq_lens - 1
    slots = tables[np.arange(len(prompts)), pos // block].astype("<i8") * block + pos % block
    n = len(prompts)
    plan = encode_plan(PlanArrays(
        step_id=1, token_ids=np.full(n, 100, "<i4"), positions=pos.astype("<i4"), slot_mapping=slots,
        block_tables=tables, seq_lens=seq_lens, query_start_loc=np.arange(n + 1, dtype="<i4"),
        do_sample=np.ones(n, bool), sample_index=np.zeros(n, "<i4"), temperature=np.zeros(n, "<f4"),
        top_p=np.ones(n, "<f4"), top_k=np.zeros(n, "<i4"), seed=np.zeros(n, "<u8"),
        block_copies=np.empty((0, 2), "<i4")))
    for _ in range(3):
        runner.execute(plan)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = runner.execute(plan)
    print(f"\none decode step, {len(prompts)} sequences, mean context {statistics.mean(lens):.0f}: "
          f"prepare {res.time_prepare * 1e3:.1f} ms, forward {res.time_forward * 1e3:.1f} ms, "
          f"sample {res.time_sample * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def report(r: dict) -> None:
    print(f"{r['name']:<40} {r['tok_s']:8.1f} output tok/s   mean TTFT {r['mean_ttft_s']:7.2f} s   "
          f"(p50 {r['p50_ttft_s']:.2f} s, {r['tokens']} tokens in {r['wall_s']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--only", choices=["server", "static"], default=None)
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile-step", action="store_true", help="also profile one decode step in-process")
    args = p.parse_args(argv)
    prompts = load_workload(args.workload)[: args.num_requests]
    print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} output tokens each, greedy, ignore_eos")
    results = {}
    if args.only in (None, "server"):
        results["server"] = bench_server(args, prompts)
        report(results["server"])
        prof = results["server"]["profile"]
        if prof:
            steps = max(prof["steps"], 1)
            keys = ["schedule", "build_plan", "round_trip", "worker_prepare", "worker_forward", "worker_sample",
                    "process_output"]
            print(f"  engine steps: {prof['steps']}, {prof['tokens']} tokens computed; mean ms per step: "
                  + ", ".join(f"{k} {prof[k] / steps * 1e3:.1f}" for k in keys))
    if args.only in (None, "static"):
        results["static"] = bench_static(args, prompts)
        report(results["static"])
    if len(results) == 2:
        s, b = results["server"], results["static"]
        print(f"ratio pagedserve / static: throughput x{s['tok_s'] / b['tok_s']:.2f}, "
              f"mean TTFT x{s['mean_ttft_s'] / b['mean_ttft_s']:.2f}")
    if args.profile_step:
        profile_one_step(args, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
