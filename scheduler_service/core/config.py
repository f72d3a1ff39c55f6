"""Configuration of the scheduler service: frozen, built once from the command line and the model
folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from scheduler_service.core.pooling import PoolingConfigError, PoolingSpec, checkpoint_has_head

TASKS = ("auto", "generate", "embed", "both")
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler knows of a model, from config.json: no weights, no torch."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    path: str | None = None
    hidden_size: int = 0
    # A PoolingSpec where it embeds, `generates` where it generates.
    pooling: PoolingSpec | None = None
    generates: bool = True
    # generation_config.json's sampling values: defaults for OpenAI requests, as in vLLM.
    sampling_defaults: dict = field(default_factory=dict, hash=False)

    @property
    def task(self) -> str:
        return "generate" if self.pooling is None else "both" if self.generates else "embed"

    @classmethod
    def from_folder(
        cls,
        folder: str | Path,
        max_model_len: int | None = None,
        task: str = "auto",
        pooling: str | None = None,
    ) -> ModelSpec:
        """task "auto" embeds a sentence-transformers folder, else generates; a head-less one only
        embeds.
        """
        folder = Path(folder)
        if task not in TASKS:
            raise PoolingConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        config = json.loads((folder / "config.json").read_text())
        config |= config.get("text_config") or {}  # a multimodal folder served as text
        meta_path = folder / "pagedserve_model.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        eos = config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        gen_path = folder / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        gen_eos = generation.get("eos_token_id")
        eos_ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        context = int(config.get("max_position_embeddings", 2048))
        if max_model_len is not None:
            context = min(context, max_model_len)
        hidden = int(config.get("hidden_size", 0))
        spec, generates = _embedding(folder, config, task, pooling, hidden)
        return cls(
            name=meta.get("model_name") or config.get("_name_or_path") or folder.name,
            vocab_size=int(config["vocab_size"]),
            max_context=context,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids)),
            path=str(folder),
            hidden_size=hidden,
            pooling=spec,
            generates=generates,
            sampling_defaults={
                k: generation[k]
                for k in SAMPLING_DEFAULTS
                if isinstance(generation.get(k), (int, float))
            },
        )


def _embedding(
    folder: Path, config: dict, task: str, pooling: str | None, hidden: int
) -> tuple[PoolingSpec | None, bool]:
    """How the folder embeds (None: it does not) under `task`, and whether it generates."""
    spec = PoolingSpec.from_folder(folder) if task != "generate" else None
    generates = task in ("generate", "both") or (task == "auto" and spec is None)
    if generates and not config.get("tie_word_embeddings") and not checkpoint_has_head(folder):
        raise PoolingConfigError(
            f"{folder}: the checkpoint has no language-model head (lm_head.weight): "
            "it can only embed (--task embed)"
        )
    if spec is None and task in ("embed", "both"):
        return PoolingSpec(pooling=pooling or "last", normalize=True, dimension=hidden), generates
    if spec is None and pooling:
        raise PoolingConfigError(
            "--pooling applies to an embedding model: give --task embed (or both)"
        )
    if spec is not None:
        spec = replace(
            spec,
            dimension=spec.dimension or hidden,
            **({"pooling": pooling, "source": "--pooling"} if pooling else {}),
        )
        if spec.dimension != hidden:
            raise PoolingConfigError(
                f"{spec.source}: word_embedding_dimension {spec.dimension} is not "
                f"the model's hidden size {hidden}"
            )
    return spec, generates


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy. The number of blocks is not here: it arrives in the workers' handshake."""

    block_size: int = 16
    max_num_seqs: int = 64
    # Adopt the workers' proposal (their handshakes' max_num_seqs, the smallest) at start instead.
    auto_max_num_seqs: bool = False
    # Per-step token budget: decodes are scheduled first, then prompt chunks fill the rest.
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_queue_len: int = 1024
    # Plan step N+1 while the workers run step N.
    overlap: bool = True
    # Check allocator invariants after every step (tests turn it on).
    debug_invariants: bool = False
    # Seconds between the step_profile log lines of a busy replica (cumulative figures).
    step_profile_interval: float = 5.0
    # Data parallelism: how much busier than the least loaded replica the prefix holder may be and
    # still get a request. None: max_num_seqs / 4.
    route_overload_slack: int | None = None
    # Speculative decoding: "off"; "ngram" wherever n-grams propose; "auto" only in small decode-
    # only steps, where drafted rows are nearly free.
    speculative: str = "auto"
    num_speculative_tokens: int = 10  # the longest draft (a long suffix match drafts this many)
    speculative_max_rows: int = 4
    # The share of decode speed embedding chunks may take (1: none kept back).
    embed_slowdown: float = 0.2
    # Seconds a decoding stream may wait while prompts compute beside it; 0: not paced.
    max_decode_gap: float = 0.0
    # Embedding tokens in a step without decodes, so generations wait behind at most this (0: all).
    embed_step_tokens: int = 512
    # Default max_tokens, capped by the context; 0: the whole context, as vLLM.
    default_max_tokens: int = 0
    # Most adapters running at once; a request for one more waits.
    max_loras: int = 8
    # Hybrid state slots: one per running sequence, snapshots in the rest; 0: stateless.
    state_slots: int = 0

    @property
    def route_slack(self) -> int:
        if self.route_overload_slack is not None:
            return self.route_overload_slack
        return max(1, self.max_num_seqs // 4)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.speculative not in ("auto", "ngram", "off"):
            raise ValueError(f"speculative must be auto, ngram or off, got {self.speculative!r}")
        if not 0.0 < self.embed_slowdown <= 1.0:
            raise ValueError(f"embed_slowdown must lie in (0, 1], got {self.embed_slowdown}")
        if self.state_slots and self.speculative != "off":
            raise ValueError(
                "a hybrid's state slots need speculative decoding off: a recurrent state cannot "
                "take back a rejected draft"
            )
        if self.max_decode_gap < 0:
            raise ValueError(f"max_decode_gap must be at least 0, got {self.max_decode_gap}")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be at least max_num_seqs (one decode token each)"
            )
