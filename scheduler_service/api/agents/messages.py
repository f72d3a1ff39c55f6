"""Anthropic's Messages API (/v1/messages): the body as a chat request, the answer as a Message or
its event stream, errors in Anthropic's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from scheduler_service.api.agents.turns import Turn, call_arguments
from scheduler_service.api.openai_responses import dumps
from scheduler_service.api.openai_schema import ChatCompletionRequest, Strict
from scheduler_service.api.validation import InvalidRequest

# Anthropic's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


class Block(Strict):
    """A content block; images and documents are refused, thinking sent back is dropped."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    citations: Any = None
    title: str | None = None
    context: str | None = None


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(Strict):
    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    service_tier: str | None = None


class CountTokensRequest(Strict):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def _texts(blocks: list[Block], where: str) -> str:
    out = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise InvalidRequest(f"{where}[{j}] is of type {b.type!r} where text is expected")
        out.append(b.text)
    return "".join(out)


def _turn(i: int, m: Message) -> list[dict]:
    """One Anthropic message as chat messages: tool results become tool messages, tool_use blocks
    calls.
    """
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_use" and m.role == "assistant":
            if not b.name or not b.id:
                raise InvalidRequest(f"{where} is a tool_use block without id and name")
            calls.append(
                {
                    "id": b.id,
                    "type": "function",
                    "function": {
                        "name": b.name,
                        "arguments": json.dumps(b.input if b.input is not None else {}),
                    },
                }
            )
        elif b.type == "tool_result" and m.role == "user":
            if not b.tool_use_id:
                raise InvalidRequest(f"{where} is a tool_result block without tool_use_id")
            content = (
                b.content
                if isinstance(b.content, str) or b.content is None
                else _texts(b.content, f"{where}.content")
            )
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": ("error: " if b.is_error else "") + (content or ""),
                }
            )
        elif b.type in ("thinking", "redacted_thinking"):
            continue  # an earlier answer's thinking, sent back: dropped, as templates drop it
        elif b.type in ("image", "document"):
            raise InvalidRequest(
                f"{where} is of type {b.type!r}: this server's models read text only"
            )
        else:
            raise InvalidRequest(
                f"{where} is of type {b.type!r}, which a {m.role} message cannot hold here"
            )
    out = results
    if texts or calls or not results:
        message: dict = {"role": m.role, "content": "".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        out = out + [message]
    return out


def conversation(system: str | list[Block] | None, messages: list[Message]) -> list[dict]:
    out = []
    if system:
        out.append(
            {
                "role": "system",
                "content": system if isinstance(system, str) else _texts(system, "system"),
            }
        )
    for i, m in enumerate(messages):
        out += _turn(i, m)
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, Any]:
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type not in ("auto", "none"):
            raise InvalidRequest("tool_choice is set but no tools are offered")
        return None, None
    tools = []
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            raise InvalidRequest(
                f"tools[{i}] is of type {t.type!r}: this server calls client tools only"
            )
        if t.input_schema is None:
            raise InvalidRequest(f"tools[{i}].input_schema: Field required")
        function = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            function["description"] = t.description
        tools.append({"type": "function", "function": function})
    c = body.tool_choice
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) if c else None
    if c is not None and c.type == "tool":
        if not c.name:
            raise InvalidRequest("tool_choice of type tool needs a name")
        choice = {"type": "function", "function": {"name": c.name}}
    return tools, choice


def chat_body(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request this Messages request is, checked under its own field names."""
    fields: dict[str, Any] = {"messages": conversation(body.system, body.messages)}
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required")
    fields["tools"], fields["tool_choice"] = _tools(body)
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be at least 1, got {body.max_tokens}")
        budget = body.thinking.budget_tokens if body.thinking else None
        if budget is not None and not 0 < budget < body.max_tokens:
            raise InvalidRequest(
                f"thinking.budget_tokens must lie below max_tokens ({body.max_tokens}), got "
                f"{budget}"
            )
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    else:
        fields["max_tokens"] = 1
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(turn: Turn) -> str:
    if turn.calls:
        return "tool_use"
    if turn.finish == "length":
        return "max_tokens"
    return "stop_sequence" if turn.stop_sequence is not None else "end_turn"


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_block(call: dict) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": call_arguments(call),
    }


def message(message_id: str, model: str, turn: Turn, usage_: dict) -> dict:
    content: list[dict] = []
    if turn.reasoning:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        content.append({"type": "text", "text": turn.content})
    content += [tool_use_block(c) for c in turn.calls]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(turn),
        "stop_sequence": turn.stop_sequence,
        "usage": usage_,
    }


def sse(kind: str, payload: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **payload}) + b"\n\n"


class MessageStream:
    """A streamed message's events, in the order Anthropic sends them."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.index = 0
        self.open: str | None = None  # the kind of the block open now

    def opening(self) -> list[bytes]:
        start = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.prompt_tokens, 0, 0),
        }
        return [sse("message_start", {"message": start})]

    def add(self, reasoning: str, content: str) -> list[bytes]:
        events = []
        if reasoning:
            events += self._switch(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""}
            )
            events.append(
                sse(
                    "content_block_delta",
                    {
                        "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": reasoning},
                    },
                )
            )
        if content:
            events += self._switch("text", {"type": "text", "text": ""})
            events.append(
                sse(
                    "content_block_delta",
                    {"index": self.index, "delta": {"type": "text_delta", "text": content}},
                )
            )
        return events

    def closing(self, turn: Turn, usage_: dict) -> list[bytes]:
        events = []
        for call in turn.calls:
            block = tool_use_block(call)
            events += self._switch("tool_use", {**block, "input": {}}, always=True)
            events.append(
                sse(
                    "content_block_delta",
                    {
                        "index": self.index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"]),
                        },
                    },
                )
            )
        events += self._stop()
        delta = {"stop_reason": stop_reason(turn), "stop_sequence": turn.stop_sequence}
        events.append(sse("message_delta", {"delta": delta, "usage": usage_}))
        return events + [sse("message_stop", {})]

    def failure(self, error) -> bytes:
        """The stream's last event where it fails midway (an ApiError)."""
        return sse("error", error_body(error.status, str(error)))

    def _switch(self, kind: str, block: dict, always: bool = False) -> list[bytes]:
        if self.open == kind and not always:
            return []
        events = self._stop()
        if events:  # the next block's index
            self.index += 1
        self.open = kind
        return events + [sse("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        # a thinking block ends with its signature (empty: not signed here)
        if self.open == "thinking":
            events.append(
                sse(
                    "content_block_delta",
                    {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}},
                )
            )
        self.open = None
        return events + [sse("content_block_stop", {"index": self.index})]
