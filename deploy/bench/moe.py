"""A mixture-of-experts decode step against its limit: `make bench-moe`.

A Qwen3-MoE-shaped model with random weights (no download; the shape scaled to the machine: on a CPU
in fp32 by default hidden 1024, 8 layers, 64 experts of intermediate 256, 8 a token; on CUDA in bf16
Qwen3-30B-A3B's layer at 12 layers), its decode step run as the worker runs one (the runner
executing a StepPlan: forward, LM head, sampling) for 1, 8 and 64 sequences at a fixed context.
Beside each, the step's limit: the bytes it must read once — every layer's attention projections,
norms and router, the experts its tokens chose (counted per layer from the step's own routing: a
grouped step reads each chosen expert once, however many of its tokens chose it), the LM head, the
sequences' K/V — over the memory bandwidth measured in the same run (a reduction over a 1 GiB
tensor). Prints ms a step, the limit, their ratio, and what a step that ran every expert for every
token would have to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    "cpu": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=256,
        intermediate_size=2048,
        vocab_size=40960,
    ),  # the plans draw token ids below 40000
    # Qwen3-30B-A3B's layer, 12 of its 48
    "cuda": dict(
        hidden_size=2048,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
    ),
}


def bandwidth(device, dtype) -> float:
    """Bytes a second one reduction reads from a 1 GiB tensor (best of 5)."""
    import torch

    x = torch.ones(2**30 // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    import torch

    p = argparse.ArgumentParser(
        prog="pagedserve-bench-moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default="1,8,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="tokens each sequence has seen")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--shape", type=json.loads, default=None, help="config fields over the default shape (JSON)"
    )
    args = p.parse_args(argv)

    from deploy.bench.harness import step_plan
    from worker.model.attention_native import make_backend
    from worker.model.kv_pool import KVPool
    from worker.model.moe import MoE
    from worker.step.runner import ModelRunner
    from worker.weights.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = {**SHAPES[device.type], **(args.shape or {})}
    cfg = dict(
        model_type="qwen3_moe",
        max_position_embeddings=4096,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **shape,
    )
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-moe-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    model, config = load_model(str(folder), "dummy", dtype, device)
    if device.type == "cpu":
        from worker.model.linear import choose as choose_matmul

        model.use_matmul(choose_matmul("auto", model.matmul_shapes(), device, dtype))
    bw = bandwidth(device, dtype)
    size = torch.finfo(dtype).bits // 8
    hidden, layers = config.hidden_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attn_bytes = (hidden * (q + 2 * kv) + q * hidden + 2 * hidden + 2 * config.head_dim) * size
    router_bytes = config.num_experts * hidden * size
    expert_bytes = 3 * hidden * config.moe_intermediate_size * size
    head_bytes = config.vocab_size * hidden * size
    total_experts = sum(1 for i in range(layers) if config.is_moe(i)) * config.num_experts
    print(
        f"Qwen3-MoE shape on {device.type} ({dtype}): {layers} layers, hidden {hidden}, "
        f"{config.num_experts} experts of {config.moe_intermediate_size}, "
        f"{config.experts_per_token} a token; context {args.context}; "
        f"{torch.get_num_threads() if device.type == 'cpu' else ''} memory read {bw / 1e9:.1f} "
        "GB/s"
    )
    print(
        f"{'rows':>5} {'step ms':>9} {'limit ms':>9} {'x limit':>8} {'experts read':>13} {'of':>6} "
        f"{'all-experts limit ms':>21}"
    )
    chosen: list[set[int]] = []
    real_route = MoE.route

    def route(self, h):  # the step's own routing, counted (one set of experts per layer per step)
        weights, ids = real_route(self, h)
        chosen.append(set(ids.reshape(-1).tolist()))
        return weights, ids

    results = []
    attn = make_backend(
        None, device, (config.num_heads, config.num_kv_heads, config.head_dim, 16, dtype)
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        plan, blocks = step_plan([(1, args.context)] * rows, step_id=2)
        runner = ModelRunner(model, KVPool(config, blocks + 4, 16, dtype, device), attn, device)
        runner.execute(plan)  # warm: kernels compiled, buffers allocated
        times = []
        for _ in range(args.reps):
            _sync(device)
            t = time.perf_counter()
            runner.execute(plan)
            _sync(device)
            times.append(time.perf_counter() - t)
        MoE.route = route
        try:
            chosen.clear()
            runner.execute(plan)
        finally:
            MoE.route = real_route
        read = sum(len(c) for c in chosen)
        kv_bytes = rows * args.context * 2 * kv * layers * size
        fixed = (
            layers * attn_bytes
            + (layers - len(chosen)) * 3 * hidden * config.intermediate_size * size
            + len(chosen) * router_bytes
            + head_bytes
            + kv_bytes
        )
        limit = (fixed + read * expert_bytes) / bw
        every = (fixed + total_experts * expert_bytes) / bw
        step = statistics.mean(times)
        print(
            f"{rows:>5} {step * 1e3:9.2f} {limit * 1e3:9.2f} {step / limit:8.2f} {read:>13} "
            f"{total_experts:>6} {every * 1e3:21.2f}"
        )
        results.append(dict(rows=rows, step_ms=step * 1e3, limit_ms=limit * 1e3, experts_read=read))
        del runner
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
