"""Tiny random Llama models and a tiny tokenizer, made in the test (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

CORPUS = (
    "the quick brown fox jumps over the lazy dog. paged attention stores keys and values in blocks. "
    "a scheduler batches requests continuously; each step admits waiting requests while blocks allow. "
    "What is the capital of France? Paris is the capital of France. 0123456789 +-*/=()[]{}<>!?,.;:'\" "
) * 4


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random LlamaForCausalLM (safetensors) with a tokenizer into folder; returns folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        # Large weights give peaked logits, so greedy choices are far from ties and batch-order
        # rounding cannot flip them.
        initializer_range=0.25,
    )
    params.update(overrides)
    config = LlamaConfig(**params)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    make_tokenizer(folder, config.vocab_size)
    return folder


def hf_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own solo greedy decode (its KV cache, one request alone), eos ignored: the reference
    every batched output must equal token for token."""
    import torch

    model = _load_cached(str(folder))
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True)
    return out


_MODELS: dict = {}


def _load_cached(folder: str):
    from transformers import AutoModelForCausalLM

    if folder not in _MODELS:
        _MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder).eval()
    return _MODELS[folder]
