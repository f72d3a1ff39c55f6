"""The choices a worker's start makes from its flags and the machine: device, KV dtype and budget,
whether the model fits, where weights come from, the quantized library, native head and fused step.
"""

from __future__ import annotations

import structlog

from worker.serve.config import WorkerConfig

CPU_KV_CACHE_MEMORY = "2GiB"  # the whole pool's on a CPU: its tensor-parallel ranks share it


# the default CPU pool, chosen once a process (before the weights load, where their bytes are
# known) and read by every later phase
_DEFAULT_POOL: dict[tuple, int] = {}


def cpu_default_kv_bytes(tp: int, one_request: int = 0, room: int | None = None) -> int:
    """One rank's share of the default pool: 2 GiB over the ranks, so it holds as many tokens at
    any --tp; where one request of the full context needs more than half of that (a 128k-token
    model), that request and half the default beside it, if `room` (memory left for the pool)
    holds them.
    """
    from protos.base.argtypes import parse_bytes

    base = parse_bytes(CPU_KV_CACHE_MEMORY) // max(tp, 1)
    if one_request <= base // 2:
        return base
    grown = one_request + base // 2
    return grown if room is not None and grown <= room else base


def one_request_bytes(cfg: WorkerConfig, config, kv_dtype) -> int:
    """One rank's pool bytes for one request of the context the scheduler checks the pool
    against: --max-model-len, else the model's; a window and a step's tokens where every layer
    slides.
    """
    from worker.model.kv_pool import bytes_per_block

    length = config.max_position_embeddings
    tokens = min(length, cfg.max_model_len or length)
    if config.max_window:
        tokens = min(tokens, config.max_window + cfg.max_num_batched_tokens + 2 * cfg.block_size)
    per_block = bytes_per_block(config, cfg.block_size, kv_dtype, cfg.tensor_parallel_size)
    return -(-tokens // cfg.block_size) * per_block


log = structlog.get_logger("worker.serve.main")


# decode rows the native rows kernel takes on fp32 weights; the fused step takes more via sgemm
FUSED_DENSE_ROWS = 8


DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


KV_CACHE_DTYPES = {"auto": None, **DTYPES}


def rank_device(device: str | None, local_rank: int, cuda_count: int) -> str:
    """cuda:N gives ranks N + local_rank; None picks cuda where present, else cpu."""
    if device is None:
        device = "cuda" if cuda_count else "cpu"
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    if cuda_count == 0:
        raise ValueError(f"--device {device} asks for a GPU and this host has none")
    if index and not index.isdigit():
        raise ValueError(f"--device {device}: expected cuda or cuda:N")
    first = int(index) if index else 0
    if not 0 <= first < cuda_count:
        raise ValueError(f"--device {device}: this host has GPUs 0-{cuda_count - 1}")
    return f"cuda:{(first + local_rank) % cuda_count}"


def kv_cache_dtype(choice: str, compute, weights, device):
    """--kv-cache-dtype resolved (auto: bf16 for bf16, else compute); ValueError if unusable."""
    import torch

    if choice == "auto":
        return torch.bfloat16 if weights == torch.bfloat16 else compute
    chosen = getattr(torch, KV_CACHE_DTYPES[choice])
    if chosen.itemsize > compute.itemsize:
        raise ValueError(
            f"--kv-cache-dtype {choice}: the model computes in "
            f"{str(compute).removeprefix('torch.')}, so a wider KV pool would hold nothing "
            "more; use auto or bf16"
        )
    if device.type == "cpu" and chosen not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"--kv-cache-dtype {choice}: a CPU worker's attention reads a float32 or bfloat16 pool"
        )
    return chosen


def kv_budget_bytes(cfg: WorkerConfig, config, dtype, weights: int = 0) -> int:
    """The KV pool a CPU worker will take: --num-blocks, --kv-cache-memory, or the default budget
    (cpu_default_kv_bytes; weights: the bytes its first reader knows will load beside it).
    """
    from protos.base.argtypes import parse_bytes
    from worker.model.kv_pool import bytes_per_block
    from worker.serve.memory_plan import MARGIN, available_bytes

    if cfg.num_blocks:
        return cfg.num_blocks * bytes_per_block(
            config, cfg.block_size, dtype, cfg.tensor_parallel_size
        )
    if cfg.kv_cache_memory:
        return parse_bytes(cfg.kv_cache_memory)
    one = one_request_bytes(cfg, config, dtype)
    key = (cfg.model, cfg.tp, one)
    if key not in _DEFAULT_POOL:
        available = available_bytes()
        room = None if available is None else available - weights - MARGIN
        chosen = _DEFAULT_POOL[key] = cpu_default_kv_bytes(cfg.tp, one, room)
        if chosen > cpu_default_kv_bytes(cfg.tp):
            log.info("kv_pool_grown", bytes=chosen, one_full_context=one, why=GROWN)
    return _DEFAULT_POOL[key]


GROWN = (
    "the default pool holds one request of the model's full context and half the default "
    "beside it, as memory allows (--kv-cache-memory or --max-model-len choose otherwise)"
)


def refuse_what_cannot_fit(
    cfg: WorkerConfig, config, dtype, kv_dtype, tp: int, source=None
) -> str | None:
    """Before loading: weights and pool against memory available, or the refusal."""
    import torch

    from worker.model.layer_kinds import parameter_count
    from worker.serve.memory_plan import available_bytes, check_fits

    if source is not None:
        weights = source.held_bytes(config.tie_word_embeddings) // tp
        what = f"this model ({source.description}, {weights / 1e9:.2f} GB a rank) with its KV pool"
    else:
        params = parameter_count(config) // tp
        weights = params * torch.tensor([], dtype=dtype).element_size()
        what = (
            f"this model ({params / 1e9:.2f}B parameters a rank, loaded as {dtype}) with its "
            "KV pool"
        )
    kv = kv_budget_bytes(cfg, config, kv_dtype, weights)
    return check_fits(
        what,
        weights + kv,
        available_bytes(),
        "serve a smaller model, lower --kv-cache-memory, or split it over more ranks "
        "(--tensor-parallel-size)",
    )


def quantized_source(cfg: WorkerConfig, config, device, dtype):
    """The GGUF whose blocks this CPU worker serves, unless --dequantize; else None."""
    from worker.weights.gguf_blocks import GGUFQuantSource, find_gguf

    path = find_gguf(cfg.model)
    mxfp4 = path is None and mxfp4_folder(cfg.model)
    if (path is None and not mxfp4) or cfg.dequantize or cfg.load_format == "dummy":
        return None
    from kernels import cpu_native

    why = (
        "not on a CPU"
        if device.type != "cpu"
        else "no native CPU kernels"
        if cpu_native.load() is None
        else ""
    )
    if why:
        log.info("quantized_weights_off", gguf=str(path or cfg.model), reason=why)
        return None
    if mxfp4:
        from worker.weights.loader import tensor_source
        from worker.weights.mxfp4 import MXFP4Source

        return MXFP4Source(tensor_source(cfg.model, cfg.load_format, config), config)
    return GGUFQuantSource(path, config.num_heads, config.num_kv_heads, config.head_dim)


def mxfp4_folder(model: str) -> bool:
    """A Hugging Face folder whose experts ship as MXFP4 blocks (gpt-oss's checkpoints)."""
    import json
    from pathlib import Path

    from worker.weights.mxfp4 import is_mxfp4

    path = Path(model) / "config.json"
    return path.is_file() and is_mxfp4(json.loads(path.read_text()))


def half_weights(cfg: WorkerConfig, config, dtype):
    """--dtype bf16/fp16 on a CPU: matrices as half-width rows for the native kernels; None
    otherwise.
    """
    import torch

    from kernels import cpu_native
    from worker.weights.gguf_blocks import CastSource
    from worker.weights.loader import tensor_source

    if cpu_native.load() is None or cfg.load_format == "dummy":
        log.info(
            "half_weights_off",
            dtype=str(dtype),
            reason="no native CPU kernels" if cfg.load_format != "dummy" else "random weights",
        )
        return None
    qtype = "BF16" if dtype == torch.bfloat16 else "F16"
    return CastSource(tensor_source(cfg.model, cfg.load_format, config), config, qtype)


def quantized_library(cfg: WorkerConfig):
    """The matmul library over blocks or half rows, made before loading so weights pack as read."""
    from kernels import cpu_native
    from worker.model.quantized import QuantizedMatmul

    kernels = cpu_native.load()
    packed = kernels is not None and kernels.packed_fast
    activations = cfg.quantized_activations
    # auto: 16-bit where a dense prefill copy is kept (int8 changed the default model's answers)
    if activations == "auto":
        activations = "int16" if packed else "fp32"
    return QuantizedMatmul(
        kernels,
        None,
        int8_activations=activations == "int8",
        packing=activations == "int16" or (activations == "int8" and packed),
    )


def int8_without_copy(cfg, lib, types: set[str]) -> bool:
    """With no dense prefill copy, auto turns on int8 activations (1.4x, llama.cpp's precision)."""
    from worker.model.quant_weights import PACKED_TYPES

    if (
        cfg.quantized_activations != "auto"
        or not lib.packing
        or lib.int8_activations
        or not types & PACKED_TYPES.keys()
    ):
        return False
    lib.int8_activations = True
    log.info(
        "quantized_activations",
        chosen="int8",
        why="no dense copy for prefill: 8-bit activations multiply prompts at its speed",
    )
    return True


def prefill_path(cfg: WorkerConfig, model, config, source, lib, kv_dtype, int8_packed: bool) -> str:
    """--quantized-prefill resolved and logged; ValueError for bf16 where it cannot run."""
    from worker.model.linear import OneDNNBf16Matmul
    from worker.serve.memory_plan import available_bytes, choose_quantized_prefill, dense_copy_bytes

    prefill = cfg.quantized_prefill
    if (
        source is not None
        and getattr(source, "qtype_name", "") == "BF16"
        and prefill == "auto"
        and lib.bf16_gemm
    ):
        prefill = "dequantize"
        model.bf16_prefill = True  # prompt chunks multiply bf16 activations: attention may too
        log.info(
            "quantized_prefill",
            chosen="dequantize",
            why="the CPU's bf16 GEMM multiplies the weights as held",
        )
    elif source is not None and prefill == "auto" and int8_packed:
        prefill = "dequantize"  # no dense copy: many rows run on the packed kernel too
        log.info(
            "quantized_prefill",
            chosen="dequantize",
            why=(
                "the packed kernel with 8-bit activations multiplies many rows faster than "
                "an fp32 copy"
            ),
        )
    elif source is not None:
        prefill, why = choose_quantized_prefill(
            prefill,
            dense_copy_bytes(model.file_blocks),
            kv_budget_bytes(cfg, config, kv_dtype),
            available_bytes(),
            bf16=cfg.matmul == "auto" and OneDNNBf16Matmul.tiles(),
        )
        log.info("quantized_prefill", chosen=prefill, why=why)
    if prefill == "bf16":
        if source is None or not OneDNNBf16Matmul.available():
            raise ValueError(
                "--quantized-prefill bf16 needs a quantized file's blocks and a CPU that "
                "multiplies bf16 (AVX512_BF16 or AMX)"
            )
        lib.copies = OneDNNBf16Matmul()
        model.bf16_prefill = True  # prompt chunks multiply bf16 activations: attention may too
    return prefill


def activations_of(lib) -> str:
    """What a quantized library's kernels multiply the weights with:
    int8, int16 (packed) or fp32.
    """
    return "int8" if lib.int8_activations else "int16" if lib.packing else "fp32"


def block_types(model) -> set[str]:
    """The file's matrix types as loaded (packed ones by packed names)."""
    return {s.qtype for w in model.file_blocks.values() for s in w.segments}


def weights_of(lib, types: set[str], prefill: str = "") -> str:
    """How the matrices are held, in the ready line's words."""
    if lib is None or types <= {"BF16", "F16", "F32"}:
        return ""
    words = {
        "int8": "8-bit activations (llama.cpp's precision)",
        "int16": "16-bit activations",
        "fp32": "fp32 activations",
    }
    prompts = ", prompts on a bf16 copy" if prefill == "bf16" else ""
    return f"the file's blocks x {words[activations_of(lib)]}{prompts}"


def use_native_head(model) -> None:
    """A decode step's logits on the native rows kernel where the head is plain fp32."""
    from kernels import cpu_native
    from worker.model.fused_decode import NativeHead

    kernels = cpu_native.load()
    weight = NativeHead.weight_of(model) if kernels is not None else None
    if weight is not None:
        model.native_head = NativeHead(kernels, weight, FUSED_DENSE_ROWS)
        log.info("native_head", max_rows=FUSED_DENSE_ROWS)


def use_fused_decode(model, tp: int, activations: str) -> None:
    """Decode steps as one native call where the model allows, else the reason logged."""
    from kernels import cpu_native
    from worker.model.fused_decode import FusedDecode
    from worker.model.quantized import QuantizedMatmul

    kernels = cpu_native.load()
    why = (
        "the native CPU kernels are not built"
        if kernels is None
        else FusedDecode.unsupported(model, tp)
    )
    if why is None and activations == "int8" and not getattr(model.mm, "packing", False):
        why = (
            "int8 activations on the file's layout (the fused step multiplies 8-bit ones on packed "
            "weights only)"
        )
    if why is not None:
        log.info("fused_decode_off", reason=why)
        return
    max_rows = (
        model.mm.max_kernel_rows if isinstance(model.mm, QuantizedMatmul) else FUSED_DENSE_ROWS
    )
    model.fused = FusedDecode(kernels, model, max_rows)
    log.info(
        "fused_decode",
        max_kernel_rows=max_rows,
        more_rows="sgemm" if model.fused.sgemm else "layer path",
    )


def hold_gemm_copy(cfg: WorkerConfig, model, config, kv_dtype, lib) -> None:
    """A blocked bf16 copy for wide steps where the CPU multiplies bf16 (AVX512_BF16, AMX) and
    memory holds it.
    """
    from worker.model.quantized import every_linear
    from worker.serve.memory_plan import available_bytes, choose_gemm_copy

    linears = every_linear(model)
    copy = lib.gemm_copy_bytes(linears)
    if not (copy and lib.bf16_gemm):
        return
    hold, why = choose_gemm_copy(copy, kv_budget_bytes(cfg, config, kv_dtype), available_bytes())
    held = lib.hold_gemm(linears) if hold else 0
    log.info("bf16_gemm_layout", blocked_copies=held, bytes=copy if held else 0, why=why)
