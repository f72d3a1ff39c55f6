"""OpenAI bodies -> pagedserve.v1 requests, so HTTP goes through the same validator and engine as
gRPC; only what the proto cannot hold is checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from google.protobuf import struct_pb2

from protos import generation_pb2
from scheduler_service.api import tool_calls
from scheduler_service.api.embedding import EmbedInputs
from scheduler_service.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
)
from scheduler_service.api.validation import MAX_LOGPROBS, InvalidRequest
from scheduler_service.text.structured import choice_regex

UINT32 = 2**32 - 1


@dataclass(frozen=True)
class ToolMode:
    """What the text becomes: content, content with <tool_call> blocks, calls, or one call."""

    kind: str = "none"
    name: str = ""
    parse_auto: bool = False


def _count(name: str, value: int | None, low: int = 0, high: int = UINT32) -> int | None:
    if value is not None and not low <= value <= high:
        if value < low and high in (UINT32, 2**31 - 1, 2**64 - 1):
            raise InvalidRequest(f"{name} must be at least {low}, got {value}")
        raise InvalidRequest(f"{name} must lie in [{low}, {high}], got {value}")
    return value


def sampling(
    body: SamplingFields, defaults: dict, max_tokens: int | None
) -> generation_pb2.SamplingParams:
    """Fields both generation endpoints share; unset ones take generation_config.json's, as vLLM's
    do.
    """
    s = generation_pb2.SamplingParams()
    if max_tokens is not None:
        s.max_tokens = _count("max_tokens", max_tokens, 1)
    temperature = (
        body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)
    )
    s.temperature = temperature
    top_p = body.top_p if body.top_p is not None else defaults.get("top_p")
    if top_p is not None:
        s.top_p = top_p
    s.top_k = _count(
        "top_k", body.top_k if body.top_k is not None else defaults.get("top_k", 0), -1, 2**31 - 1
    )
    s.min_p = body.min_p if body.min_p is not None else defaults.get("min_p", 0.0)
    repetition = (
        body.repetition_penalty
        if body.repetition_penalty is not None
        else defaults.get("repetition_penalty")
    )
    if repetition is not None:
        s.repetition_penalty = repetition
    s.n = _count("n", body.n, 1)
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.seed is not None:
        s.seed = _count("seed", body.seed, 0, 2**64 - 1)
    s.presence_penalty, s.frequency_penalty = body.presence_penalty, body.frequency_penalty
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys are token ids, got {key!r}") from None
        s.logit_bias[_count("a logit_bias token id", token)] = bias
    s.min_tokens = _count("min_tokens", body.min_tokens)
    s.ignore_eos = body.ignore_eos
    s.stop_token_ids.extend(_count("a stop_token_ids entry", t) for t in body.stop_token_ids or ())
    s.skip_special_tokens = body.skip_special_tokens
    s.include_stop_str_in_output = body.include_stop_str_in_output
    if body.truncate_prompt_tokens is not None:
        s.truncate_prompt_tokens = _count(
            "truncate_prompt_tokens", body.truncate_prompt_tokens, -1, 2**31 - 1
        )
    _structured(body, s)
    return s


def _structured(body: SamplingFields, s: generation_pb2.SamplingParams) -> None:
    """vLLM's structured_outputs object, or its older guided_* fields: at most one constraint."""
    given = []
    so = body.structured_outputs
    for name, value in (
        ("structured_outputs.json", so and so.json_),
        ("structured_outputs.regex", so and so.regex),
        ("structured_outputs.grammar", so and so.grammar),
        ("structured_outputs.choice", so and so.choice),
        ("guided_json", body.guided_json),
        ("guided_regex", body.guided_regex),
        ("guided_grammar", body.guided_grammar),
        ("guided_choice", body.guided_choice),
    ):
        if value is not None:
            given.append((name, value))
    if len(given) > 1:
        raise InvalidRequest(
            f"set at most one structured-output constraint, not {' and '.join(n for n, _ in given)}"
        )
    if not given:
        return
    name, value = given[0]
    if name.endswith("json"):
        s.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif name.endswith("regex"):
        s.regex = value
    elif name.endswith("grammar"):
        s.grammar = value
    else:
        if not value:
            raise InvalidRequest(f"{name} has no choices")
        s.regex = choice_regex(value)


def constrained(s: generation_pb2.SamplingParams) -> bool:
    return bool(s.json_schema or s.regex or s.grammar)


def chat_request(
    body: ChatCompletionRequest, defaults: dict, template_parses_calls: bool
) -> tuple[generation_pb2.GenerateRequest, ToolMode]:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequest("set max_tokens or max_completion_tokens, not both")
    if not body.messages:
        raise InvalidRequest("messages is empty: a chat request needs at least one message")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    s = sampling(body, defaults, max_tokens)
    if body.logprobs:
        s.logprobs = _count("top_logprobs", body.top_logprobs or 0, 0, MAX_LOGPROBS)
    elif body.top_logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    if body.prompt_logprobs is not None:
        if body.stream:
            raise InvalidRequest(
                "prompt_logprobs is served on a chat request with stream false (or on "
                "/v1/completions, streamed too)"
            )
        s.prompt_logprobs = _count("prompt_logprobs", body.prompt_logprobs, 0, MAX_LOGPROBS)
    _response_format(body, s)
    msg = generation_pb2.GenerateRequest(
        sampling=s, continue_final_message=body.continue_final_message
    )
    for i, m in enumerate(body.messages):
        msg.messages.append(_message(i, m))
    if body.add_generation_prompt is not None:
        msg.add_generation_prompt = body.add_generation_prompt
    kwargs = {}
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
        if body.reasoning_effort == "none":
            kwargs["enable_thinking"] = False
    kwargs.update(body.chat_template_kwargs or {})  # what the request sets there itself wins
    if kwargs:
        msg.chat_template_kwargs.update(kwargs)
    mode = _tools(body, msg, template_parses_calls)
    return msg, mode


def _message(i: int, m) -> generation_pb2.ChatMessage:
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"messages[{i}].content[{j}] is of type {part.type!r}: this server's "
                    "models read text only"
                )
            texts.append(part.text)
        content = "".join(texts)
    out = generation_pb2.ChatMessage(
        role=m.role, content=content or "", name=m.name or "", tool_call_id=m.tool_call_id or ""
    )
    for c in m.tool_calls or ():
        out.tool_calls.append(
            generation_pb2.ToolCall(
                id=c.id, type=c.type, name=c.function.name, arguments=c.function.arguments
            )
        )
    return out


def _response_format(body: ChatCompletionRequest, s: generation_pb2.SamplingParams) -> None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return
    if constrained(s):
        raise InvalidRequest("set response_format or a structured-output constraint, not both")
    if rf.type == "json_object":
        s.json_schema = '{"type": "object"}'
        return
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequest("response_format of type json_schema needs json_schema.schema")
    s.json_schema = json.dumps(rf.json_schema.schema_)


def _tools(
    body: ChatCompletionRequest, msg: generation_pb2.GenerateRequest, template_parses_calls: bool
) -> ToolMode:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice is set but no tools are offered")
        return ToolMode()
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    for f in functions:
        tool = struct_pb2.Struct()
        tool.update({"type": "function", "function": f})
        msg.tools.append(tool)
    if choice is None:
        choice = "auto"
    if choice in ("none", "auto"):
        return ToolMode(choice, parse_auto=choice == "auto" and template_parses_calls)
    if constrained(msg.sampling):
        raise InvalidRequest(
            "tool_choice required or a named function decides the output's shape: it cannot "
            "be combined with response_format or a structured-output constraint"
        )
    if choice == "required":
        msg.sampling.json_schema = json.dumps(
            tool_calls.required_schema(functions, body.parallel_tool_calls)
        )
        return ToolMode("required")
    named = [f for f in functions if f["name"] == choice.function.name]
    if not named:
        offered = ", ".join(f["name"] for f in functions)
        raise InvalidRequest(
            f"tool_choice names function {choice.function.name!r}, which is not among the "
            f"tools offered ({offered})"
        )
    msg.sampling.json_schema = json.dumps(tool_calls.parameters_schema(named[0]))
    return ToolMode("named", name=choice.function.name)


def completion_requests(
    body: CompletionRequest, defaults: dict
) -> list[generation_pb2.GenerateRequest]:
    """One request per prompt; no chat template."""
    if body.suffix:
        raise InvalidRequest("suffix is not served: these models do not fill in the middle")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of other than n is not served")
    s = sampling(body, defaults, body.max_tokens)
    if body.logprobs is not None:
        s.logprobs = _count("logprobs", body.logprobs, 0, MAX_LOGPROBS)
    if body.prompt_logprobs is not None:
        s.prompt_logprobs = _count("prompt_logprobs", body.prompt_logprobs, 0, MAX_LOGPROBS)
    # the echoed prompt's tokens get logprobs too, as vLLM's
    elif body.echo and body.logprobs is not None:
        s.prompt_logprobs = s.logprobs
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequest("prompt is empty")
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(generation_pb2.GenerateRequest(prompt=p, raw_prompt=True, sampling=s))
        else:
            if any(t < 0 or t > UINT32 for t in p):
                raise InvalidRequest("a prompt token id is negative or too large")
            out.append(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling=s))
    return out


def embed_inputs(body: EmbeddingRequest) -> EmbedInputs:
    data = body.input
    inputs = EmbedInputs(
        dimensions=_count("dimensions", body.dimensions or 0, 0, 2**31 - 1),
        truncate_prompt_tokens=_count(
            "truncate_prompt_tokens", body.truncate_prompt_tokens or 0, -1, 2**31 - 1
        ),
        prompt_name=body.prompt_name or "",
    )
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidRequest(f"dimensions must be at least 1, got {body.dimensions}")
    if isinstance(data, str):
        inputs.texts = [data]
    elif data and isinstance(data[0], int):
        inputs.token_ids = [list(data)]
    elif data and isinstance(data[0], list):
        inputs.token_ids = [list(d) for d in data]
    else:
        inputs.texts = list(data)
    if inputs.token_ids is not None and any(t < 0 for ids in inputs.token_ids for t in ids):
        raise InvalidRequest("a token id in input is negative")
    return inputs
