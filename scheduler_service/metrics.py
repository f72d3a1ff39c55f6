"""Prometheus metrics of the scheduler service (served on --metrics-port, off by default)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler_service.sequence import Request

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedserve_requests", "Finished requests by finish reason of their first sample",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Generated tokens", registry=r)
        self.prefill_tokens = Counter("pagedserve_prefill_tokens_computed", "Prompt tokens computed (cache misses)",
                                      registry=r)
        self.preemptions = Counter("pagedserve_preemptions", "Sequences preempted by recompute", registry=r)
        self.running = Gauge("pagedserve_num_running", "Running sequences", registry=r)
        self.waiting = Gauge("pagedserve_num_waiting", "Waiting sequences", registry=r)
        self.blocks_free = Gauge("pagedserve_kv_blocks_free", "Free KV blocks", registry=r)
        self.blocks_total = Gauge("pagedserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.latency = Histogram("pagedserve_request_latency_seconds", "Arrival to last token", registry=r,
                                 buckets=_LATENCY_BUCKETS)
        self.step = Histogram("pagedserve_step_seconds", "Engine step, plan to result", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def on_step(self, seconds: float, num_sampled: int, num_prefill: int, num_preempted: int, running: int,
                waiting: int, free_blocks: int, total_blocks: int) -> None:
        self.step.observe(seconds)
        self.generation_tokens.inc(num_sampled)
        self.prefill_tokens.inc(num_prefill)
        if num_preempted:
            self.preemptions.inc(num_preempted)
        self.running.set(running)
        self.waiting.set(waiting)
        self.blocks_free.set(free_blocks)
        self.blocks_total.set(total_blocks)

    def on_finish(self, request: Request, now: float) -> None:
        reason = request.seqs[0].finish_reason
        self.requests.labels(finish_reason=reason.value if reason else "unknown").inc()
        self.prompt_tokens.inc(request.prompt_len)
        self.latency.observe(now - request.arrival_time)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
