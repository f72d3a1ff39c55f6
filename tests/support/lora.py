"""Random LoRA adapters saved by PEFT itself, and PEFT's own greedy decode as the reference."""

from __future__ import annotations

import json
from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    out: Path,
    r: int,
    targets: list[str],
    alpha: float,
    seed: int,
    std: float = 0.15,
    **config,
) -> Path:
    """A PEFT LoRA adapter of the model in `base` with random A and B (PEFT starts B at zero, which
    would change nothing), saved as PEFT saves it.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **config)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(out))
    return Path(out)


def edit_config(folder: Path, **changes) -> Path:
    path = Path(folder) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return Path(folder)


_MODELS: dict = {}


def peft_model(base: Path, adapter: Path | None):
    """The base model with the adapter applied by PEFT (None: the base alone), loaded once."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(base), str(adapter))
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
        _MODELS[key] = PeftModel.from_pretrained(model, str(adapter)).eval() if adapter else model
    return _MODELS[key]


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """PEFT's own greedy decode of one request alone (its model's forward and KV cache), eos
    ignored.
    """
    import torch

    model = peft_model(base, adapter)
    out: list[int] = []
    with torch.no_grad():
        res = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(
                input_ids=torch.tensor([[token]]),
                past_key_values=res.past_key_values,
                use_cache=True,
            )
    return out
