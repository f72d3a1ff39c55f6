"""An answer as both agent APIs see it (reasoning, content, tool calls), parsed whole (`parse_turn`)
or while it streams (`TurnStream`); and the store `previous_response_id` reads.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler_service.api import openai_responses as out
from scheduler_service.api import tool_calls
from scheduler_service.api.openai_requests import ToolMode
from scheduler_service.api.reasoning import PLAIN, AnswerFormat


@dataclass
class Turn:
    """One finished answer, parsed."""

    content: str | None
    calls: list[dict] = field(default_factory=list)  # chat's tool_calls entries
    reasoning: str | None = None
    finish: str | None = None  # chat's finish_reason: stop, length, tool_calls, abort
    stop_sequence: str | None = None  # the stop string that ended it, if one did


def parse_turn(sample: out.Sample, mode: ToolMode, fmt: AnswerFormat = PLAIN) -> Turn:
    message, finish = out.chat_message(sample, mode, fmt)
    stop = sample.stop_reason if isinstance(sample.stop_reason, str) else None
    calls = message.get("tool_calls") or []
    return Turn(message["content"], calls, message.get("reasoning_content"), finish, stop)


def call_arguments(call: dict) -> dict:
    """A chat tool call's arguments as an object (what Anthropic's tool_use.input holds)."""
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class TurnStream:
    """Streamed text cut into reasoning and content; a possible tool call is held to the end."""

    def __init__(self, mode: ToolMode, fmt: AnswerFormat) -> None:
        self.mode, self.format = mode, fmt
        self.reader = fmt.reader()
        self.sample = out.Sample()
        self.sent_reasoning = 0
        self.sent_content = 0

    def add(self, delta) -> tuple[str, str]:
        """(new reasoning, new content) that delta's text lets go out."""
        self.sample.add(delta)
        reasoning, rest = self.reader.add(delta.text)
        return self._take(reasoning, "" if rest is None else self._content(rest))

    def close(self) -> tuple[Turn, str, str]:
        """The whole turn, and the reasoning and content not yet sent."""
        turn = parse_turn(self.sample, self.mode, self.format)
        reasoning = (turn.reasoning or "")[self.sent_reasoning :]
        content = (
            (turn.content or "")[self.sent_content :] if self.mode.kind in ("none", "auto") else ""
        )
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return turn, reasoning, content

    def _content(self, text: str) -> str:
        if self.mode.kind in ("required", "named"):
            return ""
        if self.mode.parse_auto:
            opened = text.find(tool_calls.TOOL_CALL_OPEN)
            return text[:opened] if opened >= 0 else text[: len(text) - tool_calls.held_back(text)]
        return text

    def _take(self, reasoning: str, content: str) -> tuple[str, str]:
        new_r = reasoning[self.sent_reasoning :]
        new_c = content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return new_r, new_c


class ResponseStore:
    """The last `capacity` responses' conversations, in memory, for previous_response_id."""

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict], response: dict) -> None:
        self.items[response_id] = (conversation, response)
        self.items.move_to_end(response_id)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.items.pop(response_id, None) is not None
