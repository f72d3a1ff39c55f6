"""What one step is: the rows the scheduler chose (`SchedulerOutput`), and what applying its result
did (`StepUpdate`); how a request becomes its sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from scheduler_service.core.plan import ReadBack
from scheduler_service.core.sequence import Request, Sequence
from scheduler_service.core.stats import TierStats

# Unique in the process: a request moved to another replica keeps its sequences.
_SEQ_IDS = itertools.count()


def make_sequences(request: Request) -> None:
    """One sequence per sample; samples 1..n-1 wait to fork from sample 0's prompt."""
    request.seqs = [Sequence(next(_SEQ_IDS), request, i) for i in range(request.sampling.n)]
    request.pending_forks = request.seqs[1:]


class DuplicateRequestId(ValueError):
    """A live request already has this id."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use by a live request")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== num_computed_tokens when scheduled)
    num_new_tokens: int
    do_sample: bool
    # the sequence's epoch when scheduled: its blocks are still these while the epochs agree
    epoch: int
    # >= 0: the last input token is the one the previous step samples in this row
    prev_row: int = -1
    draft: tuple[int, ...] = ()  # drafted tokens after the known last one, verified by this step


@dataclass
class SchedulerOutput:
    """One scheduled step: its rows, preemptions, copies, and what its plan asked of the result."""

    step_id: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (src, dst), run before the forward
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # hybrid state: (snapshot, slot) copies before the forward, (row, offset, slot) saves in it
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # (row, slot) of saves at a row's end past its prompt, keyed once the result is in
    state_trails: list[tuple[int, int]] = field(default_factory=list)
    draft_seconds: float = 0.0  # speculative decoding: seconds spent drafting (part of schedule)
    num_decodes: int = (
        0  # sequences decoding (scheduler_service/core/pacing.py paces embeddings beside them)
    )
    embed_room: int = 0  # embedding prompt tokens this step may still take
    num_embed_tokens: int = 0
    loads: bool = False  # it moves blocks to or from the KV tiers (a step, even without rows)
    # what its plan asked of the result (build_plan)
    read: ReadBack = field(default_factory=ReadBack)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.start < s.seq.prompt_len)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.loads


@dataclass
class StepUpdate:
    """What applying a step's result did to each sequence, the prefix cache and the queues."""

    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    embedded: list[Sequence] = field(default_factory=list)
    kv_events: list[tuple] = field(default_factory=list)
    num_draft_rows: int = (
        0  # rows that verified a draft, the tokens they drafted, and how many stood
    )
    num_drafted: int = 0
    num_accepted: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_used_state_slots: int = 0  # a hybrid's recurrent-state slots held after it
    kv_tiers: TierStats | None = (
        None  # the KV tiers' figures after it (core/kv_tiers.py KvTiers.stats)
    )
