"""What a folder says about embeddings (sentence-transformers' files, read into a `PoolingSpec`) and
the arithmetic that finishes a pooled vector. Without them a model generates unless `--task embed`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' pooling config keys, and what each is here
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSERVED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_TRANSFORMER, _POOLING, _NORMALIZE = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)


class PoolingConfigError(ValueError):
    """A folder's sentence-transformers files ask for what cannot be served (said by name)."""


@dataclass(frozen=True)
class PoolingSpec:
    """How hidden states become one vector (last, mean or first; normalized or not), and named
    prompts.
    """

    pooling: str = "last"
    normalize: bool = True
    dimension: int = 0  # the vector's length (the hidden size); 0 where the folder does not say
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    source: str = "--pooling"  # where it was read from, for what the server reports

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise PoolingConfigError(
                f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}"
            )

    @property
    def prefix_cacheable(self) -> bool:
        """Whether a cached prefix can stand in for computing it: not for last-token pooling."""
        return self.pooling == "last"

    @classmethod
    def from_folder(cls, folder: str | Path) -> PoolingSpec | None:
        """The folder's sentence-transformers pooling, or None where it has no `modules.json`."""
        folder = Path(folder)
        modules_path = folder / "modules.json"
        if not modules_path.exists():
            return None
        try:
            modules = json.loads(modules_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PoolingConfigError(f"{modules_path}: {e}") from None
        types = [m.get("type", "") for m in modules]
        unserved = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        if unserved:
            raise PoolingConfigError(
                f"{modules_path}: modules {unserved} are not served (a Transformer, its "
                "Pooling and a Normalize are)"
            )
        if _POOLING not in types:
            raise PoolingConfigError(
                f"{modules_path}: no Pooling module (how the hidden states pool)"
            )
        pool_dir = folder / next(m.get("path", "") for m in modules if m.get("type") == _POOLING)
        try:
            pool = json.loads((pool_dir / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PoolingConfigError(f"{pool_dir / 'config.json'}: {e}") from None
        asked = [k for k in (*_MODES, *_UNSERVED_MODES) if pool.get(k)]
        if len(asked) != 1 or asked[0] in _UNSERVED_MODES:
            raise PoolingConfigError(
                f"{pool_dir / 'config.json'}: pooling {asked or 'none'}; one of "
                f"{', '.join(_MODES)} is served"
            )
        if pool.get("include_prompt") is False:
            raise PoolingConfigError(
                f"{pool_dir / 'config.json'}: include_prompt false (pooling without the "
                "instruction's tokens) is not served"
            )
        prompts, default = {}, None
        st_config = folder / "config_sentence_transformers.json"
        if st_config.exists():
            try:
                st = json.loads(st_config.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise PoolingConfigError(f"{st_config}: {e}") from None
            prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
            default = st.get("default_prompt_name")
            if default is not None and default not in prompts:
                raise PoolingConfigError(
                    f"{st_config}: default_prompt_name {default!r} is not one of its prompts"
                )
        return cls(
            pooling=_MODES[asked[0]],
            normalize=_NORMALIZE in types,
            dimension=int(pool.get("word_embedding_dimension") or 0),
            prompts=prompts,
            default_prompt=default,
            source=str(modules_path),
        )


def embedding_vector(
    pooled: np.ndarray, num_tokens: int, spec: PoolingSpec, dimensions: int | None
) -> np.ndarray:
    """fp32: a mean divided, cut to `dimensions` (Matryoshka), normalized where the model does."""
    v = np.asarray(pooled, dtype=np.float32)
    if spec.pooling == "mean":
        v = v / np.float32(max(num_tokens, 1))
    if dimensions:
        v = v[:dimensions]
    if spec.normalize:
        norm = float(np.linalg.norm(v.astype(np.float64)))
        v = v / np.float32(max(norm, 1e-12))
    return v.astype(np.float32)


def checkpoint_has_head(folder: str | Path) -> bool:
    """Whether a folder's safetensors hold `lm_head.weight` (headers only); True where there are
    none.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if "lm_head.weight" in json.loads(fh.read(size)):
                return True
    return not files


def take_pooled(out, pooled: np.ndarray | None) -> list:
    """Add each pooled row to its sequence -> those this step finished; preempted ones redo it."""
    done = []
    read = out.read
    at = np.flatnonzero(read.pooling).tolist() if read.pooling is not None else []
    for i in np.flatnonzero(read.embed_rows).tolist():
        item = out.scheduled[i]
        seq = item.seq
        if seq.epoch != item.epoch or not seq.is_running:
            continue
        if i in at:
            v = pooled[at.index(i)]
            seq.pooling.sum = v.copy() if seq.pooling.sum is None else seq.pooling.sum + v
        if item.start + item.num_new_tokens == seq.prompt_len:
            embed = seq.request.embed
            seq.pooling.vector = embedding_vector(
                seq.pooling.sum, seq.prompt_len, embed.spec, embed.dimensions
            )
            done.append(seq)
    return done
