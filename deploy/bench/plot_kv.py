"""`make plot-kv`: KV blocks in use over time under continuous batching against what a static
allocator would hold (each live request reserving its prompt + max_tokens up front), drawn to a PNG.

Drives the real Scheduler and allocator with the simulated worker (no model, no torch), on the fixed
benchmark's request lengths arriving over time, a third of them sharing a system prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD
from protos.codec import encode_plan
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions
from tests.support.simulated import SimulatedWorker


def simulate(
    prompts: list[list[int]], max_tokens: int, num_blocks: int, block_size: int, seed: int = 0
):
    rng = random.Random(seed)
    system = [rng.randrange(100, 40000) for _ in range(96)]
    config = SchedulerConfig(block_size=block_size, max_num_seqs=32, max_num_batched_tokens=512)
    sched = Scheduler(config, num_blocks, max_model_len=8192)
    worker = SimulatedWorker(num_blocks, block_size)
    arrivals: dict[int, list[Request]] = {}
    step = 0
    for i, prompt in enumerate(prompts):
        step += rng.randint(0, 6)
        body = (system + prompt[:64]) if i % 3 == 0 else prompt
        out_len = rng.randint(max_tokens // 4, max_tokens)
        arrivals.setdefault(step, []).append(
            Request(f"r{i}", body, SamplingOptions(max_tokens=out_len))
        )
    trace = []
    live: dict[str, int] = {}
    t = 0
    while t <= max(arrivals) or sched.has_work:
        for req in arrivals.get(t, []):
            sched.add_request(req)
            live[req.request_id] = sched.allocator.blocks_for_tokens(
                req.prompt_len + req.sampling.max_tokens
            )
        if sched.has_work:
            out = sched.schedule()
            if not out.is_empty:
                for seq, _ in sched.update(
                    out, worker.execute(encode_plan(sched.build_plan(out)))
                ).tokens:
                    if seq.is_finished:  # (the scheduler ends it at max_tokens)
                        live.pop(seq.request.request_id, None)
        running = {s.request.request_id for s in sched.running}
        static = sum(live[r] for r in running)
        trace.append(
            (
                t,
                sched.allocator.num_used_blocks,
                sched.allocator.num_cached_blocks,
                static,
                len(running),
            )
        )
        t += 1
    return trace, sched


def plot(trace, out: Path, num_blocks: int, block_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r[0] for r in trace]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(
        steps,
        [r[3] for r in trace],
        color="#6b6b6b",
        linestyle="--",
        label="static reservation (prompt + max_tokens per running request)",
    )
    ax.plot(
        steps, [r[1] for r in trace], color="#8b2635", linewidth=2, label="blocks in use (paged)"
    )
    ax.fill_between(
        steps,
        [r[1] for r in trace],
        [r[1] + r[2] for r in trace],
        color="#b8932e",
        alpha=0.35,
        label="cached free blocks (prefix cache)",
    )
    ax.axhline(
        num_blocks,
        color="black",
        linewidth=0.8,
        label=f"pool ({num_blocks} blocks of {block_size})",
    )
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV blocks")
    ax.set_title("Paged KV under continuous batching vs static reservation")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-plot-kv", description=__doc__)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--out", type=Path, default=Path("docs/kv_usage.png"))
    p.add_argument("--num-blocks", type=int, default=600)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    prompts = json.loads(args.workload.read_text())
    trace, sched = simulate(prompts, args.max_tokens, args.num_blocks, args.block_size)
    plot(trace, args.out, args.num_blocks, args.block_size)
    peak_used = max(r[1] for r in trace)
    peak_static = max(r[3] for r in trace)
    mean_used = sum(r[1] for r in trace) / len(trace)
    mean_static = sum(r[3] for r in trace) / len(trace)
    print(
        f"{len(trace)} steps; peak blocks in use {peak_used} vs static {peak_static} "
        f"({peak_used / peak_static:.0%}); mean {mean_used:.0f} vs {mean_static:.0f} "
        f"({mean_used / mean_static:.0%}); prefix-cache hits {sched.prefix_cache_hits} of "
        f"{sched.prefix_cache_queries} tokens; preemptions {sched.num_preemptions}; wrote "
        f"{args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
