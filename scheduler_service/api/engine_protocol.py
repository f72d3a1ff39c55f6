"""The SMG engine protocol (`vllm.grpc.engine.VllmEngine`) beside pagedserve.v1, so gateways that
drive vLLM over gRPC drive pagedserve; every SamplingParams field is honoured or refused by name.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import zipfile
from pathlib import Path

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from scheduler_service.api.embedding import EmbedInputs, prepare_embeddings, run_embeddings
from scheduler_service.api.engine_protocol_messages import (
    LoadReports,
    input_logprobs,
    output_logprobs,
    to_generation_request,
)
from scheduler_service.api.rpc import CLIENT_ERRORS, Malformed, prepare_request, reject, tolerant
from scheduler_service.api.validation import InvalidRequest
from scheduler_service.core.sequence import FinishReason
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.errors import Draining

log = structlog.get_logger("scheduler.engine_protocol")

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "added_tokens.json",
)
CHUNK_BYTES = 64 * 1024
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class _Sample:
    __slots__ = ("tokens", "logprobs", "sent_first", "last")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.sent_first = False
        self.last = None  # the sample's last delta


class EngineProtocolServicer(LoadReports):
    """The SMG engine protocol over pagedserve.v1 validation; answers carry ids, the gateway
    detokenizes.
    """

    def __init__(self, engine: Engine, model_dir: str | Path) -> None:
        self.engine = engine
        self.model_dir = Path(model_dir).resolve()
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self._last_receive = 0.0

    def handlers(self) -> grpc.GenericRpcHandler:
        pb, common = vllm_engine_pb2, common_pb2
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        methods = {
            "Generate": (stream, self.Generate, pb.GenerateRequest),
            "Embed": (unary, self.Embed, pb.EmbedRequest),
            "HealthCheck": (unary, self.HealthCheck, pb.HealthCheckRequest),
            "FlushCache": (unary, self.FlushCache, common.FlushCacheRequest),
            "StartProfile": (unary, self.StartProfile, common.StartProfileRequest),
            "StopProfile": (unary, self.StopProfile, common.StopProfileRequest),
            "Abort": (unary, self.Abort, pb.AbortRequest),
            "GetModelInfo": (unary, self.GetModelInfo, pb.GetModelInfoRequest),
            "GetServerInfo": (unary, self.GetServerInfo, pb.GetServerInfoRequest),
            "GetLoads": (unary, self.GetLoads, pb.GetLoadsRequest),
            "GetTokenizer": (stream, self.GetTokenizer, common.GetTokenizerRequest),
            "SubscribeKvEvents": (stream, self.SubscribeKvEvents, common.SubscribeKvEventsRequest),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                name: kind(
                    fn,
                    request_deserializer=tolerant(cls),
                    response_serializer=lambda m: m.SerializeToString(),
                )
                for name, (kind, fn, cls) in methods.items()
            },
        )

    async def _malformed(self, msg, context) -> None:
        if isinstance(msg, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.error)

    # --- generation ----------------------------------------------------------------------------
    async def Generate(self, msg, context):
        self._last_receive = time.time()
        request_id = getattr(msg, "request_id", "")
        try:
            if isinstance(msg, Malformed):
                raise InvalidRequest(msg.error)
            request = await prepare_request(self.engine, to_generation_request(msg))
            samples: dict[int, _Sample] = {}
            prompt_logprobs = None
            async for delta in self.engine.generate(request):
                sample = samples.setdefault(delta.index, _Sample())
                sample.tokens.extend(delta.token_ids)
                if delta.logprobs:
                    sample.logprobs.extend(delta.logprobs)
                if delta.prompt_logprobs is not None:
                    prompt_logprobs = input_logprobs(
                        request.prompt_token_ids, delta.prompt_logprobs
                    )
                if not msg.stream:
                    if delta.finish_reason is not None:
                        sample.last = delta
                    continue
                counts = self._counts(request)
                if delta.token_ids or delta.finish_reason is not None:
                    chunk = vllm_engine_pb2.GenerateStreamChunk(
                        token_ids=delta.token_ids,
                        completion_tokens=len(delta.token_ids),
                        index=delta.index,
                        output_logprobs=output_logprobs(delta.logprobs),
                        **counts,
                    )
                    if not sample.sent_first and prompt_logprobs is not None:
                        chunk.input_logprobs.CopyFrom(prompt_logprobs)
                    sample.sent_first = True
                    yield vllm_engine_pb2.GenerateResponse(chunk=chunk)
                if delta.finish_reason is not None:
                    yield self._complete(
                        delta, delta.token_ids, delta.logprobs, counts, prompt_logprobs
                    )
            if not msg.stream:
                counts = self._counts(request)
                for index in sorted(samples):
                    sample = samples[index]
                    yield self._complete(
                        sample.last, sample.tokens, sample.logprobs, counts, prompt_logprobs
                    )
        except CLIENT_ERRORS as e:
            await reject(context, e, request_id)

    @staticmethod
    def _counts(request) -> dict:
        return {
            "prompt_tokens": request.prompt_len,
            "cached_tokens": request.cached_prompt_tokens or 0,
        }

    @staticmethod
    def _complete(
        delta, tokens, logprobs, counts, prompt_logprobs
    ) -> vllm_engine_pb2.GenerateResponse:
        done = vllm_engine_pb2.GenerateComplete(
            output_ids=tokens,
            finish_reason=_FINISH[delta.finish_reason],
            completion_tokens=len(tokens),
            index=delta.index,
            output_logprobs=output_logprobs(logprobs),
            input_logprobs=prompt_logprobs,
            **counts,
        )
        if delta.usage is not None:
            done.cached_tokens = delta.usage.cached_prompt_tokens
        if isinstance(delta.stop_reason, str):
            done.matched_stop_str = delta.stop_reason
        elif delta.stop_reason is not None:
            done.matched_token_id = delta.stop_reason
        return vllm_engine_pb2.GenerateResponse(complete=done)

    async def Abort(self, msg, context):
        await self._malformed(msg, context)
        for request_id in msg.request_ids:
            self.engine.abort(request_id, reason="engine-protocol Abort")
        return vllm_engine_pb2.AbortResponse()

    async def Embed(self, msg, context):
        """One tokenized input's vector: the gateway sends each text alone."""
        try:
            if isinstance(msg, Malformed):
                raise InvalidRequest(msg.error)
            ids = list(msg.tokenized.input_ids)
            inputs = EmbedInputs(request_id=msg.request_id, token_ids=[ids] if ids else [])
            (result,) = await run_embeddings(
                self.engine, await prepare_embeddings(self.engine, inputs)
            )
        except CLIENT_ERRORS as e:
            await reject(context, e, msg.request_id)
            return None
        return vllm_engine_pb2.EmbedResponse(
            embedding=result.vector.tolist(),
            prompt_tokens=result.prompt_tokens,
            embedding_dim=int(result.vector.shape[0]),
        )

    async def StartProfile(self, msg, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "the profiler is not served over this protocol: use "
            "the scheduler's --step-profile-interval and the workers' step timings",
        )

    StopProfile = StartProfile

    # --- state ---------------------------------------------------------------------------------
    async def HealthCheck(self, msg, context):
        e = self.engine
        if e.limits is not None and e.is_serving and not e.is_draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")
        reason = Draining.REASON if e.is_draining else e.unavailable_reason or "not ready"
        return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=reason)

    def _config(self, name: str) -> dict:
        path = self.model_dir / name
        try:
            return json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            return {}

    async def GetModelInfo(self, msg, context):
        """Answered from the config before the workers connect: a gateway reads it once, at
        registration.
        """
        e = self.engine
        max_context = e.limits.max_context if e.limits is not None else e.spec.max_context
        config, generation = self._config("config.json"), self._config("generation_config.json")
        defaults = {
            k: generation[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if k in generation
        }
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(self.model_dir),
            is_generation=e.spec.generates,
            max_context_length=max_context,
            vocab_size=e.spec.vocab_size,
            supports_vision=False,
            served_model_name=e.spec.name,
            tokenizer_path=str(self.model_dir),
            model_type=config.get("model_type", ""),
            architectures=config.get("architectures", []),
            eos_token_ids=list(e.spec.eos_token_ids),
            pad_token_id=config.get("pad_token_id")
            if isinstance(config.get("pad_token_id"), int)
            else -1,
            bos_token_id=config.get("bos_token_id")
            if isinstance(config.get("bos_token_id"), int)
            else -1,
            max_req_input_len=max_context - 1,
            default_sampling_params_json=json.dumps(defaults) if defaults else "",
        )

    async def GetServerInfo(self, msg, context):
        e = self.engine
        info = e.model_info() if e.limits is not None else {}
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(e.streams),
            is_paused=e.is_draining,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - e.started_at,
            server_type="pagedserve-grpc",
            data_parallel_size=1,
            kv_cache_dtype=info.get("kv_cache_dtype") or "auto",
            block_size=e.config.block_size,
            model_dtype=info.get("dtype", ""),
            max_num_seqs=e.config.max_num_seqs * len(e.replicas),
        )

    async def FlushCache(self, msg, context):
        await self._malformed(msg, context)
        if msg.timeout_s < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be >= 0, got {msg.timeout_s}"
            )
        ok, message = await self.engine.flush_prefix_cache(msg.timeout_s)
        return common_pb2.FlushCacheResponse(success=ok, message=message)

    async def GetTokenizer(self, msg, context):
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(self._zip_tokenizer)
            except FileNotFoundError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        data, digest = self._tokenizer_zip
        for start in range(0, len(data), CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end == len(data) else ""
            )

    def _zip_tokenizer(self) -> tuple[bytes, str]:
        buf = io.BytesIO()
        names = [n for n in TOKENIZER_FILES if (self.model_dir / n).is_file()]
        if "tokenizer.json" not in names:
            raise FileNotFoundError(f"no tokenizer.json in {self.model_dir}")
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in names:
                zf.write(self.model_dir / name, name)
        data = buf.getvalue()
        return data, hashlib.sha256(data).hexdigest()


def add_to_server(server: grpc.aio.Server, engine: Engine, model_dir: str | Path) -> str:
    server.add_generic_rpc_handlers((EngineProtocolServicer(engine, model_dir).handlers(),))
    return SERVICE_NAME
