"""The scheduler's books: live requests, waiting and running queues over the KV manager, and the one
place each change of a sequence's life happens (arrive, adopt, update, fork, preempt, finish).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from scheduler_service.core.batch import (
    DuplicateRequestId,
    ScheduledSeq,
    SchedulerOutput,
    StepUpdate,
    make_sequences,
)
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.drafting import SharedNgrams
from scheduler_service.core.kv_manager import KVCacheManager
from scheduler_service.core.kv_tiers import KvTiers
from scheduler_service.core.plan import PlanBuilder
from scheduler_service.core.pooling import take_pooled
from scheduler_service.core.results import ends_with, row_tokens, stop_at
from scheduler_service.core.sequence import FinishReason, PlanRow, Request, Sequence, SequenceStatus
from scheduler_service.core.stats import PoolGauges, PoolStats


class Queues:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        max_model_len: int,
        kv_window: int = 0,
        tiers: KvTiers | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """tiers: the KV tiers under the pool; eos_token_ids end a sample unless it ignores them."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.caching = config.enable_prefix_caching
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            kv_window,
            config.state_slots,
            # decode snapshots (state_slots.py) take at most half the room beside running sequences
            max_trails=max(1, (config.state_slots - config.max_num_seqs) // 2),
        )
        if tiers is not None:
            self.kv.use_tiers(tiers)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in cached blocks
        self.planner = PlanBuilder(
            config.max_num_seqs,
            self.kv.blocks_for_tokens(max_model_len),
            config.block_size,
            keeps_state=bool(config.state_slots),
        )
        # Speculative decoding: n-grams of finished requests, shared by every sequence here.
        self.speculating = config.speculative != "off"
        self.shared_ngrams = SharedNgrams() if self.speculating else None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def allocator(self):
        """The pool's block allocator (counts, the prefix cache, its events)."""
        return self.kv.allocator

    @property
    def has_work(self) -> bool:
        """Sequences to run, or KV-tier work no plan has carried yet."""
        return bool(self.waiting or self.running) or (
            self.kv.tiers is not None and self.kv.tiers.has_ops
        )

    # --- arrivals and ends -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise DuplicateRequestId(request.request_id)
        if not request.seqs:
            make_sequences(request)
        params = request.sampling
        request.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        self.requests[request.request_id] = request
        self.waiting.append(request.seqs[0])

    def adopt(self, request: Request) -> None:
        """A lost replica's request: its sequences keep their tokens and recompute first, as if
        preempted.
        """
        if request.request_id in self.requests:
            raise DuplicateRequestId(request.request_id)
        self.requests[request.request_id] = request
        resumed = [s for s in request.seqs if not s.is_finished and s not in request.pending_forks]
        for seq in reversed(resumed):
            self.kv.disown(seq)
            seq.pending.count = 0  # the steps in flight were lost: their tokens are drawn again
            seq.drafter = None  # drafted again from this replica's n-grams
            seq.mirror = PlanRow()  # its row was the other replica's
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def abort_request(self, request_id: str) -> Request | None:
        """End every sample; blocks return at once. None if not live."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            self.finish(seq, FinishReason.ABORT)
        return request

    def finish(self, seq: Sequence, reason: FinishReason, drop: int = 0) -> None:
        """End seq, blocks back; `drop`: its last tokens came after the one that ended it."""
        if seq.is_finished:
            if reason is FinishReason.STOP and seq.finish_reason is FinishReason.LENGTH:
                seq.finish(reason)
            return
        if drop:
            del seq.token_ids[-drop:]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in seq.request.pending_forks:
            seq.request.pending_forks.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.finish(reason)
        if seq.drafter is not None and reason is not FinishReason.ABORT:
            self.shared_ngrams.learn(seq.token_ids)
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # --- a step's result --------------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: list[int],
        accepted: list[int] | None = None,
        pooled: np.ndarray | None = None,
        failed_loads: set[int] = frozenset(),
    ) -> StepUpdate:
        # sampled: one int per row; accepted: drafts accepted per row (None: none); pooled: fp32
        # rows
        """Apply a step's result: tokens known, stops ended, drafts trimmed, blocks cached, samples
        forked.
        """
        self.kv.settle_loads(out.step_id, failed_loads)
        if out.state_trails:
            self._keep_trails(out)
        result = StepUpdate()
        tokens, running, max_len = result.tokens, SequenceStatus.RUNNING, self.max_model_len
        for i, (item, token) in enumerate(zip(out.scheduled, sampled, strict=True)):
            seq = item.seq
            slow = item.draft or seq.matcher is not None or not item.do_sample
            if slow or seq.status is not running:
                self._apply_row(item, token, accepted[i] if accepted is not None else 0, result)
                continue
            # the common row (a decode, or a prompt's last chunk) samples one token: applied inline
            seq.pending.count -= 1
            known = seq.token_ids
            known.append(token)
            tokens.append((seq, token))
            reason = ends_with(seq, token, len(known) - seq.request.prompt_len, max_len)
            if seq.drafter is not None and reason is None:
                seq.drafter.append((token,))
                seq.drafter.look_ahead()
            self._settle_row(
                item, seq, item.start + item.num_new_tokens, seq.epoch == item.epoch, reason
            )
        if out.read.embed_rows is not None:  # embeddings: their pooled states, and those finished
            result.embedded = take_pooled(out, pooled)
            for seq in result.embedded:
                self.finish(seq, FinishReason.STOP)
        result.kv_events = self.kv.take_kv_events()
        result.num_running, result.num_waiting = len(self.running), len(self.waiting)
        result.num_free_blocks = self.kv.allocator.num_available_blocks
        if (states := self.kv.states) is not None:
            result.num_used_state_slots = states.num_held
        result.kv_tiers = self.kv.tiers.stats() if self.kv.tiers is not None else None
        return result

    def _keep_trails(self, out: SchedulerOutput) -> None:
        """Key a step's decode snapshots now that their blocks' tokens are known."""
        bs = self.block_size
        for row, slot in out.state_trails:
            item = out.scheduled[row]
            seq, at = item.seq, item.start + item.num_new_tokens
            h = seq.block_hash(at // bs - 1, bs) if len(seq.token_ids) >= at else None
            self.kv.states.keep(seq, slot, h)

    def _apply_row(self, item: ScheduledSeq, token: int, accepted: int, result: StepUpdate) -> None:
        seq = item.seq
        if item.do_sample:
            seq.pending.count -= 1
        if seq.is_finished:
            return
        current = seq.epoch == item.epoch and seq.status is SequenceStatus.RUNNING
        end = item.start + item.num_new_tokens
        reason = None
        if item.do_sample:
            if item.draft:
                end = item.start + 1 + accepted  # K/V past the accepted draft is a rejected draft's
                seq.drafter.record(len(item.draft), accepted)
                result.num_draft_rows += 1
                result.num_drafted += len(item.draft)
                result.num_accepted += accepted
            tokens = row_tokens(seq, item.draft, token, accepted)
            kept, reason = stop_at(seq, tokens, self.max_model_len)
            tokens = tokens[:kept]
            end = min(end, len(seq.token_ids) + kept - 1)
            if item.draft and current:
                seq.num_computed_tokens = end
                self.kv.trim(seq, end + 1)  # blocks held only for rejected tokens go back
            seq.token_ids.extend(tokens)
            result.tokens.extend((seq, t) for t in tokens)
            if seq.drafter is not None and reason is None:
                seq.drafter.append(tokens)
                seq.drafter.look_ahead()
        self._settle_row(item, seq, end, current, reason)

    def _settle_row(
        self, item: ScheduledSeq, seq: Sequence, end: int, current: bool, reason
    ) -> None:
        """A row's tokens are in: cache full blocks, fork samples, end on a stop."""
        if current and self.caching and end // self.block_size > seq.num_registered_blocks:
            self.kv.register_full_blocks(seq, end)
        if item.do_sample and seq.index == 0 and seq.request.pending_forks:
            self._fork(seq, current)
        if reason is not None:
            self.finish(seq, reason)

    def _fork(self, leader: Sequence, leader_current: bool) -> None:
        """Samples 1..n-1 share the leader's prompt blocks; those over max_num_seqs wait at the
        head.
        """
        request = leader.request
        # a recurrent state cannot be shared: a hybrid's samples each compute the prompt
        shares = leader_current and self.kv.states is None
        room = max(0, self.config.max_num_seqs - len(self.running)) if shares else 0
        forks, queued = request.pending_forks[:room], request.pending_forks[room:]
        self.kv.fork(leader, forks)
        for seq in forks:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(queued))
        request.pending_forks = []

    # --- accounting ------------------------------------------------------------------------------
    def pool_stats(self) -> PoolStats:
        """The pool's books now: blocks by state, queues,
        prefix-cache lookups, preemptions, tiers.
        """
        a = self.kv.allocator
        return PoolStats(
            a.num_blocks,
            a.num_free_blocks,
            a.num_available_blocks,
            a.num_used_blocks,
            a.num_cached_blocks,
            a.num_shared_blocks,
            len(self.running),
            len(self.waiting),
            sum(s.num_uncomputed_tokens for s in self.waiting),
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.kv.tiers.stats() if self.kv.tiers is not None else None,
            *((st.num_slots, st.num_held, st.num_snapshots) if (st := self.kv.states) else ()),
        )

    def gauges(self) -> PoolGauges:
        """The books /metrics shows, as they stand now (lengths and counters only)."""
        a, states = self.kv.allocator, self.kv.states
        return PoolGauges(
            len(self.running),
            len(self.waiting),
            a.num_available_blocks,
            a.num_blocks,
            states.num_held if states is not None else 0,
        )

    def request_blocks(self, request: Request) -> int:
        """Distinct blocks a request holds (samples share their prompt's blocks)."""
        return self.kv.request_blocks(request)

    def check_invariants(self) -> None:
        """The pool balances, tables match states, plan rows mirror tables."""
        self.kv.check_invariants(self.running, self.waiting)
        self.planner.check(self.running)
