"""Weight loading: a Hugging Face folder (safetensors), a GGUF file (dequantized through transformers),
or random weights at the real shapes ("dummy"); each rank of a tensor-parallel group loads its shard."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.checkpoint import DictSource, SafetensorsSource
from worker.model import LlamaModel
from worker.model_config import ModelConfig
from worker.parallel import Collectives, make_shard


def load_config(source: str, load_format: str) -> ModelConfig:
    path = Path(source)
    if load_format == "gguf" or path.suffix == ".gguf":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return ModelConfig.from_dict(cfg.to_dict())
    return ModelConfig.from_folder(path)


def read_gguf(path: Path) -> DictSource:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return DictSource(dict(model.state_dict()))


def load_model(
    source: str, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
    tp_rank: int = 0, tp_size: int = 1, comm: Collectives | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """load_format: 'auto' (folder → safetensors, *.gguf → gguf), 'safetensors', 'gguf' or 'dummy'.
    With tp_size > 1 the model holds rank tp_rank's shard (ParallelConfigError if it cannot split)."""
    path = Path(source)
    if load_format == "auto":
        load_format = "gguf" if path.suffix == ".gguf" else "safetensors"
    config = load_config(source, load_format)
    shard = make_shard(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size,
                       tp_rank, tp_size, config.moe_intermediate_size)
    if load_format not in ("dummy", "safetensors", "gguf"):
        raise ValueError(f"unknown load format {load_format!r}")
    # The parameters are allocated where they will run, in their dtype, and filled there: no fp32 copy of
    # the model on the host first (32 GB and minutes for an 8B model). Every parameter is written below.
    with torch.device("meta"):
        model = LlamaModel(config, shard, comm).to(dtype)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        model.init_random(seed)
    elif load_format == "safetensors":
        model.load_hf_weights(SafetensorsSource(path))
    else:
        model.load_hf_weights(read_gguf(path))
    return model.eval(), config
