"""OpenAI's Responses API (/v1/responses): the request body and its conversation as a chat request
(the answer's shape is response_events.py's).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from scheduler_service.api.openai_schema import ChatCompletionRequest, Strict
from scheduler_service.api.validation import InvalidRequest


class InputPart(Strict):
    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(Strict):
    """A message ({role, content}), a function call or its output, or an earlier reasoning item."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class FunctionTool(Strict):
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Strict):
    type: Literal["function"] = "function"
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool = False
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # the engine's extras, as on chat
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise InvalidRequest(
                f"{where}[{j}] is of type {part.type!r}: this server's models read text only"
            )
        texts.append(part.text)
    return "".join(texts)


def conversation(body: ResponsesRequest, earlier: list[dict]) -> list[dict]:
    """Chat messages: the earlier response's conversation, the instructions, then this request's
    input.
    """
    messages = [m for m in earlier if m["role"] != "system"]
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "message":
            if item.role is None:
                raise InvalidRequest(f"{where} is a message without a role")
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.name or item.call_id is None:
                raise InvalidRequest(f"{where} is a function_call without name and call_id")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id is None:
                raise InvalidRequest(f"{where} is a function_call_output without call_id")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": _text(item.output, f"{where}.output"),
                }
            )
        # an earlier turn's reasoning, sent back: dropped, as templates drop it
        elif kind != "reasoning":
            raise InvalidRequest(
                f"{where} is of type {kind!r}: this server takes message, function_call, "
                "function_call_output and reasoning items"
            )
    return messages


def chat_body(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request this Responses request is, checked under its own field names."""
    if body.background:
        raise InvalidRequest("background is not served: responses run while the request is open")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise InvalidRequest(f"max_output_tokens must be at least 1, got {body.max_output_tokens}")
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type != "function" or not t.name:
                raise InvalidRequest(
                    f"tools[{i}] is of type {t.type!r}: this server calls functions only "
                    "(type function, with a name)"
                )
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "seed": body.seed,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "stop": body.stop,
    }
    if body.top_logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs)
    elif body.include and "message.output_text.logprobs" in body.include:
        fields["logprobs"] = True
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        fields["response_format"] = (
            {"type": fmt.type}
            if fmt.type == "json_object"
            else {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_},
            }
        )
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise InvalidRequest("text.format of type json_schema needs a schema")
    if body.reasoning and body.reasoning.effort:
        fields["reasoning_effort"] = body.reasoning.effort
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
