"""The OpenAI request bodies as pydantic models. An unknown field is refused (400 naming it); the
engine's extras sit beside OpenAI's fields under vLLM's names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one constraint on the generated text."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class SamplingFields(Strict):
    """What both generation endpoints take: OpenAI's sampling fields, then the engine's extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # taken and ignored: this server stores nothing
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # the engine's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class ImageUrl(Strict):
    url: str
    detail: str | None = None


class ContentPart(Strict):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(Strict):
    name: str
    arguments: str = "{}"


class MessageToolCall(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    # an earlier answer's reasoning, sent back: dropped, as templates do
    reasoning_content: str | None = None


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's: the prompt tokens' logprobs, top-level in the answer
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # passed to the chat template; "none" also turns enable_thinking off
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class EmbeddingRequest(Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    prompt_name: str | None = None


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a text (as it is) or a conversation (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(Strict):
    """vLLM's /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str
    replace: bool = False


class UnloadLoraRequest(Strict):
    lora_name: str
