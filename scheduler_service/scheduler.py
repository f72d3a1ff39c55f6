"""Continuous batching over a paged KV pool.

Each step:
  1. running sequences that decode get their one token first, then running sequences that are part
     way through their prompt get a chunk, all within the per-step token budget;
  2. waiting sequences are admitted (head of the queue first) while free blocks, the budget and
     max_num_seqs allow — never in a step that had to preempt;
  3. a sequence's page table grows exactly when its tokens cross a block boundary; when the pool is
     empty the most recently admitted running sequence is preempted by recompute (blocks freed,
     generated tokens kept, back to the head of the queue).
Finish, abort and preemption free blocks through one path (`_release`).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from scheduler_service.block_allocator import BlockAllocator
from scheduler_service.config import SchedulerConfig
from scheduler_service.sequence import FinishReason, Request, Sequence, SequenceStatus


class DuplicateRequestId(ValueError):
    """A live request already has this id."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== num_computed_tokens when scheduled)
    num_new_tokens: int
    do_sample: bool


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count(1)

    # --- requests ------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestId(f"request id {request.request_id!r} is already in use by a live request")
        request.seqs = [Sequence(next(self._seq_ids), request, i) for i in range(request.sampling.n)]
        self.requests[request.request_id] = request
        self.waiting.extend(request.seqs)

    def abort_request(self, request_id: str) -> Request | None:
        """End every sample of a request; its blocks return at once. None if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish(seq, FinishReason.ABORT)
        return request

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    # --- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step_id=next(self._step_ids))
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._reserve(seq, min(seq.num_uncomputed_tokens, budget), scheduled, out)
            if num_new:
                self._add(out, seq, num_new, scheduled)
                budget -= num_new

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            need = self.allocator.blocks_for_tokens(seq.num_computed_tokens + num_new) - len(seq.block_ids)
            if not self.allocator.can_allocate(need):
                break
            seq.block_ids.extend(self.allocator.allocate(need))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(out, seq, num_new, scheduled)
            budget -= num_new

        if self.config.debug_invariants:
            self.check_invariants()
        return out

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Sequence, int]]:
        """Apply a step's result: advance computed tokens, append sampled tokens. Returns (seq, token)
        for every sequence that got a new token. Sequences aborted while the step ran are skipped."""
        new_tokens: list[tuple[Sequence, int]] = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != item.start:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if item.do_sample:
                seq.token_ids.append(int(token))
                new_tokens.append((seq, int(token)))
        return new_tokens

    # --- memory ----------------------------------------------------------------------------------
    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[int]) -> None:
        do_sample = seq.num_computed_tokens + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, do_sample))
        scheduled.add(seq.seq_id)

    def _reserve(self, seq: Sequence, num_new: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Grow seq's page table to hold num_new more tokens, preempting if the pool is empty.

        A prompt chunk shrinks to what the free blocks hold before anyone is preempted.
        Returns the number of tokens reserved: 0 when seq itself had to be preempted.
        """
        while True:
            have = len(seq.block_ids)
            need = self.allocator.blocks_for_tokens(seq.num_computed_tokens + num_new) - have
            if self.allocator.can_allocate(need):
                seq.block_ids.extend(self.allocator.allocate(need))
                return num_new
            if self.config.enable_chunked_prefill and num_new > 1:
                fits = (have + self.allocator.num_free_blocks) * self.block_size - seq.num_computed_tokens
                if fits >= 1:
                    num_new = fits
                    continue
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:  # everyone else already runs this step: wait for them to finish
                return 0
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        """The one path that gives a sequence's blocks back (finish, abort, preemption)."""
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0

    # --- accounting ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        owned: dict[int, int] = {}
        for seq in self.running:
            for b in seq.block_ids:
                owned[b] = owned.get(b, 0) + 1
            need = self.allocator.blocks_for_tokens(seq.num_computed_tokens)
            if len(seq.block_ids) < need:
                raise AssertionError(f"{seq} holds too few blocks for its computed tokens")
        for seq in self.waiting:
            if seq.block_ids:
                raise AssertionError(f"waiting {seq} holds blocks")
        for b in range(self.num_blocks):
            if owned.get(b, 0) != self.allocator.refcount(b):
                raise AssertionError(f"block {b}: refcount {self.allocator.refcount(b)}, owners {owned.get(b, 0)}")
