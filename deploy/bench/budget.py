"""The per-token budget of one decode stream on a CPU (`make bench-budget`): where a token's time
goes.

The worker is built in this process exactly as `pagedserve serve --model X` builds it (the same
flags and start-up phases: the file's blocks, packing, the fused decode step), then fed the plan of
one sequence decoding at --context keys. Printed per part, in ms a token: each stage of the fused
step as the native library times it (kernels/cpu/decode_step.c: the four projections, attention, the
norms, the heads' RoPE and K/V write, the activations' rounding, SiLU), the LM head, sampling, and
the worker's own Python and staging. Beside each matrix: the bytes it reads a token and the rate
that makes against a plain read of memory measured in the same run; the read limit is every byte a
token must read over that rate. With --served the same model first runs behind a real server (one
greedy stream): its inter-token time less the worker's step is what the scheduler, the wire and the
client add.

    python -m deploy.bench.budget --served \
        --model ~/.cache/pagedserve-peers/scale/llama-1b-v128256-random.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

from deploy.bench.harness import Tally, step_plan

MATRICES = ("qkv", "o_proj", "gate_up", "down")


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes a second of a plain 1 GiB read, best of `reps`."""
    import torch

    big = torch.ones(nbytes // 4)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t)
    return nbytes / min(times[1:])


def build_worker(model: str, flags: list[str]):
    """The runner a worker started with these flags serves with (no scheduler: nothing is
    connected).
    """
    from worker.serve.assembly import build_runner, size_pool
    from worker.serve.config import WorkerConfig
    from worker.serve.main import build_parser
    from worker.serve.startup import check_flags, load, start_device

    args = build_parser().parse_args(["--model", model, "--scheduler", "tcp://127.0.0.1:1", *flags])
    cfg = WorkerConfig.from_args(args)
    check_flags(cfg, cfg.tp)
    device, dtype = start_device(cfg)
    loaded = load(cfg, device, dtype, cfg.tp)
    runner, _ = build_runner(loaded, size_pool(cfg, loaded, device, cfg.tp), device)
    return runner


def matrix_bytes(model) -> dict[str, int]:
    """Bytes each projection reads a token, every layer together (the weights the fused step
    multiplies).
    """
    from worker.model.fused_decode import matrix_bytes as one_layer

    total = dict.fromkeys(MATRICES, 0)
    for layer in model.layers:
        for name, n in one_layer(layer).items():  # a Mamba2 layer's in the step's stages of them
            total[{"in_proj": "qkv", "out_proj": "o_proj"}.get(name, name)] += n
    experts = experts_bytes(model)
    return total | ({"experts": experts} if experts else {})


def experts_bytes(model) -> int:
    """Bytes a token reads of the mixtures of experts: each layer's top-k experts' share."""
    total = 0
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        experts = moe.blocks.gate_up + moe.blocks.down if moe.blocks is not None else None
        whole = (
            sum(weight_bytes(w) for w in experts)
            if experts
            else weight_bytes(moe.gate_up) + weight_bytes(moe.down)
        )
        total += whole // moe.router.shape[0] * moe.top_k
    return total


def weight_bytes(w) -> int:
    """Bytes of a prepared weight as its kernel reads it (a QuantLinear's blocks, not its copy)."""
    from worker.model.quant_weights import QuantLinear, QuantStack, QuantWeight

    if isinstance(w, QuantLinear):
        w = w.q
    if isinstance(w, (QuantWeight, QuantStack)):
        return sum(s.data.numel() for s in w.segments)
    return w.numel() * w.element_size()


def layer_bytes(model) -> dict[str, int]:
    """Without the fused step: bytes a token reads of the layers' own matrices, and of a MoE's
    experts the top-k's share (each token reads its chosen experts).
    """
    own = sum(weight_bytes(w) for layer in model.layers for w in layer.w.values())
    return {"layer matrices": own, "experts": experts_bytes(model)}


def head_bytes(model) -> int:
    from worker.model.quant_weights import QuantLinear, QuantStack, QuantWeight

    if isinstance(model.head, (QuantLinear, QuantWeight, QuantStack)):
        return weight_bytes(model.head)
    return weight_bytes(model.lm_head if model.lm_head is not None else model.embed)


def budget(runner, context: int, steps: int) -> dict:
    """Seconds a token of each part, averaged over `steps` decode steps of one sequence."""
    model, kernels = runner.model, runner.model.fused.kernels if runner.model.fused else None
    blocks = -(-(context + 1) // runner.pool.block_size)
    if blocks + 1 > runner.pool.num_blocks:
        raise SystemExit(
            f"--context {context} needs {blocks + 1} blocks; the pool has {runner.pool.num_blocks}"
        )
    plan, _ = step_plan(
        [(1, context)],
        block=runner.pool.block_size,
        step_id=2,
        vocab=min(model.config.vocab_size, 40000),
        hybrid=model.config.keeps_state,
    )
    for t in runner.pool.k + runner.pool.v:
        t.normal_()
    # the first steps after loading run slower (pages settling): not the steady state
    for _ in range(20):
        if error := runner.execute(plan).error:
            raise SystemExit(f"the worker refused the step: {error}")
    targets = {"lm_head": (model, "compute_logits"), "sampling": (runner, "_sample")}
    if model.fused is not None:
        targets["fused"] = (model.fused, "forward")
        kernels.decode_profile(True)
    try:
        with Tally(targets) as tally:
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - t)
        stages = kernels.decode_profile(False) if model.fused is not None else {}
    finally:
        if model.fused is not None:
            kernels.decode_profile(False)
    part = {k: v / steps for k, v in tally.seconds.items()}
    per = {
        f"stage {k}": v / max(stages.get("steps", 1), 1) for k, v in stages.items() if k != "steps"
    }
    step = statistics.mean(times)
    per["lm_head"], per["sampling"] = part.get("lm_head", 0.0), part.get("sampling", 0.0)
    inside = part.get("fused", 0.0)
    staged = sum(v for k, v in per.items() if k.startswith("stage"))
    per["fused step, outside its stages"] = max(inside - staged, 0.0)
    per["worker Python and staging"] = max(step - inside - per["lm_head"] - per["sampling"], 0.0)
    return {"parts": per, "step": step, "median_step": statistics.median(times)}


def row_costs(runner, context: int, rows: list[int], steps: int) -> dict[int, float]:
    """Median seconds of a decode step of n rows (n sequences at `context` keys, a token each: what
    a verifying step of 1 + n - 1 drafted tokens reads), for each n, two alternating passes' best.
    """
    vocab = min(runner.model.config.vocab_size, 40000)
    best: dict[int, float] = {}
    for _ in range(2):
        for n in rows:
            plan, used = step_plan(
                [(1, context)] * n, block=runner.pool.block_size, step_id=2 + n, vocab=vocab
            )
            if used > runner.pool.num_blocks:
                raise SystemExit(f"{n} rows at --context {context} need {used} blocks")
            for _ in range(3):
                runner.execute(plan)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - t)
            best[n] = min(best.get(n, float("inf")), statistics.median(times))
    return best


def kv_bytes(runner, context: int) -> int:
    """Bytes of keys and values one sequence of `context` keys reads a token, over the layers
    that hold them (a hybrid's attention layers alone).
    """
    pool = runner.pool
    return context * pool.bytes_per_block // pool.block_size


def matmul_costs(model, rows: list[int]) -> None:
    """The model's matrices once at each row count (ms), every way a quantized library can multiply
    them: its row kernels, the same at fp32 activations (BF16 rows' tiles and dot products
    refused), the GEMM on the copy it holds (oneDNN's blocked layout) and on the weights as held.
    """
    import torch

    from kernels.cpu_native import load
    from worker.model.linear import best_time
    from worker.model.quantized import model_linears

    lib, native, linears = model.mm, load(), model_linears(model)

    def ms(fn, n: int) -> float:
        total = 0.0
        for w, uses in linears:
            x = torch.randn(n, w.q.in_dim)
            total += uses * best_time(lambda w=w, x=x: fn(x, w), 3)
        return 1e3 * total

    def gemm(x, w):
        saved, lib.max_kernel_rows = lib.max_kernel_rows, 0
        try:
            return lib(x, w)
        finally:
            lib.max_kernel_rows = saved

    def held(x, w):
        copy, w.q.gemm = getattr(w.q, "gemm", None), None
        try:
            return gemm(x, w)
        finally:
            w.q.gemm = copy

    print(f"{'rows':>5} {'kernels':>9} {'fp32 act':>9} {'GEMM copy':>10} {'GEMM held':>10}  (ms)")
    for n in rows:
        kernel = ms(lambda x, w: lib.kernel(x, w.q), n)
        native.bf16_rounded(0)
        try:
            fp32 = ms(lambda x, w: lib.kernel(x, w.q), n)
        finally:
            native.bf16_rounded(1)
        print(f"{n:>5} {kernel:9.1f} {fp32:9.1f} {ms(gemm, n):10.1f} {ms(held, n):10.1f}")


def print_rows(runner, args) -> None:
    """--rows: a decode step's time by its rows, or with --matmuls the matrices alone."""
    rows = [int(n) for n in args.rows.split(",")]
    if args.matmuls:
        matmul_costs(runner.model, rows)
        return
    costs = row_costs(runner, args.context, rows, args.steps)
    one = costs[min(costs)]
    print(f"{'rows':>5} {'ms/step':>8} {'x 1 row':>8}")
    for n, t in costs.items():
        print(f"{n:>5} {t * 1e3:8.1f} {t / one:8.2f}")


def served_token_s(
    model: str, flags: list[str], context: int, max_tokens: int, repeats: int
) -> list[float]:
    """Seconds a token of one greedy stream through a real server at mean context `context`."""
    from deploy.bench.cpu_peers import PagedserveTarget

    n = max(context - max_tokens // 2, 1)
    # a new prompt each repeat: a repeated one would draft its earlier answer
    prompts = [[1 + (i * (2 * r + 3) + 97 * r) % 1000 for i in range(n)] for r in range(repeats)]
    target = PagedserveTarget(types.SimpleNamespace(model=model), "pagedserve", *flags)
    try:
        return [1.0 / target.one(p, max_tokens) for p in prompts]
    finally:
        target.stop()


def print_budget(res: dict, bw: float, mats: dict, head: int, kv: int) -> None:
    parts, step = res["parts"], res["step"]
    print(f"\n{'part':34} {'ms/token':>9} {'share':>6} {'MB read':>8} {'GB/s':>6} {'of read':>8}")
    rows = [(k, v) for k, v in parts.items()]
    if "served" in res:  # below zero: the two runs differ by more than this costs (a noisy machine)
        rows.append(("scheduler, wire and client", res["served"] - step))
    total = step + (res["served"] - step if "served" in res else 0.0)
    for k, v in rows:
        name = k.removeprefix("stage ")
        nbytes = {**mats, "attention": kv, "lm_head": head}.get(name)
        if nbytes and v > 0:
            rate = nbytes / v
            extra = f" {nbytes / 1e6:8.1f} {rate / 1e9:6.1f} {rate / bw:7.0%}"
        else:
            extra = ""
        print(f"{name:34} {v * 1e3:9.3f} {v / total:6.1%}{extra}")
    read = sum(mats.values()) + head + kv
    print(f"{'worker step':34} {step * 1e3:9.3f} (median {res['median_step'] * 1e3:.3f})")
    if "served" in res:
        print(
            f"{'served, one stream':34} {res['served'] * 1e3:9.3f} ({1 / res['served']:.1f} tok/s)"
        )
    print(
        f"read limit: {read / 1e6:.0f} MB a token at {bw / 1e9:.1f} GB/s = {read / bw * 1e3:.2f} "
        f"ms ({bw / read:.1f} tok/s); the worker's step is at {read / bw / step:.0%} of it"
        + (f", the served stream at {read / bw / res['served']:.0%}" if "served" in res else "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve-bench-budget",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="a .gguf file or model folder, as `pagedserve serve` takes"
    )
    p.add_argument(
        "--context", type=int, default=256, help="keys the sequence attends (default 256)"
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--served", action="store_true", help="also one stream through a real server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="served streams (the median is printed)")
    p.add_argument(
        "--flags", default="", help="worker flags, as `pagedserve serve` would pass them"
    )
    p.add_argument(
        "--no-tiles",
        action="store_true",
        help="BF16 rows on the row kernel and oneDNN, not AMX tiles or AVX512_BF16 dot products",
    )
    p.add_argument(
        "--matmuls",
        action="store_true",
        help="with --rows: the model's matrices alone, by each path a quantized library has",
    )
    p.add_argument(
        "--rows",
        default="",
        help="instead: a decode step's time by its rows (e.g. 1,2,3,4,6,8,11), as a ratio to one "
        "row: what a drafted token costs (speculative decoding's `auto` learns the same line)",
    )
    args = p.parse_args(argv)
    import shlex

    import torch

    from protos.base.logs import configure_logging
    from worker.serve.host_memory import ensure_allocator, resolve_mode

    flags = shlex.split(args.flags)
    configure_logging("warning", process="bench-budget")
    ensure_allocator(
        resolve_mode(None), "cpu", "deploy.bench.budget", sys.argv[1:] if argv is None else argv
    )
    if args.no_tiles:
        from kernels.cpu_native import load

        load().bf16_rounded(0)
    bw = read_bandwidth()
    served = None
    if args.served and not args.rows:  # first: a model that fills memory fits once, not twice
        served = statistics.median(
            served_token_s(args.model, flags, args.context, args.max_tokens, args.repeats)
        )
    runner = build_worker(args.model, flags)
    model = runner.model
    mats = matrix_bytes(model) if model.fused is not None else layer_bytes(model)
    head, kv = head_bytes(model), kv_bytes(runner, args.context)
    print(
        f"{args.model}: {torch.get_num_threads()} threads, context {args.context}, weights "
        f"{model.mm.name}, fused step {'on' if model.fused is not None else 'off'}, row kernels "
        f"to {getattr(model.mm, 'max_kernel_rows', '-')} rows"
    )
    if args.rows:
        print_rows(runner, args)
        return 0
    res = budget(runner, args.context, args.steps)
    if served is not None:
        res["served"] = served
    print_budget(res, bw, mats, head, kv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
