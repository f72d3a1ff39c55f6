"""The gate every HTTP body passes (scheduler_service/api/json_gate.py)."""

import json

import pytest

from scheduler_service.api.json_gate import MAX_DEPTH, BadJson, depth, parse


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
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nests 129 levels deep", None),
        (b'{"a": ' * 100_000, "nests 100000 levels deep", None),  # refused before parsing
    ],
)
def test_what_no_handler_could_take_is_refused_naming_it(raw, says, param):
    with pytest.raises(BadJson, match=None) as e:
        parse(raw)
    assert says in str(e.value)
    assert e.value.param == param
