"""One data-parallel replica: a worker group, its own scheduler (allocator, page tables, prefix cache) and
its own step loop. Replicas step concurrently in one event loop: a step in flight is an await on the
wire, so a replica whose workers are slow never holds up another's.

The loop: schedule a step, build its plan, send it; with overlap on (the default), schedule and send the
next step before awaiting this one's result (see `_steps`); apply each result in order and hand the new
tokens to the engine (which streams them). A failed step fails only its requests; a lost rank takes the
replica down (the engine decides what happens to its requests) until a new group joins.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import structlog

from protos.codec import (
    CodecError,
    decode_accepted,
    decode_logprobs,
    decode_pooled,
    decode_result,
    encode_mask,
    encode_plan,
)
from scheduler_service.core.block_allocator import block_hash
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler, SchedulerOutput
from scheduler_service.runtime.worker_client import WorkerClient, WorkerError, WorkerGroup, WorkerLost
from scheduler_service.text.output import TokenLogprob

log = structlog.get_logger("scheduler.replica")


@dataclass
class StepProfile:
    """Where the time of a replica's steps went, cumulative seconds."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    schedule: float = 0.0
    build_plan: float = 0.0
    round_trip: float = 0.0  # plan sent -> result received (with overlap, includes time queued behind a step)
    wait: float = 0.0  # the step loop blocked on a result: what the scheduler did not hide behind the workers
    worker_prepare: float = 0.0
    worker_forward: float = 0.0
    worker_sample: float = 0.0
    process_output: float = 0.0
    masks: float = 0.0  # structured-output masks that followed their plans
    draft: float = 0.0  # making drafts (part of schedule)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class _Flight:
    """A step sent to the workers whose result has not been applied yet."""

    out: SchedulerOutput
    t0: float  # scheduling began
    t1: float  # plan building began
    t2: float  # sent
    limit: float  # seconds the workers have for it once they start it
    task: asyncio.Task | None = field(default=None, repr=False)
    # Set once its plan is on the socket; its structured-output masks, when they follow the plan, go after.
    sent: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    masks_sent: bool = False


# Routing load: a waiting sequence counts as this many running ones (it is a whole prefill away from
# its first token, and its being there means the replica is full).
WAITING_WEIGHT = 4


def prompt_block_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks that prefix caching could reuse (never the last token)."""
    hashes: list[bytes] = []
    for i in range((len(prompt) - 1) // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None, prompt[i * block_size:(i + 1) * block_size]))
    return hashes


def read_logprobs(out: SchedulerOutput, result) -> dict[int, TokenLogprob] | None:
    """The step result's logprobs: those of sampled tokens by sequence id; prompt logprobs are stored in
    their requests at once (positions recomputed after a preemption overwrite theirs with the same values).
    Raises CodecError when the arrays do not match what the plan asked for."""
    by_seq = None
    if out.logprobs_k is not None:
        k = out.logprobs_k
        rows = np.flatnonzero(k >= 0)
        lp = decode_logprobs(result, "logprobs", rows.size, int(k[rows].sum()))
        if lp is not None:
            by_seq, at = {}, 0
            chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
            for n, row in enumerate(rows.tolist()):
                seq, kk = out.scheduled[row].seq, int(k[row])
                by_seq[seq.seq_id] = TokenLogprob(-1, chosen[n],
                                                  list(zip(ids[at:at + kk], values[at:at + kk], strict=True)))
                at += kk
    if out.prompt_logprobs is not None:
        k, counts = out.prompt_logprobs
        rows = np.flatnonzero(counts > 0)
        total = int(counts.sum())
        lp = decode_logprobs(result, "prompt_logprobs", total, int((counts[rows] * k[rows]).sum()))
        chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
        pos = top_at = 0
        for row in rows.tolist():
            item = out.scheduled[row]
            request, kk = item.seq.request, int(k[row])
            for j in range(item.start + 1, item.start + 1 + int(counts[row])):
                top = list(zip(ids[top_at:top_at + kk], values[top_at:top_at + kk], strict=True))
                request.prompt_logprobs[j] = TokenLogprob(request.prompt_token_ids[j], chosen[pos], top)
                pos += 1
                top_at += kk
    return by_seq


class StepLoop:
    def __init__(self, index: int, config: SchedulerConfig, client: WorkerClient, sink,
                 hidden_size: int = 0) -> None:
        """hidden_size: the length of what a pooling row gives back. sink: the engine; gets `on_step(replica,
        out, new_tokens, seconds)`, `on_step_failed(replica, out, error)`, `on_unschedulable(replica, request,
        error)` and `await on_lost(replica, error)`."""
        self.index = index
        self.config = config
        self.client = client
        self.sink = sink
        self.hidden_size = hidden_size
        self.scheduler: Scheduler | None = None
        self.down_reason: str | None = "workers not connected yet"
        self.profile = StepProfile()
        self.num_routed = 0
        # Since the service started, across reattachments (GetCacheStats' counters).
        self.num_generated_tokens = 0
        self.num_embeddings = 0  # vectors finished
        self.num_prompt_tokens_computed = 0
        self.num_draft_rows = 0  # rows that verified a draft
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def group(self) -> WorkerGroup:
        return self.client.groups[self.index]

    @property
    def is_serving(self) -> bool:
        return self.down_reason is None

    @property
    def load(self) -> int:
        s = self.scheduler
        return WAITING_WEIGHT * len(s.waiting) + len(s.running) if s else 0

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt this replica's prefix cache holds (read-only: no LRU touch)."""
        if self.scheduler is None:
            return 0
        n = 0
        for h in hashes:
            if self.scheduler.allocator.lookup(h) is None:
                break
            n += 1
        return n

    # --- lifecycle -------------------------------------------------------------------------------
    def attach(self, max_model_len: int) -> None:
        """A group was accepted: start serving with a fresh scheduler sized to its pool."""
        self.scheduler = Scheduler(self.config, self.group.num_blocks, max_model_len,
                                   kv_window=self.group.handshake.kv_window)
        # KV-event subscribers learn that this replica's cache starts empty (published after its first step).
        self.scheduler.allocator.events = [("cleared",)]
        self.down_reason = None
        self.profile = StepProfile()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"replica-{self.index}")
        log.info("replica_serving", replica=self.index, num_blocks=self.group.num_blocks,
                 pids=self.group.pids)

    async def detach(self, reason: str) -> None:
        """Stop serving: end the step loop, drop the group (survivors are told to exit), forget the
        scheduler."""
        self.down_reason = reason
        self.scheduler = None
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None
        await self.client.drop_group(self.index, reason)
        log.error("replica_down", replica=self.index, reason=reason)

    async def stop(self) -> None:
        log.info("step_profile", replica=self.index, **self.profile.as_dict(), final=True)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass

    def wake(self) -> None:
        self._wake.set()

    # --- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead loop must not leave requests hanging
            log.exception("replica_loop_failed", replica=self.index)
            await self.sink.on_lost(self, f"replica {self.index} loop error: {e!r}")

    async def _steps(self) -> None:
        """Schedule, plan and send a step; with overlap on, plan and send the next one before awaiting this
        one's result, so the workers find the next plan queued when they finish (the scheduler's own time
        is hidden behind theirs). At most two steps are in flight."""
        sched = self.scheduler
        depth = 2 if self.config.overlap else 1
        inflight: deque[_Flight] = deque()
        last_profile_log = time.monotonic()
        try:
            while True:
                launched = False
                if sched.has_work and len(inflight) < depth:
                    t0 = time.perf_counter()
                    out = sched.schedule()
                    for seq in out.preempted:
                        log.info("preempted", request_id=seq.request.request_id, index=seq.index,
                                 tokens=seq.num_tokens, replica=self.index)
                    if not out.is_empty:
                        t1 = time.perf_counter()
                        plan = encode_plan(sched.build_plan(out))
                        t2 = time.perf_counter()
                        behind = inflight[-1].limit if inflight else 0.0
                        flight = _Flight(out, t0, t1, t2, self.client.step_limit(plan) + behind)
                        flight.task = asyncio.get_running_loop().create_task(
                            self.client.execute(self.index, plan, queued_behind=behind, sent=flight.sent))
                        inflight.append(flight)
                        launched = True
                    elif not inflight:
                        await self._no_progress(sched)
                        continue
                if not inflight:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if launched and len(inflight) < depth and sched.has_work:
                    continue  # room for one more in flight: plan it before waiting
                if not await self._finish(sched, inflight.popleft()):
                    return
                for flight in inflight:  # its masks waited for the step just applied (failed or not)
                    await self._send_masks(flight)
                if time.monotonic() - last_profile_log > self.config.step_profile_interval:
                    last_profile_log = time.monotonic()
                    log.info("step_profile", replica=self.index, **self.profile.as_dict(),
                             running=len(sched.running), waiting=len(sched.waiting))
        finally:
            for flight in inflight:
                flight.task.cancel()

    async def _finish(self, sched: Scheduler, flight: _Flight) -> bool:
        """Await a step's result and apply it; False when the replica is lost."""
        t_wait = time.perf_counter()
        out = flight.out
        try:
            result = await flight.task
            tokens = decode_result(result, len(out.scheduled)).tolist()
            accepted = decode_accepted(result, len(out.scheduled))
            accepted = accepted.tolist() if accepted is not None else None
            logprobs = read_logprobs(out, result)
            pooled = (decode_pooled(result, int(np.count_nonzero(out.pooling)), self.hidden_size)
                      if out.pooling is not None else None)
        except WorkerLost as e:
            await self.sink.on_lost(self, str(e))
            return False
        except (WorkerError, CodecError) as e:
            # Its requests fail; a step planned behind it that needs its tokens is refused by the worker,
            # and fails its own requests in turn.
            log.error("step_failed", replica=self.index, step_id=out.step_id, error=str(e))
            self.sink.on_step_failed(self, out, str(e))
            return True
        t3 = time.perf_counter()
        new_tokens = sched.update(out, tokens, accepted, pooled)
        other_prefill = out.num_prefill_tokens - out.num_embed_tokens
        sched.pacer.observe(out.num_decodes, out.num_embed_tokens, other_prefill,
                            result.time_prepare + result.time_forward + result.time_sample)
        self.sink.on_step(self, out, new_tokens, t3 - flight.t2, logprobs)
        t4 = time.perf_counter()
        self.num_generated_tokens += len(new_tokens)
        self.num_embeddings += len(out.embedded)
        self.num_prompt_tokens_computed += out.num_prefill_tokens
        self.num_draft_rows += out.num_draft_rows
        self.num_drafted_tokens += out.num_drafted
        self.num_accepted_tokens += out.num_accepted
        p = self.profile
        p.steps += 1
        p.tokens += out.num_tokens
        p.prefill_tokens += out.num_prefill_tokens
        p.schedule += flight.t1 - flight.t0
        p.draft += out.draft_seconds
        p.build_plan += flight.t2 - flight.t1
        p.round_trip += t3 - flight.t2
        p.wait += t3 - t_wait
        p.worker_prepare += result.time_prepare
        p.worker_forward += result.time_forward
        p.worker_sample += result.time_sample
        p.process_output += t4 - t3
        if self.config.debug_invariants:
            sched.check_invariants()
        return True

    async def _send_masks(self, flight: _Flight) -> None:
        """Compute the masks of a step sent with mask_follows from its matchers as they are now and send them,
        after its plan and before any later plan. Called once the step before it is applied; if that step
        failed, its requests were ended and whatever this step draws for them is dropped."""
        if flight.out.deferred_masks is None or flight.masks_sent:
            return
        flight.masks_sent = True
        t0 = time.perf_counter()
        engine, matchers, drafted = flight.out.deferred_masks
        mask = encode_mask(flight.out.step_id, engine.fill_masks(matchers, drafted))
        self.profile.masks += time.perf_counter() - t0
        await flight.sent.wait()
        await self.client.send_mask(self.index, mask)

    async def _no_progress(self, sched: Scheduler) -> None:
        """Nothing runs and the head of the queue cannot be admitted: it can never be, so it gets an error
        rather than a retry forever (validated sizes make this a last line of defence)."""
        log.error("no_progress", replica=self.index, waiting=len(sched.waiting),
                  running=len(sched.running), free_blocks=sched.allocator.num_available_blocks)
        if not sched.running and sched.waiting:
            head = sched.waiting[0]
            self.sink.on_unschedulable(self, head.request, (
                f"the request cannot be scheduled: its next step needs more than the "
                f"{sched.allocator.num_available_blocks} free KV blocks of an otherwise idle pool"))
        else:
            await asyncio.sleep(0.05)

    # --- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """This replica's pool accounting (zeros while it is down)."""
        s = self.scheduler
        group = self.group
        bpb = group.bytes_per_block if group.is_ready else 0
        row = {"replica": self.index, "serving": self.is_serving, "status": self.down_reason or "serving",
               "num_requests": self.num_routed, "worker_pids": group.pids if group.is_ready else [],
               "bytes_per_block": bpb, "num_generated_tokens": self.num_generated_tokens,
               "num_embeddings": self.num_embeddings,
               "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
               "num_draft_verifications": self.num_draft_rows, "num_draft_tokens": self.num_drafted_tokens,
               "num_accepted_draft_tokens": self.num_accepted_tokens}
        if s is None:
            return row
        a = s.allocator
        row.update(
            num_blocks=a.num_blocks, num_free_blocks=a.num_free_blocks, num_cached_blocks=a.num_cached_blocks,
            used_bytes=a.num_used_blocks * bpb, total_bytes=a.num_blocks * bpb,
            utilization=a.num_used_blocks / a.num_blocks, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            num_running=len(s.running), num_waiting=len(s.waiting), num_shared_blocks=a.num_shared_blocks,
        )
        return row
