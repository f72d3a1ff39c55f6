"""The OpenAI-compatible HTTP server a pagedserve process serves beside gRPC, driven by the `openai`
SDK as a user drives it: answers equal to gRPC's, streams with usage, tool calls and JSON that
parse, and every bad request a 4xx in OpenAI's error shape with pagedserve's message.
"""

import json
import time

import httpx
import openai
import pytest

from protos import generation_pb2
from scheduler_service.api import tool_calls
from scheduler_service.api.openai_requests import ToolMode
from scheduler_service.api.openai_responses import ChatStream
from scheduler_service.core.sequence import FinishReason
from scheduler_service.text.output import Delta

KEY = "sk-test-key"
pytestmark = pytest.mark.slow
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir, "--api-key", KEY, "--served-model-name", "tiny", "tiny-alias"
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url, api_key=KEY, max_retries=0, timeout=120)


def no_leak(server):
    deadline = time.monotonic() + 10
    while True:
        st = server.stats()
        if st.num_running == 0 and st.num_waiting == 0:
            break
        assert time.monotonic() < deadline, "a request is still running"
        time.sleep(0.1)
    assert st.num_free_blocks + st.num_cached_blocks == st.num_blocks, "blocks leaked"


def grpc_answer(server, **fields):
    return server.stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=60)


CONVERSATION = [
    {"role": "system", "content": "you are terse."},
    {"role": "user", "content": "the quick brown"},
    {"role": "assistant", "content": "fox jumps"},
    {"role": "user", "content": "over the lazy"},
]


def test_a_two_turn_chat_equals_grpc_and_streams_the_same_text_with_usage(server, client):
    answer = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0
    )
    expected = grpc_answer(
        server,
        messages=[generation_pb2.ChatMessage(**m) for m in CONVERSATION],
        sampling=generation_pb2.SamplingParams(max_tokens=12, temperature=0),
    )
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.choices[0].text
    assert choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    assert answer.usage.completion_tokens == 12 and answer.model == "tiny"

    chunks = list(
        client.chat.completions.create(
            model="tiny-alias",
            messages=CONVERSATION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    no_leak(server)


def test_completion_logprobs_equal_grpc_and_n2_with_a_seed_repeats(server, client):
    prompt = "the quick brown fox"
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    want = grpc_answer(
        server,
        prompt=prompt,
        raw_prompt=True,
        sampling=generation_pb2.SamplingParams(max_tokens=6, temperature=0, logprobs=3),
    )
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.choices[0].text
    assert lp.token_logprobs == pytest.approx(
        [t.logprob for t in want.choices[0].logprobs], abs=1e-6
    )
    assert [len(t) for t in lp.top_logprobs] == [3] * 6 or all(
        1 <= len(t) <= 3 for t in lp.top_logprobs
    )
    assert "".join(lp.tokens) == got.choices[0].text

    twice = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, n=2, seed=11, temperature=1.0
        )
        for _ in range(2)
    ]
    assert [c.text for c in twice[0].choices] == [c.text for c in twice[1].choices]
    assert [c.index for c in twice[0].choices] == [0, 1]
    assert twice[0].choices[0].text != twice[0].choices[1].text
    no_leak(server)


def test_structured_output_and_tool_calls_parse(server, client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "sure": {"type": "boolean"},
        },
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "is it?"}],
        max_tokens=40,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": schema},
        },
    )
    data = json.loads(got.choices[0].message.content)
    assert data["answer"] in ("yes", "no") and isinstance(data["sure"], bool)

    named = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=40,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.8,
        seed=2,
    )
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

    required = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "time?"}],
        max_tokens=80,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.8,
        seed=3,
        parallel_tool_calls=False,
    )
    assert required.choices[0].finish_reason == "tool_calls"
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)

    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "weather?"}],
            max_tokens=40,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0.8,
            seed=2,
            stream=True,
        )
    )
    deltas = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == call.function.arguments
    no_leak(server)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"messages": []}, 400, "messages is empty"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
            400,
            "max_tokens must be at least 1",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"},
            404,
            "'gpt-4' does not exist",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            400,
            "temperature must be >= 0",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
            400,
            "top_logprobs needs logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
            400,
            "frobnicate: is not a field",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            400,
            "no tools",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            400,
            "text only",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "context"),
    ],
)
def test_bad_chat_requests_are_answered_in_openais_error_shape(server, body, status, message):
    r = httpx.post(
        f"{server.http_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"]


def test_an_error_names_the_field_it_is_about_as_param(server):
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": hi, "max_tokens": -1}, "max_tokens"),
        ({"messages": hi, "frobnicate": 1}, "frobnicate"),
        ({"messages": hi, "top_logprobs": 3}, "top_logprobs"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": hi, "temperature": "hot"}, "temperature"),
    ]
    for body, param in cases:
        r = httpx.post(
            f"{server.http_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_malformed_json_a_missing_key_and_unknown_routes(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.http_url}/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.http_url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(
            f"{server.http_url}/models", headers={"Authorization": "Bearer wrong"}
        ).status_code
        == 401
    )
    r = httpx.get(f"{server.http_url}/nothing", headers=auth)
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    models = httpx.get(f"{server.http_url}/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    root = server.http_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200  # no key needed, as for a load balancer
    assert "pagedserve_num_running" in httpx.get(f"{root}/metrics").text


POST_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)


def test_hostile_bytes_get_a_400_naming_what_is_wrong_on_every_route(server):
    """Bodies that are JSON but no request (a lone surrogate in a string, NaN, a number past a
    float, nesting 10,000 deep) and bytes that are not UTF-8 get a 400 that says so, on every POST
    route, at the one gate where bodies are parsed; none reaches a handler (they had answered 500
    with a traceback: a surrogate cannot be encoded, a deep body overflowed the parser's stack).
    """
    root = server.http_url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    surrogate = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    cases = [
        (surrogate, "lone surrogate", "messages[0].content"),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN is not a JSON number", None),
        (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', "past a float", None),
        (b"[" * 10_000 + b"]" * 10_000, "nests 10000 levels deep", None),
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', "not valid JSON", None),
    ]
    for route in POST_ROUTES:
        for body, says, param in cases:
            r = httpx.post(f"{root}{route}", content=body, headers=auth, timeout=30)
            assert r.status_code == 400, (route, body[:60], r.text)
            error = r.json()["error"]
            assert says in error["message"], (route, error)
            if param is not None and "messages" not in route:  # Anthropic's shape has no param
                assert error["param"] == param, (route, error)
    # a tool's schema as deep as the gate takes (32 levels, body included) is served: its Struct
    # is one protobuf can parse (one 60 deep had answered 500 with protobuf's DecodeError)
    deep: dict = {"type": "string"}
    for _ in range(27):
        deep = {"not": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{server.http_url}/chat/completions",
        json={**chat, "tools": [tool]},
        headers=auth,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    no_leak(server)


def test_a_client_that_disconnects_aborts_its_request(server):
    body = {
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{server.http_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # unary too: the request is aborted when the connection closes before the answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.http_url}/completions",
            json={"prompt": "go", "max_tokens": 400, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
        )
    no_leak(server)


def test_auto_tool_calls_are_parsed_out_of_hermes_blocks_whole_and_streamed():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>"
    )
    parsed = tool_calls.parse_auto(text)
    assert parsed.content == "Let me look."
    assert parsed.calls[0]["function"]["name"] == "get_weather"
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert tool_calls.parse_auto("<tool_call>not json</tool_call>").calls == []

    stream = ChatStream("id", "m", ToolMode("auto", parse_auto=True), None, False)
    pieces = [
        "Let me",
        " look.\n<to",
        'ol_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "\n</tool_call>",
    ]
    events = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = stream.delta(Delta(0, [i], piece, FinishReason.STOP if last else None), None)
        if chunk:
            events.append(json.loads(chunk.decode().removeprefix("data: ")))
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content.strip() == "Let me look."
    final = events[-1]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    assert final["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tokenize_and_detokenize_as_vllm_serves_them(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    text = httpx.post(
        f"{server.http_url.removesuffix('/v1')}/tokenize",
        json={"prompt": "the quick brown"},
        headers=auth,
    ).json()
    want = server.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="the quick brown",
            raw_prompt=True,
            sampling=generation_pb2.SamplingParams(max_tokens=1),
        ),
        timeout=60,
    ).usage.prompt_tokens
    assert text["count"] == len(text["tokens"]) == want and text["max_model_len"] > 0
    chat = httpx.post(
        f"{server.http_url.removesuffix('/v1')}/tokenize",
        json={"messages": CONVERSATION},
        headers=auth,
    ).json()
    expected = grpc_answer(
        server,
        messages=[generation_pb2.ChatMessage(**m) for m in CONVERSATION],
        sampling=generation_pb2.SamplingParams(max_tokens=1),
    ).usage.prompt_tokens
    assert chat["count"] == expected
    back = httpx.post(
        f"{server.http_url.removesuffix('/v1')}/detokenize",
        json={"tokens": text["tokens"]},
        headers=auth,
    ).json()
    assert back["prompt"] == "the quick brown"
    bad = httpx.post(
        f"{server.http_url.removesuffix('/v1')}/detokenize", json={"tokens": [10**9]}, headers=auth
    )
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_prompt_logprobs_on_both_endpoints_and_echo_with_logprobs_as_vllm_serves_them(
    server, client
):
    prompt = "the quick brown fox"
    want = grpc_answer(
        server,
        prompt=prompt,
        raw_prompt=True,
        sampling=generation_pb2.SamplingParams(
            max_tokens=4, temperature=0, prompt_logprobs=2, logprobs=2
        ),
    )
    expected = [lp.logprob for lp in want.prompt_logprobs]
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = got.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(expected) + 1
    own = [
        e[str(lp.token_id)]["logprob"]
        for e, lp in zip(entries[1:], want.prompt_logprobs, strict=True)
    ]
    assert own == pytest.approx(expected, abs=1e-6)
    assert all(2 <= len(e) <= 3 for e in entries[1:])  # the prompt's token and the 2 most likely

    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"prompt_logprobs": 2},
        )
    )
    assert streamed[0].choices[0].model_extra["prompt_logprobs"] == entries

    echoed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt + want.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        expected + [t.logprob for t in want.choices[0].logprobs], abs=1e-6
    )
    assert "".join(lp.tokens) == echoed.choices[0].text and lp.text_offset[
        len(expected) + 1
    ] == len(prompt)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ] == lp.token_logprobs

    one = client.completions.create(
        model="tiny", prompt=[5], max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    # nothing comes before the first token
    assert one.choices[0].model_extra["prompt_logprobs"] == [None]
    chat = client.chat.completions.create(
        model="tiny",
        messages=CONVERSATION,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == chat.usage.prompt_tokens
    with pytest.raises(
        openai.BadRequestError, match="prompt_logprobs is served on a chat request with"
    ):
        client.chat.completions.create(
            model="tiny",
            messages=CONVERSATION,
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )
    no_leak(server)
