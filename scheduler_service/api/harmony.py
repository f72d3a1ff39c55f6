"""gpt-oss's harmony format: an answer is messages, each a header (channel, recipient, content type)
and a body; the analysis channel is reasoning, final the answer, commentary to `functions.NAME` a
tool call (commentary without a recipient: a preamble, shown as content). Parsed from the answer's
text with the format's special tokens rendered, whole or as it streams.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL, "<|endoftext|>")  # a message's end (the last, the tokenizer's own)
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *ENDS)
SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
LONGEST = max(map(len, MARKERS))


@dataclass
class Message:
    """One message of an answer: where it goes, and its body so far."""

    channel: str = ""
    recipient: str | None = None
    content_type: str | None = None
    text: str = ""
    done: bool = False

    @property
    def kind(self) -> str:
        """reasoning, content or tool_call."""
        if self.recipient and self.recipient.startswith("functions."):
            return "tool_call"
        return "reasoning" if self.channel == "analysis" else "content"

    @property
    def tool_name(self) -> str:
        return (self.recipient or "").removeprefix("functions.")


@dataclass
class Answer:
    reasoning: str | None
    content: str
    tool_calls: list[tuple[str, str]]  # (function name, arguments as the model wrote them)


class HarmonyStream:
    """Text deltas in; each message's new body text out as soon as no marker can still cut it.
    Generation starts inside the first header: the prompt ends with `<|start|>assistant`.
    """

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._pending = ""  # text not yet placed: it may end in part of a marker
        self._header: list[str] = []  # the open header's pieces, markers included
        self._in_body = False

    def feed(self, delta: str) -> list[tuple[Message, str]]:
        """(message, its new body text) for what delta makes certain."""
        text = self._pending + delta
        keep = _partial_marker(text)
        self._pending, text = text[len(text) - keep :], text[: len(text) - keep]
        return self._place(text)

    def close(self) -> list[tuple[Message, str]]:
        """The rest at the end of the answer (cut by max_tokens: the open message as it stands)."""
        out, self._pending = self._place(self._pending), ""
        return out

    def _place(self, text: str) -> list[tuple[Message, str]]:
        out: list[tuple[Message, str]] = []
        for piece in SPLIT.split(text):
            if not piece:
                continue
            if self._in_body:
                msg = self.messages[-1]
                if piece in ENDS:
                    msg.done, self._in_body = True, False
                elif piece == START:  # a body cut short by the next message's header
                    msg.done, self._in_body, self._header = True, False, []
                else:
                    msg.text += piece
                    out.append((msg, piece))
            elif piece == MESSAGE:
                self.messages.append(_header_message("".join(self._header)))
                self._header, self._in_body = [], True
            elif piece == START:
                self._header = []
            elif piece not in ENDS:
                self._header.append(piece)
        return out


def _header_message(header: str) -> Message:
    """`assistant to=functions.f<|channel|>commentary <|constrain|>json` and its variants."""
    msg = Message()
    recipient = re.search(r"to=([^\s<]+)", header)
    msg.recipient = recipient.group(1) if recipient else None
    channel = re.search(re.escape(CHANNEL) + r"\s*([^\s<]+)", header)
    msg.channel = channel.group(1) if channel else ""
    constrain = re.search(re.escape(CONSTRAIN) + r"\s*([^\s<]+)", header)
    if constrain:
        msg.content_type = constrain.group(1)
    elif channel and (rest := header[channel.end() :].split()) and rest[-1] == "json":
        msg.content_type = "json"
    return msg


def _partial_marker(text: str) -> int:
    """How many characters at the end of text might begin a marker."""
    start = text.rfind("<|", max(0, len(text) - LONGEST))
    if start < 0:
        return 1 if text.endswith("<") else 0
    tail = text[start:]
    return len(tail) if any(m.startswith(tail) and m != tail for m in MARKERS) else 0


def parse_answer(text: str) -> Answer:
    """A whole answer: reasoning (None where it had no analysis), content, tool calls."""
    stream = HarmonyStream()
    stream.feed(text)
    stream.close()
    return collect(stream.messages)


def collect(messages: list[Message]) -> Answer:
    reasoning = [m.text for m in messages if m.kind == "reasoning"]
    content = "".join(m.text for m in messages if m.kind == "content")
    calls = [(m.tool_name, m.text) for m in messages if m.kind == "tool_call"]
    return Answer("".join(reasoning) if reasoning else None, content, calls)
