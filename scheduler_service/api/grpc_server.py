"""The gRPC front door: pagedserve.v1.Generation, health and reflection. The servicer is thin; a
malformed message or non-UTF-8 string gets INVALID_ARGUMENT, never UNKNOWN.
"""

from __future__ import annotations

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import generation_pb2
from scheduler_service.api.embedding import EmbedInputs, prepare_embeddings, run_embeddings
from scheduler_service.api.lora import (
    AdapterExists,
    AdapterNotFound,
    adapter_message,
    load_adapter,
    loaded,
    unload_adapter,
)
from scheduler_service.api.reasoning import AnswerSplit, Formats
from scheduler_service.api.rpc import (
    CLIENT_ERRORS,
    ApiKeyInterceptor,
    BytesGate,
    Malformed,
    prepare_request,
    reject,
    tolerant,
)
from scheduler_service.api.tool_calls import new_call_id
from scheduler_service.api.validation import InvalidRequest
from scheduler_service.core.adapters import AdapterError
from scheduler_service.core.sequence import FinishReason
from scheduler_service.runtime.engine import Engine
from scheduler_service.text.output import Delta
from scheduler_service.text.tokenizer import TokenTable

log = structlog.get_logger("scheduler.grpc")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH = {
    FinishReason.LENGTH: generation_pb2.LENGTH,
    FinishReason.STOP: generation_pb2.STOP,
    FinishReason.ABORT: generation_pb2.ABORT,
    FinishReason.ERROR: generation_pb2.ABORT,
}


def _usage(delta: Delta) -> generation_pb2.Usage:
    u = delta.usage
    return generation_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
    )


def _set_stop_reason(out, stop_reason: str | int | None) -> None:
    if isinstance(stop_reason, str):
        out.stop_str = stop_reason
    elif stop_reason is not None:
        out.stop_token_id = stop_reason


def _logprobs(items, text: TokenTable) -> list[generation_pb2.TokenLogprob]:
    return [
        generation_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=text.text(lp.token_id),
            top_logprobs=[
                generation_pb2.TopLogprob(token_id=t, logprob=v, token=text.text(t))
                for t, v in lp.top
            ],
        )
        for lp in items
    ]


def _tool_calls(calls: list[tuple[str, str]]) -> list[generation_pb2.ToolCall]:
    return [
        generation_pb2.ToolCall(id=new_call_id(), type="function", name=name, arguments=arguments)
        for name, arguments in calls
    ]


class GenerationServicer:
    def __init__(self, engine: Engine, expose_request_ids: bool = False) -> None:
        self.engine = engine
        self.expose_request_ids = expose_request_ids
        self.token_text = TokenTable(engine.tokenizer)
        self.formats = Formats(engine.tokenizer)

    async def _request(self, msg: generation_pb2.GenerateRequest):
        """The request, and its answers' split (reasoning, harmony's calls) where it is a chat's."""
        if isinstance(msg, generation_pb2.GenerateRequest):
            self.formats.keep_markers(msg)
        request = await prepare_request(self.engine, msg)
        fmt = self.formats.of(msg, request)
        return request, AnswerSplit(fmt) if fmt.reasons else None

    def handlers(self) -> grpc.GenericRpcHandler:
        pb = generation_pb2
        methods = {
            "Generate": (grpc.unary_unary_rpc_method_handler, self.Generate, pb.GenerateRequest),
            "GenerateStream": (
                grpc.unary_stream_rpc_method_handler,
                self.GenerateStream,
                pb.GenerateRequest,
            ),
            "Abort": (grpc.unary_unary_rpc_method_handler, self.Abort, pb.AbortRequest),
            "GetModelInfo": (
                grpc.unary_unary_rpc_method_handler,
                self.GetModelInfo,
                pb.GetModelInfoRequest,
            ),
            "GetCacheStats": (
                grpc.unary_unary_rpc_method_handler,
                self.GetCacheStats,
                pb.GetCacheStatsRequest,
            ),
            "Embed": (grpc.unary_unary_rpc_method_handler, self.Embed, pb.EmbedRequest),
            "LoadLoraAdapter": (
                grpc.unary_unary_rpc_method_handler,
                self.LoadLoraAdapter,
                pb.LoadLoraAdapterRequest,
            ),
            "UnloadLoraAdapter": (
                grpc.unary_unary_rpc_method_handler,
                self.UnloadLoraAdapter,
                pb.UnloadLoraAdapterRequest,
            ),
            "ListLoraAdapters": (
                grpc.unary_unary_rpc_method_handler,
                self.ListLoraAdapters,
                pb.ListLoraAdaptersRequest,
            ),
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

    async def _fail(
        self, context: grpc.aio.ServicerContext, error: Exception, request_id: str = ""
    ) -> None:
        await reject(context, error, request_id)

    async def Generate(self, msg, context):
        try:
            request, split = await self._request(msg)
            choices = {}
            usage = None
            prompt_logprobs = []
            async for delta in self.engine.generate(request):
                c = choices.setdefault(delta.index, generation_pb2.Completion(index=delta.index))
                c.token_ids.extend(delta.token_ids)
                if split is None:
                    c.text += delta.text
                else:
                    last = delta.finish_reason is not None
                    reasoning, content, calls = split.add(delta.index, delta.text, last)
                    c.reasoning_text += reasoning
                    c.text += content
                    c.tool_calls.extend(_tool_calls(calls))
                if delta.logprobs:
                    c.logprobs.extend(_logprobs(delta.logprobs, self.token_text))
                if delta.prompt_logprobs:
                    prompt_logprobs = _logprobs(delta.prompt_logprobs, self.token_text)
                if delta.finish_reason is not None:
                    c.finish_reason = _FINISH[delta.finish_reason]
                    _set_stop_reason(c, delta.stop_reason)
                if delta.usage is not None:
                    usage = _usage(delta)
        except CLIENT_ERRORS as e:
            await self._fail(context, e, msg.request_id)
            return None
        return generation_pb2.GenerateResponse(
            request_id=request.request_id,
            choices=[choices[i] for i in sorted(choices)],
            usage=usage,
            prompt_logprobs=prompt_logprobs,
        )

    async def GenerateStream(self, msg, context):
        try:
            request, split = await self._request(msg)
            async for delta in self.engine.generate(request):
                out = generation_pb2.GenerateStreamResponse(
                    request_id=request.request_id,
                    index=delta.index,
                    token_ids=delta.token_ids,
                    text=delta.text,
                )
                if split is not None:
                    last = delta.finish_reason is not None
                    out.reasoning_text, out.text, calls = split.add(delta.index, delta.text, last)
                    out.tool_calls.extend(_tool_calls(calls))
                if delta.logprobs:
                    out.logprobs.extend(_logprobs(delta.logprobs, self.token_text))
                if delta.prompt_logprobs:
                    out.prompt_logprobs.extend(_logprobs(delta.prompt_logprobs, self.token_text))
                if delta.finish_reason is not None:
                    out.finish_reason = _FINISH[delta.finish_reason]
                    _set_stop_reason(out, delta.stop_reason)
                if delta.usage is not None:
                    out.usage.CopyFrom(_usage(delta))
                yield out
        except CLIENT_ERRORS as e:
            await self._fail(context, e, msg.request_id)

    async def Embed(self, msg, context):
        try:
            if isinstance(msg, Malformed):
                raise InvalidRequest(msg.error)
            inputs = EmbedInputs(
                request_id=msg.request_id,
                texts=list(msg.texts) if msg.texts else None,
                token_ids=[list(t.ids) for t in msg.inputs] if msg.inputs else None,
                dimensions=msg.dimensions,
                truncate_prompt_tokens=msg.truncate_prompt_tokens,
                prompt_name=msg.prompt_name,
                prompt=msg.prompt,
            )
            if inputs.texts is None and inputs.token_ids is None:
                inputs.texts = []  # (said as "no input")
            requests = await prepare_embeddings(self.engine, inputs)
            results = await run_embeddings(self.engine, requests)
        except CLIENT_ERRORS as e:
            await self._fail(context, e, msg.request_id)
            return None
        prompt = sum(r.prompt_tokens for r in results)
        return generation_pb2.EmbedResponse(
            request_id=inputs.request_id,
            data=[
                generation_pb2.Embedding(
                    index=r.index,
                    values=r.vector.tolist(),
                    prompt_tokens=r.prompt_tokens,
                    cached_prompt_tokens=r.cached_prompt_tokens,
                )
                for r in results
            ],
            usage=generation_pb2.Usage(
                prompt_tokens=prompt,
                cached_prompt_tokens=sum(r.cached_prompt_tokens for r in results),
            ),
        )

    async def Abort(self, msg, context):
        if isinstance(msg, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.error)
        if not msg.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return generation_pb2.AbortResponse(
            aborted=self.engine.abort(msg.request_id, reason="Abort RPC")
        )

    async def GetModelInfo(self, msg, context):
        e = self.engine
        if e.limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, e.unavailable_reason or "not ready")
        adapters = [adapter_message(a) for a in loaded(e)]
        return generation_pb2.ModelInfo(**e.model_info(), lora_adapters=adapters)

    async def LoadLoraAdapter(self, msg, context):
        if isinstance(msg, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.error)
        try:
            adapter = await load_adapter(self.engine, msg.name, msg.path, msg.replace)
        except AdapterExists as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except (AdapterError, OSError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info(
            "lora_loaded",
            name=adapter.name,
            path=adapter.path,
            rank=adapter.rank,
            identity=adapter.identity,
        )
        return adapter_message(adapter)

    async def UnloadLoraAdapter(self, msg, context):
        if isinstance(msg, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.error)
        try:
            running = unload_adapter(self.engine, msg.name)
        except AdapterNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        log.info("lora_unloaded", name=msg.name, running=running)
        return generation_pb2.UnloadLoraAdapterResponse(num_running=running)

    async def ListLoraAdapters(self, msg, context):
        adapters = [adapter_message(a) for a in loaded(self.engine)]
        return generation_pb2.ListLoraAdaptersResponse(adapters=adapters)

    async def GetCacheStats(self, msg, context):
        if self.engine.limits is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, self.engine.unavailable_reason or "not ready"
            )
        stats = self.engine.cache_stats()
        requests = [generation_pb2.RequestCacheUsage(**r) for r in stats.pop("requests")]
        # blocks and tokens per request, but not ids anyone could abort
        if not self.expose_request_ids:
            for r in requests:
                r.request_id = ""
        replicas = [generation_pb2.ReplicaCacheStats(**r) for r in stats.pop("replicas")]
        return generation_pb2.CacheStats(**stats, requests=requests, replicas=replicas)


class HealthReporter:
    """Keeps grpc.health.v1 in step with the engine: SERVING only while workers are live."""

    def __init__(self, services: list[str] | None = None) -> None:
        self.servicer = (
            health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        )
        self.services = services or [SERVICE_NAME]

    async def set(self, serving: bool) -> None:
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if serving else response.NOT_SERVING
        for name in ("", *self.services):
            result = self.servicer.set(name, status)
            if hasattr(result, "__await__"):
                await result


def build_server(
    engine: Engine,
    address: str,
    expose_request_ids: bool = False,
    tls: tuple[bytes, bytes] | None = None,
    model_dir: str | None = None,
    api_key: str | None = None,
) -> tuple[grpc.aio.Server, HealthReporter, int]:
    """Requests parsed tolerantly and prepared off the event loop; `api_key`, `tls` and `model_dir`
    as named.
    """
    # the key first: a call without it is UNAUTHENTICATED whatever its bytes
    interceptors = [*([ApiKeyInterceptor(api_key)] if api_key else []), BytesGate()]
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ],
    )
    generation = GenerationServicer(engine, expose_request_ids)
    server.add_generic_rpc_handlers((generation.handlers(),))
    services = [SERVICE_NAME]
    if model_dir is not None:
        from scheduler_service.api.engine_protocol import add_to_server

        services.append(add_to_server(server, engine, model_dir))
    reporter = HealthReporter(services)
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    reflection.enable_server_reflection(
        (
            *services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return server, reporter, port
