"""An answer as the agent APIs say it: reasoning split from content where the template thinks, whole
and while streaming (the streamed pieces add up to the whole), tool calls held until they are whole,
and the chat fields the agent APIs lean on (reasoning_effort, a cut-short required call).
"""

import json

import pytest

from scheduler_service.api.agents.turns import ResponseStore, TurnStream, parse_turn
from scheduler_service.api.openai_requests import ToolMode, chat_request
from scheduler_service.api.openai_responses import Sample, chat_message
from scheduler_service.api.openai_schema import ChatCompletionRequest
from scheduler_service.api.reasoning import AnswerFormat, split_reasoning, template_thinks
from scheduler_service.core.sequence import FinishReason
from scheduler_service.text.output import Delta


def sample(text: str, finish=FinishReason.STOP, stop=None) -> Sample:
    s = Sample()
    s.add(Delta(index=0, text=text, finish_reason=finish, stop_reason=stop))
    return s


@pytest.mark.parametrize(
    "text, opened, reasoning, rest",
    [
        (
            "<think>\nfirst a, then b\n</think>\n\nThe answer.",
            False,
            "first a, then b",
            "The answer.",
        ),
        (
            "weighing it</think>The answer.",
            True,
            "weighing it",
            "The answer.",
        ),  # the prompt opened the block
        ("<think>still thinking when cut", False, "still thinking when cut", ""),
        ("No thinking here.", False, None, "No thinking here."),
    ],
)
def test_reasoning_is_split_from_the_answer(text, opened, reasoning, rest):
    assert split_reasoning(text, True, opened) == (reasoning, rest)
    assert split_reasoning(text, False, opened) == (None, text)  # a template that does not think


def test_only_a_template_that_closes_think_blocks_thinks():
    assert template_thinks("{% if enable_thinking %}<think>\n{% endif %}...</think>")
    assert not template_thinks("{{ message['content'] }}") and not template_thinks(None)


@pytest.mark.parametrize(
    "pieces",
    [
        ["<th", "ink>plan", " it</th", "ink>\n\nHel", "lo", " world"],
        ["<think>a</think>b"],
        ["Plain ", "answer ", "<", "/think> is just text"],
    ],
)
def test_streamed_pieces_add_up_to_the_whole_turn(pieces):
    stream = TurnStream(ToolMode(), AnswerFormat(thinks=True))
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        r, c = stream.add(
            Delta(index=0, text=piece, finish_reason=FinishReason.STOP if last else None)
        )
        reasoning, content = reasoning + r, content + c
        assert "<think" not in content and "</th" not in reasoning
    turn, r, c = stream.close()
    assert (reasoning + r, content + c) == (turn.reasoning or "", turn.content or "")
    assert turn == parse_turn(sample("".join(pieces)), ToolMode(), AnswerFormat(thinks=True))


def test_auto_tool_calls_are_held_back_and_parsed_at_the_end():
    stream = TurnStream(ToolMode("auto", parse_auto=True), AnswerFormat())
    said = []
    for piece in ["Let me check. <tool", '_call>{"name": "f", "arguments": {"x": 1}}</tool_call>']:
        said.append(stream.add(Delta(index=0, text=piece))[1])
    stream.add(Delta(index=0, finish_reason=FinishReason.STOP))
    turn, _, rest = stream.close()
    assert said == ["Let me check. ", ""] and rest == "" and turn.content == "Let me check."
    assert [c["function"]["name"] for c in turn.calls] == ["f"] and turn.finish == "tool_calls"


def test_a_stop_string_is_kept_and_a_required_call_cut_short_is_no_content():
    turn = parse_turn(sample("The end", stop="STOP"), ToolMode())
    assert turn.stop_sequence == "STOP" and turn.finish == "stop"
    message, finish = chat_message(
        sample('[{"name": "get_we', FinishReason.LENGTH), ToolMode("required")
    )
    assert message["content"] is None and "tool_calls" not in message and finish == "length"


def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
    )
    msg, _ = chat_request(body, {}, False)
    assert dict(msg.chat_template_kwargs) == {"reasoning_effort": "high"}
    off = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        reasoning_effort="none",
        chat_template_kwargs={"custom": 1},
    )
    msg, _ = chat_request(off, {}, False)
    assert dict(msg.chat_template_kwargs) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
        "custom": 1,
    }


def test_the_response_store_keeps_the_newest_within_its_bound():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    assert store.get("r0") is None and store.get("r2")[1] == {"id": "r2"}
    assert store.delete("r1") and not store.delete("r1")


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize(
    "pieces",
    [
        ["<th", "ink>plan", " it</th", "ink>\n\nHel", "lo", " world"],
        [
            "<think>a, then b</think>",
            "<tool_call>\n",
            '{"name": "f", "arguments": {}}\n</tool_call>',
        ],
        ["Plain ", "answer ", "<", "/think> is just text"],
    ],
)
def test_a_chat_completion_says_its_reasoning_apart_whole_and_streamed(pieces, opened):
    """Chat completions split a <think> block into reasoning_content as vLLM's reasoning parser
    does: the streamed deltas add up to the whole message, no tag leaks into either field, and
    tool calls are parsed from what follows the block.
    """
    from scheduler_service.api.openai_responses import ChatStream

    if opened:  # the prompt opened the block: the answer starts inside it
        pieces = [
            p.replace("<think>", "").replace("<th", "").replace("ink>plan", "plan") for p in pieces
        ]
    mode = ToolMode(kind="auto", parse_auto=True)
    message, finish = chat_message(sample("".join(pieces)), mode, AnswerFormat(True, opened))
    stream = ChatStream("chatcmpl-1", "m", mode, None, False, AnswerFormat(True, opened))
    got = {"reasoning_content": "", "content": "", "tool_calls": None}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = stream.delta(
            Delta(index=0, text=piece, finish_reason=FinishReason.STOP if last else None), None
        )
        if chunk is None:
            continue
        choice = json.loads(chunk[len(b"data: ") :])["choices"][0]
        for key in ("reasoning_content", "content"):
            got[key] += choice["delta"].get(key) or ""
        got["tool_calls"] = choice["delta"].get("tool_calls", got["tool_calls"])
    assert got["reasoning_content"] == (message["reasoning_content"] or "")
    assert got["content"] == (message["content"] or "")
    assert "<think" not in got["content"] and "</th" not in got["reasoning_content"]
    if "tool_call" in "".join(pieces):
        assert finish == "tool_calls" and got["tool_calls"][0]["function"]["name"] == "f"
        assert message["reasoning_content"] == "a, then b"
    # a template that does not think: the whole text is content, with no reasoning field
    plain, _ = chat_message(sample("".join(pieces)), ToolMode())
    assert "reasoning_content" not in plain and plain["content"] == "".join(pieces)
