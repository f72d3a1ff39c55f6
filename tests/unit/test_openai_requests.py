"""OpenAI bodies in the shape of pagedserve.v1 requests (no processes): model defaults for what a
request leaves out, structured output and tool choices as constraints, several prompts as several
requests.
"""

import json

import pytest

from scheduler_service.api.openai_requests import chat_request, completion_requests, embed_inputs
from scheduler_service.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from scheduler_service.api.validation import InvalidRequest
from scheduler_service.core.config import ModelSpec
from tests.support.tiny import make_tiny_llama

HI = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": ["x"],
        },
    },
}


def chat(**body):
    return chat_request(
        ChatCompletionRequest.model_validate({"messages": HI, **body}), DEFAULTS, True
    )


DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_what_a_request_leaves_out_comes_from_the_models_generation_config(tmp_path):
    folder = make_tiny_llama(tmp_path / "m", seed=1)
    (folder / "generation_config.json").write_text(
        json.dumps({**DEFAULTS, "do_sample": True, "eos_token_id": 2})
    )
    assert ModelSpec.from_folder(folder).sampling_defaults == DEFAULTS
    msg, _ = chat()
    s = msg.sampling
    assert (round(s.temperature, 4), round(s.top_p, 4), s.top_k) == (0.6, 0.9, 20)
    assert round(s.repetition_penalty, 4) == 1.1 and not s.HasField("max_tokens")
    msg, _ = chat(temperature=0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_tokens=5)
    s = msg.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens) == (
        0,
        1.0,
        0,
        1.0,
        5,
    )
    bare = chat_request(ChatCompletionRequest.model_validate({"messages": HI}), {}, False)[
        0
    ].sampling
    assert bare.temperature == 1.0 and not bare.HasField("top_p")  # OpenAI's own defaults


def test_structured_output_and_tool_choices_become_one_constraint():
    assert json.loads(chat(response_format={"type": "json_object"})[0].sampling.json_schema) == {
        "type": "object"
    }
    msg, mode = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert mode.kind == "named" and json.loads(msg.sampling.json_schema)["required"] == ["x"]
    assert msg.tools[0]["function"]["name"] == "f"
    msg, mode = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(msg.sampling.json_schema)
    assert mode.kind == "required" and schema["maxItems"] == 1 and schema["minItems"] == 1
    _, mode = chat(tools=[TOOL])
    assert mode.kind == "auto" and mode.parse_auto
    assert chat(structured_outputs={"choice": ["yes", "no"]})[0].sampling.regex == "(yes|no)"
    for body, message in (
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "not among",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot",
        ),
        ({"guided_regex": "a+", "guided_json": {"type": "object"}}, "at most one"),
        ({"logit_bias": {"x": 1}}, "token ids"),
        ({"max_tokens": 1, "max_completion_tokens": 2}, "not both"),
        ({"seed": -1}, "seed must be at least 0"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            chat(**body)


def test_several_prompts_are_several_requests_and_embeddings_take_every_input_shape():
    many = completion_requests(
        CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "n": 2}), {}
    )
    assert [list(m.prompt_token_ids) for m in many] == [[1, 2], [3]] and many[0].sampling.n == 2
    texts = completion_requests(CompletionRequest.model_validate({"prompt": ["a", "b"]}), {})
    assert [m.prompt for m in texts] == ["a", "b"] and all(m.raw_prompt for m in texts)
    with pytest.raises(InvalidRequest, match="suffix"):
        completion_requests(CompletionRequest.model_validate({"prompt": "a", "suffix": "b"}), {})
    assert embed_inputs(EmbeddingRequest.model_validate({"input": "a"})).texts == ["a"]
    assert embed_inputs(EmbeddingRequest.model_validate({"input": [1, 2]})).token_ids == [[1, 2]]
    assert embed_inputs(EmbeddingRequest.model_validate({"input": [[1], [2, 3]]})).token_ids == [
        [1],
        [2, 3],
    ]
    assert (
        embed_inputs(
            EmbeddingRequest.model_validate({"input": ["a", "b"], "dimensions": 4})
        ).dimensions
        == 4
    )
