"""pagedserve-worker: load a model (or this rank's shard of it), size the KV pool, join the
tensor-parallel group, connect to the scheduler and run its plans.

On another host: `pagedserve-worker --model M --scheduler tcp://HOST:PORT --replica D --rank R
--tensor-parallel-size N --rendezvous tcp://RANK0HOST:PORT` (add `--curve-keys DIR` when the
scheduler requires CurveZMQ)."""

from __future__ import annotations

import argparse
import sys

import structlog

from protos.base import EXIT_CONFIG, EXIT_LOAD, env
from protos.base.argtypes import COUNT, POSITIVE, SECONDS, Parser, float_range, memory_size
from protos.base.logs import LOG_FORMATS, configure_logging
from worker.serve.assembly import build_runner, handshake_for, size_pool
from worker.serve.choices import DTYPES, KV_CACHE_DTYPES
from worker.serve.config import WorkerConfig
from worker.serve.startup import Refused, check_flags, load, start_device

log = structlog.get_logger("worker.serve.main")


def add_step_args(p: argparse.ArgumentParser) -> None:
    """Settings the scheduler and its workers must agree on (checked in the handshake)."""
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (a power of two)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget: decodes first, then prompt chunks (sizes the profiling "
        "forward on CUDA)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap the model's context (default: the model's); the longest decode graph tier "
        "serves it",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences in a step (default: 64 on a CPU; on a GPU from the KV pool's "
        "capacity, 64-512); on CUDA the decode graphs are captured for up to this many",
    )


def add_worker_args(p: argparse.ArgumentParser) -> None:
    # one function: the worker's flag table
    """The worker's own flags; `pagedserve serve` and `pagedserve deploy` pass them through
    unchanged.
    """
    g = p.add_argument_group("workers")
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="how to read the weights; dummy: random weights of the model's shapes (benchmarks)",
    )
    g.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:N or cpu (default: cuda when present; the launchers give each local rank "
        "its own GPU)",
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_CACHE_DTYPES),
        help="the KV pool's element type: bf16 holds twice the tokens in the same memory and "
        "halves the bytes a long context reads (keys and values rounded to bf16); auto: bf16 "
        "where the model is served in bfloat16 (--dtype bfloat16) or a quantized file's "
        "prompts run on a bf16 copy (--quantized-prefill), else the model's compute dtype",
    )
    g.add_argument(
        "--num-blocks",
        type=POSITIVE,
        default=None,
        help="KV pool size in blocks (overrides the memory budget)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default=None,
        help="KV pool memory per rank, e.g. 2GiB (default: 2GiB on a CPU shared by the "
        "tensor-parallel ranks, so --tp holds as many tokens; on CUDA what "
        "--gpu-memory-utilization leaves once everything else is measured)",
    )
    g.add_argument(
        "--kv-offload-size",
        type=memory_size,
        default=None,
        help="a host-memory tier under the KV pool, e.g. 16GiB (pinned on CUDA): cached blocks "
        "the pool evicts are kept there and read back for a prompt that starts with them, "
        "instead of computed again (default: none; on a CPU the same memory given to "
        "--kv-cache-memory serves as well)",
    )
    g.add_argument(
        "--kv-offload-dir",
        default=None,
        help="a disk tier under the KV pool: every block entering the prefix cache is also "
        "written here (one file a block, checksummed, in a folder per model and layout) and "
        "read back across evictions and restarts; default: none",
    )
    g.add_argument(
        "--kv-offload-disk-size",
        type=memory_size,
        default="16GiB",
        help="the most the disk tier holds (its least recently used blocks are deleted)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float_range(0.0, 1.0, low_open=True),
        default=0.9,
        help="on CUDA: share of the GPU's memory this worker may use (weights, activations, KV "
        "pool)",
    )
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=["triton", "cpu", "torch"],
        help="default: triton on CUDA; on a CPU the native kernel (cpu), else torch "
        "(triton on a CPU needs TRITON_INTERPRET=1)",
    )
    g.add_argument(
        "--dequantize",
        action="store_true",
        help="serve a quantized GGUF (or a folder prepared from one, or gpt-oss's MXFP4 "
        "checkpoint) dequantized to --dtype instead of on its own blocks",
    )
    g.add_argument(
        "--quantized-prefill",
        default="auto",
        choices=["auto", "dense", "bf16", "dequantize"],
        help="with quantized weights, prefill on a dense fp32 copy of each weight (memory for "
        "speed), on a bf16 copy (half the memory; bf16 products, several times fp32's rate "
        "on AMX) or dequantize each into a scratch matrix when it is used (or multiply on "
        "the packed kernel where it is faster); auto: the copy (bf16 where the CPU has AMX) "
        "for a model whose copy holds at most 1 GiB, where the machine's available memory "
        "holds it beside the KV pool, none with --quantized-activations int8 (the choice "
        "is logged and said in the ready line)",
    )
    g.add_argument(
        "--quantized-activations",
        default="auto",
        choices=["auto", "int16", "fp32", "int8"],
        help="with quantized weights, what the kernels multiply the weights with: int16 rounds "
        "activations per 32-value block to 16-bit integers (2^-16 of the block's largest "
        "value) and multiplies Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K (and Q8_0 with VNNI) "
        "weights, repacked at load, in integers (AVX-512 VNNI or AVX2); int8 rounds them to "
        "8 bits instead (llama.cpp's precision: 1.3-1.9%% perplexity on the default model's "
        "files) for one byte dot product a weight where 16 bits take two (1.4-1.5x the "
        "throughput of many rows and of prefill on the packed kernel); fp32 multiplies fp32 "
        "activations (exact up to summation order); auto: int16 where the CPU has AVX-512 "
        "VNNI or AVX2 and prefill keeps a dense copy (a small model), int8 where it keeps "
        "none, else fp32; the ready line says which",
    )
    g.add_argument(
        "--cpu-decode",
        default="fused",
        choices=["fused", "layers"],
        help="on a CPU (fp32, one rank), a decode-only step of a few sequences runs as one native "
        "call (fused: the threads stay up for the whole step; fp32 weights are then also "
        "kept unpacked where --matmul packs them for oneDNN) or layer by layer as every "
        "other step",
    )
    g.add_argument(
        "--matmul",
        default="auto",
        choices=["auto", "dense", "onednn", "mkl"],
        help="projection matmuls: auto times the libraries on the model's shapes at start and "
        "keeps the fastest; dense is F.linear; onednn and mkl pack each weight once (CPU, "
        "fp32)",
    )
    g.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads per worker")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument(
        "--graph-max-context",
        type=POSITIVE,
        default=8192,
        help="on CUDA, the longest sequence the first tier of decode graphs serves (few splits); "
        "a second tier serves up to --max-model-len",
    )
    g.add_argument(
        "--malloc",
        default=None,
        choices=["auto", "tcmalloc", "glibc", "default"],
        help="host allocator (serve/host_memory.py): auto preloads the system's tcmalloc for a "
        "CPU worker where present, else tunes glibc to reuse freed blocks; default: "
        "$PAGEDSERVE_MALLOC or auto",
    )
    g.add_argument(
        "--state-snapshots",
        type=COUNT,
        default=None,
        help="a hybrid model's recurrent-state slots for prefix snapshots beside one per "
        "running sequence (--max-num-seqs), their memory taken from the KV pool's budget; the "
        "scheduler keeps snapshots in every slot no running sequence holds (default: as many as "
        "running sequences; 0: snapshots only in slots the running sequences leave idle)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=COUNT,
        default=None,
        help="LoRA adapters this worker keeps read at once (the least recently used given back), "
        "their (twice: a step's are also kept stacked) memory at --max-lora-rank taken from "
        "the KV pool's budget; default: under `pagedserve serve` one per adapter "
        "--lora-modules names, up to --max-loras, else 0 (no adapters)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=POSITIVE,
        default=16,
        help="the highest LoRA rank served (an adapter above it is refused by name)",
    )
    g.add_argument("--seed", type=COUNT, default=0, help="seed of dummy weights")
    g.add_argument(
        "--scheduler-timeout",
        type=SECONDS,
        default=30.0,
        help="exit when the scheduler is silent this long",
    )
    g.add_argument(
        "--stop-timeout",
        type=SECONDS,
        default=60.0,
        help="on SIGTERM (unsupervised, as under Kubernetes): keep serving the draining scheduler "
        "until it says shutdown or is gone, at most this many seconds",
    )
    g.add_argument(
        "--collective-timeout",
        type=SECONDS,
        default=300.0,
        help="seconds a rank waits for its group in a collective before it gives up and exits",
    )


def add_group_args(p: argparse.ArgumentParser) -> None:
    """Flags that describe the parallel layout (the launchers set the per-rank ones)."""
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=POSITIVE,
        default=1,
        dest="tensor_parallel_size",
        help="ranks of one model (heads, MLP and vocabulary split over them)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pagedserve-worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="Hugging Face folder or .gguf file")
    p.add_argument(
        "--scheduler",
        required=True,
        help="ZeroMQ endpoint of the scheduler, e.g. tcp://127.0.0.1:5557",
    )
    p.add_argument(
        "--replica", type=int, default=0, help="data-parallel replica (worker group) of this rank"
    )
    p.add_argument("--rank", type=int, default=0, help="rank within the tensor-parallel group")
    p.add_argument(
        "--rendezvous",
        default="",
        help="torch.distributed rendezvous of the group, tcp://HOST:PORT (needed when --tp > 1)",
    )
    p.add_argument(
        "--rendezvous-file",
        default=None,
        help="for a group on one host (the launchers set it): rank 0 listens on any free port of "
        "the rendezvous host and writes it here for the other ranks (the rendezvous port is "
        "ignored)",
    )
    p.add_argument(
        "--local-rank",
        type=int,
        default=0,
        help="index of this worker process on its host: it takes GPU (N + index) mod GPUs, where "
        "N is --device cuda:N (0 for cuda or no --device)",
    )
    p.add_argument(
        "--curve-keys",
        default=None,
        help="folder made by `pagedserve keys`: this worker's key pair and the scheduler's public "
        "key",
    )
    p.add_argument("--log-level", default="info", help="the least severe log events written")
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="console: readable lines; json: one JSON object a line; auto: console on a terminal",
    )
    add_group_args(p)
    add_step_args(p)
    add_worker_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if env.supervised():
        # Ctrl-C reaches the whole group: under a supervisor, leave it to drain and then SIGTERM us
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from worker.serve.host_memory import ensure_allocator, resolve_mode

    cfg = WorkerConfig.from_args(args)
    # may re-execute
    allocator = ensure_allocator(resolve_mode(cfg.malloc), cfg.device, "worker.serve.main", argv)
    tp = cfg.tp
    configure_logging(
        cfg.log_level, process=f"worker-{cfg.replica}.{cfg.rank}", log_format=cfg.log_format
    )
    try:
        check_flags(cfg, tp)
        device, dtype = start_device(cfg)
        loaded = load(cfg, device, dtype, tp)
        plan = size_pool(cfg, loaded, device, tp)
        runner, warm_s = build_runner(loaded, plan, device, cfg)
    except Refused as e:
        log.error(e.event, **e.fields)
        details = ", ".join(f"{k}={v}" for k, v in e.fields.items())
        message = e.message or f"{e.event.replace('_', ' ')} ({details})"
        print(f"pagedserve-worker: {message}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:  # a fault no check foresaw: one line, its traceback at --log-level debug
        log.error("model_load_failed", model=cfg.model, error=f"{type(e).__name__}: {e}")
        log.debug("model_load_failed_at", exc_info=True)
        said = f"pagedserve-worker: {cfg.model} could not be loaded: {type(e).__name__}: {e}"
        print(said, file=sys.stderr)
        return EXIT_LOAD
    from worker.serve.step_server import WorkerServer

    handshake = handshake_for(cfg, loaded, plan, device, tp)
    if runner.tiers is not None:
        runner.tiers.describe(handshake)
    log.info(
        "model_loaded",
        model=cfg.model,
        device=str(device),
        dtype=handshake.dtype,
        compute_dtype=str(loaded.dtype).removeprefix("torch."),
        kv_cache_dtype=handshake.kv_cache_dtype,
        num_blocks=plan.num_blocks,
        attention_backend=loaded.attn.name,
        matmul=loaded.model.mm.name,
        malloc=allocator,
        warm_up_s=round(warm_s, 3),
        tp_rank=cfg.rank,
        tp_size=tp,
        replica=cfg.replica,
        kv_heads=loaded.heads,
        max_num_seqs=plan.max_num_seqs,
        decode_graphs=runner.graphs.buckets if runner.graphs is not None else None,
        graph_contexts=runner.graphs.contexts if runner.graphs is not None else None,
    )
    server = WorkerServer(
        cfg.scheduler,
        runner,
        handshake,
        scheduler_timeout=cfg.scheduler_timeout,
        curve_keys=cfg.curve_keys,
    )
    if not env.supervised():  # a supervisor stops its workers after their scheduler
        import signal

        signal.signal(signal.SIGTERM, lambda *_: server.request_stop(cfg.stop_timeout))
    code = server.serve()
    # the disk tier's writes asked for so far reach their files before exit
    if runner.tiers is not None:
        runner.tiers.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
