"""Every OpenAI API failure as OpenAI's error body and status, a refused body said in one line
naming the field.
"""

from __future__ import annotations

import functools
import re

import pydantic
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from scheduler_service.api import openai_responses as out
from scheduler_service.api.lora import AdapterExists, AdapterNotFound
from scheduler_service.api.streams import ClientGone
from scheduler_service.api.validation import InvalidRequest
from scheduler_service.core.adapters import AdapterError
from scheduler_service.core.batch import DuplicateRequestId
from scheduler_service.runtime.errors import EngineUnavailable, QueueFull, Unschedulable
from scheduler_service.text import json_gate

log = structlog.get_logger("scheduler.http")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code
        self.param = param if param is not None else param_of(message) if status == 400 else None


_PATH = re.compile(r"^([a-z][a-z0-9_]*)((?:\[\d+\]|\.[a-z][a-z0-9_]*)*)(?=[ :]|$)")


@functools.cache
def request_fields() -> frozenset[str]:
    """Every top-level field of a request body the HTTP APIs take."""
    from scheduler_service.api import openai_schema as schema
    from scheduler_service.api.agents import messages, responses

    models = (
        schema.ChatCompletionRequest,
        schema.CompletionRequest,
        schema.EmbeddingRequest,
        schema.TokenizeRequest,
        responses.ResponsesRequest,
        messages.MessagesRequest,
    )
    return frozenset(f.alias or name for m in models for name, f in m.model_fields.items())


def param_of(message: str) -> str | None:
    """OpenAI's `param`: the field an error message begins with, if any."""
    m = _PATH.match(message)
    return m.group(0) if m and m.group(1) in request_fields() else None


def api_error(error: Exception) -> ApiError:
    """An error's HTTP status and OpenAI error type."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ClientGone):
        return ApiError(499, str(error))
    if isinstance(error, (InvalidRequest, DuplicateRequestId)):
        return ApiError(400, str(error).replace("sampling.", ""))
    if isinstance(error, QueueFull):
        return ApiError(429, str(error), "rate_limit_error")
    if isinstance(error, Unschedulable):
        return ApiError(400, str(error))
    if isinstance(error, AdapterNotFound):
        return ApiError(404, str(error), code="model_not_found")
    if isinstance(error, AdapterError):  # a bad folder, or a name in use
        return ApiError(409 if isinstance(error, AdapterExists) else 400, str(error))
    if isinstance(error, EngineUnavailable):
        return ApiError(503, str(error), "service_unavailable")
    return ApiError(500, str(error), "server_error")


def log_refusal(error: ApiError, request_id: str) -> None:
    log.info("request_rejected", request_id=request_id, status=error.status, error=str(error))


def error_response(error: ApiError, request_id: str = "", logged: bool = True) -> Response:
    if logged:
        log_refusal(error, request_id)
    return Response(
        out.dumps(out.error_body(str(error), error.kind, error.code, error.param)),
        error.status,
        media_type="application/json",
    )


def _where(err: dict) -> str:
    """A pydantic error's location as the body names it (`messages.0.content`), less pydantic's own
    steps.
    """
    return ".".join(
        str(x)
        for x in err["loc"]
        if not str(x).startswith(("function-", "list[", "str", "literal[", "int"))
    )


def validation_message(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:4]:
        where = _where(err)
        what = "is not a field of this request" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {what}" if where else what)
    more = f" (and {len(e.errors()) - 4} more)" if len(e.errors()) > 4 else ""
    return "; ".join(dict.fromkeys(parts)) + more


MAX_BODY_BYTES = 64 * 1024 * 1024


async def read_body(request: Request, model: type[pydantic.BaseModel]):
    """The request's JSON body as `model`, or ApiError saying what is wrong with it."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body was whole: nothing to answer, nothing ran
        raise ClientGone("the client disconnected before its request body was complete") from None
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        data = json_gate.parse(raw)
    except json_gate.BadJson as e:
        raise ApiError(400, str(e), param=e.param) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise ApiError(400, validation_message(e), param=_where(e.errors()[0]) or None) from None
