"""gpt-oss's harmony answers parsed into reasoning, content and tool calls, whole and streamed in
any chunking, on answers as the model writes them (the prompt ends in `<|start|>assistant`).
"""

import random

import pytest

from scheduler_service.api.harmony import MARKERS, HarmonyStream, collect, parse_answer

ANSWERS = {
    "reasoning then answer": (
        "<|channel|>analysis<|message|>User asks 2+2. Simple arithmetic.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        ("User asks 2+2. Simple arithmetic.", "2 + 2 = 4.", []),
    ),
    "a tool call, recipient after the channel": (
        "<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Paris", "unit": "c"}<|call|>',
        (
            "Need the weather: call the tool.",
            "",
            [("get_weather", '{"location": "Paris", "unit": "c"}')],
        ),
    ),
    "a tool call, recipient in the role": (
        "<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>"
        '{"q": "<tags> & |pipes|"}<|call|>',
        ("Look it up.", "", [("lookup", '{"q": "<tags> & |pipes|"}')]),
    ),
    "a preamble, then the answer": (
        "<|channel|>commentary<|message|>Let me check that.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 12°C — mild.<|return|>",
        (None, "Let me check that.It is 12°C — mild.", []),
    ),
    "cut by max_tokens while thinking": (
        "<|channel|>analysis<|message|>First, consider the <edge",
        ("First, consider the <edge", "", []),
    ),
    "an answer with no analysis": (
        "<|channel|>final<|message|>Hi <|there<|return|>",
        (None, "Hi <|there", []),
    ),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_whole_answer_splits_into_reasoning_content_and_calls(name):
    text, (reasoning, content, calls) = ANSWERS[name]
    got = parse_answer(text)
    assert (got.reasoning, got.content, got.tool_calls) == (reasoning, content, calls)


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_answer_gives_the_same_in_any_chunking_and_no_marker_leaks(name, seed):
    """Chunks of 1-9 characters (a marker cut anywhere), and one chunk a character: the deltas of
    each kind add up to the whole answer's, and none holds a marker's text.
    """
    text, _ = ANSWERS[name]
    rng = random.Random(seed)
    cuts, at = [], 0
    while at < len(text):
        step = 1 if seed == 0 else rng.randint(1, 9)
        cuts.append(text[at : at + step])
        at += step
    stream = HarmonyStream()
    deltas = [d for piece in cuts for d in stream.feed(piece)] + stream.close()
    for _, piece in deltas:
        assert not any(m in piece for m in MARKERS)
    whole = parse_answer(text)
    got = collect(stream.messages)
    assert (got.reasoning, got.content, got.tool_calls) == (
        whole.reasoning,
        whole.content,
        whole.tool_calls,
    )
    by_kind = {}
    for msg, piece in deltas:
        by_kind[msg.kind] = by_kind.get(msg.kind, "") + piece
    assert by_kind.get("reasoning") == whole.reasoning
    assert by_kind.get("content", "") == whole.content
    assert by_kind.get("tool_call", "") == "".join(args for _, args in whole.tool_calls)


def test_body_text_streams_before_the_message_ends():
    """The reasoning is sent as it comes, held back only where a marker may begin."""
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analysis<|mess") == []
    out = stream.feed("age|>Thinking hard <")
    assert [(m.kind, t) for m, t in out] == [("reasoning", "Thinking hard ")]
    out = stream.feed("b>")
    assert [(m.kind, t) for m, t in out] == [("reasoning", "<b>")]
