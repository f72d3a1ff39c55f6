"""Tiny random Llama models and a tiny tokenizer, made in the test (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: "
    "{{ message['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

CORPUS = (
    "the quick brown fox jumps over the lazy dog. paged attention stores keys and values in "
    "blocks. a scheduler batches requests continuously; each step admits waiting requests while "
    "blocks allow. What is the capital of France? Paris is the capital of France. 0123456789 "
    "+-*/=()[]{}<>!?,.;:'\" "
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


# Every tiny model's shape. Large weights give peaked logits, so greedy choices are far from ties
# and batch-order rounding cannot flip them.
TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
)


def make_tiny_llama(folder: Path, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """Save a random model of a transformers family (model_type: llama, mistral, qwen2, ...;
    safetensors) with a tokenizer into folder; returns folder. overrides: that family's config
    fields.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(TINY, rms_norm_eps=1e-5, tie_word_embeddings=False)
    params.update(overrides)
    config = AutoConfig.for_model(family, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    make_tokenizer(folder, config.vocab_size)
    return folder


def randomize_buffers(folder, suffix: str | tuple[str, ...]) -> None:
    """Give buffers a checkpoint saves as zeros (a router's correction bias) values that change
    which experts are chosen, so that reading them is tested.
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    found = [name for name in state if name.endswith(suffix)]
    if not found:
        return
    gen = torch.Generator().manual_seed(11)
    for name in found:
        state[name] = torch.rand(state[name].shape, generator=gen) * 0.5
    save_file(state, str(path), metadata={"format": "pt"})


def recompute_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """A transformers model's greedy tokens, each from a forward over the whole sequence so far (no
    cache): the reference for a model loaded in the test itself (a multimodal one served as text).
    """
    import torch

    out, ids = [], list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            out.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def hf_greedy(
    folder: Path,
    prompt: list[int],
    max_tokens: int,
    repetition_penalty: float = 1.0,
    margins: list[float] | None = None,
) -> list[int]:
    """transformers' own solo greedy decode (its KV cache, one request alone), eos ignored: the
    reference every batched output must equal token for token. repetition_penalty as transformers'
    logits processor applies it: every token seen so far (prompt and output) divided by it where
    positive, else times it. margins, when given, gets each choice's lead over the runner-up.
    """
    import torch

    model = load_hf_cached(str(folder))
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logits = res.logits[0, -1]
            if repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(prompt + out)))
                score = logits[seen]
                logits = logits.clone()
                logits[seen] = torch.where(
                    score > 0, score / repetition_penalty, score * repetition_penalty
                )
            token = int(logits.argmax())
            out.append(token)
            if margins is not None:
                top = torch.topk(logits, 2).values
                margins.append(float(top[0] - top[1]))
            res = model(
                torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True
            )
    return out


def hf_recompute_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy without its cache: every token from a forward over the whole sequence.
    The reference where its cached decode disagrees with itself (Nemotron-H floors Mamba2's step
    sizes in a prompt but not in a cached decode step).
    """
    return recompute_greedy(load_hf_cached(str(folder)), prompt, max_tokens)


_MODELS: dict = {}


def load_hf_cached(folder: str):
    from transformers import AutoModelForCausalLM

    if folder not in _MODELS:
        _MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder).eval()
    return _MODELS[folder]


# llama.cpp's architecture name of each transformers family; only "llama" has its q/k rows permuted
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
GGUF_MATRICES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
GGUF_OTHERS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def make_tiny_gguf(
    folder: Path,
    qtype: str = "Q8_0",
    seed: int = 0,
    family: str = "llama",
    tables: bool = False,
    rope_freqs: list[float] | None = None,
    **overrides,
) -> Path:
    """A tiny model of a transformers family shipped as llama.cpp ships one: a GGUF of that family's
    architecture whose projections are `qtype` blocks under llama.cpp's names (q and k rows permuted
    where llama.cpp's converter permutes them; Phi-3's q/k/v and gate/up stacked as its converter
    writes them; MoE experts stacked per layer), norms, biases and (unless `tables`: `qtype` too)
    embeddings and head F32; rope_freqs: a rope_freqs tensor of those factors, as llama.cpp writes a
    Llama 3.x file's rope scaling; beside it, the folder `prepare-model` would make of it (config,
    tokenizer, the GGUF's weights dequantized to fp32, and pagedserve_model.json naming the file).
    Returns the folder.
    """
    import json

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file, save_file

    folder = make_tiny_llama(folder, seed=seed, family=family, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    kind = getattr(GGMLQuantizationType, qtype)
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = GGUF_ARCH[family]

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    path = folder / f"tiny.{qtype}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    dequantized, experts = {}, {}
    gemma = family.startswith("gemma")
    for name, t in state.items():
        w = t.float().numpy()
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            gname = "token_embd.weight" if name == "model.embed_tokens.weight" else "output.weight"
            if tables:
                blocks = quants.quantize(w, kind)
                w = quants.dequantize(blocks, kind).reshape(w.shape)
                writer.add_tensor(gname, blocks, raw_dtype=kind)
            else:
                writer.add_tensor(gname, w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif ".".join(parts[3:5]) in GGUF_MATRICES and parts[-1] == "weight":
            gname = GGUF_MATRICES[".".join(parts[3:5])]
            blocks = quants.quantize(w, kind)
            # what the file holds, in Hugging Face's order
            w = quants.dequantize(blocks, kind).reshape(w.shape)
            stored = (
                permute(w, heads if gname == "attn_q" else kv)
                if arch == "llama" and gname in ("attn_q", "attn_k")
                else w
            )
            writer.add_tensor(
                f"blk.{parts[2]}.{gname}.weight", quants.quantize(stored, kind), raw_dtype=kind
            )
        # model.layers.N.mlp.experts.E.gate_proj.weight: stacked per layer below
        elif parts[4] == "experts":
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = w
        else:
            rest = ".".join(parts[3:-1]) + (".bias" if parts[-1] == "bias" else "")
            if rest == "post_attention_layernorm":
                gname = "post_attention_norm" if gemma else "ffn_norm"
            else:
                gname = GGUF_OTHERS.get(rest, rest)
            writer.add_tensor(
                f"blk.{parts[2]}.{gname}{'' if gname.endswith('.bias') else '.weight'}", w
            )
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(w))
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [E, out, in]
        gname = {
            "gate_proj": "ffn_gate_exps",
            "up_proj": "ffn_up_exps",
            "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps",
            "w3": "ffn_up_exps",
            "w2": "ffn_down_exps",
        }[proj]  # Mixtral's names
        writer.add_tensor(f"blk.{layer}.{gname}.weight", stacked)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(dequantized, str(folder / "model.safetensors"), metadata={"format": "pt"})
    marker = {"model_name": f"tiny-{qtype}", "gguf": str(path)}
    (folder / "pagedserve_model.json").write_text(json.dumps(marker))
    return folder


def make_tiny_embedder(
    folder: Path,
    pooling: str = "lasttoken",
    seed: int = 0,
    tied: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt: str | None = None,
) -> Path:
    """A random Qwen3 embedding model as Qwen3-Embedding ships (a `Qwen3Model` checkpoint: the
    decoder's tensors without `model.`, no head unless `tied`), with sentence-transformers' files:
    pooling (its config's pooling_mode_<pooling>), a Normalize module, named prompts.
    """
    import torch
    from transformers import AutoConfig, AutoModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen3", **TINY, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    AutoModel.from_config(config).eval().save_pretrained(str(folder), safe_serialization=True)
    make_tokenizer(folder, config.vocab_size)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = "<unk>"  # sentence-transformers pads its batches
    # tokenizer.json as it is (transformers' Qwen2 class would put Qwen's own digit-splitting
    # pre-tokenizer in front of this tiny vocabulary; a real Qwen tokenizer.json carries that one
    # itself)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": i,
                    "name": str(i),
                    "path": path,
                    "type": f"sentence_transformers.models.{kind}",
                }
                for i, (kind, path) in enumerate(zip(kinds, paths, strict=True))
            ]
        )
    )
    for path in paths[1:]:
        (folder / path).mkdir(exist_ok=True)
    modes = (
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    )
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": config.hidden_size,
                "include_prompt": True,
                **{f"pooling_mode_{m}": m == pooling for m in modes},
            }
        )
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": prompts or {},
                "default_prompt_name": default_prompt,
                "similarity_fn_name": "cosine",
            }
        )
    )
    return folder


# model.layers.N.<hugging face> -> blk.N.<gguf>, as llama.cpp's converter names them
GPT_OSS_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}


def make_tiny_gpt_oss_gguf(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random gpt-oss shipped as llama.cpp ships one after `llama-quantize ... MXFP4_MOE`: a
    `gpt-oss` GGUF whose experts are MXFP4 blocks, gate and up apart (the converter splits the
    checkpoint's alternate columns), their biases beside them, attention Q8_0, the rest F32; the
    folder holds the Hugging Face checkpoint rewritten with the file's dequantized values (what
    transformers must agree with) and names the file (pagedserve_model.json). Returns the folder.
    """
    import json

    import gguf
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, quants
    from safetensors.torch import load_file, save_file

    folder = make_tiny_llama(folder, seed=seed, family="gpt_oss", **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    path = folder / "tiny.MXFP4_MOE.gguf"
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    rope = cfg["rope_parameters"]  # as llama.cpp's converter writes YaRN
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])

    def blocks(w: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray]:
        q = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
        return q, quants.dequantize(q, kind).reshape(w.shape)

    dequantized = {}
    for name, t in state.items():
        w = t.float().numpy()
        parts = name.split(".")
        rest = ".".join(parts[3:])
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif rest in GPT_OSS_GGUF:
            writer.add_tensor(f"blk.{parts[2]}.{GPT_OSS_GGUF[rest]}", w)
        elif rest.startswith("self_attn.") and rest.endswith("_proj.weight"):
            kind = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}[parts[4][0]]
            q, w = blocks(w, T.Q8_0)
            writer.add_tensor(f"blk.{parts[2]}.{kind}.weight", q, raw_dtype=T.Q8_0)
        elif rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2I]: gate and up alternate
            layout = w.transpose(0, 2, 1)  # [E, 2I, hidden]
            for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                q, d = blocks(layout[:, rows], T.MXFP4)
                writer.add_tensor(f"blk.{parts[2]}.ffn_{part}_exps.weight", q, raw_dtype=T.MXFP4)
                layout[:, rows] = d
            w = layout.transpose(0, 2, 1)
        elif rest == "mlp.experts.down_proj":  # [E, I, hidden]
            q, d = blocks(w.transpose(0, 2, 1), T.MXFP4)
            writer.add_tensor(f"blk.{parts[2]}.ffn_down_exps.weight", q, raw_dtype=T.MXFP4)
            w = d.transpose(0, 2, 1)
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(
                f"blk.{parts[2]}.ffn_gate_exps.bias", np.ascontiguousarray(w[:, 0::2])
            )
            writer.add_tensor(f"blk.{parts[2]}.ffn_up_exps.bias", np.ascontiguousarray(w[:, 1::2]))
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"blk.{parts[2]}.ffn_down_exps.bias", w)
        else:
            raise KeyError(f"no gpt-oss GGUF name for {name}")
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(dequantized, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "pagedserve_model.json").write_text(
        json.dumps({"model_name": "tiny-gpt-oss-MXFP4", "gguf": str(path)})
    )
    return folder


def make_tiny_gpt_oss_mxfp4(folder: Path, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """A tiny random gpt-oss checkpoint as openai/gpt-oss-20b ships: its experts as MXFP4
    `*_blocks` [E, rows, cols / 32, 16] (value 2j in byte j's low nibble, 2j + 1 in its high) and
    E8M0 `*_scales`, quantization_config naming mxfp4; and beside it the same model with those
    experts dequantized (what transformers must agree with). Returns (served, reference).
    """
    import json
    import shutil

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    from safetensors.torch import load_file, save_file

    reference = make_tiny_llama(folder / "reference", seed=seed, family="gpt_oss", **overrides)
    state = load_file(str(reference / "model.safetensors"))
    served_state = {}

    def mxfp4(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """[..., cols] -> (HF blocks, scales, the dequantized values)."""
        q = quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), T.MXFP4)
        values = quants.dequantize(q, T.MXFP4).reshape(rows.shape)
        q = q.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 17)
        scales, qs = q[..., 0], q[..., 1:]
        v = np.concatenate([qs & 15, qs >> 4], axis=-1)  # ggml: value j low, j + 16 high
        hf = v[..., 0::2] | (v[..., 1::2] << 4)
        return torch.from_numpy(hf.copy()), torch.from_numpy(scales.copy()), values

    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, hidden, 2I] -> rows [E, 2I, hidden]
            blocks, scales, values = mxfp4(t.float().numpy().transpose(0, 2, 1))
            state[name] = torch.from_numpy(values.transpose(0, 2, 1).copy())
        elif name.endswith("mlp.experts.down_proj"):  # [E, I, hidden] -> rows [E, hidden, I]
            blocks, scales, values = mxfp4(t.float().numpy().transpose(0, 2, 1))
            state[name] = torch.from_numpy(values.transpose(0, 2, 1).copy())
        else:
            served_state[name] = t
            continue
        served_state[name + "_blocks"], served_state[name + "_scales"] = blocks, scales
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    served = folder / "served"
    shutil.copytree(reference, served)
    save_file(served_state, str(served / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((served / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (served / "config.json").write_text(json.dumps(cfg))
    return served, reference
