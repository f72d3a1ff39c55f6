"""The sizes people serve on a CPU, made here: `make bench-cpu-scale`.

Random-weight models at Llama-3.2-1B and Llama-3.1-8B shapes (and Qwen3.5-4B's and -0.8B's, hybrids:
three Gated DeltaNet layers to one gated attention layer; Granite-4.0-H-1B's, Mamba2 between four
attention layers; Gemma-3-1B's, `--vocab 262144`; gpt-oss-20b's, its experts MXFP4 as openai ships
them, the rest Q8_0: `--quant MXFP4_MOE`, one server at a time with `--alone`), written as a Hugging
Face folder (bf16 safetensors, the default model's tokenizer; the vocabulary its own 49,152 or
padded to Llama-3's 128,256 as llama.cpp's converter pads it: the LM head a smaller or larger share
of a token's bytes), converted to GGUF by the llama.cpp built from the `llama-cpp-python` sdist
(`convert_hf_to_gguf.py`, then `llama-quantize` to Q4_K_M or Q8_0): the files a user downloads,
made by the tools that make them, once, cached under ~/.cache/pagedserve-peers/scale/.

For each vocabulary: the per-token budget of one stream (deploy/bench/budget.py), then pagedserve
and `llama-server` (and ik_llama.cpp's, with -rtr, where `make peer-ik` built it) serve the same
GGUF in alternating rounds (deploy/bench/cpu_peers.py): one stream of 128 greedy tokens
(ignore_eos), and the workload's first N prompts at once.

    python -m deploy.bench.cpu_scale --shape 1b --quant Q4_K_M --streams 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from deploy.bench.llama_build import CACHE, build_llama_tool, convert
from deploy.bench.scale_shapes import GPT_OSS, NAMED, SHAPES, VOCABS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_folder(shape: str, tokenizer_from: Path, vocab: int) -> Path:
    """The random-weight model as a bf16 HF folder, a shard a layer; made once."""
    import torch
    from safetensors.torch import save_file

    out = CACHE / "scale" / f"llama-{shape}-v{vocab}-random"
    if (out / "done").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if shape in NAMED:
        return named_folder(out, NAMED[shape], tokenizer_from, vocab)
    if shape in GPT_OSS:
        return gpt_oss_folder(out, GPT_OSS[shape], tokenizer_from, vocab)
    s = SHAPES[shape]
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        hidden_act="silu",
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        **s,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (n for n in TOKENIZER_FILES if (tokenizer_from / n).is_file()):
        shutil.copy(tokenizer_from / name, out / name)
    g = torch.Generator().manual_seed(0)
    h, i, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd

    def rand(*shape):  # std 0.02, as initializer_range
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    index = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})

    shard(
        "embed.safetensors",
        {
            "model.embed_tokens.weight": rand(vocab, h),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            **({} if s["tie_word_embeddings"] else {"lm_head.weight": rand(vocab, h)}),
        },
    )
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shard(
            f"layer{n:03d}.safetensors",
            {
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            },
        )
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    (out / "done").write_text("")
    return out


def saved_shapes(config, out: Path, tokenizer_from: Path) -> dict[str, tuple]:
    """config (bf16) and the tokenizer saved into out; every tensor's name and shape in
    transformers' own model of it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    for name in (n for n in TOKENIZER_FILES if (tokenizer_from / n).is_file()):
        shutil.copy(tokenizer_from / name, out / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def pad_tokenizer(path: Path, vocab: int) -> None:
    """The tokenizer's vocabulary padded to `vocab` entries with tokens no text makes."""
    saved = json.loads(path.read_text())
    table = saved["model"]["vocab"]
    table.update({f"<unused{i}>": i for i in range(len(table), vocab)})
    path.write_text(json.dumps(saved))


def as_released(path: Path, shape: dict) -> None:
    """The saved config.json as the released ones write it: Granite 4's layer_types; a dense
    Nemotron-H's pattern string, without the MoE keys transformers' class adds (the converter
    takes them for experts).
    """
    saved = json.loads(path.read_text())
    if "layer_types" in shape:
        saved["layer_types"] = shape["layer_types"]
    if "hybrid_override_pattern" in shape:
        routing = ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")
        saved = {
            k: v
            for k, v in saved.items()
            if "expert" not in k and "moe" not in k and k not in routing and "mtp" not in k
        }
        saved.pop("layers_block_type", None)
        pattern = shape["hybrid_override_pattern"]
        saved.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    path.write_text(json.dumps(saved))


def released_experts(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """LFM2-MoE's experts as its checkpoints ship them (w1, w3, w2 an expert, which llama.cpp's
    converter merges), from transformers' fused tensors.
    """
    out = {}
    for name, dims in shapes.items():
        base, _, kind = name.rpartition(".")
        if not base.endswith("feed_forward.experts") or kind not in ("gate_up_proj", "down_proj"):
            out[name] = dims
            continue
        experts, rows, cols = dims
        parts = {"w1": rows // 2, "w3": rows // 2} if kind == "gate_up_proj" else {"w2": rows}
        out.update(
            {f"{base}.{e}.{w}.weight": (n, cols) for e in range(experts) for w, n in parts.items()}
        )
    return out


def named_folder(out: Path, shape: dict, tokenizer_from: Path, vocab: int) -> Path:
    """A random Qwen3.5, Granite 4, Gemma 3, LFM2, Nemotron-H or OLMo 3 shape named and shaped by
    transformers' own model, norms and decays as it starts them.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    shape = dict(shape)
    kind = shape.pop("model_type", "qwen3_5_text")
    config = AutoConfig.for_model(kind, vocab_size=vocab, rms_norm_eps=1e-6, **shape)
    config.architectures = [type(config).__name__[:-6].removesuffix("Text") + "ForCausalLM"]
    shapes = saved_shapes(config, out, tokenizer_from)
    if kind == "lfm2_moe":
        shapes = released_experts(shapes)
    if kind.startswith("gemma"):  # its converter cuts the embedding to the tokenizer's vocabulary
        pad_tokenizer(out / "tokenizer.json", vocab)
    as_released(out / "config.json", shape)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied to the embedding
    g = torch.Generator().manual_seed(0)
    ones = ("linear_attn.norm.weight", "dt_bias", "mamba.D", "mamba.norm.weight")
    # Qwen3.5's and Gemma's norms scale by 1 + w; Granite's by w
    norm = 0.0 if kind.startswith(("qwen3_5", "gemma")) else 1.0

    def value(name: str, shape: tuple) -> torch.Tensor:
        if name.endswith(ones):
            return torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            return torch.full(shape, norm, dtype=torch.bfloat16)
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1, 16, generator=g).log().to(torch.bfloat16)
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    index = {}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = (
            name.split(".")[2]
            if name.startswith(("model.layers.", "backbone.layers."))
            else "embed"
        )
        shards.setdefault(layer, []).append(name)
    for layer, names in shards.items():
        file = f"{layer}.safetensors" if layer == "embed" else f"layer{int(layer):03d}.safetensors"
        save_file(
            {n: value(n, shapes[n]) for n in names}, str(out / file), metadata={"format": "pt"}
        )
        index.update({n: file for n in names})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    (out / "done").write_text("")
    return out


def gpt_oss_folder(out: Path, shape: dict, tokenizer_from: Path, vocab: int) -> Path:
    """A random gpt-oss as openai ships it: bf16 but the experts, which are MXFP4 `*_blocks`
    (uniform nibbles) and `*_scales` (2^-8: weights within +-0.023), names and shapes from
    transformers' own model; a shard a layer.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=vocab, **shape)
    config.architectures = ["GptOssForCausalLM"]
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    shapes = saved_shapes(config, out, tokenizer_from)
    g = torch.Generator().manual_seed(0)

    def tensors(name: str, dims: tuple) -> dict:
        if name.endswith(("gate_up_proj", "down_proj")):  # [E, in, out] -> rows [E, out, in / 32]
            experts, cols, rows = dims
            blocks = (experts, rows, cols // 32, 16)
            return {
                name + "_blocks": torch.randint(0, 256, blocks, dtype=torch.uint8, generator=g),
                name + "_scales": torch.full(blocks[:3], 119, dtype=torch.uint8),
            }
        if name.endswith("norm.weight"):
            return {name: torch.ones(dims, dtype=torch.bfloat16)}
        return {name: (torch.randn(*dims, generator=g) * 0.02).to(torch.bfloat16)}

    index: dict[str, str] = {}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = (
            name.split(".")[2]
            if name.startswith(("model.layers.", "backbone.layers."))
            else "embed"
        )
        shards.setdefault(layer, []).append(name)
    for layer, names in shards.items():  # a shard made, written and let go at a time
        file = f"{layer}.safetensors" if layer == "embed" else f"layer{int(layer):03d}.safetensors"
        shard = {k: v for n in names for k, v in tensors(n, shapes[n]).items()}
        save_file(shard, str(out / file), metadata={"format": "pt"})
        index.update({n: file for n in shard})
        del shard
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    (out / "done").write_text("")
    return out


def gguf_file(shape: str, quant: str, tokenizer_from: Path, vocab: int) -> Path:
    """The model as a `quant` GGUF by llama.cpp's converter and llama-quantize; made once."""
    target = CACHE / "scale" / f"llama-{shape}-v{vocab}-random.{quant}.gguf"
    if target.is_file():
        return target
    bf16 = CACHE / "scale" / f"llama-{shape}-v{vocab}-random.BF16.gguf"
    if shape in GPT_OSS:  # the converter keeps the experts' MXFP4, the rest Q8_0: MXFP4_MOE
        if quant != "MXFP4_MOE":
            raise SystemExit(f"{shape} is made as MXFP4_MOE only, not {quant}")
        bf16 = target
    if not bf16.is_file():
        folder = hf_folder(shape, tokenizer_from, vocab)
        convert(
            folder,
            bf16.with_suffix(".part"),
            "q8_0" if shape in GPT_OSS else "bf16",
            *(["--no-mtp"] if shape.startswith("qwen35") else []),
        )
        bf16.with_suffix(".part").rename(bf16)
    if quant == "BF16" or shape in GPT_OSS:
        return bf16
    subprocess.run(
        [
            str(build_llama_tool("llama-quantize")),
            str(bf16),
            str(target.with_suffix(".part")),
            quant,
            str(os.cpu_count() or 2),
        ],
        check=True,
    )
    target.with_suffix(".part").rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument(
        "--quant", default="Q4_K_M", help="llama-quantize's type name (Q4_K_M, Q8_0, ...) or BF16"
    )
    p.add_argument(
        "--vocab", default=",".join(map(str, VOCABS)), help="vocabulary sizes, each its own model"
    )
    p.add_argument("--tokenizer-from", type=Path, default=Path(".models/smollm2-135m-instruct"))
    p.add_argument("--make-only", action="store_true", help="make the GGUFs and print their paths")
    p.add_argument("--no-budget", action="store_true", help="skip the per-token budget")
    p.add_argument(
        "--repeats", default="3", help="rounds of the one-stream measurement (at least three)"
    )
    args, rest = p.parse_known_args(argv)
    from deploy.bench import cpu_peers

    for vocab in (int(v) for v in args.vocab.split(",")):
        path = gguf_file(args.shape, args.quant, args.tokenizer_from, vocab)
        size = path.stat().st_size / 2**30
        print(
            f"\n{args.shape} {args.quant}, vocabulary {vocab}: {path} ({size:.2f} GiB)", flush=True
        )
        if args.make_only:
            continue
        # its own process: the worker's allocator and memory, then given back
        if not args.no_budget:
            subprocess.run(
                [sys.executable, "-m", "deploy.bench.budget", "--model", str(path)], check=True
            )
        status = cpu_peers.main(
            ["--model", str(path), "--gguf", str(path), "--repeats", args.repeats, *rest]
        )
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
