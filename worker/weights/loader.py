"""Weight loading: safetensors, GGUF (mapped here or through transformers), a folder prepared from a
GGUF, or random weights ("dummy"); each TP rank loads its shard, and matrices served as blocks are
never allocated in full precision.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog
import torch

from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.model.parallel import Collectives, make_shard
from worker.weights.checkpoint import (
    BareDecoderSource,
    DictSource,
    LanguageModelSource,
    SafetensorsSource,
    TensorSource,
)
from worker.weights.fill import copy_checkpoint
from worker.weights.gguf_plan import read_quantized
from worker.weights.layouts import (
    BackboneSource,
    GroupedDeltaNetSource,
    ScaledSource,
    SplitDeltaNetSource,
)

log = structlog.get_logger("worker.weights")


def load_config(source: str, load_format: str) -> ModelConfig:
    """A GGUF's or a folder's config, with the GGUF's rope_freqs where it carries them."""
    from worker.weights.gguf_blocks import find_gguf

    path = Path(source)
    if load_format == "gguf" or path.suffix == ".gguf":
        from worker.weights.gguf_header import HEADER_CONFIGS, GGUFHeader

        header = GGUFHeader(path)
        if header.arch in HEADER_CONFIGS:  # transformers cannot read these files' configs
            config = ModelConfig.from_dict(HEADER_CONFIGS[header.arch](header))
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            config = ModelConfig.from_dict(cfg.to_dict())
        gguf = path
    else:
        config = ModelConfig.from_folder(path)
        gguf = None if load_format == "dummy" else find_gguf(path)
        if (
            not config.tie_word_embeddings
            and (path / "modules.json").exists()
            and gguf is None
            and any(path.glob("*.safetensors"))
            and "lm_head.weight" not in SafetensorsSource(path).names()
        ):
            # a head-less embedding model: the token table stands in the head's place, never read
            config = dataclasses.replace(config, tie_word_embeddings=True)
    return with_rope_freqs(config, gguf) if gguf is not None else config


def with_rope_freqs(config: ModelConfig, gguf: Path) -> ModelConfig:
    """config with the GGUF's rope_freqs factors, which llama.cpp writes
    as a tensor, not metadata.
    """
    from worker.weights.gguf import GGUFFile
    from worker.weights.gguf_header import ROPE_FREQS

    file = GGUFFile(gguf)
    if ROPE_FREQS not in file.tensors:
        return config
    factors = tuple(float(f) for f in file.dequantize(ROPE_FREQS).flatten().tolist())
    return dataclasses.replace(config, rope_freq_factors=factors)


def read_gguf(path: Path, config: ModelConfig) -> TensorSource:
    from worker.weights.gguf import GGUFTensorSource
    from worker.weights.gguf_header import reads_natively

    if reads_natively(path):
        source = GGUFTensorSource(path, config.num_heads, config.num_kv_heads, config.head_dim)
        return GroupedDeltaNetSource.wrap(source, config)  # Qwen3-Next's b and a, by key head
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return DictSource(dict(model.state_dict()))


def block_kinds_of(config: ModelConfig) -> tuple[str, ...]:
    """Nemotron-H's layer kinds as its config gave them; () for the other families."""
    if not config.ffn_only_layers:
        return ()
    return tuple(
        ("moe" if config.is_moe(i) else "mlp")
        if config.ffn_only(i)
        else ("mamba" if config.is_mamba(i) else "attention")
        for i in range(config.num_layers)
    )


def checkpoint(path: Path, config: ModelConfig) -> TensorSource:
    """A folder's safetensors, or the GGUF it was prepared from."""
    from worker.weights.gguf_blocks import find_gguf

    gguf = None if any(path.glob("*.safetensors")) else find_gguf(path)
    if gguf is not None:
        return read_gguf(gguf, config)
    source = LanguageModelSource.wrap(BareDecoderSource.wrap(SafetensorsSource(path)))
    if isinstance(source, LanguageModelSource) and source.skipped:
        log.info("text_only", skipped_tensors=source.skipped, why="vision, audio, MTP")
    kinds = block_kinds_of(config)
    source = SplitDeltaNetSource.wrap(GroupedDeltaNetSource.wrap(source, config), config)
    source = BackboneSource.wrap(source, kinds)
    return ScaledSource.wrap(source, config.weight_scales)


def tensor_source(source: str, load_format: str, config: ModelConfig) -> TensorSource | None:
    """The checkpoint a model loads from (None for random "dummy" weights)."""
    path = Path(source)
    if load_format == "auto":
        load_format = "gguf" if path.suffix == ".gguf" else "safetensors"
    if load_format == "dummy":
        return None
    if load_format == "safetensors":
        return checkpoint(path, config)
    if load_format == "gguf":
        return read_gguf(path, config)
    raise ValueError(f"unknown load format {load_format!r}")


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Module.to_empty without its sympy import (a second of every start); shared tensors stay
    shared.
    """
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            is_param = isinstance(t, torch.nn.Parameter)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if is_param else new
        return made[id(t)]

    for module in model.modules():
        for name, t in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            setattr(module, name, empty(t))


def load_model(
    source: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    comm: Collectives | None = None,
    quantized=None,
    pack=None,
) -> tuple[LlamaModel, ModelConfig]:
    """load_format auto/safetensors/gguf/dummy; this rank's shard; block sources packed as read."""
    config = load_config(source, load_format)
    shard = make_shard(
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
        config.vocab_size,
        tp_rank,
        tp_size,
        config.moe_intermediate_size,
        (config.linear_k_heads, config.linear_v_heads),
    )
    weights = getattr(quantized, "checkpoint", None) or tensor_source(source, load_format, config)
    # Parameters are allocated and filled where they run, in their dtype: no host fp32 copy first.
    with torch.device("meta"):
        model = LlamaModel(config, shard, comm).to(dtype)
    model.file_blocks = (
        read_quantized(model, quantized, True, pack) if quantized is not None else {}
    )
    model.release(model.file_blocks)
    materialize(model, device)
    if weights is None:
        model.init_random(seed)
    else:
        copy_checkpoint(model, weights)
    return model.eval(), config
