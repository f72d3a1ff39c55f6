"""The worker's start-up in phases (flags, device, model, pool, runner, handshake), each refusing
what cannot work with `Refused`, which serve/main.py turns into exit 2.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import structlog

from worker.serve.choices import (
    DTYPES,
    activations_of,
    block_types,
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
    # how prompt chunks multiply a file's blocks, as chosen ("": no blocks)
    quantized_prefill: str = ""
    # how the matrices are held and multiplied, for the ready line (choices.weights_of)
    weights: str = ""


def check_flags(cfg: WorkerConfig, tp: int) -> None:
    """Phase 0: flags that contradict each other, before anything is loaded."""
    if tp > 1 and not cfg.rendezvous:
        raise Refused("no_rendezvous", tensor_parallel_size=tp)
    # the kernels' tile arithmetic needs it
    if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
        raise Refused(
            "bad_block_size", block_size=cfg.block_size, error="--block-size must be a power of two"
        )


def start_device(cfg: WorkerConfig):
    """Phase 1: device and compute dtype (bf16 on CUDA, fp32 on a CPU, or --dtype)."""
    import torch

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0 and (cfg.device or "cuda").startswith("cuda") and nvidia_gpu_present():
        why = (
            "this torch is a CPU-only build"
            if torch.version.cuda is None
            else f"this torch (CUDA {torch.version.cuda}) cannot use it: check the driver"
        )
        raise Refused(
            "gpu_unusable",
            f"this host has an NVIDIA GPU and {why} (torch {torch.__version__}). "
            "Install a CUDA build of torch, or pass --device cpu to serve on the CPU.",
            torch=torch.__version__,
            reason=why,
        )
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
        make_shard(
            config.num_heads,
            config.num_kv_heads,
            config.intermediate_size,
            config.vocab_size,
            cfg.rank,
            tp,
            config.moe_intermediate_size,
            (config.linear_k_heads, config.linear_v_heads),
        )
        if any(config.mamba_layers) and (config.mamba_heads % tp or config.mamba_groups % tp):
            raise ParallelConfigError(
                f"its Mamba2 mixers' {config.mamba_heads} heads in {config.mamba_groups} groups "
                f"cannot be split over {tp} ranks: serve it with a --tp that divides both"
            )
        if config.global_kv_heads:  # Gemma 4's full layers split their own KV heads
            n = config.global_kv_heads
            if (n >= tp and n % tp) or (n < tp and tp % n):
                raise ParallelConfigError(
                    f"tensor-parallel size {tp} cannot split or replicate evenly the "
                    f"{n} KV heads of the model's full-attention layers"
                )
        if config.linear_tiled_values and tp > 1:
            raise ParallelConfigError(
                "a qwen35 GGUF keeps each key head's value heads apart (llama.cpp's tiled order), "
                "so tensor parallelism cannot split them: serve it with --tp 1, or its Hugging "
                "Face folder"
            )
    # served wrong without a word otherwise: refused, naming the field
    except UnsupportedModel as e:
        raise Refused(
            "unsupported_model",
            f"this model cannot be served right: {e}",
            field=e.field_name,
            value=repr(e.value),
            error=str(e),
        ) from None
    except ParallelConfigError as e:  # refuse before joining a group that could never run
        raise Refused("cannot_split_model", str(e), error=str(e)) from None
    if config.layer_windows:
        log.info(
            "sliding_window_layers",
            windows=sorted(set(config.layer_windows)),
            sliding=sum(1 for w in config.layer_windows if w),
            layers=config.num_layers,
        )
    if config.kv_sources:
        log_kv_sharing(config, tp)
    return config


def log_kv_sharing(config, tp: int) -> None:
    """Gemma 4's last layers read earlier layers' K/V and hold none: what the pool saves."""
    from dataclasses import replace

    import torch

    from worker.model.kv_pool import bytes_per_block

    held = bytes_per_block(config, 1, torch.bfloat16, tp)
    unshared = bytes_per_block(replace(config, kv_sources=()), 1, torch.bfloat16, tp)
    log.info(
        "kv_shared_layers",
        reading_earlier=sum(s != i for i, s in enumerate(config.kv_sources)),
        layers=config.num_layers,
        bf16_bytes_per_token=held,
        saved_per_token=unshared - held,
        saved_fraction=round(1 - held / unshared, 3),
    )


def load(cfg: WorkerConfig, device, dtype, tp: int) -> Loaded:
    """Phase 2: config, weights, what cannot fit refused, model loaded with its matmuls and
    attention.
    """
    import torch

    from worker.model.attention_native import make_backend
    from worker.model.parallel import init_group
    from worker.weights.loader import load_model

    config = read_config(cfg, tp)
    source = quantized_source(cfg, config, device, dtype)
    weights_dtype = dtype  # what the matrices are held in; the model computes in `dtype`
    if device.type == "cpu" and dtype != torch.float32:
        if source is None:
            source = half_weights(cfg, config, dtype)
        # the blocks' kernels take fp32 activations: norms and activations in fp32
        if source is not None:
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
    comm = init_group(
        cfg.rendezvous, cfg.rank, tp, device, cfg.collective_timeout, cfg.rendezvous_file
    )
    t0 = time.perf_counter()
    try:  # a tensor missing, or one the model has no place for, fails every start alike
        model, config = load_model(
            cfg.model,
            cfg.load_format,
            dtype,
            device,
            seed=cfg.seed,
            tp_rank=cfg.rank,
            tp_size=tp,
            comm=comm,
            quantized=source,
            pack=lib.pack if lib else None,
        )
    except KeyError as e:
        reason = e.args[0] if e.args else str(e)
        raise Refused("checkpoint_refused", f"{cfg.model}: {reason}", error=reason) from None
    load_s = time.perf_counter() - t0
    try:
        types = block_types(model)  # before attach_matmuls hands the blocks to the model
        prefill = attach_matmuls(
            cfg, model, config, source, lib, device, dtype, kv_dtype, tp, load_s
        )
        # prompts computed in bf16: keys, values too
        if prefill == "bf16" and cfg.kv_cache_dtype == "auto":
            kv_dtype = torch.bfloat16
            log.info(
                "kv_cache_dtype",
                chosen="bfloat16",
                why="prompts multiply a bf16 copy (AMX): the pool "
                "holds twice the tokens and prompt attention runs on tiles",
            )
        heads = model.shard.num_kv_heads
        # one shape a layer kind (Gemma 4's full layers have their own head size and KV heads)
        kinds = {config.kv_shape(i, tp) for i in range(config.num_layers)} - {None}
        attn = make_backend(
            cfg.attention_backend,
            device,
            [(model.shard.num_q_heads, h, d, cfg.block_size, dtype, kv_dtype) for h, d in kinds],
            getattr(model, "bf16_prefill", False),
        )
        if getattr(attn, "prefill_bf16_dots", False):
            log.info(
                "prefill_attention",
                arithmetic="bf16 dot products",
                why="bf16 prompt matmuls and pool",
                units="AMX tiles" if attn.native.prefill_tiles() else "vector registers",
            )
    except ValueError as e:
        raise Refused("bad_worker_option", str(e), error=str(e)) from None
    return Loaded(
        model,
        config,
        dtype,
        weights_dtype,
        kv_dtype,
        attn,
        heads,
        prefill,
        weights_of(lib, types, prefill),
    )


def attach_matmuls(
    cfg: WorkerConfig, model, config, source, lib, device, dtype, kv_dtype, tp: int, load_s: float
) -> str:
    """Matmul libraries, fused step and native head -> prefill's path; ValueError on conflicting
    flags.
    """
    import torch

    from worker.model.linear import choose as choose_matmul
    from worker.model.quant_weights import PACKED_TYPES
    from worker.serve.start_cache import start_cache

    t0 = time.perf_counter()
    # 8-bit activations meet packed blocks only: a file of bf16 / fp16 rows keeps the choices below
    int8_packed = (
        source is not None
        and lib.packing
        and lib.int8_activations
        and bool(block_types(model) & PACKED_TYPES.keys())
    )
    prefill = prefill_path(cfg, model, config, source, lib, kv_dtype, int8_packed)
    # dequantized tiles meet F.linear: nothing to measure without the fp32 copy avoided
    no_dense_copy = source is not None and prefill == "dequantize"
    int8_packed = int8_packed or (no_dense_copy and int8_without_copy(cfg, lib, block_types(model)))
    cache = start_cache(cfg, device, dtype, tp, prefill, activations_of(lib) if lib else "")
    measured = cache.get("matmul") if cfg.matmul == "auto" and not no_dense_copy else None
    dense = choose_matmul(
        measured or ("dense" if no_dense_copy else cfg.matmul), model.matmul_shapes(), device, dtype
    )
    if cfg.matmul == "auto" and not no_dense_copy and measured is None:
        cache.put("matmul", dense.name)
    elif measured is not None:
        log.info(
            "matmul_chosen", library=measured, measured="at an earlier start", kept=str(cache.path)
        )
    fused = (
        device.type == "cpu" and cfg.cpu_decode == "fused" and tp == 1 and dtype == torch.float32
    )
    # the fused decode step reads plain fp32 rows: kept beside oneDNN's packed copies
    if source is None:
        model.use_matmul(dense, drop_dense=not fused)
    else:
        from worker.model.quantized import choose_threshold, model_linears

        lib.dense = dense
        counts = model.use_quantized(
            model.file_blocks, lib, keep_dense=prefill in ("dense", "bf16")
        )
        hold_gemm_copy(cfg, model, config, kv_dtype, lib)  # bf16 weights where the CPU has bf16
        if int8_packed and no_dense_copy:
            # every step on the packed kernel: faster at any row count, and an answer never depends
            # on its company
            lib.max_kernel_rows = 1 << 30
        elif (rows := cache.get(f"max_kernel_rows/{dense.name}")) is not None:
            # measured at an earlier start: the same machine, build and model
            lib.max_kernel_rows = rows
            log.info(
                "quantized_matmul_threshold", max_kernel_rows=rows, measured="at an earlier start"
            )
        else:
            cache.put(f"max_kernel_rows/{dense.name}", choose_threshold(lib, model_linears(model)))
        log.info(
            "quantized_weights",
            source=source.description,
            matrices=counts,
            prefill=prefill,
            activations=activations_of(lib),
            max_kernel_rows=lib.max_kernel_rows,
            read_s=round(load_s, 1),
            ready_s=round(load_s + time.perf_counter() - t0, 1),
        )
    if fused:
        activations = activations_of(lib) if source is not None else cfg.quantized_activations
        use_fused_decode(model, tp, activations)
    if device.type == "cpu" and tp == 1 and dtype == torch.float32:
        use_native_head(model)
    return prefill if source is not None else ""
