"""OpenAI's Responses API's answers: a Response object with its reasoning, message and function_call
items, whole or as the stream of events OpenAI sends (response.created ... response.completed).
"""

from __future__ import annotations

import time
import uuid

from scheduler_service.api.agents.responses import NamedTool, ResponsesRequest
from scheduler_service.api.agents.turns import Turn
from scheduler_service.api.openai_responses import dumps


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseShape:
    """The Response object and its items for one request; `body` whole, `events` streamed."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.id, self.model, self.request = response_id, model, body
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.seq = 0

    def response(
        self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None
    ) -> dict:
        r = self.request
        fmt = (
            r.text.format.model_dump(by_alias=True, exclude_none=True)
            if r.text and r.text.format
            else {"type": "text"}
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice.model_dump()
            if isinstance(r.tool_choice, NamedTool)
            else (r.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "top_p": r.top_p,
            "truncation": r.truncation or "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "status": status,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
        }

    def message_item(
        self, text: str, status: str = "completed", logprobs: list | None = None
    ) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

    @staticmethod
    def call_item(call: dict) -> dict:
        return {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }

    def output(self, turn: Turn, logprobs: list | None = None) -> list[dict]:
        items = []
        if turn.reasoning:
            items.append(self.reasoning_item(turn.reasoning))
        if turn.content or not turn.calls:
            items.append(self.message_item(turn.content or "", logprobs=logprobs))
        items += [self.call_item(c) for c in turn.calls]
        return items

    def whole(self, turn: Turn, usage: dict, logprobs: list | None = None) -> dict:
        cut = turn.finish == "length"
        return self.response(
            "incomplete" if cut else "completed",
            self.output(turn, logprobs),
            usage,
            "max_output_tokens" if cut else None,
        )

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(payload) + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def history(messages: list[dict], turn: Turn) -> list[dict]:
    """The conversation as stored for a later previous_response_id:
    the messages, then this answer.
    """
    answer: dict = {"role": "assistant", "content": turn.content}
    if turn.calls:
        answer["tool_calls"] = turn.calls
    return messages + [answer]


class ResponseStream:
    """A streamed response's events, in the order OpenAI sends them."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.items: list[dict] = []  # output items, as they are done
        self.reasoning: str | None = None  # text of an open reasoning item
        self.text: str | None = None  # text of an open message item
        self.final: dict | None = None  # the Response the last event carried

    def opening(self) -> list[bytes]:
        r = self.shape.response("in_progress", [], None)
        return [
            self.shape.event("response.created", response=r),
            self.shape.event("response.in_progress", response=r),
        ]

    def add(self, reasoning: str, content: str) -> list[bytes]:
        events = []
        if reasoning:
            if self.reasoning is None:
                self.reasoning = ""
                events.append(self._added(self.shape.reasoning_item("", "in_progress")))
            self.reasoning += reasoning
            events.append(
                self._delta("response.reasoning_text.delta", self.shape.reasoning_id, reasoning)
            )
        if content:
            events += self._close_reasoning() + self._open_message()
            self.text += content
            events.append(
                self._delta(
                    "response.output_text.delta", self.shape.message_id, content, logprobs=[]
                )
            )
        return events

    def closing(self, turn: Turn, usage: dict) -> list[bytes]:
        events = self._close_reasoning() + self._close_message(turn)
        for call in turn.calls:
            item = self.shape.call_item(call)
            events.append(self._added({**item, "arguments": "", "status": "in_progress"}))
            events.append(
                self._delta("response.function_call_arguments.delta", item["id"], item["arguments"])
            )
            events.append(
                self.shape.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=self._index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._done(item))
        cut = turn.finish == "length"
        self.final = self.shape.response(
            "incomplete" if cut else "completed",
            self.items,
            usage,
            "max_output_tokens" if cut else None,
        )
        return events + [
            self.shape.event(
                "response.incomplete" if cut else "response.completed", response=self.final
            )
        ]

    def failure(self, error) -> bytes:
        """The stream's last event where it fails midway (an ApiError)."""
        return self.shape.event(
            "error", code=error.code or error.kind, message=str(error), param=None
        )

    @property
    def _index(self) -> int:
        """The output index of the item open now (items done so far come before it)."""
        return len(self.items)

    def _added(self, item: dict) -> bytes:
        return self.shape.event("response.output_item.added", output_index=self._index, item=item)

    def _done(self, item: dict) -> bytes:
        event = self.shape.event("response.output_item.done", output_index=self._index, item=item)
        self.items.append(item)
        return event

    def _delta(self, kind: str, item_id: str, delta: str, **extra) -> bytes:
        return self.shape.event(
            kind, item_id=item_id, output_index=self._index, content_index=0, delta=delta, **extra
        )

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning is None:
            return []
        text, self.reasoning = self.reasoning, None
        done = self.shape.event(
            "response.reasoning_text.done",
            item_id=self.shape.reasoning_id,
            output_index=self._index,
            content_index=0,
            text=text,
        )
        return [done, self._done(self.shape.reasoning_item(text))]

    def _open_message(self) -> list[bytes]:
        if self.text is not None:
            return []
        self.text = ""
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._added(self.shape.message_item("", "in_progress")),
            self.shape.event(
                "response.content_part.added",
                item_id=self.shape.message_id,
                output_index=self._index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_message(self, turn: Turn) -> list[bytes]:
        events = []
        if turn.content or not turn.calls:  # an empty answer is an empty message
            events += self._open_message()
        if self.text is None:
            return events
        text, part = (
            self.text,
            {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []},
        )
        ids = {"item_id": self.shape.message_id, "output_index": self._index, "content_index": 0}
        events.append(self.shape.event("response.output_text.done", **ids, text=text, logprobs=[]))
        events.append(self.shape.event("response.content_part.done", **ids, part=part))
        events.append(self._done(self.shape.message_item(text)))
        self.text = None
        return events
