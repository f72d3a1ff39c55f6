"""Prometheus metrics of the scheduler service (served on --metrics-port: 9090 unless told
otherwise, 0 off).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler_service.core.sequence import Request
from scheduler_service.core.stats import PoolGauges, TierStats

DOWN = PoolGauges(0, 0, 0, 0, 0)  # a replica that is down: no pool

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2.5,
    5,
)

# The port --metrics-port takes when it is not given; -1 binds any free port (reported in
# --port-file).
DEFAULT_METRICS_PORT = 9090


class Metrics:
    """Every series the dashboard graphs (deploy/grafana/pagedserve.json), per replica where it is
    one's.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        rep = ["replica"]
        self.requests = Counter(
            "pagedserve_requests",
            "Finished requests by finish reason of their first sample",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pagedserve_prefix_cache_hit_tokens",
            "Prompt tokens of finished requests that came from the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Generated tokens", rep, registry=r
        )
        self.prefill_tokens = Counter(
            "pagedserve_prefill_tokens_computed",
            "Prompt tokens computed (cache misses)",
            rep,
            registry=r,
        )
        self.preemptions = Counter(
            "pagedserve_preemptions", "Sequences preempted by recompute", rep, registry=r
        )
        self.running = Gauge("pagedserve_num_running", "Running sequences", rep, registry=r)
        self.waiting = Gauge("pagedserve_num_waiting", "Waiting sequences", rep, registry=r)
        self.blocks_free = Gauge(
            "pagedserve_kv_blocks_free",
            "KV blocks no request holds (cached prefixes included)",
            rep,
            registry=r,
        )
        self.blocks_total = Gauge(
            "pagedserve_kv_blocks_total", "KV blocks in the pool", rep, registry=r
        )
        self.kv_usage = Gauge(
            "pagedserve_kv_usage_ratio",
            "Share of the KV pool's blocks requests hold (0-1)",
            rep,
            registry=r,
        )
        self.state_slots = Gauge(
            "pagedserve_state_slots_used",
            "A hybrid model's recurrent-state slots running sequences hold",
            rep,
            registry=r,
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1)",
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Gap between a sequence's tokens",
            rep,
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.queue = Histogram(
            "pagedserve_queue_time_seconds",
            "Arrival to the first step that computes it",
            rep,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.latency = Histogram(
            "pagedserve_request_latency_seconds",
            "Arrival to last token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.draft_rows = Counter(
            "pagedserve_spec_decode_verifications",
            "Sequence-steps that verified a draft (speculative decoding)",
            rep,
            registry=r,
        )
        self.draft_tokens = Counter(
            "pagedserve_spec_decode_draft_tokens", "Tokens drafted", rep, registry=r
        )
        self.accepted_tokens = Counter(
            "pagedserve_spec_decode_accepted_tokens",
            "Drafted tokens that equalled the model's own",
            rep,
            registry=r,
        )
        self.embeddings = Counter(
            "pagedserve_embeddings", "Embedding vectors finished (Embed inputs)", registry=r
        )
        self.embedding_tokens = Counter(
            "pagedserve_embedding_tokens", "Prompt tokens of finished embeddings", registry=r
        )
        # LoRA: each adapter's requests and tokens, and adapters in the last step
        self.lora_requests = Counter(
            "pagedserve_lora_requests", "Finished requests by LoRA adapter", ["adapter"], registry=r
        )
        self.lora_prompt_tokens = Counter(
            "pagedserve_lora_prompt_tokens",
            "Prompt tokens of finished requests by LoRA adapter",
            ["adapter"],
            registry=r,
        )
        self.lora_generation_tokens = Counter(
            "pagedserve_lora_generation_tokens",
            "Generated tokens of finished requests by LoRA adapter",
            ["adapter"],
            registry=r,
        )
        self.lora_step_adapters = Gauge(
            "pagedserve_lora_step_adapters",
            "LoRA adapters the replica's last step ran",
            rep,
            registry=r,
        )
        self.step = Histogram(
            "pagedserve_step_seconds",
            "Engine step, plan to result",
            rep,
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
        )
        self._add_tier_series(r)

    def _add_tier_series(self, r: CollectorRegistry) -> None:
        """The KV tiers' series, by replica and tier (host, disk)."""
        rep = ["replica"]
        tier = ["replica", "tier"]
        self.tier_blocks = Gauge(
            "pagedserve_kv_tier_blocks", "KV blocks a tier under the pool holds", tier, registry=r
        )
        self.tier_capacity = Gauge(
            "pagedserve_kv_tier_capacity_blocks", "KV blocks a tier holds at most", tier, registry=r
        )
        self.tier_loaded = Counter(
            "pagedserve_kv_tier_loaded_blocks",
            "KV blocks read back into the pool",
            tier,
            registry=r,
        )
        self.tier_stored = Counter(
            "pagedserve_kv_tier_stored_blocks", "KV blocks written down to a tier", tier, registry=r
        )
        self.tier_failures = Counter(
            "pagedserve_kv_tier_load_failures",
            "KV-tier loads that failed their check (computed instead)",
            rep,
            registry=r,
        )
        self.tier_seconds = Counter(
            "pagedserve_kv_tier_seconds",
            "Workers' seconds storing and loading tier blocks",
            rep,
            registry=r,
        )
        # each replica's last figures (its counters move by differences)
        self._tiers_seen: dict[str, TierStats] = {}

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics; returns the port bound (any free one for port 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def watch(self, replica: int, books: Callable[[], PoolGauges | None]) -> None:
        """The pool's gauges read from `books` (a replica's StepLoop.gauges) at each scrape, so they
        tell the truth idle as busy (set at steps, they kept the last step's figures once idle); a
        replica that is down shows an empty pool.
        """
        label = str(replica)

        def read(field: str) -> Callable[[], float]:
            return lambda: float(getattr(books() or DOWN, field))

        def usage() -> float:
            b = books() or DOWN
            return (b.num_blocks - b.num_available_blocks) / b.num_blocks if b.num_blocks else 0.0

        self.running.labels(label).set_function(read("num_running"))
        self.waiting.labels(label).set_function(read("num_waiting"))
        self.blocks_free.labels(label).set_function(read("num_available_blocks"))
        self.blocks_total.labels(label).set_function(read("num_blocks"))
        self.state_slots.labels(label).set_function(read("num_used_state_slots"))
        self.kv_usage.labels(label).set_function(usage)

    def on_step(self, replica: int, report) -> None:
        """One step's report (runtime/step_results.py StepReport): its counters and histograms (the
        pool's gauges are read at each scrape: `watch`).
        """
        label, u, out = str(replica), report.update, report.out
        self.step.labels(label).observe(report.seconds)
        self.generation_tokens.labels(label).inc(len(u.tokens))
        self.prefill_tokens.labels(label).inc(out.num_prefill_tokens)
        if out.preempted:
            self.preemptions.labels(label).inc(len(out.preempted))
        if u.num_draft_rows:
            self.draft_rows.labels(label).inc(u.num_draft_rows)
            self.draft_tokens.labels(label).inc(u.num_drafted)
            self.accepted_tokens.labels(label).inc(u.num_accepted)
        adapters = {
            item.seq.request.lora.id for item in out.scheduled if item.seq.request.lora is not None
        }
        self.lora_step_adapters.labels(label).set(len(adapters))
        if u.kv_tiers is not None:
            self._on_tiers(label, u.kv_tiers)

    def _on_tiers(self, label: str, now: TierStats) -> None:
        """The tiers' gauges set and counters moved by what changed since the last step."""
        last = self._tiers_seen.get(label, TierStats())
        self._tiers_seen[label] = now

        def grew(name: str) -> float:
            was, is_ = getattr(last, name), getattr(now, name)
            return is_ - was if is_ >= was else is_

        for tier in ("host", "disk"):
            self.tier_blocks.labels(label, tier).set(getattr(now, f"{tier}_blocks"))
            self.tier_capacity.labels(label, tier).set(getattr(now, f"{tier}_capacity"))
            self.tier_loaded.labels(label, tier).inc(grew(f"{tier}_loaded"))
            self.tier_stored.labels(label, tier).inc(grew(f"{tier}_stored"))
        self.tier_failures.labels(label).inc(grew("load_failures"))
        self.tier_seconds.labels(label).inc(grew("seconds"))

    def on_token_gap(self, replica: int, seconds: float) -> None:
        self.itl.labels(str(replica)).observe(seconds)

    def on_scheduled(self, replica: int, queued: float) -> None:
        self.queue.labels(str(replica)).observe(queued)

    def on_finish(self, request: Request, now: float) -> None:
        reason = request.seqs[0].finish_reason
        self.requests.labels(finish_reason=reason.value if reason else "unknown").inc()
        self.prompt_tokens.inc(request.prompt_len)
        self.cached_prompt_tokens.inc(request.cached_prompt_tokens or 0)
        self.latency.observe(now - request.arrival_time)
        if request.lora is not None:
            name = request.lora.name
            self.lora_requests.labels(name).inc()
            self.lora_prompt_tokens.labels(name).inc(request.prompt_len)
            self.lora_generation_tokens.labels(name).inc(
                sum(s.num_output_tokens for s in request.seqs)
            )
        if request.embed is not None and reason is not None and reason.value == "stop":
            self.embeddings.inc()
            self.embedding_tokens.inc(request.prompt_len)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
            outputs = sum(s.num_output_tokens for s in request.seqs)
            if outputs > 1:
                self.tpot.observe((now - request.first_token_time) / (outputs - 1))
