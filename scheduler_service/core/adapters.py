"""LoRA adapters as PEFT saves them, checked against the base model before they are served (config
and safetensors header, no torch) and keyed by a hash of both files, so two adapters never share KV
blocks.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from protos.codec import lora_identity

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# the projections LoRA may change, as Hugging Face names them; Phi-3's fused names included
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served as meant; the message says why."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter's shapes are checked against: the base model's projections."""

    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    moe: bool = False
    # a base no adapter is served on, and why (Gemma 4: its layers' shapes differ by kind)
    refusal: str = ""

    @classmethod
    def from_config(cls, config: dict) -> BaseShapes:
        text = config.get("text_config") or config  # a multimodal folder's language model
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        head_dim = text.get("head_dim") or hidden // heads
        moe = bool(text.get("num_experts") or text.get("num_local_experts"))
        return cls(
            text["num_hidden_layers"],
            hidden,
            heads * head_dim,
            text.get("num_key_value_heads", heads) * head_dim,
            text.get("intermediate_size", 0),
            moe,
            "Gemma 4 (its full and sliding layers' heads differ in size, and its last layers "
            "project no K/V)"
            if text.get("model_type") == "gemma4_text" or config.get("model_type") == "gemma4"
            else "",
        )

    def shape(self, module: str) -> tuple[int, int]:
        """(out, in) of a projection."""
        h, q, kv, i = self.hidden, self.q_size, self.kv_size, self.intermediate
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "qkv_proj": (q + 2 * kv, h),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
            "gate_up_proj": (2 * i, h),
        }[module]


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: `id` is per load, `identity` its files' hash."""

    name: str
    path: str
    identity: str
    rank: int
    target_modules: tuple[str, ...]
    id: int = 0

    @property
    def event_id(self) -> int:
        """KvBlock.lora_id: the identity's first 8 bytes as a signed int64."""
        return int.from_bytes(bytes.fromhex(self.identity)[:8], "big", signed=True)

    @property
    def hash_root(self) -> bytes:
        """The parent of its first KV block's chained hash."""
        return b"lora:" + bytes.fromhex(self.identity)


def safetensors_header(path: Path) -> dict:
    """Tensor name -> {"dtype", "shape", ...} from a safetensors file's JSON header."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise AdapterError(f"{path} is not a safetensors file (its header claims {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise AdapterError(f"{path} is not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def read_adapter(
    name: str, path: str | Path, base: BaseShapes, max_rank: int | None = None
) -> Adapter:
    # one function: every check of a PEFT folder, each with the message that names it
    """The adapter in a PEFT folder, or AdapterError."""
    folder = Path(path).expanduser()
    what = f"LoRA adapter {name!r} ({folder})"
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(
            f"{what}: no {CONFIG_FILE} there (a PEFT adapter folder has it and {WEIGHTS_FILE})"
        )
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"{what}: no {WEIGHTS_FILE} there (save it with PEFT's save_pretrained, "
            "safe_serialization on)"
        )
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as e:
        raise AdapterError(f"{what}: {CONFIG_FILE} is not JSON ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(
            f"{what}: peft_type {config.get('peft_type')!r} is not served (LoRA only)"
        )
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole modules trained beside LoRA)",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
        "layers_pattern": None,
    }
    for key, label in refused.items():
        if label and config.get(key):
            raise AdapterError(f"{what}: {label} is not served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{what}: LoRA biases (bias={config['bias']!r}) are not served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{what}: r must be a positive integer, not {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{what}: rank {rank} is above --max-lora-rank {max_rank}")
    if base.refusal:
        raise AdapterError(f"{what}: LoRA on {base.refusal} is not served")
    targets: dict[str, dict] = {}
    for key, meta in safetensors_header(folder / WEIGHTS_FILE).items():
        m = _KEY.match(key)
        if m is None:
            module = key.split(".lora_")[0].rsplit(".", 1)[-1] if ".lora_" in key else key
            raise AdapterError(
                f"{what}: {module} is not served (LoRA on q/k/v/o/gate/up/down projections "
                f"only; found {key})"
            )
        layer, part, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in (ATTENTION if part == "self_attn" else MLP):
            raise AdapterError(
                f"{what}: {part}.{module} is not served (LoRA on q/k/v/o/gate/up/down "
                "projections only)"
            )
        if layer >= base.num_layers:
            raise AdapterError(
                f"{what}: it changes layer {layer}; the base model has {base.num_layers} "
                "(an adapter of another base model)"
            )
        if part == "mlp" and base.moe:
            raise AdapterError(
                f"{what}: LoRA on a mixture of experts' MLP ({module}) is not served"
            )
        out, inp = base.shape(module)
        want = [rank, inp] if ab == "A" else [out, rank]
        if list(meta.get("shape", ())) != want:
            raise AdapterError(
                f"{what}: layer {layer} {module}.lora_{ab} is {meta.get('shape')}, this base "
                f"model needs {want} (an adapter of another base model, or r in its config "
                "does not match its weights)"
            )
        targets.setdefault(module, {}).setdefault(layer, set()).add(ab)
    if not targets:
        raise AdapterError(f"{what}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, layers in targets.items():
        for layer, halves in layers.items():
            if halves != {"A", "B"}:
                raise AdapterError(
                    f"{what}: layer {layer} {module} has lora_{''.join(halves)} without its "
                    "other half"
                )
    return Adapter(name, str(folder.resolve()), lora_identity(folder), rank, tuple(sorted(targets)))


def parse_module_flag(entries: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... -> [(name, path)], or AdapterError."""
    out = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise AdapterError(f"--lora-modules takes NAME=PATH, got {entry!r}")
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    for n in names:
        if names.count(n) > 1:
            raise AdapterError(f"--lora-modules names {n!r} twice")
    return out


@dataclass
class AdapterRegistry:
    """Loaded adapters by name; a reload gets a new id while old holders finish on the old one."""

    base: BaseShapes
    base_names: tuple[str, ...] = ()  # the base model's names: an adapter may not take one
    max_rank: int | None = None
    adapters: dict[str, Adapter] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def load(self, name: str, path: str, replace: bool = False) -> Adapter:
        if not name or name in self.base_names:
            raise AdapterError(
                f"LoRA adapter name {name!r} is {'empty' if not name else 'the base model'}"
            )
        if name in self.adapters and not replace:
            raise AdapterError(f"a LoRA adapter named {name!r} is loaded already")
        a = read_adapter(name, path, self.base, self.max_rank)
        a = Adapter(a.name, a.path, a.identity, a.rank, a.target_modules, next(self._ids))
        self.adapters[name] = a
        return a

    def unload(self, name: str) -> Adapter:
        if name not in self.adapters:
            raise KeyError(self.unknown(name))
        return self.adapters.pop(name)

    def get(self, name: str) -> Adapter:
        """The adapter a request names, or KeyError whose message names those that exist."""
        a = self.adapters.get(name)
        if a is None:
            raise KeyError(self.unknown(name))
        return a

    def unknown(self, name: str) -> str:
        have = ", ".join(sorted(self.adapters)) or "none"
        return f"unknown LoRA adapter {name!r} (loaded: {have})"
