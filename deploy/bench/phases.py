"""One server step in process, profiled: where a decode step's time goes, each phase against its
local limit, at the default model's shapes.
"""

from __future__ import annotations

import time

from deploy.bench.harness import Tally, best, step_plan


def _worker(args, num_blocks: int):
    import torch

    from worker.model.attention_native import make_backend
    from worker.model.kv_pool import KVPool
    from worker.model.linear import choose as choose_matmul
    from worker.step.runner import ModelRunner
    from worker.weights.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    model, config = load_model(args.model, "auto", torch.float32, cpu)
    model.use_matmul(choose_matmul(args.matmul, model.matmul_shapes(), cpu, torch.float32))
    pool = KVPool(config, num_blocks, 16, torch.float32, cpu)
    attn = make_backend(
        None, cpu, (config.num_heads, config.num_kv_heads, config.head_dim, 16, torch.float32)
    )
    return ModelRunner(model, pool, attn, cpu), model, config


def _matmuls_alone(model, rows: int, sampled_rows: int, reps: int) -> float:
    """Seconds of the step's matmuls alone, on the model's prepared weights."""
    import torch

    from worker.model.linear import LIBRARIES

    cpu = torch.device("cpu")
    names = [n for n, cls in LIBRARIES.items() if n == "dense" or cls.available(cpu, torch.float32)]
    hidden = model.config.hidden_size
    fastest = float("inf")
    for name in names:
        lib = LIBRARIES[name]()
        same = model.mm.name == name
        weights = (
            [
                [layer.w[n] if same else lib.prepare(getattr(layer, n)) for n in layer.matmul_names]
                for layer in model.layers
            ]
            if same or model.mm.name == "dense"
            else None
        )
        # the dense copies were dropped when packing: only the model's own library is timed
        if weights is None:
            continue
        head_lib = model.head_mm if same else lib
        head = (
            model.head
            if same
            else lib.prepare(model.embed if model.lm_head is None else model.lm_head)
        )
        xs = {}
        for w in weights[0]:
            k = w.shape[1] if w.dim() == 2 else hidden
            xs.setdefault(k, torch.randn(rows, k))
        inputs = [xs[w.shape[1]] for w in weights[0]]
        h = torch.randn(sampled_rows, hidden)

        def run(lib=lib, weights=weights, inputs=inputs, head=head, h=h, head_lib=head_lib):
            for layer in weights:
                for x, w in zip(inputs, layer, strict=True):
                    lib(x, w)
            head_lib(h, head)

        fastest = min(fastest, best(run, reps))
    return fastest


def _kv_read(pool, blocks: int, reps: int) -> float:
    """Seconds to read every layer's K and V of the first `blocks` blocks once."""

    def run():
        for k, v in zip(pool.k, pool.v, strict=True):
            k[:blocks].sum()
            v[:blocks].sum()

    return best(run, reps)


def phases(args, prompts) -> dict:
    """A prefill chunk and a decode step timed in-process, beside their limits."""
    import statistics as st

    q_chunk = []
    total = 0
    for p in prompts:  # whole prompts up to the token budget, as the scheduler packs a chunk
        if total + len(p) > args.max_num_batched_tokens:
            break
        q_chunk.append((len(p), len(p)))
        total += len(p)
    decode = [(1, len(p) + args.max_tokens // 2) for p in prompts]  # mid-way through decoding
    prefill_plan, prefill_blocks = step_plan(q_chunk)
    decode_plan, decode_blocks = step_plan(decode, step_id=2)
    runner, model, config = _worker(args, max(prefill_blocks, decode_blocks) + 4)
    # written memory, as in a server: a never-written page reads as
    for t in runner.pool.k + runner.pool.v:
        t.normal_()  # the kernel's one shared zero page, from cache
    reps = args.reps
    res = {}
    t_prefill = best(lambda: runner.execute(prefill_plan), reps)
    m_prefill = _matmuls_alone(model, total, len(q_chunk), reps)
    t_decode = best(lambda: runner.execute(decode_plan), reps)
    m_decode = _matmuls_alone(model, len(decode), len(decode), reps)
    kv = _kv_read(runner.pool, decode_blocks, reps)
    res = {
        "matmul": model.mm.name,
        "attention": runner.attn.name,
        "ops": model.ops.name,
        "prefill_tokens": total,
        "prefill_s": t_prefill,
        "prefill_matmul_s": m_prefill,
        "decode_rows": len(decode),
        "decode_mean_context": st.mean(n for _, n in decode),
        "decode_s": t_decode,
        "decode_matmul_s": m_decode,
        "decode_kv_read_s": kv,
    }
    print(
        f"\nin-process, {res['matmul']} matmuls, {res['attention']} attention, {res['ops']} "
        "elementwise ops:"
    )
    print(
        f"  prefill chunk of {total} tokens ({len(q_chunk)} prompts): {t_prefill * 1e3:.0f} ms; "
        f"its matmuls alone {m_prefill * 1e3:.0f} ms -> x{t_prefill / m_prefill:.2f} of the "
        "matmul time (target <= 1.3)"
    )
    limit = m_decode + kv
    print(
        f"  decode step of {len(decode)} sequences (mean context "
        f"{res['decode_mean_context']:.0f}): {t_decode * 1e3:.1f} ms; matmuls alone "
        f"{m_decode * 1e3:.1f} ms + one read of its K/V {kv * 1e3:.1f} ms = local limit "
        f"{limit * 1e3:.1f} ms -> x{t_decode / limit:.2f} (target <= 1.5)"
    )
    if args.profile_step:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runner.execute(decode_plan)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return res


def _served_model(args, cpu):
    """The model as a CPU worker serves it at fp32, library chosen, fused step attached."""
    import torch

    from kernels import cpu_native
    from worker.model.linear import choose as choose_matmul
    from worker.model.quantized import QuantizedMatmul, choose_threshold, model_linears
    from worker.serve.choices import use_fused_decode
    from worker.weights.gguf_blocks import GGUFQuantSource, find_gguf
    from worker.weights.gguf_plan import read_quantized
    from worker.weights.loader import load_model

    model, config = load_model(args.model, "auto", torch.float32, cpu)
    dense = choose_matmul(args.matmul, model.matmul_shapes(), cpu, torch.float32)
    gguf = None if args.dequantize else find_gguf(args.model)
    if gguf is None:
        model.use_matmul(dense, drop_dense=False)
    else:
        kernels = cpu_native.load()
        # the worker's default (auto)
        lib = QuantizedMatmul(kernels, dense, packing=kernels.packed_fast)
        source = GGUFQuantSource(gguf, config.num_heads, config.num_kv_heads, config.head_dim)
        model.use_quantized(read_quantized(model, source), lib)
        choose_threshold(lib, model_linears(model))
    use_fused_decode(model, 1, "fp32")
    return model, config


def decode_breakdown(args) -> dict:
    """A decode step at each --decode-rows: the layer path's time by part, beside the fused step."""
    import torch

    from worker.model.attention_native import make_backend

    cpu = torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, config = _served_model(args, cpu)
    attn = make_backend(
        None, cpu, (config.num_heads, config.num_kv_heads, config.head_dim, 16, torch.float32)
    )
    context = args.decode_context
    fused = model.fused
    res = {"weights": model.mm.name, "context": context, "rows": {}}
    print(
        f"\ndecode step, {model.mm.name} weights, context {context}, {torch.get_num_threads()} "
        "threads (ms; fused: "
        f"{'none' if fused is None else f'up to {fused.max_rows} rows on the row kernels'}"
        f"{', more through sgemm' if fused is not None and fused.sgemm else ''}):"
    )
    print(
        f"  {'rows':>4} {'layers':>8} {'fused':>8} {'x':>6}   layer path: "
        + " ".join(
            f"{k:>9}" for k in ("matmul", "attention", "kv_write", "elementwise", "lm_head", "rest")
        )
    )
    for rows in args.decode_rows:
        res["rows"][rows] = _decode_rows(model, config, attn, fused, rows, context, args.reps)
    return res


def _decode_rows(model, config, attn, fused, rows: int, context: int, reps: int) -> dict:
    import torch

    from worker.model.kv_pool import KVPool
    from worker.step.runner import ModelRunner

    cpu = torch.device("cpu")
    plan, blocks = step_plan([(1, context)] * rows, step_id=2)
    runner = ModelRunner(model, KVPool(config, blocks + 4, 16, torch.float32, cpu), attn, cpu)
    for t in runner.pool.k + runner.pool.v:
        t.normal_()
    model.fused = None
    try:
        t_layers = best(lambda: runner.execute(plan), reps)
        ops = model.ops
        targets = {
            "matmul": (type(model.mm), "__call__"),
            "attention": (attn, "forward"),
            "kv_write": (attn, "write_kv"),
            "norm": (ops, "add_rms_norm"),
            "silu": (ops, "silu_mul"),
            "rope": (ops, "rope"),
            "lm_head": (model, "compute_logits"),
        }
        with Tally(targets) as tally:
            t0 = time.perf_counter()
            for _ in range(reps):
                runner.execute(plan)
            total = (time.perf_counter() - t0) / reps
    finally:
        model.fused = fused
    part = {k: v / reps for k, v in tally.seconds.items()}
    head = part.get("lm_head", 0.0)
    split = {
        "matmul": max(part.get("matmul", 0.0) - head, 0.0),
        "attention": part.get("attention", 0.0),
        "kv_write": part.get("kv_write", 0.0),
        "elementwise": part.get("norm", 0.0) + part.get("silu", 0.0) + part.get("rope", 0.0),
        "lm_head": head,
    }
    split["rest"] = max(total - sum(split.values()), 0.0)
    t_fused = (
        best(lambda: runner.execute(plan), reps)
        if fused and (rows <= fused.max_rows or fused.sgemm)
        else None
    )
    f = f"{t_fused * 1e3:8.2f} {t_layers / t_fused:6.2f}" if t_fused else f"{'-':>8} {'-':>6}"
    print(
        f"  {rows:>4} {t_layers * 1e3:8.2f} {f}   {'':12}"
        + " ".join(
            f"{split[k] * 1e3:9.2f}"
            for k in ("matmul", "attention", "kv_write", "elementwise", "lm_head", "rest")
        )
    )
    return {"layers_s": t_layers, "fused_s": t_fused, "layer_path_split_s": split}
