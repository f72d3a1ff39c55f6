"""The engine protocol's messages in our shape, and its load and KV-event RPCs."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from protos import generation_pb2
from scheduler_service.api.validation import MAX_LOGPROBS, InvalidRequest
from scheduler_service.runtime.kv_events import SubscriberGone
from scheduler_service.text.structured import choice_regex

log = structlog.get_logger("scheduler.engine_protocol")


def put(target, name: str, value) -> None:
    """target.name = value, or InvalidRequest where our field cannot hold what theirs did."""
    try:
        setattr(target, name, value)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"sampling_params.{name} {value} is out of range: {e}") from None


def to_generation_request(msg: vllm_engine_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    # one function: a field-by-field translation
    """The engine protocol's request as pagedserve.v1's, or InvalidRequest naming the field."""
    for name, what in (
        ("mm_inputs", "multimodal inputs"),
        ("media_refs", "media references"),
        ("kv_transfer_params", "KV transfer (disaggregated prefill)"),
    ):
        if msg.HasField(name):
            raise InvalidRequest(f"{name}: this engine serves text-only models without {what}")
    if msg.extra_mm_inputs:
        raise InvalidRequest(
            "extra_mm_inputs: this engine serves text-only models without multimodal inputs"
        )
    if msg.HasField("kv_transfer_params_json"):
        raise InvalidRequest(
            "kv_transfer_params_json: this engine has no KV transfer (disaggregated prefill)"
        )
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidRequest(
            f"data_parallel_rank {msg.data_parallel_rank}: this engine reports one rank and "
            "balances its data-parallel replicas itself"
        )
    out = generation_pb2.GenerateRequest(request_id=msg.request_id)
    kind = msg.WhichOneof("input")
    if kind == "tokenized":
        out.prompt_token_ids.extend(msg.tokenized.input_ids)
    elif kind == "text":
        out.prompt, out.raw_prompt = msg.text, True
    p = msg.sampling_params
    s = out.sampling
    s.temperature = p.temperature if p.HasField("temperature") else 1.0
    if p.top_p:
        s.top_p = p.top_p
    # a number their field holds and ours cannot (top_k is their uint32, our int32) is the
    # client's: a 400 naming it, not the protobuf's ValueError
    put(s, "top_k", p.top_k)
    s.min_p, s.presence_penalty, s.frequency_penalty = (
        p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
    )
    if p.repetition_penalty:
        s.repetition_penalty = p.repetition_penalty
    if p.HasField("max_tokens"):
        put(s, "max_tokens", p.max_tokens)
    put(s, "min_tokens", p.min_tokens)
    s.stop.extend(p.stop)
    s.stop_token_ids.extend(p.stop_token_ids)
    s.skip_special_tokens = p.skip_special_tokens
    s.ignore_eos = p.ignore_eos
    s.n = p.n
    s.include_stop_str_in_output = p.include_stop_str_in_output
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name):
            value = getattr(p, name)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(
                    f"sampling_params.{name} must lie in [0, {MAX_LOGPROBS}], got {value} "
                    "(-1, every token, is not served)"
                )
            setattr(s, name, value)
    if p.HasField("seed"):
        if p.seed < 0:
            raise InvalidRequest(f"sampling_params.seed must be >= 0, got {p.seed}")
        s.seed = p.seed
    for token, bias in p.logit_bias.items():
        if token < 0:
            raise InvalidRequest(f"sampling_params.logit_bias has a negative token id {token}")
        s.logit_bias[token] = bias
    if p.HasField("truncate_prompt_tokens"):
        s.truncate_prompt_tokens = p.truncate_prompt_tokens
    constraint = p.WhichOneof("constraint")
    if constraint in ("json_schema", "regex", "grammar"):
        setattr(s, constraint, getattr(p, constraint))
    elif constraint == "json_object":
        if p.json_object:
            s.json_schema = '{"type": "object"}'
    elif constraint == "choice":
        if not p.choice.choices:
            raise InvalidRequest("sampling_params.choice has no choices")
        s.regex = choice_regex(list(p.choice.choices))
    elif constraint == "structural_tag":
        raise InvalidRequest(
            "sampling_params.structural_tag is not served: use json_schema, regex or grammar"
        )
    return out


def output_logprobs(entries) -> vllm_engine_pb2.OutputLogProbs | None:
    if not entries:
        return None
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[
            vllm_engine_pb2.TopLogProbs(
                values=[v for _, v in e.top], token_ids=[t for t, _ in e.top]
            )
            for e in entries
        ],
    )


def input_logprobs(prompt_ids: list[int], entries) -> vllm_engine_pb2.InputLogProbs:
    """The prompt's logprobs: none for its first token, then one entry per token."""
    out = vllm_engine_pb2.InputLogProbs(token_ids=prompt_ids)
    out.token_logprobs.add()
    out.top_logprobs.add()
    for e in entries:
        out.token_logprobs.add(value=e.logprob)
        out.top_logprobs.add(values=[v for _, v in e.top], token_ids=[t for t, _ in e.top])
    return out


class LoadReports:
    """The engine protocol's load and prefix-cache event RPCs (a base of EngineProtocolServicer)."""

    def _load(self) -> dict:
        load = self.engine.loads()
        return {
            "running": load["running"],
            "waiting": load["waiting"],
            "token_usage": load["token_usage"],
            "capacity": load["num_blocks"] * load["block_size"],
            "used": load["used_blocks"] * load["block_size"],
            "hit_rate": load["cache_hit_rate"],
            "waiting_tokens": load["waiting_tokens"],
            "max_running": load["max_running"],
            "throughput": self._throughput(load["generated_tokens"]),
        }

    def _throughput(self, generated: int) -> float:
        """Tokens generated per second over the interval since the previous reading (at least a
        second).
        """
        now = time.monotonic()
        last = getattr(self, "_rate_mark", None)
        if last is None:
            self._rate_mark, self._rate = (now, generated), 0.0
        elif now - last[0] >= 1.0:
            self._rate = (generated - last[1]) / (now - last[0])
            self._rate_mark = (now, generated)
        return self._rate

    async def GetLoads(self, msg, context):
        await self._malformed(msg, context)
        if msg.HasField("dp_rank") and msg.dp_rank != 0:
            return vllm_engine_pb2.GetLoadsResponse(
                timestamp=datetime.now(timezone.utc).isoformat(),
                version="pagedserve",
                dp_rank_count=0,
            )
        x = self._load()
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=x["running"],
            num_waiting_reqs=x["waiting"],
            num_total_reqs=x["running"] + x["waiting"],
            num_used_tokens=x["used"],
            max_total_num_tokens=x["capacity"],
            token_usage=x["token_usage"],
            gen_throughput=x["throughput"],
            cache_hit_rate=x["hit_rate"],
            utilization=x["token_usage"],
            max_running_requests=x["max_running"],
            num_waiting_uncached_tokens=x["waiting_tokens"],
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version="pagedserve",
            dp_rank_count=1,
            loads=[load],
        )

    async def SubscribeKvEvents(self, msg, context):
        await self._malformed(msg, context)
        publisher = self.engine.kv_events
        queue = publisher.subscribe(msg.start_sequence_number)
        log.info(
            "kv_events_subscribed",
            start=msg.start_sequence_number,
            subscribers=publisher.num_subscribers,
        )
        # the last sequence number this stream carried (a heartbeat repeats it: 0 before any)
        sent = 0
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:  # a heartbeat with the load while the cache is quiet
                    yield common_pb2.KvEventBatch(
                        sequence_number=sent,
                        timestamp=time.time(),
                        load=self._load_record(load_only=True),
                    )
                    continue
                if isinstance(batch, SubscriberGone):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(batch))
                sent = batch.sequence_number
                yield self._batch(batch)
        finally:
            publisher.unsubscribe(queue)

    def _load_record(self, load_only: bool = False) -> common_pb2.EngineLoad:
        x = self._load()
        return common_pb2.EngineLoad(
            running_requests=x["running"],
            waiting_requests=x["waiting"],
            waiting_uncached_tokens=x["waiting_tokens"],
            token_usage=x["token_usage"],
            gen_throughput=x["throughput"],
            max_running_requests=x["max_running"],
            load_only=load_only,
        )

    def _batch(self, batch) -> common_pb2.KvEventBatch:
        out = common_pb2.KvEventBatch(
            sequence_number=batch.sequence_number,
            timestamp=batch.timestamp,
            dp_rank=batch.replica,
            load=self._load_record(),
        )
        block_size = self.engine.config.block_size
        for i, event in enumerate(batch.events):
            item = out.events.add(event_id=batch.sequence_number * 1_000_000 + i)
            if event[0] == "stored":
                stored = item.stored
                block = stored.blocks.add(
                    block_hash=event[1], token_ids=event[3], block_size=block_size
                )
                if len(event) > 4:  # a LoRA adapter's K/V
                    block.lora_id = event[4]
                if event[2] is not None:
                    stored.parent_block_hash = event[2]
                stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
                stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
            elif event[0] == "removed":
                item.removed.block_hashes.append(event[1])
                item.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            else:
                item.cleared.SetInParent()
        return out
