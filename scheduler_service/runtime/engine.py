"""The engine: routes requests to replicas, streams their outputs, owns
what spans the step loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from scheduler_service.core.adapters import AdapterRegistry
from scheduler_service.core.batch import DuplicateRequestId, SchedulerOutput, make_sequences
from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.core.sequence import FinishReason, Request
from scheduler_service.runtime import reporting
from scheduler_service.runtime.errors import (
    Draining,
    EngineUnavailable,
    QueueFull,
    StepFailed,
    Unschedulable,
)
from scheduler_service.runtime.groups import (
    adopted_config,
    context_limit,
    group_problem,
    lora_problem,
)
from scheduler_service.runtime.kv_events import KvEventPublisher
from scheduler_service.runtime.metrics import Metrics
from scheduler_service.runtime.orphans import Failover, Orphans
from scheduler_service.runtime.step_loop import StepLoop
from scheduler_service.runtime.step_results import StepReport, prompt_block_hashes
from scheduler_service.runtime.worker_client import WorkerClient, WorkerGroup
from scheduler_service.text.limits import Limits
from scheduler_service.text.output import Delta, DeltaQueue, SampleOutput, Usage
from scheduler_service.text.structured import GrammarEngine
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("scheduler.engine")


@dataclass
class RequestStream:
    request: Request
    samples: list[SampleOutput]
    replica: StepLoop | None  # None while its replica was lost and no other has taken it yet
    queue: DeltaQueue = field(default_factory=DeltaQueue)
    num_open: int = 0  # samples whose last delta has not been sent
    started: bool = False  # a delta has been sent

    def __post_init__(self) -> None:
        self.num_open = len(self.samples)


class Engine(Failover):
    """Routes to the replica with the longest cached prefix unless its load exceeds the least's by
    `route_slack`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        client: WorkerClient,
        worker_restart_timeout: float = 120.0,
    ) -> None:
        self.config = config
        self.spec = spec
        self.tokenizer = tokenizer
        self.client = client
        self.replicas = [
            StepLoop(d, config, client, self, spec.hidden_size, spec.eos_token_ids)
            for d in range(len(client.groups))
        ]
        self.limits: Limits | None = None
        self.streams: dict[str, RequestStream] = {}
        self.metrics = Metrics()
        for loop in self.replicas:
            self.metrics.watch(loop.index, loop.gauges)
        self.kv_events = KvEventPublisher()
        self.started_at = time.time()
        self._starting_reason = "workers not connected yet"
        self._monitor: asyncio.Task | None = None
        self._draining = False
        # each change of "any replica serving" after start, in order (gRPC health follows it)
        self.health_changes: asyncio.Queue[bool] = asyncio.Queue()
        self._was_serving = False
        self.worker_restart_timeout = worker_restart_timeout
        self._orphans = Orphans(worker_restart_timeout)
        self.adapters: AdapterRegistry | None = None  # LoRA adapters by name (core/adapters.py)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, worker_timeout: float) -> None:
        self.client.attach(self)
        await self.client.wait_for_workers(worker_timeout)
        groups = self.client.groups
        self._adopt_max_num_seqs(groups)
        self.limits = Limits(
            self.spec.vocab_size,
            context_limit(self.spec, groups[0]),
            min(g.num_blocks for g in groups),
            self.config.block_size,
            self.tokenizer.max_token_bytes,
            self.spec.eos_token_ids,
            GrammarEngine(self.tokenizer.to_json(), self.spec.vocab_size, self.spec.eos_token_ids),
            kv_window=groups[0].handshake.kv_window,
            step_tokens=self.config.max_num_batched_tokens,
            default_max_tokens=self.config.default_max_tokens,
        )
        for replica in self.replicas:
            replica.attach(self.limits.max_context)
        self._was_serving = True
        self._monitor = asyncio.get_running_loop().create_task(
            self._watch_workers(), name="worker-monitor"
        )

    def _adopt_max_num_seqs(self, groups) -> None:
        """Where --max-num-seqs was left to the workers, the smallest they proposed."""
        # and no more LoRA adapters at once than they keep
        adopted = adopted_config(self.config, groups)
        if adopted != self.config:
            self.config = adopted
            for replica in self.replicas:
                replica.config = self.config
            log.info(
                "adopted_from_workers",
                max_num_seqs=adopted.max_num_seqs,
                max_loras=adopted.max_loras,
                state_slots=adopted.state_slots,
                prefix_caching=adopted.enable_prefix_caching,
                speculative=adopted.speculative,
            )

    async def _watch_workers(self, interval: float = 0.5) -> None:
        """Find ranks gone silent while idle (a step in flight checks its own)."""
        while True:
            await asyncio.sleep(interval)
            for d, reason in self.client.find_lost():
                await self.on_lost(self.replicas[d], reason)
            self._expire_orphans()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait up to `timeout` for running ones; True if all finished."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.streams.values())
        for stream in left:
            self._fail_request(
                stream.request,
                EngineUnavailable(
                    "the server is shutting down and this request did not finish within its "
                    f"{timeout:g}s drain"
                ),
            )
        await asyncio.sleep(0)  # let the handlers send what they were given
        return not left

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for replica in self.replicas:
            await replica.stop()
        for rid in list(self.streams):
            self.abort(rid)
        await self.client.close()

    # --- the worker client's events (runtime/worker_client.py GroupEvents) ------------------------
    def check_group(self, group: WorkerGroup) -> str:
        """Why a complete worker group cannot serve this model, or ""."""
        return group_problem(group, self.spec, self.config, self.limits) or lora_problem(
            group, self.adapters
        )

    def group_ready(self, group: WorkerGroup) -> None:
        """A replica's group rejoined after start (a restarted worker group); start attaches the
        first.
        """
        if self.limits is None:
            return
        self.replicas[group.replica].attach(self.limits.max_context)
        self._report_health()
        self._resume_orphans()

    def _report_health(self) -> None:
        if self.is_serving != self._was_serving:
            self._was_serving = self.is_serving
            self.health_changes.put_nowait(self.is_serving)

    @property
    def is_serving(self) -> bool:
        return any(r.is_serving for r in self.replicas)

    @property
    def is_draining(self) -> bool:  # stopping: running requests finish, new ones are refused
        return self._draining

    @property
    def unavailable_reason(self) -> str | None:
        if self.is_serving:
            return None
        reasons = {r.down_reason for r in self.replicas}
        return "; ".join(sorted(reasons)) if self.limits else self._starting_reason

    # --- requests --------------------------------------------------------------------------------
    def route(self, request: Request) -> StepLoop:
        """The replica a new request goes to (see the module docstring)."""
        if self._draining:
            raise Draining()
        return self._pick(request)

    def _pick(self, request: Request) -> StepLoop:
        serving = [r for r in self.replicas if r.is_serving]
        if not serving:
            raise EngineUnavailable(self.unavailable_reason)
        least = min(serving, key=lambda r: (r.load, r.num_routed))
        if len(serving) == 1 or not self.config.enable_prefix_caching:
            return least
        hashes = prompt_block_hashes(
            request.prompt_token_ids,
            self.config.block_size,
            request.lora.hash_root if request.lora is not None else None,
        )
        hits = {r.index: r.cached_blocks(hashes) for r in serving}
        best = max(serving, key=lambda r: (hits[r.index], -r.load))
        if hits[best.index] and best.load <= least.load + self.config.route_slack:
            return best
        return least

    async def generate(self, request: Request) -> AsyncIterator[Delta]:
        """Yield a request's deltas until every sample ends; leaving early aborts it."""
        if self._draining:
            raise Draining()
        waiting = len(self._orphans) + sum(r.num_waiting for r in self.replicas)
        if waiting >= self.config.max_queue_len:
            raise QueueFull(f"{waiting} requests are waiting already; try again later")
        if request.request_id in self.streams:
            raise DuplicateRequestId(request.request_id)
        make_sequences(request)
        samples = [SampleOutput(self.tokenizer, s) for s in request.seqs]
        if self.is_serving:
            replica = self.route(request)
            replica.submit(request, samples)
        # every group is being replaced: wait for one (at most --worker-restart-timeout), like the
        else:
            replica = None  # requests that were running on it
            self._orphans.add([request], self.unavailable_reason or "no worker")
        stream = RequestStream(request, samples, replica)
        self.streams[request.request_id] = stream
        log.info(
            "request_added",
            request_id=request.request_id,
            prompt_tokens=request.prompt_len,
            max_tokens=request.sampling.max_tokens,
            n=request.sampling.n,
            replica=replica.index if replica else None,
        )
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.usage is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id, reason="client went away")

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a live request; its blocks return at once; its stream ends with ABORT."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        unfinished = [o for o in stream.samples if not o.seq.is_finished]
        if stream.replica is not None:
            stream.replica.abort(request_id)
        else:  # waiting for a replica: it holds no blocks anywhere
            self._orphans.remove(stream.request)
            for out in unfinished:
                out.seq.finish(FinishReason.ABORT)
        for out in unfinished:
            self._emit(stream, out.last_delta(FinishReason.ABORT))
        log.info("request_aborted", request_id=request_id, reason=reason)
        return True

    # --- what the replicas report -----------------------------------------------------------------
    def on_step(self, replica: StepLoop, report: StepReport) -> None:
        """A step applied: deltas to their streams."""
        started = time.monotonic() - report.seconds
        # queue time: arrival to the first step that computes the request
        for s in report.out.scheduled:
            request = s.seq.request
            if request.scheduled_time is None:
                request.scheduled_time = started
                self.metrics.on_scheduled(replica.index, started - request.arrival_time)
        for gap in report.token_gaps:
            self.metrics.on_token_gap(replica.index, gap)
        for request, delta in report.deltas:
            stream = self.streams.get(request.request_id)
            if stream is not None and stream.request is request:
                self._emit(stream, delta)
        self.metrics.on_step(replica.index, report)
        self.kv_events.collect(replica.index, report.update.kv_events)

    def on_step_failed(self, replica: StepLoop, out: SchedulerOutput, message: str) -> None:
        for request in {id(s.seq.request): s.seq.request for s in out.scheduled}.values():
            self._fail_request(
                request, StepFailed(f"the worker failed a step of this request: {message}")
            )

    def on_unschedulable(self, replica: StepLoop, request: Request, message: str) -> None:
        self._fail_request(request, Unschedulable(message))

    def _emit(self, stream: RequestStream, delta: Delta) -> None:
        request = stream.request
        if not stream.started:
            stream.started = True
            wanted = request.prompt_logprobs
            if wanted is not None and all(x is not None for x in wanted[1:]):
                delta.prompt_logprobs = request.prompt_logprobs[1:]
        if delta.finish_reason is not None:
            stream.num_open -= 1
        if stream.num_open == 0:
            delta.usage = Usage(
                prompt_tokens=request.prompt_len,
                completion_tokens=sum(s.num_output_tokens for s in request.seqs),
                cached_prompt_tokens=request.cached_prompt_tokens or 0,
            )
            self.streams.pop(request.request_id, None)
            self.metrics.on_finish(request, time.monotonic())
            log.info(
                "request_finished",
                request_id=request.request_id,
                completion_tokens=delta.usage.completion_tokens,
                reasons=[s.finish_reason.value for s in request.seqs],
                seconds=round(time.monotonic() - request.arrival_time, 3),
            )
        stream.queue.put_nowait(delta)

    def _fail_request(self, request: Request, error: Exception) -> None:
        """End a request with an error, by identity (never a new one reusing its id)."""
        stream = self.streams.get(request.request_id)
        if stream is None or stream.request is not request:
            return
        del self.streams[request.request_id]
        if stream.replica is not None:
            stream.replica.abort(request.request_id)
        stream.queue.put_nowait(error)

    async def flush_prefix_cache(self, timeout: float) -> tuple[bool, str]:
        """Forget every cached prefix once no request is live (waiting up to `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.streams:
            return False, (
                f"{len(self.streams)} request(s) still in flight"
                + (f" after {timeout:g}s" if timeout else "; give timeout_s to wait for them")
            )
        forgotten = 0
        for replica in self.replicas:
            n, events = replica.reset_prefix_cache()
            forgotten += n
            self.kv_events.collect(replica.index, events)
        log.info("prefix_cache_flushed", prefixes=forgotten)
        return True, f"forgot {forgotten} cached prefix blocks"

    # --- reporting -------------------------------------------------------------------------------
    def model_info(self) -> dict:
        """What GetModelInfo answers."""
        return reporting.model_info(self)

    def loads(self) -> dict:
        """The service's load now, summed over serving replicas (what a gateway balances on)."""
        return reporting.service_load(self)

    def cache_stats(self) -> dict:
        """The pool's accounting, in total, per replica and per live request (GetCacheStats)."""
        return reporting.cache_stats(self)
