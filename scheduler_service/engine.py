"""The engine loop: schedule a step, ship its plan to the workers, apply the result, stream outputs.

Runs as one asyncio task beside the gRPC server in the scheduler process. While a step runs on the
workers the event loop keeps serving RPCs (new requests, aborts, stats).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from scheduler_service.config import ModelSpec, SchedulerConfig
from scheduler_service.metrics import Metrics
from scheduler_service.output import Delta, SampleOutput, Usage
from scheduler_service.plan import build_plan, sampled_tokens
from scheduler_service.scheduler import Scheduler, SchedulerOutput
from scheduler_service.sequence import FinishReason, Request
from scheduler_service.tokenizer import Tokenizer
from scheduler_service.validation import Limits
from scheduler_service.worker_client import WorkerClient, WorkerError, WorkerLost

log = structlog.get_logger("scheduler.engine")


class QueueFull(RuntimeError):
    """Too many requests wait already; answered with RESOURCE_EXHAUSTED."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (no live worker); answered with UNAVAILABLE."""


class StepFailed(RuntimeError):
    """A step holding this request failed on a worker; answered with INTERNAL."""


@dataclass
class RequestStream:
    request: Request
    samples: list[SampleOutput]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_open: int = 0  # samples whose last delta has not been sent

    def __post_init__(self) -> None:
        self.num_open = len(self.samples)


@dataclass
class StepProfile:
    """Where the time of the engine's steps went, cumulative seconds."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    schedule: float = 0.0
    build_plan: float = 0.0
    round_trip: float = 0.0
    worker_prepare: float = 0.0
    worker_forward: float = 0.0
    worker_sample: float = 0.0
    process_output: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class Engine:
    def __init__(self, config: SchedulerConfig, spec: ModelSpec, tokenizer: Tokenizer, client: WorkerClient) -> None:
        self.config = config
        self.spec = spec
        self.tokenizer = tokenizer
        self.client = client
        self.scheduler: Scheduler | None = None
        self.limits: Limits | None = None
        self.streams: dict[str, RequestStream] = {}
        self.profile = StepProfile()
        self.metrics = Metrics()
        self.unavailable_reason: str | None = "workers not connected yet"
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, worker_timeout: float) -> None:
        await self.client.wait_for_workers(worker_timeout, expected={"block_size": self.config.block_size})
        hs = self.client.handshake
        if hs.vocab_size != self.spec.vocab_size:
            raise RuntimeError(f"worker vocab {hs.vocab_size} != model config vocab {self.spec.vocab_size}")
        max_context = min(self.spec.max_context, hs.max_context)
        pool_tokens = self.client.num_blocks * self.config.block_size
        if pool_tokens < max_context:
            raise RuntimeError(
                f"the KV pool ({self.client.num_blocks} blocks x {self.config.block_size} = {pool_tokens} tokens) "
                f"cannot hold one request of the full {max_context}-token context: give the workers more KV "
                "memory (--kv-cache-memory / --gpu-memory-utilization / --num-blocks) or lower --max-model-len"
            )
        self.scheduler = Scheduler(self.config, self.client.num_blocks, max_context)
        self.limits = Limits(self.spec.vocab_size, max_context, self.client.num_blocks, self.config.block_size)
        self.unavailable_reason = None
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        log.info("step_profile", **self.profile.as_dict(), final=True)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for rid in list(self.streams):
            self.abort(rid)
        await self.client.close()

    @property
    def is_serving(self) -> bool:
        return self.unavailable_reason is None

    @property
    def bytes_per_block(self) -> int:
        return self.client.handshake.bytes_per_block

    # --- requests --------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[Delta]:
        """Add a request and yield its deltas until every sample has finished.

        Leaving the iteration early (client cancelled or disconnected) aborts the request."""
        if not self.is_serving:
            raise EngineUnavailable(self.unavailable_reason)
        if len(self.scheduler.waiting) >= self.config.max_queue_len:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting already; try again later")
        self.scheduler.add_request(request)  # raises ValueError on a duplicate live id
        stream = RequestStream(
            request,
            [SampleOutput(self.tokenizer, s, self.spec.eos_token_ids, self.scheduler.max_model_len) for s in request.seqs],
        )
        self.streams[request.request_id] = stream
        log.info("request_added", request_id=request.request_id, prompt_tokens=request.prompt_len,
                 max_tokens=request.sampling.max_tokens, n=request.sampling.n)
        self._wake.set()
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
        if stream is None or self.scheduler is None:
            return False
        unfinished = [o for o in stream.samples if not o.seq.is_finished]
        self.scheduler.abort_request(request_id)
        for out in unfinished:
            self._emit(stream, out.finish(FinishReason.ABORT))
        log.info("request_aborted", request_id=request_id, reason=reason)
        return True

    # --- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead loop must not leave requests hanging
            log.exception("engine_loop_failed")
            self._fail_all(f"engine error: {e!r}")

    async def _steps(self) -> None:
        sched = self.scheduler
        last_profile_log = time.monotonic()
        while True:
            if not sched.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            out = sched.schedule()
            for seq in out.preempted:
                log.info("preempted", request_id=seq.request.request_id, index=seq.index, tokens=seq.num_tokens)
            if out.is_empty:  # everything waits on blocks held by nobody: cannot happen with validated sizes
                log.error("no_progress", waiting=len(sched.waiting), free_blocks=sched.allocator.num_free_blocks)
                await asyncio.sleep(0.05)
                continue
            t1 = time.perf_counter()
            plan = build_plan(out, self.config.block_size)
            t2 = time.perf_counter()
            try:
                result = await self.client.execute(plan)
                tokens = sampled_tokens(result, len(out.scheduled))
            except WorkerLost as e:
                self._fail_all(str(e))
                return
            except (WorkerError, ValueError) as e:
                log.error("step_failed", step_id=out.step_id, error=str(e))
                self._fail_step(out, str(e))
                continue
            t3 = time.perf_counter()
            new_tokens = sched.update(out, tokens)
            self._process(out, new_tokens)
            t4 = time.perf_counter()
            self.metrics.on_step(t3 - t2, len(new_tokens), out.num_prefill_tokens, len(out.preempted), len(sched.running),
                                 len(sched.waiting), sched.allocator.num_free_blocks, sched.num_blocks)
            p = self.profile
            p.steps += 1
            p.tokens += out.num_tokens
            p.prefill_tokens += out.num_prefill_tokens
            p.schedule += t1 - t0
            p.build_plan += t2 - t1
            p.round_trip += t3 - t2
            p.worker_prepare += result.time_prepare
            p.worker_forward += result.time_forward
            p.worker_sample += result.time_sample
            p.process_output += t4 - t3
            if self.config.debug_invariants:
                sched.check_invariants()
            if time.monotonic() - last_profile_log > 5.0:
                last_profile_log = time.monotonic()
                log.info("step_profile", **p.as_dict(), running=len(sched.running), waiting=len(sched.waiting))

    def _process(self, out: SchedulerOutput, new_tokens) -> None:
        now = time.monotonic()
        for seq, token in new_tokens:
            stream = self.streams.get(seq.request.request_id)
            if stream is None:
                continue
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            delta, reason = stream.samples[seq.index].add_token(token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            self._emit(stream, delta)

    def _emit(self, stream: RequestStream, delta: Delta) -> None:
        request = stream.request
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
            log.info("request_finished", request_id=request.request_id,
                     completion_tokens=delta.usage.completion_tokens,
                     reasons=[s.finish_reason.value for s in request.seqs],
                     seconds=round(time.monotonic() - request.arrival_time, 3))
        stream.queue.put_nowait(delta)

    def _fail_request(self, request_id: str, error: Exception) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self.scheduler.abort_request(request_id)
        stream.queue.put_nowait(error)

    def _fail_step(self, out: SchedulerOutput, message: str) -> None:
        for rid in {s.seq.request.request_id for s in out.scheduled}:
            self._fail_request(rid, StepFailed(f"the worker failed a step of this request: {message}"))

    def _fail_all(self, message: str) -> None:
        self.unavailable_reason = message
        log.error("workers_lost", error=message)
        for rid in list(self.streams):
            self._fail_request(rid, EngineUnavailable(message))

    # --- reporting -------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        sched = self.scheduler
        alloc = sched.allocator
        bpb = self.bytes_per_block
        per_request = []
        for rid, req in sched.requests.items():
            blocks = sched.request_blocks(req)
            per_request.append({
                "request_id": rid, "num_blocks": blocks,
                "num_tokens": sum(s.num_computed_tokens for s in req.seqs), "num_bytes": blocks * bpb,
            })
        return {
            "block_size": self.config.block_size,
            "num_blocks": alloc.num_blocks,
            "num_free_blocks": alloc.num_free_blocks,
            "num_cached_blocks": alloc.num_cached_blocks,
            "bytes_per_block": bpb,
            "used_bytes": alloc.num_used_blocks * bpb,
            "total_bytes": alloc.num_blocks * bpb,
            "utilization": alloc.num_used_blocks / alloc.num_blocks,
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "requests": per_request,
        }
