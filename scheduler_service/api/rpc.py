"""What both gRPC front ends share: the tolerant deserializer, client errors as statuses,
preparation.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import uuid

import grpc
import structlog

from scheduler_service.api.embedding import refuse_task
from scheduler_service.api.validation import InvalidRequest, request_from_proto
from scheduler_service.core.batch import DuplicateRequestId
from scheduler_service.runtime.engine import Engine
from scheduler_service.runtime.errors import EngineUnavailable, QueueFull, StepFailed, Unschedulable

log = structlog.get_logger("scheduler.rpc")

# errors a request's sender caused or must retry: answered with a status, never a crash
CLIENT_ERRORS = (
    InvalidRequest,
    QueueFull,
    EngineUnavailable,
    StepFailed,
    DuplicateRequestId,
    Unschedulable,
)


def status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, (QueueFull, Unschedulable)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, DuplicateRequestId):
        return grpc.StatusCode.ALREADY_EXISTS
    return grpc.StatusCode.INTERNAL


class Malformed:
    """What the tolerant deserializer returns for bytes that are not a valid request message."""

    def __init__(self, error: str) -> None:
        self.error = error
        self.request_id = ""


def tolerant(message_cls):
    """A deserializer that never raises: bad bytes become a Malformed, answered INVALID_ARGUMENT."""

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(f"the request is not a valid {message_cls.DESCRIPTOR.full_name}: {e}")

    return parse


async def prepare_request(engine: Engine, msg):
    """pagedserve.v1 GenerateRequest -> Request, off the event loop; raises one of CLIENT_ERRORS."""
    if isinstance(msg, Malformed):
        raise InvalidRequest(msg.error)
    # assigned before validation, so that a refusal's log line names the request too
    if not msg.request_id:
        msg.request_id = uuid.uuid4().hex
    if engine.limits is None:
        raise EngineUnavailable(engine.unavailable_reason)
    refuse_task(engine, embedding=False)
    return await asyncio.to_thread(
        request_from_proto, msg, engine.tokenizer, engine.limits, engine.adapters
    )


async def reject(context: grpc.aio.ServicerContext, error: Exception, request_id: str = "") -> None:
    """End the call with the error's status and message."""
    code = status_for(error)
    log.info("request_rejected", request_id=request_id, code=code.name, error=str(error))
    await context.abort(code, str(error))


class BytesGate(grpc.aio.ServerInterceptor):
    """Every RPC's request bytes parsed without raising, health and reflection included: bytes that
    are no message end INVALID_ARGUMENT (they had ended UNKNOWN with a traceback in the log).
    """

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _gated(handler, details.method)


async def _checked(requests, context):
    """A request stream whose malformed messages end the call."""
    async for r in requests:
        if isinstance(r, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.error)
        yield r


def _gated(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that returns Malformed, answered INVALID_ARGUMENT."""
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(f"the request to {method} is not a valid message: {e}")

    async def first(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        if handler.request_streaming:
            return _checked(request, context)
        return request

    async def unary(request, context):
        behaviour = handler.unary_unary or handler.stream_unary
        result = behaviour(await first(request, context), context)
        return await result if inspect.isawaitable(result) else result

    async def streaming(request, context):
        behaviour = handler.unary_stream or handler.stream_stream
        result = behaviour(await first(request, context), context)
        if hasattr(result, "__aiter__"):
            async for item in result:
                yield item
        elif inspect.isawaitable(result):  # writes through context.write
            await result
        else:
            for item in result:
                yield item

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[(handler.request_streaming, handler.response_streaming)](
        streaming if handler.response_streaming else unary,
        request_deserializer=deserialize,
        response_serializer=handler.response_serializer,
    )


OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes (load balancers, kubelets) carry no key


def bearer_matches(header: str, key: str) -> bool:
    """Whether an `authorization` value is `Bearer <key>` (compared in constant time)."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """--api-key on gRPC: every call but health needs `authorization: Bearer <key>` or ends
    UNAUTHENTICATED.
    """

    def __init__(self, key: str) -> None:
        self.key = key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if bearer_matches(given, self.key):
            return handler
        return _refusal(
            handler,
            "invalid or missing API key: send the metadata authorization: Bearer <key>"
            if given
            else "this server needs an API key: send the metadata authorization: "
            "Bearer <key> (pagedserve's commands read $PAGEDSERVE_API_KEY or --api-key)",
        )


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - an async generator that ends at the abort

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    streaming = (handler.request_streaming, handler.response_streaming)
    return kinds[streaming](
        refuse_stream if handler.response_streaming else refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
