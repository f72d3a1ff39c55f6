"""The gate every HTTP body passes (scheduler_service.text.json_gate.py)."""

import json

import pytest

from scheduler_service.text.json_gate import MAX_DEPTH, BadJson, depth, parse


def test_depth_counts_brackets_outside_strings_only():
    assert depth(b'{"a": [1, {"b": []}]}') == 4
    assert depth(b'{"a": "[[[[{{{{", "b": "\\"[["}') == 1
    assert depth(b"42") == 0
    assert depth(b"[" * 5000 + b"]" * 5000) == 5000


def test_what_real_requests_hold_parses_as_json_does():
    body = {
        "messages": [{"role": "user", "content": "héllo 🙂 \u00e9 [x] {y}"}],
        "temperature": 0.5,
        "n": 2,
        "stop": ["\n", "END"],
        "tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}],
    }
    raw = json.dumps(body).encode()
    assert parse(raw) == body
    nested: object = 1
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert parse(json.dumps(nested).encode()) == nested  # exactly the limit is taken


@pytest.mark.parametrize(
    "raw, says, param",
    [
        (b'{"messages": [{"content": "\\ud800"}]}', "lone surrogate", "messages[0].content"),
        (b'{"tools": [{"\\udfff": 1}]}', "lone surrogate", "tools[0]"),
        (b'"\\udc00"', "the request body: a string holds a lone surrogate", None),
        (b'{"top_p": NaN}', "NaN is not a JSON number", None),
        (b'{"top_p": -Infinity}', "-Infinity is not a JSON number", None),
        (b'{"top_p": 1e400}', "past a float's range", None),
        (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON", None),
        (b'{"prompt": "\xff"}', "not valid JSON", None),
        (
            b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
            f"nests {MAX_DEPTH + 1} levels deep",
            None,
        ),
        (b'{"a": ' * 100_000, "nests 100000 levels deep", None),  # refused before parsing
    ],
)
def test_what_no_handler_could_take_is_refused_naming_it(raw, says, param):
    with pytest.raises(BadJson, match=None) as e:
        parse(raw)
    assert says in str(e.value)
    assert e.value.param == param


def test_a_tool_schema_at_the_limit_passes_on_as_a_grpc_message():
    """The limit is what a protobuf Struct carries: an HTTP tool whose schema nests as deep as the
    gate takes becomes a GenerateRequest that protobuf serializes and parses back.
    """
    from protos import generation_pb2
    from scheduler_service.api import openai_requests
    from scheduler_service.api.openai_schema import ChatCompletionRequest

    schema: object = {"type": "string"}
    body = {}
    for _ in range(MAX_DEPTH):
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        }
        if depth(json.dumps(body).encode()) == MAX_DEPTH:
            break
        schema = {"not": schema}
    assert depth(json.dumps(body).encode()) == MAX_DEPTH
    request = ChatCompletionRequest.model_validate(parse(json.dumps(body).encode()))
    msg, _ = openai_requests.chat_request(request, {}, False)
    again = generation_pb2.GenerateRequest.FromString(msg.SerializeToString())
    assert again.tools[0]["function"]["name"] == "f"


def test_json_inside_a_grpc_field_is_named():
    with pytest.raises(BadJson, match="json_schema is not valid JSON"):
        parse('{"type": ', "json_schema")
    with pytest.raises(BadJson, match="json_schema nests 40 levels deep"):
        parse("[" * 40 + "]" * 40, "json_schema")
