"""GenerateRequest.messages and the request-level controls that came with it: validated in one
place.
"""

import pytest
from google.protobuf import struct_pb2

from protos import generation_pb2 as pb
from scheduler_service.api.validation import InvalidRequest, request_from_proto
from scheduler_service.text.limits import Limits
from scheduler_service.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def limits(tok):
    return Limits(tok.vocab_size, 256, 64, 16, tok.max_token_bytes, (2,))


def text_of(tok, req):
    return tok.decode(req.prompt_token_ids, skip_special_tokens=False)


def test_messages_render_through_the_chat_template(tok, limits):
    req = request_from_proto(
        pb.GenerateRequest(
            messages=[
                pb.ChatMessage(role="system", content="be brief"),
                pb.ChatMessage(role="user", content="hi"),
                pb.ChatMessage(role="assistant", content="hello"),
                pb.ChatMessage(role="user", content="and?"),
            ]
        ),
        tok,
        limits,
    )
    assert (
        text_of(tok, req)
        == "<s>system: be brief</s><s>user: hi</s><s>assistant: hello</s><s>user: and?</s>"
        "<s>assistant:"
    )
    no_prompt = request_from_proto(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="hi")], add_generation_prompt=False
        ),
        tok,
        limits,
    )
    assert text_of(tok, no_prompt) == "<s>user: hi</s>"
    cont = request_from_proto(
        pb.GenerateRequest(
            messages=[
                pb.ChatMessage(role="user", content="hi"),
                pb.ChatMessage(role="assistant", content="the fox"),
            ],
            continue_final_message=True,
        ),
        tok,
        limits,
    )
    assert text_of(tok, cont) == "<s>user: hi</s><s>assistant: the fox"


def test_a_user_prompt_equals_the_same_single_message(tok, limits):
    a = request_from_proto(pb.GenerateRequest(prompt="hi there"), tok, limits)
    b = request_from_proto(
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi there")]), tok, limits
    )
    assert a.prompt_token_ids == b.prompt_token_ids


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: pb.GenerateRequest(
                prompt="a", messages=[pb.ChatMessage(role="user", content="b")]
            ),
            "exactly one of prompt, prompt_token_ids and messages, not prompt and messages",
        ),
        (
            lambda: pb.GenerateRequest(
                prompt_token_ids=[5], messages=[pb.ChatMessage(role="user", content="b")]
            ),
            "not prompt_token_ids and messages",
        ),
        (lambda: pb.GenerateRequest(), "set prompt \\(text\\), prompt_token_ids or messages"),
        (
            lambda: pb.GenerateRequest(messages=[pb.ChatMessage(content="b")]),
            "messages\\[0\\].role is empty",
        ),
        (
            lambda: pb.GenerateRequest(prompt="a", add_generation_prompt=True),
            "add_generation_prompt applies to messages",
        ),
        (
            lambda: pb.GenerateRequest(prompt="a", tools=[struct_pb2.Struct()]),
            "tools applies to messages only",
        ),
        (
            lambda: pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="b")],
                continue_final_message=True,
                add_generation_prompt=True,
            ),
            "exclude each other",
        ),
        (
            lambda: pb.GenerateRequest(
                messages=[
                    pb.ChatMessage(
                        role="user", content="b", tool_calls=[pb.ToolCall(name="f", arguments="{}")]
                    )
                ]
            ),
            "tool_calls but its role is 'user'",
        ),
        (
            lambda: pb.GenerateRequest(
                messages=[
                    pb.ChatMessage(
                        role="assistant",
                        content="",
                        tool_calls=[pb.ToolCall(name="f", arguments="{not json")],
                    )
                ]
            ),
            "arguments is not valid JSON",
        ),
        (
            lambda: pb.GenerateRequest(
                prompt="a", sampling=pb.SamplingParams(truncate_prompt_tokens=-2)
            ),
            "truncate_prompt_tokens must be -1, 0 or positive",
        ),
        (
            lambda: pb.GenerateRequest(
                prompt="a", sampling=pb.SamplingParams(truncate_prompt_tokens=256)
            ),
            "truncate_prompt_tokens is 256",
        ),
    ],
)
def test_bad_chat_requests_say_what_is_wrong(tok, limits, build, message):
    with pytest.raises(InvalidRequest, match=message):
        request_from_proto(build(), tok, limits)


def test_a_template_that_refuses_a_conversation_is_a_client_error(tok, limits, tmp_path):
    import json

    from tests.support.tiny import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "m", seed=2)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must come first') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequest, match="System message must come first"):
        request_from_proto(
            pb.GenerateRequest(
                messages=[
                    pb.ChatMessage(role="user", content="a"),
                    pb.ChatMessage(role="system", content="b"),
                ]
            ),
            Tokenizer(folder),
            limits,
        )


def test_truncate_prompt_tokens_keeps_the_last_tokens(tok, limits):
    ids = list(range(10, 40))
    req = request_from_proto(
        pb.GenerateRequest(
            prompt_token_ids=ids, sampling=pb.SamplingParams(truncate_prompt_tokens=8, max_tokens=4)
        ),
        tok,
        limits,
    )
    assert req.prompt_token_ids == ids[-8:]
    long = list(range(10, 10 + 300))
    req = request_from_proto(
        pb.GenerateRequest(
            prompt_token_ids=long,
            sampling=pb.SamplingParams(truncate_prompt_tokens=-1, max_tokens=1),
        ),
        tok,
        limits,
    )
    assert req.prompt_token_ids == long[-255:]


def test_tools_and_template_kwargs_reach_the_template(tok, limits, tmp_path):
    import json

    from tests.support.tiny import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "m", seed=3)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% if think "
        "%}(think){% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(folder)
    tool = struct_pb2.Struct()
    tool.update(
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    )
    kwargs = struct_pb2.Struct()
    kwargs.update({"think": True})
    req = request_from_proto(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="the fox")],
            tools=[tool],
            chat_template_kwargs=kwargs,
        ),
        t,
        limits,
    )
    assert t.decode(req.prompt_token_ids) == "[lookup](think)the fox"
    kwargs.update({"messages": []})
    with pytest.raises(InvalidRequest, match="chat_template_kwargs cannot set messages"):
        request_from_proto(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="x")], chat_template_kwargs=kwargs
            ),
            t,
            limits,
        )
