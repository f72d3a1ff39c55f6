"""The APIs agents speak, driven by the SDKs a user drives them with: OpenAI's Responses API
(`responses.create`, unary and streamed, tools, previous_response_id) and Anthropic's Messages API
(`messages.create`, streamed, a named tool, tool results), each answer equal to chat's for the same
conversation; the key guarding every door (HTTP, x-api-key, gRPC) and errors in each API's own
shape.
"""

import json
import time

import anthropic
import grpc
import httpx
import openai
import pytest

from protos import generation_pb2, generation_pb2_grpc
from tests.support.default_model import MODEL_DIR, has_model

KEY = "sk-agents"
pytestmark = pytest.mark.slow
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, "--api-key", KEY, "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(
        base_url=server.http_url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=120
    )


def chat_text(oai, messages, **fields) -> str:
    got = oai.chat.completions.create(model="tiny", messages=messages, temperature=0, **fields)
    return got.choices[0].message.content


def no_leak(server):
    deadline = time.monotonic() + 10
    while (st := server.stats()).num_running or st.num_waiting:
        assert time.monotonic() < deadline, "a request is still running"
        time.sleep(0.1)
    assert st.num_free_blocks + st.num_cached_blocks == st.num_blocks, "blocks leaked"


def test_a_response_equals_chat_streams_the_same_text_and_continues_from_its_id(server, oai):
    first = oai.responses.create(
        model="tiny",
        input="the quick brown",
        instructions="be terse.",
        max_output_tokens=10,
        temperature=0,
    )
    conversation = [
        {"role": "system", "content": "be terse."},
        {"role": "user", "content": "the quick brown"},
    ]
    assert first.output_text == chat_text(oai, conversation, max_tokens=10)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 10 and first.model == "tiny"

    events = list(
        oai.responses.create(
            model="tiny",
            input="the quick brown",
            instructions="be terse.",
            max_output_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"]
        and kinds[-1] == "response.incomplete"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == first.output_text
    )
    assert events[-1].response.output_text == first.output_text

    second = oai.responses.create(
        model="tiny",
        input="over the lazy",
        previous_response_id=first.id,
        instructions="be terse.",
        max_output_tokens=8,
        temperature=0,
    )
    whole = conversation + [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "over the lazy"},
    ]
    assert second.output_text == chat_text(oai, whole, max_tokens=8)
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        oai.responses.create(model="tiny", input="x", previous_response_id="resp_nowhere")
    no_leak(server)


def test_a_response_calls_a_function_and_takes_its_output_back(server, oai):
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    called = oai.responses.create(
        model="tiny",
        input="weather?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0.8,
        parallel_tool_calls=False,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    answer = oai.responses.create(
        model="tiny",
        previous_response_id=called.id,
        tools=[tool],
        max_output_tokens=5,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert (
        answer.output[0].type == "message" and answer.usage.input_tokens > called.usage.input_tokens
    )
    named = list(
        oai.responses.create(
            model="tiny",
            input="weather?",
            tools=[tool],
            stream=True,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0.8,
        )
    )
    done = [e for e in named if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    assert not [e for e in named if e.type == "response.output_text.delta"]
    no_leak(server)


def test_a_message_equals_chat_streams_the_same_text_and_stops_on_a_sequence(server, oai, claude):
    msgs = [
        {"role": "user", "content": "the quick brown"},
        {"role": "assistant", "content": "fox jumps"},
        {"role": "user", "content": [{"type": "text", "text": "over the lazy"}]},
    ]
    got = claude.messages.create(
        model="tiny",
        max_tokens=10,
        system="be terse.",
        messages=msgs,
        extra_body={"temperature": 0},
    )
    chat = [
        {"role": "system", "content": "be terse."},
        *msgs[:2],
        {"role": "user", "content": "over the lazy"},
    ]
    assert got.content[0].text == chat_text(oai, chat, max_tokens=10)
    assert (
        got.stop_reason == "max_tokens"
        and got.usage.output_tokens == 10
        and got.role == "assistant"
    )

    with claude.messages.stream(
        model="tiny",
        max_tokens=10,
        system="be terse.",
        messages=msgs,
        extra_body={"temperature": 0},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == got.content[0].text and final.stop_reason == "max_tokens"

    stop = got.content[0].text[3:6]
    cut = claude.messages.create(
        model="tiny",
        max_tokens=10,
        system="be terse.",
        messages=msgs,
        stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert got.content[0].text.startswith(cut.content[0].text) and stop not in cut.content[0].text
    counted = claude.messages.count_tokens(model="tiny", system="be terse.", messages=msgs)
    assert counted.input_tokens == got.usage.input_tokens + got.usage.cache_read_input_tokens
    no_leak(server)


def test_a_message_uses_a_named_tool_and_reads_its_result(server, claude):
    tool = {"name": "get_weather", "description": "the weather in a city", "input_schema": CITY}
    used = claude.messages.create(
        model="tiny",
        max_tokens=60,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather in Paris?"}],
    )
    assert used.stop_reason == "tool_use"
    block = [b for b in used.content if b.type == "tool_use"][0]
    assert block.name == "get_weather" and block.input["city"] in ("Paris", "Rome")
    with claude.messages.stream(
        model="tiny",
        max_tokens=60,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather in Paris?"}],
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.content[0].input["city"]
    after = claude.messages.create(
        model="tiny",
        max_tokens=4,
        tools=[tool],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": used.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}],
            },
        ],
    )
    assert after.content[0].type == "text" and after.usage.input_tokens > used.usage.input_tokens
    no_leak(server)


@pytest.mark.parametrize(
    "body, status, kind, message",
    [
        (
            {"model": "gpt-4", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            404,
            "not_found_error",
            "'gpt-4' does not exist",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
            "max_tokens: Field required",
        ),
        (
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "text only",
        ),
        (
            {"model": "tiny", "max_tokens": 5, "messages": []},
            400,
            "invalid_request_error",
            "at least one message",
        ),
        (
            {
                "model": "tiny",
                "max_tokens": 5,
                "top_k": -7,
                "messages": [{"role": "user", "content": "x"}],
            },
            400,
            "invalid_request_error",
            "top_k",
        ),
    ],
)
def test_bad_messages_are_answered_in_anthropics_error_shape(server, body, status, kind, message):
    r = httpx.post(f"{server.http_url}/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert (
        error["type"] == "error"
        and error["error"]["type"] == kind
        and message in error["error"]["message"]
    )


def test_bad_responses_name_the_field(server):
    cases = [
        ({"input": "x", "background": True}, "background is not served"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "text only",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be at least 1"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "calls functions only"),
        ({"input": "x", "frobnicate": 1}, "frobnicate: is not a field"),
    ]
    for body, message in cases:
        r = httpx.post(
            f"{server.http_url}/responses", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)


def test_one_key_guards_every_door(server, tiny_model_dir):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        for path in ("/responses", "/messages", "/chat/completions"):
            r = httpx.post(server.http_url + path, json={}, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
    bare = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as refused:
        bare.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in refused.value.details()
    with pytest.raises(grpc.RpcError) as streamed:
        list(bare.GenerateStream(generation_pb2.GenerateRequest(prompt="x"), timeout=10))
    assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = [("authorization", "Bearer nope")]
    with pytest.raises(grpc.RpcError) as bad:
        bare.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=wrong, timeout=10)
    assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = bare.GetModelInfo(
        generation_pb2.GetModelInfoRequest(),
        timeout=10,
        metadata=[("authorization", f"Bearer {KEY}")],
    )
    assert info.model_name == "tiny"  # the name the HTTP APIs serve it as
    assert server.stats().num_blocks > 0  # the helper's channel carries the key


def test_the_ready_line_says_the_served_name_and_its_curl_carries_the_key(server, oai):
    lines = server.log_path.read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("pagedserve is serving"))
    assert lines[head].startswith("pagedserve is serving tiny (")
    assert "export PAGEDSERVE_API_KEY" in lines[head + 1]
    assert '-H "Authorization: Bearer $PAGEDSERVE_API_KEY"' in lines[head + 2]
    assert "/v1/responses" in lines[head + 2] and "/v1/messages" in lines[head + 2]
    assert [m.id for m in oai.models.list().data] == ["tiny"]


@has_model
@pytest.mark.real_model
def test_the_sdks_against_the_default_model_as_make_run_serves_it(server_factory):
    """`make run`'s model and flags (its GGUF's blocks, its template): Responses unary and streamed,
    Messages unary, streamed and with a named tool, each through its own SDK."""
    served = server_factory(MODEL_DIR, "--max-model-len", "2048", "--kv-cache-memory", "256MiB")
    name = MODEL_DIR.name
    oai = openai.OpenAI(base_url=served.http_url, api_key="none", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(
        base_url=served.http_url.removesuffix("/v1"), api_key="none", max_retries=0, timeout=120
    )
    question = "What is the capital of France? Answer in one sentence."
    answer = oai.responses.create(model=name, input=question, max_output_tokens=30, temperature=0)
    assert "Paris" in answer.output_text and answer.status == "completed"
    streamed = list(
        oai.responses.create(
            model=name, input=question, max_output_tokens=30, temperature=0, stream=True
        )
    )
    assert (
        "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
        == answer.output_text
    )
    ask = [{"role": "user", "content": question}]
    reply = claude.messages.create(
        model=name, max_tokens=30, messages=ask, extra_body={"temperature": 0}
    )
    assert "Paris" in reply.content[0].text and reply.stop_reason == "end_turn"
    with claude.messages.stream(
        model=name, max_tokens=30, messages=ask, extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == reply.content[0].text
    tool = {"name": "get_weather", "description": "the weather in a city", "input_schema": CITY}
    used = claude.messages.create(
        model=name,
        max_tokens=40,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
    )
    assert used.stop_reason == "tool_use" and used.content[-1].input["city"] in ("Paris", "Rome")
    no_leak(served)


THINKING_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"
)


def test_a_thinking_template_answers_with_its_reasoning_apart_in_chat_and_grpc(
    server_factory, tiny_model_dir, tmp_path
):
    """A template that opens a <think> block (as Qwen3.5's does): chat's reasoning_content, its
    streamed deltas and gRPC's reasoning_text hold the thinking, content and text the answer;
    chat_template_kwargs.enable_thinking=false turns it off and the whole text is content.
    """
    import shutil

    folder = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    srv = server_factory(folder, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=srv.http_url, api_key="x", max_retries=0, timeout=120)
        asked = dict(model="tiny", messages=[{"role": "user", "content": "think"}], max_tokens=12)
        whole = client.chat.completions.create(temperature=0, **asked).choices[0].message
        thought = whole.model_extra["reasoning_content"]
        assert thought and not whole.content and "<think>" not in thought
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(temperature=0, stream=True, **asked):
            if chunk.choices:
                delta = chunk.choices[0].delta
                streamed["content"] += delta.content or ""
                streamed["reasoning_content"] += delta.model_extra.get("reasoning_content") or ""
        assert streamed == {"reasoning_content": thought, "content": ""}
        req = generation_pb2.GenerateRequest(
            messages=[generation_pb2.ChatMessage(role="user", content="think")],
            sampling=generation_pb2.SamplingParams(max_tokens=12),
        )
        got = srv.stub.Generate(req, timeout=60).choices[0]
        assert (got.reasoning_text, got.text) == (thought, "")
        pieces = list(srv.stub.GenerateStream(req, timeout=60))
        assert "".join(p.reasoning_text for p in pieces) == thought
        assert "".join(p.text for p in pieces) == ""
        off = (
            client.chat.completions.create(
                temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                **asked,
            )
            .choices[0]
            .message
        )
        assert off.content and off.model_extra.get("reasoning_content") is None
    finally:
        srv.stop()
