"""The agent APIs' routes: each request made a chat request, run on the engine, its turn said in the
API's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from scheduler_service.api.agents import messages as anthropic
from scheduler_service.api.agents import response_events as answers
from scheduler_service.api.agents import responses as openai
from scheduler_service.api.agents.turns import ResponseStore, TurnStream, parse_turn
from scheduler_service.api.openai_errors import ApiError, api_error, log_refusal, read_body
from scheduler_service.api.openai_responses import dumps
from scheduler_service.api.openapi import Operation as Op
from scheduler_service.api.streams import unless_disconnected

JSON = "application/json"


class AgentRoutes:
    """/v1/responses (with a bounded store for previous_response_id) and /v1/messages."""

    def __init__(self, server) -> None:
        self.server = server
        self.engine = server.engine
        self.store = ResponseStore()
        self.operations = [
            Op(
                "/v1/responses",
                "POST",
                self.create_response,
                "a response (OpenAI's Responses API)",
                openai.ResponsesRequest,
                "stream",
            ),
            Op("/v1/responses/{response_id}", "GET", self.get_response, "a stored response"),
            Op(
                "/v1/responses/{response_id}",
                "DELETE",
                self.delete_response,
                "forget a stored response",
            ),
            Op(
                "/v1/messages",
                "POST",
                self.create_message,
                "a message (Anthropic's Messages API)",
                anthropic.MessagesRequest,
                "stream",
            ),
            Op(
                "/v1/messages/count_tokens",
                "POST",
                self.count_tokens,
                "a message's prompt tokens",
                anthropic.CountTokensRequest,
            ),
        ]

    def _event_stream(
        self, prepared, mode, fmt, shape, usage, on_turn=None, headers=None
    ) -> Response:
        """Server-sent events in `shape`'s words; a failure midway is the last event."""

        async def events() -> AsyncIterator[bytes]:
            for event in shape.opening():
                yield event
            stream = TurnStream(mode, fmt)
            totals = (prepared.prompt_len, 0, 0)
            try:
                async for delta in self.engine.generate(prepared):
                    for event in shape.add(*stream.add(delta)):
                        yield event
                    if delta.usage is not None:
                        u = delta.usage
                        totals = (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
                turn, reasoning, content = stream.close()
                for event in shape.add(reasoning, content) + shape.closing(turn, usage(*totals)):
                    yield event
                if on_turn is not None:
                    on_turn(turn)
            # noqa: BLE001 - a stream that fails midway says so in its last event
            except Exception as e:
                yield shape.failure(api_error(e))

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    # --- OpenAI's Responses API -------------------------------------------------------------------
    async def create_response(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, openai.ResponsesRequest)
            model = self.server.resolve_model(body.model)
            earlier: list[dict] = []
            if body.previous_response_id is not None:
                stored = self.store.get(body.previous_response_id)
                if stored is None:
                    raise ApiError(
                        404,
                        f"no stored response {body.previous_response_id!r}: this server keeps "
                        f"the last {self.store.capacity} responses made with store true, in "
                        "memory until it restarts",
                        code="response_not_found",
                    )
                earlier = stored[0]
            messages = openai.conversation(body, earlier)
            chat = openai.chat_body(body, messages)
            prepared, mode, fmt = await self.server.prepare_chat(chat, rid, model)
            shape = answers.ResponseShape(rid, model, body)
            if body.stream:
                return self._response_stream(body, prepared, mode, fmt, shape, messages)
            samples, usage = await unless_disconnected(request, self.server.collect([prepared]))
            turn = parse_turn(samples[0], mode, fmt)
            logprobs = (
                self._logprobs(samples[0]) if prepared.sampling.logprobs is not None else None
            )
            result = shape.whole(
                turn,
                answers.usage(
                    usage["prompt_tokens"],
                    usage["completion_tokens"],
                    usage["prompt_tokens_details"]["cached_tokens"],
                ),
                logprobs,
            )
            if body.store:
                self.store.put(rid, answers.history(messages, turn), result)
            return Response(dumps(result), media_type=JSON)

        return await self.server.guarded(request, handler, "resp")

    def _logprobs(self, sample) -> list[dict]:
        table = self.server.token_text
        return table.chat_logprobs(sample.logprobs)["content"]

    def _response_stream(self, body, prepared, mode, fmt, shape, messages) -> Response:
        stream = answers.ResponseStream(shape)

        def keep(turn) -> None:
            if body.store:
                self.store.put(shape.id, answers.history(messages, turn), stream.final)

        return self._event_stream(
            prepared, mode, fmt, stream, answers.usage, keep, {"x-request-id": shape.id}
        )

    async def get_response(self, request: Request) -> Response:
        async def handler(rid: str):
            stored = self.store.get(request.path_params["response_id"])
            if stored is None:
                raise ApiError(
                    404,
                    f"no stored response {request.path_params['response_id']!r}",
                    code="response_not_found",
                )
            return Response(dumps(stored[1]), media_type=JSON)

        return await self.server.guarded(request, handler)

    async def delete_response(self, request: Request) -> Response:
        async def handler(rid: str):
            response_id = request.path_params["response_id"]
            if not self.store.delete(response_id):
                raise ApiError(
                    404, f"no stored response {response_id!r}", code="response_not_found"
                )
            return Response(
                dumps({"id": response_id, "object": "response", "deleted": True}), media_type=JSON
            )

        return await self.server.guarded(request, handler)

    # --- Anthropic's Messages API -----------------------------------------------------------------
    @staticmethod
    def _anthropic_error(error: ApiError, rid: str) -> Response:
        log_refusal(error, rid)
        return Response(
            dumps(anthropic.error_body(error.status, str(error))),
            error.status,
            media_type=JSON,
            headers={"request-id": rid},
        )

    async def create_message(self, request: Request) -> Response:
        async def handler(rid: str):
            body = await read_body(request, anthropic.MessagesRequest)
            model = self.server.resolve_model(body.model)
            chat = anthropic.chat_body(body)
            prepared, mode, fmt = await self.server.prepare_chat(chat, rid, model)
            message_id = anthropic.new_id()
            if body.stream:
                return self._message_stream(prepared, mode, fmt, message_id, model)
            samples, usage = await unless_disconnected(request, self.server.collect([prepared]))
            turn = parse_turn(samples[0], mode, fmt)
            counts = anthropic.usage(
                usage["prompt_tokens"],
                usage["completion_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
            )
            result = anthropic.message(message_id, model, turn, counts)
            return Response(dumps(result), media_type=JSON, headers={"request-id": rid})

        return await self.server.guarded(request, handler, "msg", render=self._anthropic_error)

    def _message_stream(self, prepared, mode, fmt, message_id: str, model: str) -> Response:
        stream = anthropic.MessageStream(message_id, model, prepared.prompt_len)
        return self._event_stream(
            prepared,
            mode,
            fmt,
            stream,
            anthropic.usage,
            headers={"request-id": prepared.request_id},
        )

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens as this server would count
        them.
        """

        async def handler(rid: str):
            body = await read_body(request, anthropic.CountTokensRequest)
            model = self.server.resolve_model(body.model)
            prepared, _, _ = await self.server.prepare_chat(anthropic.chat_body(body), rid, model)
            return Response(dumps({"input_tokens": prepared.prompt_len}), media_type=JSON)

        return await self.server.guarded(request, handler, "count", render=self._anthropic_error)
