"""Weight loading: a Hugging Face folder (safetensors), a GGUF file (dequantized through transformers),
or random weights at the real shapes ("dummy")."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model import LlamaModel
from worker.model_config import ModelConfig


def load_config(source: str, load_format: str) -> ModelConfig:
    path = Path(source)
    if load_format == "gguf" or path.suffix == ".gguf":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return ModelConfig.from_dict(cfg.to_dict())
    return ModelConfig.from_folder(path)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


def read_gguf(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return dict(model.state_dict())


def load_model(
    source: str, load_format: str, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[LlamaModel, ModelConfig]:
    """load_format: 'auto' (folder → safetensors, *.gguf → gguf), 'safetensors', 'gguf' or 'dummy'."""
    path = Path(source)
    if load_format == "auto":
        load_format = "gguf" if path.suffix == ".gguf" else "safetensors"
    config = load_config(source, load_format)
    with torch.device("cpu"):
        model = LlamaModel(config).to(dtype)
    if load_format == "dummy":
        model.init_random(seed)
    elif load_format == "safetensors":
        model.load_hf_weights(read_safetensors(path))
    elif load_format == "gguf":
        model.load_hf_weights(read_gguf(path))
    else:
        raise ValueError(f"unknown load format {load_format!r}")
    return model.to(device).eval(), config
