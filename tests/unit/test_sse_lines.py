"""A streamed event is one line to every client's line reader: a token whose text holds U+0085,
U+2028 or U+2029 (JSON leaves them raw; Python's splitlines and so httpx's aiter_lines end a line
at each) reaches an httpx client whole, as the chat chunk and the Messages API event it was.
"""

from __future__ import annotations

import json

import httpx

from scheduler_service.api.agents.messages import sse
from scheduler_service.api.openai_requests import ToolMode
from scheduler_service.api.openai_responses import ChatStream

TEXT = "a\x85b\u2028c\u2029d\x1ce\nf"


def _events(body: bytes) -> list[dict]:
    """The data lines as httpx's line reader gives them, each parsed."""
    response = httpx.Response(200, content=body)
    lines = list(response.iter_lines())
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ")]


def test_a_chat_chunk_with_line_breaks_in_its_text_is_one_event():
    stream = ChatStream("chatcmpl-1", "m", ToolMode(), None, usage_each_chunk=False)
    body = stream.chunk([{"index": 0, "delta": {"content": TEXT}, "finish_reason": None}])
    (event,) = _events(body)
    assert event["choices"][0]["delta"]["content"] == TEXT


def test_a_messages_api_delta_with_line_breaks_in_its_text_is_one_event():
    delta = {"index": 0, "delta": {"type": "text_delta", "text": TEXT}}
    (event,) = _events(sse("content_block_delta", delta))
    assert event["type"] == "content_block_delta" and event["delta"]["text"] == TEXT
