"""The OpenAI generation routes: a body parsed, made a pagedserve.v1 request and validated as
gRPC's; a client that leaves aborts its request.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator

import numpy as np
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from scheduler_service.api import openai_requests as to_engine
from scheduler_service.api import openai_responses as out
from scheduler_service.api.agents.routes import AgentRoutes
from scheduler_service.api.embedding import prepare_embeddings, run_embeddings
from scheduler_service.api.lora import loaded
from scheduler_service.api.openai_errors import ApiError, api_error, error_response, read_body
from scheduler_service.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)
from scheduler_service.api.openai_service import ServiceRoutes
from scheduler_service.api.openapi import Operation as Op
from scheduler_service.api.reasoning import AnswerFormat, Formats
from scheduler_service.api.rpc import bearer_matches, prepare_request
from scheduler_service.api.streams import merged, unless_disconnected
from scheduler_service.api.tool_calls import template_writes_tool_calls
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.errors import EngineUnavailable, StepFailed

log = structlog.get_logger("scheduler.http")


class OpenAIServer(ServiceRoutes):
    """The routes, over one engine."""

    def __init__(
        self,
        engine: Engine,
        served_model_names: list[str],
        api_key: str | None = None,
        aliases: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.names = served_model_names
        self.aliases = aliases or []  # accepted as `model`, not listed (the config's own name)
        self.api_key = api_key
        self.defaults = engine.spec.sampling_defaults
        self.parse_auto_tools = template_writes_tool_calls(engine.tokenizer.chat_template)
        self.formats = Formats(engine.tokenizer)
        self.token_text = out.TokenText(engine.tokenizer)
        self.agents = AgentRoutes(self)
        self.operations = self.agents.operations + [
            Op(
                "/v1/chat/completions",
                "POST",
                self.chat,
                "a chat turn",
                ChatCompletionRequest,
                "stream",
            ),
            Op(
                "/v1/completions",
                "POST",
                self.completions,
                "a completion",
                CompletionRequest,
                "stream",
            ),
            Op("/v1/embeddings", "POST", self.embeddings, "embeddings", EmbeddingRequest),
            Op("/v1/models", "GET", self.models, "the served models and adapters"),
            Op("/tokenize", "POST", self.tokenize, "a prompt's token ids", TokenizeRequest),
            Op("/detokenize", "POST", self.detokenize, "token ids as text", DetokenizeRequest),
            Op("/v1/models/{model:path}", "GET", self.model, "one model's card"),
            Op(
                "/v1/load_lora_adapter",
                "POST",
                self.load_lora,
                "load a LoRA adapter",
                LoadLoraRequest,
                "text",
            ),
            Op(
                "/v1/unload_lora_adapter",
                "POST",
                self.unload_lora,
                "unload a LoRA adapter",
                UnloadLoraRequest,
                "text",
            ),
            Op("/health", "GET", self.health, "200 while serving"),
            Op("/metrics", "GET", self.metrics, "Prometheus metrics", answers="metrics"),
            Op("/openapi.json", "GET", self.openapi, "this document"),
        ]
        routes = [op.route() for op in self.operations]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    # --- plumbing ---------------------------------------------------------------------------------
    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        message = {
            404: (
                f"no route {request.url.path}: this server serves /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/messages, /v1/embeddings, /v1/models, "
                "/tokenize, /detokenize, /health and /metrics"
            ),
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message))

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        anthropic = request.headers.get("x-api-key", "")  # Anthropic's SDKs send the key so
        if not (
            bearer_matches(given, self.api_key)
            or bearer_matches(f"Bearer {anthropic}", self.api_key)
        ):
            raise ApiError(
                401,
                "invalid or missing API key: send the header Authorization: Bearer <key> (or "
                "x-api-key: <key>)",
                "authentication_error",
                "invalid_api_key",
            )

    def resolve_model(self, name: str | None, lora: bool = True) -> str:
        """The model a request names: the base model's name, or (where `lora`) a LoRA adapter's."""
        adapters = [a.name for a in loaded(self.engine)] if lora else []
        if name in self.aliases:
            return self.names[0]
        if name is None or name in self.names or name in adapters:
            return name or self.names[0]
        served = ", ".join(repr(n) for n in self.names + adapters)
        raise ApiError(
            404,
            f"the model {name!r} does not exist: this server serves {served}",
            code="model_not_found",
        )

    def lora_of(self, model: str) -> str:
        """GenerateRequest.lora for a request that names `model`."""
        return "" if model in self.names else model

    async def guarded(
        self, request: Request, handler, prefix: str = "req", render=error_response
    ) -> Response:
        """Runs handler(request id), rendering its failure; the id is X-Request-Id or made here."""
        rid = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        try:
            self._check_key(request)
            return await handler(rid)
        except Exception as e:  # noqa: BLE001 - every failure is answered in the API's error shape
            error = api_error(e)
            if error.status >= 500 and not isinstance(e, (EngineUnavailable, StepFailed)):
                log.exception("http_handler_failed", request_id=rid)
            return render(error, rid)

    async def chat(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, ChatCompletionRequest)
            model = self.resolve_model(body.model)
            prepared, mode, fmt = await self.prepare_chat(body, rid, model)
            token_text = self.token_text if body.logprobs else None
            if body.stream:
                return self._chat_stream(body, model, prepared, mode, token_text, fmt)
            samples, usage = await unless_disconnected(request, self.collect([prepared]))
            answer = out.chat_completion(
                prepared.request_id, model, samples, mode, usage, token_text, fmt
            )
            if body.prompt_logprobs is not None:
                table, prompt = self.token_text, samples[0].prompt_logprobs
                answer["prompt_logprobs"] = out.prompt_logprobs_body(table, prompt)
            return Response(out.dumps(answer), media_type="application/json")

        return await self.guarded(request, handler, "chatcmpl")

    async def prepare_chat(self, body, rid: str, model: str) -> tuple:
        """A chat body made a request, validated, templated and tokenized: (prepared, tool mode,
        the answer's format).
        """
        msg, mode = to_engine.chat_request(body, self.defaults, self.parse_auto_tools)
        msg.request_id, msg.lora = rid, self.lora_of(model)
        self.formats.keep_markers(msg)
        prepared = await prepare_request(self.engine, msg)
        return prepared, mode, self.formats.of(msg, prepared)

    async def collect(self, requests: list) -> tuple[dict[int, out.Sample], dict]:
        """Every request's samples (request i * n + sample) and the summed usage."""
        samples: dict[int, out.Sample] = {}
        prompt = completion = cached = 0
        prompt_logprobs: dict[int, list] = {}
        streams = [self.engine.generate(r) for r in requests]
        async for i, delta in merged(streams):
            n = requests[i].sampling.n
            samples.setdefault(i * n + delta.index, out.Sample()).add(delta)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[i] = delta.prompt_logprobs
            if delta.usage is not None:
                u = delta.usage
                prompt += u.prompt_tokens
                completion += u.completion_tokens
                cached += u.cached_prompt_tokens
        n = requests[0].sampling.n if requests else 1  # every request of one call samples alike
        for k, sample in samples.items():
            sample.prompt_logprobs = prompt_logprobs.get(k // n)
        return samples, out.usage_body(prompt, completion, cached)

    def _chat_stream(
        self,
        body: ChatCompletionRequest,
        model: str,
        prepared,
        mode,
        token_text,
        fmt: AnswerFormat,
    ) -> Response:
        options = body.stream_options
        include_usage = bool(options and (options.include_usage or options.continuous_usage_stats))
        continuous = bool(options and options.continuous_usage_stats)
        stream = out.ChatStream(prepared.request_id, model, mode, token_text, include_usage, fmt)
        prompt_len = prepared.prompt_len

        async def chunks() -> AsyncIterator[bytes]:
            yield stream.opening(prepared.sampling.n)
            generated = 0
            usage = None
            try:
                async for delta in self.engine.generate(prepared):
                    generated += len(delta.token_ids)
                    now = out.usage_body(prompt_len, generated, 0) if continuous else None
                    if delta.usage is not None:
                        u = delta.usage
                        usage = out.usage_body(
                            u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens
                        )
                    chunk = stream.delta(delta, now)
                    if chunk is not None:
                        yield chunk
            # noqa: BLE001 - a stream that fails midway says so in its last event
            except Exception as e:
                error = api_error(e)
                yield b"data: " + out.dumps(out.error_body(str(error), error.kind)) + b"\n\n"
            yield stream.closing(usage if include_usage else None)

        return StreamingResponse(
            chunks(), media_type="text/event-stream", headers={"x-request-id": prepared.request_id}
        )

    async def completions(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, CompletionRequest)
            model = self.resolve_model(body.model)
            msgs = to_engine.completion_requests(body, self.defaults)
            for i, m in enumerate(msgs):
                m.request_id, m.lora = rid if len(msgs) == 1 else f"{rid}-{i}", self.lora_of(model)
            prepared = [await prepare_request(self.engine, m) for m in msgs]
            table = self.token_text if body.logprobs is not None else None
            echoes = [
                self._echo(m, p) if body.echo else None for m, p in zip(msgs, prepared, strict=True)
            ]
            shape = out.CompletionShape(
                rid,
                model,
                body.n,
                echoes,
                table,
                self.token_text,
                [p.prompt_token_ids for p in prepared],
                body.prompt_logprobs,
            )
            if body.stream:
                options = body.stream_options
                usage = bool(options and (options.include_usage or options.continuous_usage_stats))
                return self._completion_stream(shape, prepared, usage)
            samples, usage = await unless_disconnected(request, self.collect(prepared))
            return Response(out.dumps(shape.whole(samples, usage)), media_type="application/json")

        return await self.guarded(request, handler, "cmpl")

    def _echo(self, msg, prepared) -> str:
        return msg.prompt or self.engine.tokenizer.decode(
            prepared.prompt_token_ids, skip_special_tokens=False
        )

    def _completion_stream(
        self, shape: out.CompletionShape, prepared: list, include_usage: bool
    ) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            totals = [0, 0, 0]
            try:
                async for i, delta in merged([self.engine.generate(r) for r in prepared]):
                    if delta.usage is not None:
                        u = delta.usage
                        totals = [
                            a + b
                            for a, b in zip(
                                totals,
                                (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
                                strict=True,
                            )
                        ]
                    chunk = shape.delta(
                        i, delta, out.usage_body(*totals) if include_usage else None
                    )
                    if chunk is not None:
                        yield chunk
            except Exception as e:  # noqa: BLE001 - said in the stream's last event
                error = api_error(e)
                yield b"data: " + out.dumps(out.error_body(str(error), error.kind)) + b"\n\n"
            if include_usage:
                yield shape.event([], out.usage_body(*totals))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            chunks(), media_type="text/event-stream", headers={"x-request-id": shape.id}
        )

    async def embeddings(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, EmbeddingRequest)
            model = self.resolve_model(body.model, lora=False)
            inputs = to_engine.embed_inputs(body)
            inputs.request_id = rid
            requests = await prepare_embeddings(self.engine, inputs)
            results = await unless_disconnected(request, run_embeddings(self.engine, requests))
            data = []
            for r in results:
                vector = np.asarray(r.vector, dtype="<f4")
                value = (
                    base64.b64encode(vector.tobytes()).decode()
                    if body.encoding_format == "base64"
                    else vector.tolist()
                )
                data.append({"object": "embedding", "index": r.index, "embedding": value})
            prompt = sum(r.prompt_tokens for r in results)
            usage = {"prompt_tokens": prompt, "total_tokens": prompt}
            return Response(
                out.dumps({"object": "list", "data": data, "model": model, "usage": usage}),
                media_type="application/json",
            )

        return await self.guarded(request, handler, "embd")
