"""The step loop of one replica: a worker group and the scheduler that owns its pool; replicas step
concurrently in one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol

import numpy as np
import structlog

from protos.codec import CodecError, encode_mask, encode_plan
from protos.result_codec import decode_accepted, decode_load_failed, decode_pooled, decode_result
from scheduler_service.core.batch import SchedulerOutput
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request
from scheduler_service.core.stats import PoolGauges, PoolStats
from scheduler_service.runtime.step_results import (
    Flight,
    StepProfile,
    StepReport,
    apply_text,
    read_logprobs,
)
from scheduler_service.runtime.worker_client import (
    WorkerClient,
    WorkerError,
    WorkerGroup,
    WorkerLost,
)
from scheduler_service.text.output import SampleOutput

log = structlog.get_logger("scheduler.replica")


class StepSink(Protocol):
    """Where a step loop reports (the engine)."""

    def on_step(self, loop: StepLoop, report: StepReport) -> None: ...

    def on_step_failed(self, loop: StepLoop, out: SchedulerOutput, message: str) -> None: ...

    def on_unschedulable(self, loop: StepLoop, request: Request, message: str) -> None: ...

    async def on_lost(self, loop: StepLoop, message: str) -> None: ...


# Routing load: a waiting sequence counts as this many running ones (its replica is full).
WAITING_WEIGHT = 4


class StepLoop:
    """Schedule, plan, send (with overlap, the next before this result), apply, report; a failed
    step fails only its requests.
    """

    def __init__(
        self,
        index: int,
        config: SchedulerConfig,
        client: WorkerClient,
        sink: StepSink,
        hidden_size: int = 0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """hidden_size: the length of what a pooling row gives back; eos_token_ids: the model's."""
        self.index = index
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.client = client
        self.sink = sink
        self.hidden_size = hidden_size
        self._sched: Scheduler | None = None
        # by sequence id: each live sample's text and stops
        self._samples: dict[int, SampleOutput] = {}
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
        s = self._sched
        return WAITING_WEIGHT * len(s.waiting) + len(s.running) if s else 0

    @property
    def num_waiting(self) -> int:
        return len(self._sched.waiting) if self._sched else 0

    @property
    def num_blocks(self) -> int:
        return self._sched.num_blocks if self._sched else 0

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt this replica's prefix cache
        holds (read-only: no LRU touch).
        """
        return self._sched.kv.cached_blocks(hashes) if self._sched else 0

    # --- requests ---------------------------------------------------------------------------------
    def submit(self, request: Request, samples: list[SampleOutput]) -> None:
        """A new request (its sequences made), and the text side of each of its samples."""
        self._sched.add_request(request)
        self._samples.update((o.seq.seq_id, o) for o in samples)
        self.num_routed += 1
        self.wake()

    def adopt(self, request: Request, samples: list[SampleOutput]) -> None:
        """A lost replica's live request, recomputed here."""
        self._sched.adopt(request)
        self._samples.update((o.seq.seq_id, o) for o in samples if not o.seq.is_finished)
        self.wake()

    def abort(self, request_id: str) -> None:
        """End every sample of a live request; its blocks return at once."""
        if self._sched is None:
            return
        request = self._sched.abort_request(request_id)
        for seq in request.seqs if request else ():
            self._samples.pop(seq.seq_id, None)

    def live_requests(self) -> list[Request]:
        """Every live request, oldest first."""
        return (
            sorted(self._sched.requests.values(), key=lambda r: r.arrival_time)
            if self._sched
            else []
        )

    def reset_prefix_cache(self) -> tuple[int, list[tuple]]:
        """Forget every cached prefix: how many blocks, and the prefix
        cache's events that says so.
        """
        if self._sched is None:
            return 0, []
        self.wake()  # the tiers' deletes go in the next step, even on an idle replica
        return self._sched.kv.reset_prefix_cache(), self._sched.kv.take_kv_events()

    # --- lifecycle -------------------------------------------------------------------------------
    def attach(self, max_model_len: int) -> None:
        """A group was accepted: start serving with a fresh scheduler sized to its pool."""
        self.serve(
            Scheduler(
                self.config,
                self.group.num_blocks,
                max_model_len,
                kv_window=self.group.handshake.kv_window,
                tiers=self.group.kv_tiers(self.config.block_size),
                eos_token_ids=self.eos_token_ids,
            )
        )
        log.info(
            "replica_serving",
            replica=self.index,
            num_blocks=self.group.num_blocks,
            pids=self.group.pids,
        )

    def serve(self, sched: Scheduler) -> None:
        """Start stepping `sched`, whose pool is the group's."""
        self._sched = sched
        # KV-event subscribers learn that this replica's cache starts empty (published after its
        # first step).
        sched.kv.record_kv_events()
        self._samples = {}
        self.down_reason = None
        self.profile = StepProfile()
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"replica-{self.index}"
        )

    async def detach(self, reason: str) -> None:
        """End the loop, drop the group, forget the scheduler."""
        self.down_reason = reason
        self._sched = None
        self._samples = {}
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None
        await self.client.drop_group(self.index, reason)
        log.error("replica_down", replica=self.index, reason=reason)

    async def stop(self) -> None:
        log.info("step_profile", replica=self.index, **self.profile.as_dict(), final=True)
        if self._task:
            self._task.cancel()
            # (cancelled, or failed: it is done)
            await asyncio.gather(self._task, return_exceptions=True)

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
        """At most two steps in flight, so the scheduler's time hides behind the workers'."""
        sched = self._sched
        depth = 2 if self.config.overlap else 1
        inflight: deque[Flight] = deque()
        last_profile_log = time.monotonic()
        try:
            while True:
                launched = False
                if sched.has_work and len(inflight) < depth:
                    t0 = time.perf_counter()
                    out = sched.schedule()
                    for seq in out.preempted:
                        log.info(
                            "preempted",
                            request_id=seq.request.request_id,
                            index=seq.index,
                            tokens=seq.num_tokens,
                            replica=self.index,
                        )
                    if not out.is_empty:
                        t1 = time.perf_counter()
                        plan = encode_plan(sched.build_plan(out))
                        t2 = time.perf_counter()
                        behind = inflight[-1].limit if inflight else 0.0
                        flight = Flight(out, t0, t1, t2, self.client.step_limit(plan) + behind)
                        flight.task = asyncio.get_running_loop().create_task(
                            self.client.execute(
                                self.index, plan, queued_behind=behind, sent=flight.sent
                            )
                        )
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
                if not await self._land(sched, inflight.popleft()):
                    return
                # its masks waited for the step just applied (failed or not)
                for flight in inflight:
                    await self._send_masks(flight)
                if time.monotonic() - last_profile_log > self.config.step_profile_interval:
                    last_profile_log = time.monotonic()
                    log.info(
                        "step_profile",
                        replica=self.index,
                        **self.profile.as_dict(),
                        running=len(sched.running),
                        waiting=len(sched.waiting),
                    )
        finally:
            for flight in inflight:
                flight.task.cancel()

    async def _land(self, sched: Scheduler, flight: Flight) -> bool:
        """Await a step's result and apply it; False when the replica is lost."""
        t_wait = time.perf_counter()
        out = flight.out
        try:
            result = await flight.task
            tokens = decode_result(result, len(out.scheduled)).tolist()
            accepted = decode_accepted(result, len(out.scheduled))
            accepted = accepted.tolist() if accepted is not None else None
            logprobs = read_logprobs(out, result)
            read = out.read
            pooled = (
                decode_pooled(result, int(np.count_nonzero(read.pooling)), self.hidden_size)
                if read.pooling is not None
                else None
            )
            failed = decode_load_failed(
                result, read.kv_ops.num_loads if read.kv_ops is not None else 0
            )
        except WorkerLost as e:
            await self.sink.on_lost(self, str(e))
            return False
        except (WorkerError, CodecError) as e:
            # Its requests fail, and so do those of a step behind it that needs its tokens.
            log.error("step_failed", replica=self.index, step_id=out.step_id, error=str(e))
            sched.kv.step_failed(out.step_id, out.state_saves)
            self.sink.on_step_failed(self, out, str(e))
            return True
        t3 = time.perf_counter()
        update = sched.update(out, tokens, accepted, pooled, failed)
        sched.observe(
            out, result.time_prepare + result.time_forward + result.time_sample, result.time_kv
        )
        deltas, gaps = apply_text(self._samples, sched, update, logprobs)
        self.sink.on_step(self, StepReport(out, update, deltas, gaps, t3 - flight.t2))
        t4 = time.perf_counter()
        self.num_generated_tokens += len(update.tokens)
        self.num_embeddings += len(update.embedded)
        self.num_prompt_tokens_computed += out.num_prefill_tokens
        self.num_draft_rows += update.num_draft_rows
        self.num_drafted_tokens += update.num_drafted
        self.num_accepted_tokens += update.num_accepted
        self.profile.add(flight, result, t_wait, t3, t4)
        if self.config.debug_invariants:
            sched.check_invariants()
        return True

    async def _send_masks(self, flight: Flight) -> None:
        """Masks of a mask_follows step, once the step before is applied."""
        masks = flight.out.read.deferred_masks
        if masks is None or flight.masks_sent:
            return
        flight.masks_sent = True
        t0 = time.perf_counter()
        mask = encode_mask(flight.out.step_id, masks.fill())
        self.profile.masks += time.perf_counter() - t0
        await flight.sent.wait()
        await self.client.send_mask(self.index, mask)

    async def _no_progress(self, sched: Scheduler) -> None:
        """The queue's head can never be admitted: it gets an error, not endless retries."""
        free = sched.pool_stats().num_available_blocks
        log.error(
            "no_progress",
            replica=self.index,
            waiting=len(sched.waiting),
            running=len(sched.running),
            free_blocks=free,
        )
        if not sched.running and sched.waiting:
            head = sched.waiting[0]
            self.sink.on_unschedulable(
                self,
                head.request,
                (
                    f"the request cannot be scheduled: its next step needs more than the "
                    f"{free} free KV blocks of an otherwise idle pool"
                ),
            )
        else:
            await asyncio.sleep(0.05)

    def pool_stats(self) -> PoolStats | None:
        """The scheduler's books now; None while the replica is down."""
        return self._sched.pool_stats() if self._sched else None

    def gauges(self) -> PoolGauges | None:
        """The books /metrics shows, now; None while the replica is down."""
        sched = self._sched
        return sched.gauges() if sched is not None else None

    def request_rows(self) -> list[dict]:
        """Each live request's blocks, bytes and computed tokens (GetCacheStats' rows)."""
        if self._sched is None:
            return []
        bpb = self.group.bytes_per_block
        rows = []
        for rid, req in self._sched.requests.items():
            blocks = self._sched.request_blocks(req)
            rows.append(
                {
                    "request_id": rid,
                    "num_blocks": blocks,
                    "replica": self.index,
                    "num_bytes": blocks * bpb,
                    "num_tokens": sum(s.num_computed_tokens for s in req.seqs),
                }
            )
        return rows
