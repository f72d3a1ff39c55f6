"""The worker's start-up in phases (flags, device, model, pool sizing, runner, handshake), each refusing
what cannot work with a `Refused` that serve/main.py turns into exit 2 (the choices they make: choices.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import structlog

from protos.base.argtypes import parse_bytes
from worker.serve.choices import (
    DTYPES,
    activations_of,
    block_types,
    cpu_default_kv_bytes,
    half_weights,
    hold_gemm_copy,
    int8_without_copy,
    kv_cache_dtype,
    prefill_path,
    quantized_library,
    quantized_source,
    rank_device,
    refuse_what_cannot_fit,
    use_fused_decode,
    use_native_head,
    weights_of,
)
from worker.serve.config import Refused, WorkerConfig
from worker.serve.kv_offload import fingerprint, tier_store

log = structlog.get_logger("worker.serve.main")


def nvidia_gpu_present() -> bool:
    """Whether the NVIDIA driver reports a GPU on this host, whatever torch can see."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


@dataclass
class Loaded:
    """The model as this rank serves it, and what it computes and caches in."""

    model: object
    config: object
    dtype: object  # what the model computes in
    weights_dtype: object  # what its matrices are held in
    kv_dtype: object
    attn: object
    heads: int  # this rank's KV heads
    quantized_prefill: str = ""  # how prompt chunks multiply a file's blocks, as chosen ("": no blocks)
    weights: str = ""  # how the matrices are held and multiplied, for the ready line (choices.weights_of)


@dataclass
class PoolPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_num_seqs: int
    use_graphs: bool
    graph_context: list[int]


def check_flags(cfg: WorkerConfig, tp: int) -> None:
    """Phase 0: flags that contradict each other, before anything is loaded."""
    if tp > 1 and not cfg.rendezvous:
        raise Refused("no_rendezvous", tensor_parallel_size=tp)
    # the kernels' tile arithmetic needs it
    if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
        raise Refused("bad_block_size", block_size=cfg.block_size,
                      error="--block-size must be a power of two")


def start_device(cfg: WorkerConfig):
    """Phase 1: this rank's device and the dtype it computes in (bf16 on CUDA, fp32 on a CPU, or --dtype)."""
    import torch

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0 and (cfg.device or "cuda").startswith("cuda") and nvidia_gpu_present():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"this torch (CUDA {torch.version.cuda}) cannot use it: check the driver")
        raise Refused("gpu_unusable", f"this host has an NVIDIA GPU and {why} (torch {torch.__version__}). "
                      "Install a CUDA build of torch, or pass --device cpu to serve on the CPU.",
                      torch=torch.__version__, reason=why)
    try:
        device = torch.device(rank_device(cfg.device, cfg.local_rank, cuda_count))
    except ValueError as e:
        raise Refused("bad_device", str(e), device=cfg.device, error=str(e)) from None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    default = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, DTYPES[cfg.dtype] if cfg.dtype else default)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return device, dtype


def read_config(cfg: WorkerConfig, tp: int):
    """The model's config, refused where it cannot be served right or split over tp ranks."""
    from worker.model.families import UnsupportedModel
    from worker.model.parallel import ParallelConfigError, make_shard
    from worker.weights.loader import load_config

    try:
        config = load_config(cfg.model, cfg.load_format)
        make_shard(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size,
                   cfg.rank, tp, config.moe_intermediate_size)
    except UnsupportedModel as e:  # served wrong without a word otherwise: refused, naming the field
        raise Refused("unsupported_model", f"this model cannot be served right: {e}", field=e.field_name,
                      value=repr(e.value), error=str(e)) from None
    except ParallelConfigError as e:  # refuse before joining a group that could never run
        raise Refused("cannot_split_model", str(e), error=str(e)) from None
    if config.layer_windows:
        log.info("sliding_window_layers", windows=sorted(set(config.layer_windows)),
                 sliding=sum(1 for w in config.layer_windows if w), layers=config.num_layers)
    return config


def load(cfg: WorkerConfig, device, dtype, tp: int) -> Loaded:
    """Phase 2: the config, where the weights come from (a GGUF's blocks, bf16 rows, a checkpoint), what
    this machine cannot hold refused, the model loaded (joining the TP group), its matmuls and attention."""
    import torch

    from worker.model.attention import make_backend
    from worker.model.parallel import init_group
    from worker.weights.loader import load_model

    config = read_config(cfg, tp)
    source = quantized_source(cfg, config, device, dtype)
    weights_dtype = dtype  # what the matrices are held in; the model computes in `dtype`
    if device.type == "cpu" and dtype != torch.float32:
        if source is None:
            source = half_weights(cfg, config, dtype)
        if source is not None:  # the blocks' kernels take fp32 activations: norms and activations in fp32
            dtype = torch.float32
    try:
        kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype, weights_dtype, device)
        lib = quantized_library(cfg) if source is not None else None
    except ValueError as e:
        raise Refused("bad_worker_option", str(e), error=str(e)) from None
    if device.type == "cpu" and cfg.load_format != "dummy":
        refusal = refuse_what_cannot_fit(cfg, config, dtype, kv_dtype, tp, source)
        if refusal:
            raise Refused("model_too_large", refusal, error=refusal)
    comm = init_group(cfg.rendezvous, cfg.rank, tp, device, cfg.collective_timeout, cfg.rendezvous_file)
    t0 = time.perf_counter()
    try:  # a tensor missing, or one the model has no place for, fails every start alike
        model, config = load_model(cfg.model, cfg.load_format, dtype, device, seed=cfg.seed,
                                   tp_rank=cfg.rank, tp_size=tp, comm=comm, quantized=source,
                                   pack=lib.pack if lib else None)
    except KeyError as e:
        reason = e.args[0] if e.args else str(e)
        raise Refused("checkpoint_refused", f"{cfg.model}: {reason}", error=reason) from None
    load_s = time.perf_counter() - t0
    try:
        types = block_types(model)  # before attach_matmuls hands the blocks to the model
        prefill = attach_matmuls(cfg, model, config, source, lib, device, dtype, kv_dtype, tp, load_s)
        if prefill == "bf16" and cfg.kv_cache_dtype == "auto":  # prompts computed in bf16: keys, values too
            kv_dtype = torch.bfloat16
            log.info("kv_cache_dtype", chosen="bfloat16", why="prompts multiply a bf16 copy (AMX): the pool "
                     "holds twice the tokens and prompt attention runs on tiles")
        heads = model.shard.num_kv_heads
        attn = make_backend(cfg.attention_backend, device, (model.shard.num_q_heads, heads, config.head_dim,
                            cfg.block_size, dtype, kv_dtype), getattr(model, "bf16_prefill", False))
        if getattr(attn, "prefill_bf16_dots", False):
            log.info("prefill_attention", arithmetic="bf16 dot products", why="bf16 prompt matmuls and pool",
                     units="AMX tiles" if attn.native.prefill_tiles() else "vector registers")
    except ValueError as e:
        raise Refused("bad_worker_option", str(e), error=str(e)) from None
    return Loaded(model, config, dtype, weights_dtype, kv_dtype, attn, heads, prefill,
                  weights_of(lib, types, prefill))


def attach_matmuls(cfg: WorkerConfig, model, config, source, lib, device, dtype, kv_dtype, tp: int,
                   load_s: float) -> str:
    """The model's matmul libraries: the dense one chosen by timing, the quantized one over a GGUF's blocks
    with prefill's path (a dense copy or not) and the rows its kernel takes; the fused decode step and the
    native head on a CPU. Returns prefill's path ("" without a file's blocks). ValueError: flags that
    conflict."""
    import torch

    from worker.model.linear import choose as choose_matmul
    from worker.model.quantized import PACKED_TYPES
    from worker.serve.start_cache import start_cache

    t0 = time.perf_counter()
    # 8-bit activations meet packed blocks only: a file of bf16 / fp16 rows keeps the choices below
    int8_packed = source is not None and lib.packing and lib.int8_activations and bool(
        block_types(model) & PACKED_TYPES.keys())
    prefill = prefill_path(cfg, model, config, source, lib, kv_dtype, int8_packed)
    # dequantized tiles meet F.linear: no library to measure (that would allocate the fp32 copy avoided)
    no_dense_copy = source is not None and prefill == "dequantize"
    int8_packed = int8_packed or (no_dense_copy and int8_without_copy(cfg, lib, block_types(model)))
    cache = start_cache(cfg, device, dtype, tp, prefill, activations_of(lib) if lib else "")
    measured = cache.get("matmul") if cfg.matmul == "auto" and not no_dense_copy else None
    dense = choose_matmul(measured or ("dense" if no_dense_copy else cfg.matmul), model.matmul_shapes(),
                          device, dtype)
    if cfg.matmul == "auto" and not no_dense_copy and measured is None:
        cache.put("matmul", dense.name)
    elif measured is not None:
        log.info("matmul_chosen", library=measured, measured="at an earlier start", kept=str(cache.path))
    fused = device.type == "cpu" and cfg.cpu_decode == "fused" and tp == 1 and dtype == torch.float32
    if source is None:  # the fused decode step reads plain fp32 rows: kept beside oneDNN's packed copies
        model.use_matmul(dense, drop_dense=not fused)
    else:
        from worker.model.quantized import choose_threshold, model_linears

        lib.dense = dense
        counts = model.use_quantized(model.file_blocks, lib, keep_dense=prefill in ("dense", "bf16"))
        hold_gemm_copy(cfg, model, config, kv_dtype, lib)  # bf16 weights where the CPU has AMX
        if int8_packed and no_dense_copy:
            # every step on the packed kernel: faster than dequantizing tiles at any row count (1B and 8B
            # measured), and one arithmetic for every batch, so an answer does not depend on its company
            lib.max_kernel_rows = 1 << 30
        elif (rows := cache.get(f"max_kernel_rows/{dense.name}")) is not None:
            lib.max_kernel_rows = rows  # measured at an earlier start: the same machine, build and model
            log.info("quantized_matmul_threshold", max_kernel_rows=rows, measured="at an earlier start")
        else:
            cache.put(f"max_kernel_rows/{dense.name}", choose_threshold(lib, model_linears(model)))
        log.info("quantized_weights", source=source.description, matrices=counts,
                 prefill=prefill, activations=activations_of(lib), max_kernel_rows=lib.max_kernel_rows,
                 read_s=round(load_s, 1), ready_s=round(load_s + time.perf_counter() - t0, 1))
    if fused:
        activations = activations_of(lib) if source is not None else cfg.quantized_activations
        use_fused_decode(model, tp, activations)
    if device.type == "cpu" and tp == 1 and dtype == torch.float32:
        use_native_head(model)
    return prefill if source is not None else ""


def size_pool(cfg: WorkerConfig, loaded: Loaded, device, tp: int) -> PoolPlan:
    """Phase 3: the KV pool's blocks (by flag; on CUDA what the card holds after the largest step and the
    decode graphs, each measured), the most sequences a step runs, and whether decode runs as graphs."""
    import torch

    from worker.model.kv_pool import bytes_per_block
    from worker.serve.sizing import (
        GPU_MAX_NUM_SEQS,
        default_max_num_seqs,
        gpu_blocks,
        lora_reserve,
        measure_graph_bytes,
        profile_gpu_peak,
    )

    config, attn = loaded.config, loaded.attn
    per_block = bytes_per_block(config, cfg.block_size, loaded.kv_dtype, loaded.heads)
    # graphs capture the step as the triton backend runs it (its per-step metadata is built without a host
    # sync); the torch backend reads lengths back on the host, which a capture cannot hold
    use_graphs = device.type == "cuda" and not cfg.enforce_eager and tp == 1 and attn.name == "triton"
    if device.type == "cuda" and not cfg.enforce_eager and attn.name != "triton":
        log.info("decode_graphs_off",
                 reason=f"the {attn.name} attention backend syncs with the host each step")
    if device.type == "cuda" and not cfg.enforce_eager and tp > 1:
        # collectives inside a captured graph are not covered yet: TP groups decode eagerly
        log.info("decode_graphs_off", reason="tensor parallel")
    model_len = min(config.max_position_embeddings, cfg.max_model_len or config.max_position_embeddings)
    graph_context = sorted({min(model_len, cfg.graph_max_context), model_len})  # a long tier where longer
    # the most rows a step may hold before the pool is sized: what the sampler and the graphs are measured at
    rows_bound = min(cfg.max_num_seqs or GPU_MAX_NUM_SEQS[1], cfg.max_num_batched_tokens)
    lora = lora_reserve(cfg, loaded.config, loaded.model.shard, loaded.dtype)  # LoRA: from the pool's budget
    try:
        if cfg.num_blocks:
            num_blocks = cfg.num_blocks
        elif cfg.kv_cache_memory:
            num_blocks = (parse_bytes(cfg.kv_cache_memory) - lora) // per_block
        elif device.type == "cuda":
            non_kv = profile_gpu_peak(loaded.model, attn, device, loaded.kv_dtype, cfg.block_size,
                                      cfg.max_num_batched_tokens, rows_bound)
            graph_bytes = measure_graph_bytes(loaded.model, attn, device, loaded.kv_dtype, cfg.block_size,
                                              rows_bound, graph_context) if use_graphs else 0
            non_kv += graph_bytes + lora
            num_blocks = gpu_blocks(device, cfg.gpu_memory_utilization, non_kv, per_block)
            log.info("gpu_memory_budget", non_kv_bytes=non_kv, graph_bytes=graph_bytes, lora_bytes=lora,
                     bytes_per_block=per_block, num_blocks=num_blocks, utilization=cfg.gpu_memory_utilization)
        else:
            num_blocks = (cpu_default_kv_bytes(tp) - lora) // per_block
    except torch.cuda.OutOfMemoryError as e:
        raise Refused("profile_out_of_memory", "out of GPU memory while measuring the largest step: lower "
                      "--max-num-batched-tokens or --max-num-seqs, or raise --gpu-memory-utilization "
                      f"({e})", error=str(e)) from None
    if num_blocks < 1:
        beside = f" beside {lora} bytes of LoRA adapters (--max-cpu-loras x --max-lora-rank)" if lora else ""
        raise Refused("kv_budget_too_small", f"the KV budget holds no block of {per_block} bytes{beside}: "
                      "give --kv-cache-memory (or --num-blocks, --gpu-memory-utilization) more",
                      kv_cache_memory=cfg.kv_cache_memory,
                      gpu_memory_utilization=cfg.gpu_memory_utilization, bytes_per_block=per_block)
    max_num_seqs = cfg.max_num_seqs or default_max_num_seqs(
        device.type, num_blocks, cfg.block_size, cfg.max_num_batched_tokens)
    return PoolPlan(num_blocks, cfg.block_size, per_block, max_num_seqs, use_graphs, graph_context)


def build_runner(loaded: Loaded, plan: PoolPlan, device, cfg: WorkerConfig | None = None):
    """Phase 4: the pool allocated, the runner warmed (kernels compiled, libraries warmed before the first
    request, not during it), decode graphs captured. -> (runner, seconds the warm-up took)."""
    from worker.model.kv_pool import KVPool
    from worker.serve.memory_plan import available_bytes, resident_bytes
    from worker.serve.sizing import lora_cache
    from worker.step.runner import ModelRunner, warm_up
    from worker.step.staging import is_device_fatal

    if device.type == "cpu":
        from worker.serve.host_memory import huge_pages, release_free_memory, weight_tensors

        release_free_memory()
    model_resident, _ = resident_bytes()  # weights (and their copies), libraries: everything but the pool
    pool = KVPool(loaded.config, plan.num_blocks, plan.block_size, loaded.kv_dtype, device, loaded.heads)
    # what this worker will hold: the model as loaded, and the pool (paged in as used)
    if device.type == "cpu":
        rss, peak = resident_bytes()
        pool_bytes = plan.num_blocks * plan.bytes_per_block
        log.info("host_memory", model_resident_bytes=model_resident, kv_pool_bytes=pool_bytes,
                 planned_bytes=model_resident + pool_bytes, peak_resident_bytes=peak, resident_bytes=rss,
                 available_bytes=available_bytes())
        # the weights only: a pool advised too faults its pages in 2 MiB at a time, compacting memory as
        # prompts arrive (a served 16-stream run lost a quarter of its rate)
        t0 = time.perf_counter()
        advised = huge_pages(weight_tensors(loaded.model), collapse=True)
        log.info("huge_pages", weights_bytes=advised, seconds=round(time.perf_counter() - t0, 2))
    runner = ModelRunner(loaded.model, pool, loaded.attn, device)
    if cfg is not None and cfg.max_cpu_loras:
        runner.adapters = lora_cache(cfg, loaded.config, loaded.model.shard, loaded.dtype, device)
    if cfg is not None and (cfg.kv_offload_size or cfg.kv_offload_dir):
        runner.tiers = tier_store(cfg, loaded, pool)
    warm_s = warm_up(runner)
    if plan.use_graphs:
        from worker.step.graphs import DecodeGraphs

        try:
            runner.graphs = DecodeGraphs(loaded.model, pool, loaded.attn, device, max_rows=plan.max_num_seqs,
                                         max_context=plan.graph_context)
            runner.graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - the budget or the model is wrong: say so and stop
            # fatal: the pool was sized with the graphs' memory set aside, so serving without them would
            # hide a wrong budget
            if is_device_fatal(e):
                raise
            raise Refused("decode_graphs_failed",
                          f"capturing the decode graphs failed ({e!r}); lower --gpu-memory-utilization or "
                          "--max-num-seqs, or pass --enforce-eager to decode without graphs",
                          error=repr(e), max_num_seqs=plan.max_num_seqs) from None
    return runner, warm_s


def handshake_for(cfg: WorkerConfig, loaded: Loaded, plan: PoolPlan, device, tp: int):
    """Phase 5: what this rank tells the scheduler it is (the scheduler checks it against the group's)."""
    from protos import wire_pb2

    config = loaded.config
    return wire_pb2.Handshake(
        tp_rank=cfg.rank,
        tp_size=tp,
        replica=cfg.replica,
        rendezvous=cfg.rendezvous,
        num_blocks=plan.num_blocks,
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=plan.max_num_seqs,
        kv_window=config.max_window,
        model_fingerprint=fingerprint(cfg, loaded),
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        bytes_per_block=plan.bytes_per_block,
        num_kv_heads=loaded.heads,
        device=str(device),
        dtype=str(loaded.weights_dtype).removeprefix("torch."),
        kv_cache_dtype=str(loaded.kv_dtype).removeprefix("torch."),
        attention_backend=loaded.attn.name,
        weights=loaded.weights,
        lora_slots=cfg.max_cpu_loras or 0,
        max_lora_rank=cfg.max_lora_rank,
        pid=os.getpid(),
    )
