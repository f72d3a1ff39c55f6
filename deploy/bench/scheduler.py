"""Scheduler cost per step (`make bench-scheduler`): what the scheduler process spends on one decode
step of a large batch, with a worker that answers instantly, so only the scheduler's own work is
timed.

    python -m deploy.bench.scheduler --model .models/smollm2-135m-instruct  # 256 and 1024 sequences

Each running sequence has a ~2k-token context and decodes one token a step. Printed per step, in ms:
schedule (batching, page tables), build_plan (numpy arrays), encode (protobuf bytes), result (decode
the answer, apply it: tokens, prefix-cache registration) and outputs (detokenize, stop checks, the
delta put on the request's stream queue).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from protos.codec import encode_plan
from protos.result_codec import decode_result, encode_result
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions
from scheduler_service.text.output import DeltaQueue, SampleOutput
from scheduler_service.text.tokenizer import Tokenizer


def measure(
    tokenizer: Tokenizer, num_seqs: int, context: int, steps: int, block_size: int
) -> dict[str, float]:
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-(context + steps + 1) // block_size)
    config = SchedulerConfig(
        block_size=block_size, max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs)
    )
    # Set-up prefills every prompt in one step; the timed steps then run under the real budget.
    sched = Scheduler(
        replace(config, max_num_batched_tokens=num_seqs * (context + 1)),
        num_seqs * blocks_per_seq + 8,
        context + steps + 16,
    )
    outputs, queues = {}, {}
    for i in range(num_seqs):
        req = Request(
            f"r{i}",
            rng.integers(100, 40000, context).tolist(),
            SamplingOptions(max_tokens=steps + 4, ignore_eos=True),
        )
        sched.add_request(req)
        outputs[req.seqs[0].seq_id] = SampleOutput(tokenizer, req.seqs[0])
        queues[req.seqs[0].seq_id] = DeltaQueue()  # the engine's request stream
    out = sched.schedule()  # prefill everything (not timed), then time decode steps
    assert len(out.scheduled) == num_seqs and not sched.waiting
    sched.update(out, [int(t) for t in rng.integers(100, 40000, num_seqs)])
    sched.config = config
    times: dict[str, list[float]] = {
        k: [] for k in ("schedule", "build_plan", "encode", "result", "outputs")
    }
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        arrays = sched.build_plan(out)
        t2 = time.perf_counter()
        wire = encode_plan(arrays).SerializeToString()
        t3 = time.perf_counter()
        answer = encode_result(
            out.step_id, rng.integers(100, 40000, len(out.scheduled)).astype(np.int32)
        )
        tokens = decode_result(answer, len(out.scheduled)).tolist()
        new = sched.update(out, tokens).tokens
        t4 = time.perf_counter()
        # what the engine does per token: stop checks, a delta on the request's stream
        for seq, token in new:
            queues[seq.seq_id].put_nowait(outputs[seq.seq_id].add_token(token)[0])
        t5 = time.perf_counter()
        assert len(out.scheduled) == num_seqs and len(wire) > 0
        for k, a, b in (
            ("schedule", t0, t1),
            ("build_plan", t1, t2),
            ("encode", t2, t3),
            ("result", t3, t4),
            ("outputs", t4, t5),
        ):
            times[k].append((b - a) * 1000)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["total"] = sum(result.values())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench-scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="model folder (its tokenizer detokenizes the outputs)"
    )
    p.add_argument("--seqs", default="256,1024")
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    tokenizer = Tokenizer(args.model)
    print(
        f"decode steps, contexts of ~{args.context} tokens, block size {args.block_size}; median "
        "ms per step"
    )
    print(
        f"{'sequences':>10}"
        + "".join(
            f"{k:>12}" for k in ("schedule", "build_plan", "encode", "result", "outputs", "total")
        )
    )
    for n in (int(x) for x in args.seqs.split(",")):
        r = measure(tokenizer, n, args.context, args.steps, args.block_size)
        print(
            f"{n:>10}"
            + "".join(
                f"{r[k]:>12.2f}"
                for k in ("schedule", "build_plan", "encode", "result", "outputs", "total")
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
