"""gpt-oss's harmony answers through every API a user calls, on recorded token streams replayed
through the real routes and detokenizer: chat (unary and streamed), Responses, Messages and
gRPC each give the analysis channel as reasoning, the final channel as content and a commentary
message to functions.NAME as a tool call; reasoning_effort reaches the system message; no marker
leaks into any field.
"""

import asyncio
import json

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from protos import generation_pb2
from scheduler_service.api.grpc_server import GenerationServicer
from scheduler_service.api.harmony import MARKERS
from scheduler_service.api.openai_routes import OpenAIServer
from tests.support.scripted import ScriptedEngine, make_harmony_tokenizer

THOUGHT = "User asks for 2 + 2. Simple arithmetic."
ANSWER = "2 + 2 = 4."
REASONED = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
ARGS = '{"city": "Paris"}'
CALLED = (
    "<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{ARGS}<|call|>"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = ScriptedEngine(make_harmony_tokenizer(tmp_path_factory.mktemp("harmony")))
    server = OpenAIServer(engine, ["gpt-oss"])
    with TestClient(server.app) as http:
        yield engine, http


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=served[1], max_retries=0
    )


def leaks(*texts) -> bool:
    return any(m in (t or "") for t in texts for m in MARKERS)


def test_chat_says_analysis_as_reasoning_and_final_as_content_whole_and_streamed(served, oai):
    engine, _ = served
    engine.say(REASONED)
    got = oai.chat.completions.create(model="gpt-oss", messages=ASK, reasoning_effort="high")
    message = got.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THOUGHT, ANSWER)
    assert got.choices[0].finish_reason == "stop"
    request = engine.requests[-1]
    prompt = engine.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")
    assert not request.sampling.skip_special_tokens  # the markers reach the parser
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in oai.chat.completions.create(model="gpt-oss", messages=ASK, stream=True):
        delta = chunk.choices[0].delta
        assert not leaks(delta.content, delta.model_extra.get("reasoning_content"))
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += delta.model_extra.get("reasoning_content") or ""
    assert streamed == {"reasoning_content": THOUGHT, "content": ANSWER}


def test_chat_makes_a_commentary_message_to_a_function_a_tool_call(served, oai):
    engine, _ = served
    engine.say(CALLED)
    got = oai.chat.completions.create(model="gpt-oss", messages=ASK, tools=[TOOL])
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    assert choice.message.model_extra["reasoning_content"] == "Need the weather: call the tool."
    assert "get_weather" in engine.tokenizer.decode(
        engine.requests[-1].prompt_token_ids, skip_special_tokens=False
    )
    calls, finish, content = [], None, ""
    for chunk in oai.chat.completions.create(
        model="gpt-oss", messages=ASK, tools=[TOOL], stream=True
    ):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", ARGS)]


def test_a_constrained_answer_is_read_plain(served, oai):
    """A grammar decides the output's shape, so it is not harmony: the text is content as is."""
    engine, _ = served
    engine.say('{"x": 1}')
    got = oai.chat.completions.create(
        model="gpt-oss", messages=ASK, response_format={"type": "json_object"}
    )
    assert got.choices[0].message.content == '{"x": 1}'
    assert engine.requests[-1].sampling.skip_special_tokens


def test_responses_give_a_reasoning_item_then_the_message_or_a_function_call(served, oai):
    engine, _ = served
    engine.say(REASONED)
    got = oai.responses.create(model="gpt-oss", input="What is 2 + 2?")
    kinds = [item.type for item in got.output]
    assert kinds == ["reasoning", "message"] and got.output_text == ANSWER
    assert got.output[0].content[0].text == THOUGHT
    events = list(oai.responses.create(model="gpt-oss", input="What is 2 + 2?", stream=True))
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, said) == (THOUGHT, ANSWER)
    engine.say(CALLED)
    tools = [
        {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
    ]
    got = oai.responses.create(model="gpt-oss", input="Weather in Paris?", tools=tools)
    call = got.output[-1]
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", ARGS)


def test_messages_give_a_thinking_block_then_text_or_tool_use(served):
    engine, http = served
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )
    engine.say(REASONED)
    got = claude.messages.create(model="gpt-oss", max_tokens=50, messages=ASK)
    assert [b.type for b in got.content] == ["thinking", "text"]
    assert (got.content[0].thinking, got.content[1].text) == (THOUGHT, ANSWER)
    with claude.messages.stream(model="gpt-oss", max_tokens=50, messages=ASK) as stream:
        assert "".join(stream.text_stream) == ANSWER
    engine.say(CALLED)
    tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
    got = claude.messages.create(model="gpt-oss", max_tokens=50, messages=ASK, tools=[tool])
    assert got.stop_reason == "tool_use"
    assert (got.content[-1].name, got.content[-1].input) == ("get_weather", json.loads(ARGS))


def test_grpc_gives_reasoning_text_text_and_tool_calls_unary_and_streamed(served):
    engine, _ = served
    servicer = GenerationServicer(engine)
    req = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="What is 2 + 2?")],
        sampling=generation_pb2.SamplingParams(max_tokens=50),
    )

    async def both():
        whole = await servicer.Generate(req, None)
        pieces = [p async for p in servicer.GenerateStream(req, None)]
        return whole.choices[0], pieces

    engine.say(REASONED)
    got, pieces = asyncio.run(both())
    assert (got.reasoning_text, got.text, list(got.tool_calls)) == (THOUGHT, ANSWER, [])
    assert "".join(p.reasoning_text for p in pieces) == THOUGHT
    assert "".join(p.text for p in pieces) == ANSWER
    engine.say(CALLED)
    got, pieces = asyncio.run(both())
    assert got.text == "" and [(c.name, c.arguments) for c in got.tool_calls] == [
        ("get_weather", ARGS)
    ]
    assert [(c.name, c.arguments) for c in pieces[-1].tool_calls] == [("get_weather", ARGS)]
