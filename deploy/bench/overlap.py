"""A simulated worker process of fixed step time, and the overlap benchmark (`make bench-overlap`):
`python -m deploy.bench.overlap bench --model ...`."""

from __future__ import annotations

import numpy as np

from protos import wire_pb2
from protos.codec import decode_plan, resolve_tokens
from tests.support.simulated import VOCAB, SimulatedWorker


# --- a simulated worker process, and the overlap benchmark ----------------------------------------
class SimulatedRunner:
    """Answers plans with a fixed step time: a GPU worker as the scheduler sees it."""

    def __init__(
        self, num_blocks: int, block_size: int, step_s: float, check: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.step_s = step_s
        self.model = SimulatedWorker(num_blocks, block_size) if check else None
        self.last_step_id = 0
        self.last_sampled: np.ndarray | None = None
        self.device_free_at = 0.0

    def launch(self, plan: wire_pb2.StepPlan, await_mask=None):
        """As ModelRunner.launch: tokens now, device time simulated as a clock done step_s later
        (overlap).
        """
        import time

        from protos.codec import CodecError
        from protos.result_codec import encode_result

        t0 = time.perf_counter()
        try:
            if self.model is not None:
                sampled = np.asarray(self.model.execute(plan), dtype=np.int32)
            else:
                p = decode_plan(plan)
                resolve_tokens(p, self.last_step_id, self.last_sampled)
                sampled = np.where(
                    p.do_sample, 1 + (p.seq_lens.astype(np.int64) * 7919) % (VOCAB - 1), -1
                )
                sampled = sampled.astype(np.int32)
        except (CodecError, AssertionError) as e:
            self.last_sampled = None
            return wire_pb2.StepResult(step_id=plan.step_id, error=f"rejected plan: {e}")
        self.last_step_id, self.last_sampled = plan.step_id, sampled
        # one device: a step starts when the one before it is done (or now), and runs step_s
        start = max(t0, self.device_free_at)
        done_at = max(start + self.step_s, time.perf_counter())
        self.device_free_at = done_at
        return SimulatedStep(
            plan.step_id,
            encode_result(plan.step_id, sampled, time_forward=done_at - start),
            SimulatedClock(done_at),
        )

    def land(self, f: SimulatedStep) -> wire_pb2.StepResult:
        f.clock.wait()
        return f.result

    def execute(self, plan: wire_pb2.StepPlan) -> wire_pb2.StepResult:
        launched = self.launch(plan)
        return launched if isinstance(launched, wire_pb2.StepResult) else self.land(launched)


class SimulatedClock:
    """A step's device time, simulated: done at a moment."""

    def __init__(self, at: float) -> None:
        self.at = at

    def done(self) -> bool:
        import time

        return time.perf_counter() >= self.at

    def wait(self) -> None:
        import time

        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class SimulatedStep:
    """A launched step: what ModelRunner.launch returns, as far as the worker's server reads it."""

    def __init__(self, step_id: int, result: wire_pb2.StepResult, clock: SimulatedClock) -> None:
        self.step_id, self.result, self.clock = step_id, result, clock


def serve_worker(args) -> int:
    """A worker process of one rank that simulates its steps (see SimulatedRunner)."""
    import os

    from worker.serve.step_server import WorkerServer

    handshake = wire_pb2.Handshake(
        tp_rank=0,
        tp_size=1,
        replica=0,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        model_fingerprint="simulated",
        vocab_size=args.vocab_size,
        max_context=args.max_context,
        bytes_per_block=1,
        num_kv_heads=1,
        device="simulated",
        dtype="none",
        attention_backend="simulated",
        pid=os.getpid(),
    )
    runner = SimulatedRunner(
        args.num_blocks, args.block_size, args.step_ms / 1000, check=args.check
    )
    return WorkerServer(args.scheduler, runner, handshake).serve()


async def measure_overlap(args, overlap: bool) -> dict[str, float]:
    # one function: the benchmark's script, read top to bottom
    """Decode step times through the real engine over a simulated worker."""
    import asyncio
    import subprocess
    import sys
    import time

    from scheduler_service.core.config import ModelSpec, SchedulerConfig
    from scheduler_service.core.sequence import Request, SamplingOptions
    from scheduler_service.main import tune_gc
    from scheduler_service.runtime.engine import Engine
    from scheduler_service.runtime.worker_client import WorkerClient
    from scheduler_service.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.model)
    budget = max(2048, args.seqs)
    config = SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.seqs,
        max_num_batched_tokens=budget,
        overlap=overlap,
    )
    # every request still decodes through the timed window
    steps = (
        args.steps
        or int(args.seqs * args.context / budget + 3 * args.window * 1000 / args.step_ms) + 50
    )
    max_context = args.context + steps + 64
    num_blocks = args.seqs * (max_context // args.block_size + 2)
    client = WorkerClient(
        "tcp://127.0.0.1:0",
        expected={"block_size": args.block_size, "max_num_batched_tokens": budget},
    )
    endpoint = client.bind()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.bench.overlap",
            "worker",
            "--scheduler",
            endpoint,
            "--num-blocks",
            str(num_blocks),
            "--block-size",
            str(args.block_size),
            "--max-num-batched-tokens",
            str(budget),
            "--vocab-size",
            str(tokenizer.vocab_size),
            "--max-context",
            str(max_context),
            "--step-ms",
            str(args.step_ms),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    spec = ModelSpec(
        name="simulated", vocab_size=tokenizer.vocab_size, max_context=max_context, eos_token_ids=()
    )
    engine = Engine(config, spec, tokenizer, client)
    try:
        await engine.start(60)
        tune_gc()  # as the scheduler process does once serving
        rng = np.random.default_rng(0)
        first = asyncio.Event()
        have_first = 0

        async def one(i: int) -> None:
            nonlocal have_first
            req = Request(
                f"sim-{i}",
                rng.integers(1, VOCAB, args.context).tolist(),
                SamplingOptions(max_tokens=steps, ignore_eos=True),
            )
            got = False
            async for _ in engine.generate(req):
                if not got:
                    got = True
                    have_first += 1
                    if have_first == args.seqs:
                        first.set()

        tasks = [asyncio.create_task(one(i)) for i in range(args.seqs)]
        await first.wait()
        replica = engine.replicas[0]
        p0, t0 = dict(replica.profile.as_dict()), time.perf_counter()
        await asyncio.sleep(args.window)
        p1, t1 = dict(replica.profile.as_dict()), time.perf_counter()
        if replica.pool_stats().num_running != args.seqs:
            raise SystemExit("some requests finished inside the timed window: raise --steps")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await engine.stop()
        worker.terminate()
        worker.wait(10)
    steps = p1["steps"] - p0["steps"]
    if steps < 3:
        raise SystemExit(f"only {steps} steps in the window: lengthen --window or --steps")
    per = {
        k: (p1[k] - p0[k]) * 1000 / steps
        for k in ("schedule", "build_plan", "process_output", "wait", "worker_forward")
    }
    per["period"] = (t1 - t0) * 1000 / steps
    per["scheduler"] = per["schedule"] + per["build_plan"] + per["process_output"]
    return per


def bench(args) -> int:
    import asyncio

    from protos.base.logs import configure_logging

    configure_logging("warning", "simulate")

    print(
        f"simulated worker, {args.step_ms:g} ms a step; {args.seqs} sequences decoding with "
        f"~{args.context}-token contexts; ms per step over {args.window:g} s of decode steps"
    )
    print(
        f"{'overlap':>8}{'period':>9}{'worker':>9}{'scheduler':>11}{'(schedule':>11}{'plan':>7}{'output)':>9}"
        f"{'waited':>9}"
    )
    rows = {}
    for overlap in (False, True):
        r = rows[overlap] = asyncio.run(measure_overlap(args, overlap))
        print(
            f"{'on' if overlap else 'off':>8}{r['period']:>9.2f}{r['worker_forward']:>9.2f}"
            f"{r['scheduler']:>11.2f}{r['schedule']:>11.2f}{r['build_plan']:>7.2f}{r['process_output']:>9.2f}{r['wait']:>9.2f}",
            flush=True,
        )
    on, off = rows[True], rows[False]
    print(
        "overlap on: period / max(worker, scheduler) = "
        f"{on['period'] / max(on['worker_forward'], on['scheduler']):.2f}; overlap off: period / "
        f"(worker + scheduler) = {off['period'] / (off['worker_forward'] + off['scheduler']):.2f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="simulate", description="the simulated worker, and the overlap benchmark"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="serve as a simulated worker rank")
    w.add_argument("--scheduler", required=True)
    w.add_argument("--num-blocks", type=int, required=True)
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--max-num-batched-tokens", type=int, default=2048)
    w.add_argument("--vocab-size", type=int, default=VOCAB)
    w.add_argument("--max-context", type=int, default=4096)
    w.add_argument("--step-ms", type=float, default=10.0)
    w.add_argument("--check", action="store_true", help="answer with the exact hash model (slow)")
    b = sub.add_parser(
        "bench", help="step period with overlap off and on, against a fixed worker step time"
    )
    b.add_argument(
        "--model", required=True, help="model folder (its tokenizer detokenizes the outputs)"
    )
    b.add_argument("--seqs", type=int, default=256)
    b.add_argument("--context", type=int, default=2000)
    b.add_argument(
        "--steps",
        type=int,
        default=0,
        help="tokens each request generates (default: enough to decode through the timed window)",
    )
    b.add_argument("--step-ms", type=float, default=5.0)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--window", type=float, default=1.5, help="seconds of decode steps timed")
    args = p.parse_args(argv)
    return serve_worker(args) if args.cmd == "worker" else bench(args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
