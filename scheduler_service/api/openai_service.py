"""The OpenAI server's routes beside generation (a base of OpenAIServer): models, tokenize and
detokenize, LoRA load and unload, health and metrics."""

from __future__ import annotations

from importlib import metadata

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from scheduler_service.api import openai_requests as to_engine
from scheduler_service.api import openai_responses as out
from scheduler_service.api.lora import load_adapter, loaded, unload_adapter
from scheduler_service.api.openai_errors import ApiError, error_response, read_body
from scheduler_service.api.openai_schema import (
    ChatCompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)
from scheduler_service.api.openapi import document
from scheduler_service.api.rpc import prepare_request
from scheduler_service.api.validation import InvalidRequest


class ServiceRoutes:
    """Routes that read the engine's state and tokenizer, and manage its adapters."""

    _openapi: bytes | None = None

    # --- routes -----------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's token ids as this server would compute them."""

        async def handler(rid: str):
            body = await read_body(request, TokenizeRequest)
            self.resolve_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequest("set exactly one of prompt and messages")
            if body.prompt is not None:
                ids = self.engine.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
            else:  # the chat request's own path: template, tools, the same checks
                chat = ChatCompletionRequest(
                    messages=body.messages,
                    tools=body.tools,
                    max_tokens=1,
                    add_generation_prompt=body.add_generation_prompt,
                )
                msg, _ = to_engine.chat_request(chat, {}, False)
                msg.request_id = rid
                ids = (await prepare_request(self.engine, msg)).prompt_token_ids
            limit = (
                self.engine.limits.max_context
                if self.engine.limits
                else self.engine.spec.max_context
            )
            return Response(
                out.dumps({"count": len(ids), "max_model_len": limit, "tokens": ids}),
                media_type="application/json",
            )

        return await self.guarded(request, handler)

    async def detokenize(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, DetokenizeRequest)
            self.resolve_model(body.model)
            vocab = self.engine.spec.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(
                    f"tokens has {len(bad)} id(s) outside the vocabulary [0, {vocab}), e.g. "
                    f"{bad[0]}"
                )
            text = self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
            return Response(out.dumps({"prompt": text}), media_type="application/json")

        return await self.guarded(request, handler)

    async def health(self, request: Request) -> Response:
        e = self.engine
        if e.limits is not None and e.is_serving and not e.is_draining:
            return Response(b"{}", 200, media_type="application/json")
        reason = "draining" if e.is_draining else (e.unavailable_reason or "not ready")
        # a probe, not a request: not logged
        return error_response(ApiError(503, reason, "service_unavailable"), logged=False)

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI 3.1 document of every route, built once from the models they check with."""
        if self._openapi is None:
            try:
                version = metadata.version("pagedserve")
            except metadata.PackageNotFoundError:  # run from a source tree
                version = "0"
            spec = document(self.operations, "pagedserve", version, self.api_key is not None)
            self._openapi = out.dumps(spec)
        return Response(self._openapi, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        return Response(
            generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    def _model_card(self, name: str) -> dict:
        limits = self.engine.limits
        return {
            "id": name,
            "object": "model",
            "created": int(self.engine.started_at),
            "owned_by": "pagedserve",
            "root": self.engine.spec.path,
            "parent": None,
            "max_model_len": limits.max_context if limits else self.engine.spec.max_context,
        }

    async def models(self, request: Request) -> Response:
        async def handler(rid: str):
            cards = [self._model_card(n) for n in self.names] + [
                {**self._model_card(a.name), "root": a.path, "parent": self.names[0]}
                for a in loaded(self.engine)
            ]
            body = {"object": "list", "data": cards}
            return Response(out.dumps(body), media_type="application/json")

        return await self.guarded(request, handler)

    async def load_lora(self, request: Request) -> Response:
        """vLLM's /v1/load_lora_adapter: {"lora_name", "lora_path"[, "replace"]}."""

        async def handler(rid: str):
            body = await read_body(request, LoadLoraRequest)
            a = await load_adapter(self.engine, body.lora_name, body.lora_path, body.replace)
            return Response(
                f"LoRA adapter {a.name!r} loaded (rank {a.rank})", media_type="text/plain"
            )

        return await self.guarded(request, handler)

    async def unload_lora(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, UnloadLoraRequest)
            running = unload_adapter(self.engine, body.lora_name)
            return Response(
                f"LoRA adapter {body.lora_name!r} unloaded ({running} running requests finish on "
                "it)",
                media_type="text/plain",
            )

        return await self.guarded(request, handler)

    async def model(self, request: Request) -> Response:
        async def handler(rid: str):
            return Response(
                out.dumps(self._model_card(self.resolve_model(request.path_params["model"]))),
                media_type="application/json",
            )

        return await self.guarded(request, handler)
