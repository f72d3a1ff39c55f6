"""Request and sequence state. A Request is what a client asked for and owns one Sequence per
sample; a Sequence moves through the scheduler's states and owns KV blocks:

WAITING ──admit──▶ RUNNING ──finish/abort──▶ FINISHED ▲ │ └────preempt───────┘ (recompute: blocks
freed, generated tokens kept)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from scheduler_service.core.block_allocator import block_hash
from scheduler_service.core.drafting import SequenceDrafter
from scheduler_service.core.plan import MaskFiller
from scheduler_service.core.pooling import PoolingSpec


class Matcher(Protocol):
    """A sample's grammar state (llguidance's LLMatcher, text/structured.py): it takes tokens in
    turn.
    """

    def consume_token(self, token: int) -> bool: ...

    def validate_tokens(self, tokens: list[int]) -> int: ...

    def is_stopped(self) -> bool: ...

    def is_error(self) -> bool: ...


class Constraint(Protocol):
    """A request's compiled grammar: a matcher per sample, and the engine filling their masks."""

    engine: MaskFiller

    def new_matcher(self) -> Matcher: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters of one request (the scheduler's own copy, protobuf-free)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-K wanted with each generated token's log-probability
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token ids banned while fewer than min_tokens were generated (end-of-sequence and stop ids).
    min_tokens_ban: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def may_draft(self) -> bool:
        """Not with logprobs: a verifying step's logits differ in their last digits."""
        return self.logprobs is None and self.prompt_logprobs is None

    @property
    def has_bias(self) -> bool:
        return bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.min_tokens_ban))


@dataclass(frozen=True)
class EmbedOptions:
    """How an embedding pools, and the Matryoshka `dimensions` kept (None: all)."""

    spec: PoolingSpec
    dimensions: int | None = None


@dataclass(slots=True)
class PendingToken:
    """Tokens of steps in flight and the (step id, row) producing the last; token_ids holds known
    ones.
    """

    count: int = 0
    step: int = 0
    row: int = -1


@dataclass(slots=True)
class PlanRow:
    """A running sequence's plan row and entries copied; the KV manager marks it `stale`."""

    row: int = -1
    blocks: int = 0

    def stale(self, index: int = 0) -> None:
        if index < self.blocks:
            self.blocks = index


@dataclass(slots=True)
class Pooling:
    """An embedding's pooled state so far (fp32), restarted at each admission, then the finished
    vector.
    """

    sum: np.ndarray | None = None
    vector: np.ndarray | None = None


class Sequence:
    """One sample's tokens and KV blocks; each feature's state in its own part."""

    def __init__(self, seq_id: int, request: Request, index: int) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.block_ids: list[int] = []  # the page table: logical block i -> physical block id
        self.num_computed_tokens = 0  # tokens whose K/V is in the pool
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # leading blocks out of every window (entries -1), and what they held (maybe still cached)
        self.num_dropped_blocks = 0
        self.dropped_ids: list[int] = []
        self.state_slot = -1  # a hybrid's slot of the recurrent-state pool while it holds blocks
        self.state_branch = 0  # and where its prompt leaves a cached one's (state_slots.py)
        self.state_trail: bytes | None = None  # the block its latest decode snapshot follows
        self._block_hashes: list[bytes] = []  # chained hashes of full blocks, computed on demand
        self.pending = PendingToken()
        # Bumped when the blocks are given back: an older step's result may add its token, not touch
        # blocks.
        self.epoch = 0
        self.mirror = PlanRow()
        self.last_token_time: float | None = None  # for the inter-token latency histogram
        # Structured output: the llguidance matcher that has consumed this sample's generated
        # tokens.
        constraint = request.constraint
        self.matcher: Matcher | None = constraint.new_matcher() if constraint is not None else None
        # Speculative decoding's n-grams and draft length, made at the first decode that may draft.
        self.drafter: SequenceDrafter | None = None
        self.pooling = Pooling()  # an embedding's

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.RUNNING

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those that steps in flight will sample."""
        return len(self.token_ids) + self.pending.count

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.pending.count - self.num_computed_tokens

    def block_hash(self, index: int, block_size: int) -> bytes:
        """Chained hash of full block `index` of this sequence's tokens (prefix caching)."""
        while len(self._block_hashes) <= index:
            i = len(self._block_hashes)
            # the first block's parent: the adapter's identity, so no prefix is shared across
            # adapters
            parent = (
                self._block_hashes[-1]
                if self._block_hashes
                else (self.request.lora.hash_root if self.request.lora is not None else None)
            )
            self._block_hashes.append(
                block_hash(parent, self.token_ids[i * block_size : (i + 1) * block_size])
            )
        return self._block_hashes[index]

    def finish(self, reason: FinishReason) -> None:
        """The one place a sequence ends, once its blocks are back."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    @property
    def sample_seed(self) -> int:
        return (self.request.sampling.seed + self.index) & 0xFFFFFFFFFFFFFFFF

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request.request_id}#{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"pending={self.pending.count}, blocks={len(self.block_ids)})"
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # start of the first step that computed it (queue time)
    # samples 1..n-1 wait here, then fork from sample 0's prompt blocks
    pending_forks: list[Sequence] = field(default_factory=list)
    cached_prompt_tokens: int | None = None  # prefix-cache hit of the first admission
    constraint: Constraint | None = None  # text/structured.py makes it
    # entry j is prompt token j's TokenLogprob once known
    prompt_logprobs: list | None = None
    # An embedding: the prompt is computed (chunked, batched, prefix-cached) and pooled; nothing is
    # sampled.
    embed: EmbedOptions | None = None
    # A LoRA adapter (core/adapters.py Adapter) the request generates with; None: the base model.
    lora: object | None = None
    # stop ids and, unless ignored, the model's end-of-sequence ids
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
