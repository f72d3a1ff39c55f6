"""A step's result applied to the scheduler's state: pending tokens become known (a drafting row's accepted
draft, then its sampled token), blocks held only for rejected drafts go back, newly full blocks are offered
to the prefix cache, samples waiting on their prompt fork, embeddings take their pooled rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler_service.core.batch import SchedulerOutput, StepUpdate
from scheduler_service.core.pooling import take_pooled
from scheduler_service.core.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:  # the scheduler calls in here; only its type is named
    from scheduler_service.core.scheduler import Scheduler


def apply_result(sched: Scheduler, out: SchedulerOutput, sampled: list[int], accepted: list[int] | None,
                 pooled: np.ndarray | None) -> StepUpdate:
    # sampled: Python ints, one per scheduled row (numpy's tolist() gives them); accepted: drafted tokens
    # each row accepted (None: the step drafted nothing); pooled: fp32 [pooling rows, hidden]
    """Reconcile a step with its result: pending tokens become known (a drafting row's accepted draft,
    then its sampled token; the slots and blocks past them are given back), newly full blocks of
    confirmed tokens are offered to the prefix cache, pending samples fork. Returns (seq, token) for
    every token a sequence got, in order. A sequence that finished (stopped, aborted) since the step was
    planned gets nothing; one preempted since keeps its tokens (computed from its blocks as they were)
    but its blocks, given back, are left alone. Stop conditions on the text are the caller's: it ends
    a sequence with `finish`."""
    result = StepUpdate()
    new_tokens = result.tokens
    caching, bs = sched.config.enable_prefix_caching, sched.block_size
    finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
    for i, (item, token) in enumerate(zip(out.scheduled, sampled, strict=True)):
        seq = item.seq
        if item.do_sample:
            seq.pending.count -= 1
        if seq.status is finished:
            continue
        current = seq.epoch == item.epoch and seq.status is running
        end = item.start + item.num_new_tokens
        tokens = (token,)
        if item.draft:
            n = accepted[i] if accepted is not None else 0
            tokens = (*item.draft[:n], token)
            end = item.start + 1 + n  # K/V past the accepted draft is a rejected draft's
            seq.drafter.record(len(item.draft), n)
            result.num_draft_rows += 1
            result.num_drafted += len(item.draft)
            result.num_accepted += n
        if item.do_sample:
            if seq.matcher is not None:  # (a grammar that ends inside the tokens ends the sample there)
                tokens = consume(seq, tokens)
                end = min(end, len(seq.token_ids) + len(tokens) - 1)
            if item.draft and current:
                seq.num_computed_tokens = end
                if sched.kv.trim(seq, end + 1):  # blocks held only for rejected tokens go back
                    sched.planner.trimmed(seq)
            seq.token_ids.extend(tokens)
            for t in tokens:
                new_tokens.append((seq, t))
            if seq.drafter is not None:
                seq.drafter.append(tokens)
                seq.drafter.look_ahead()
        if current and caching and end // bs > seq.num_registered_blocks:
            sched.kv.register_full_blocks(seq, end)
        if item.do_sample and seq.index == 0 and seq.request.pending_forks:
            fork_samples(sched, seq, current)
    if out.embed_rows is not None:  # embeddings: their pooled states, and those finished
        result.embedded = take_pooled(out, pooled)
        for seq in result.embedded:
            sched.finish(seq, FinishReason.STOP)
    result.kv_events = sched.kv.take_kv_events()
    result.num_running, result.num_waiting = len(sched.running), len(sched.waiting)
    result.num_free_blocks = sched.kv.allocator.num_available_blocks
    return result

def consume(seq: Sequence, tokens: tuple[int, ...]) -> tuple[int, ...]:
    """seq's grammar matcher takes its new tokens in turn, up to the one that completes or breaks it (a
    refused token leaves it in error: the output ends the sample there). The tokens it took."""
    for n, t in enumerate(tokens, 1):
        seq.matcher.consume_token(t)
        if seq.matcher.is_stopped() or seq.matcher.is_error():
            return tokens[:n]
    return tokens


def fork_samples(sched: Scheduler, leader: Sequence, leader_current: bool) -> None:
    """Samples 1..n-1 share the leader's prompt blocks and recompute only the last prompt token. Those
    beyond max_num_seqs wait at the head of the queue instead, where admission finds the prompt's
    full blocks in the prefix cache; so do all of them when the leader lost its blocks (preempted while
    its first token was in flight)."""
    request = leader.request
    room = max(0, sched.config.max_num_seqs - len(sched.running)) if leader_current else 0
    forks, queued = request.pending_forks[:room], request.pending_forks[room:]
    sched.kv.fork(leader, forks)
    for seq in forks:
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        sched.planner.attach(seq)
    sched.waiting.extendleft(reversed(queued))
    request.pending_forks = []
