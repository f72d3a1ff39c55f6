"""How a chat answer reads: reasoning models' <think> blocks (Qwen3 and Qwen3.5, SmolLM3,
DeepSeek-R1; a prompt may open the block) or gpt-oss's harmony channels, cut into reasoning,
content and (harmony's) tool calls, whole or while it streams.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.api.harmony import CHANNEL, HarmonyStream, parse_answer
from scheduler_service.api.openai_requests import constrained

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    return bool(chat_template) and THINK_CLOSE in chat_template


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt itself ends inside a <think> block (templates that open it)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, thinks: bool, opened: bool) -> tuple[str | None, str]:
    """(reasoning, the rest) of a whole answer; reasoning None where the answer did not think."""
    if not thinks:
        return None, text
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        stripped, opened = stripped[len(THINK_OPEN) :], True
    if not opened:
        return None, text
    if THINK_CLOSE not in stripped:  # cut while thinking
        return stripped.strip(), ""
    reasoning, rest = stripped.split(THINK_CLOSE, 1)
    return reasoning.strip(), rest.lstrip()


def streamed_regions(text: str, thinks: bool, opened: bool) -> tuple[str, str | None]:
    """What the answer so far certainly holds: (reasoning, content or None while unknown)."""
    if thinks:
        stripped = text.lstrip()
        if not opened and len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped):
            return "", None  # maybe the opening of a <think> block
        if opened or stripped.startswith(THINK_OPEN):
            body = stripped.removeprefix(THINK_OPEN).lstrip()
            if THINK_CLOSE not in body:
                return body[: len(body) - partial_tag(body, THINK_CLOSE)].rstrip(), None
            reasoning, rest = body.split(THINK_CLOSE, 1)
            return reasoning.strip(), rest.lstrip()
    return "", text


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text might begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def template_speaks_harmony(chat_template: str | None) -> bool:
    """gpt-oss's templates write each message's channel: answers come back in harmony."""
    return bool(chat_template) and CHANNEL in chat_template


@dataclass
class Split:
    """A whole answer read: reasoning (None where it did not reason), content, and a harmony
    answer's tool calls as (name, arguments) (None where the format leaves calls in content).
    """

    reasoning: str | None
    content: str
    calls: list[tuple[str, str]] | None = None


class AnswerFormat:
    """How one chat request's answer reads: plain, <think> blocks (opened: by the prompt), or
    harmony's channels.
    """

    def __init__(self, thinks: bool = False, opened: bool = False, harmony: bool = False) -> None:
        self.thinks, self.opened, self.harmony = thinks, opened, harmony

    @property
    def reasons(self) -> bool:
        """Whether answers say a reasoning_content (None where one did not reason)."""
        return self.thinks or self.harmony

    def split(self, text: str) -> Split:
        if self.harmony:
            answer = parse_answer(text)
            return Split(answer.reasoning, answer.content, answer.tool_calls)
        return Split(*split_reasoning(text, self.thinks, self.opened))

    def reader(self) -> Reader:
        return Reader(self)


PLAIN = AnswerFormat()


class Reader:
    """One sample's answer as it streams: its (reasoning, content) so far, each cut back to what is
    certain; content None while it is not yet known where the answer starts.
    """

    def __init__(self, fmt: AnswerFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.harmony = HarmonyStream() if fmt.harmony else None
        self.reasoning = self.content = ""

    def add(self, piece: str) -> tuple[str, str | None]:
        self.text += piece
        if self.harmony is None:
            return streamed_regions(self.text, self.fmt.thinks, self.fmt.opened)
        for message, new in self.harmony.feed(piece):
            if message.kind == "reasoning":
                self.reasoning += new
            elif message.kind == "content":
                self.content += new
        return self.reasoning, self.content


class Formats:
    """A served chat template's way of answering, and each chat request's AnswerFormat from it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.thinks = template_thinks(tokenizer.chat_template)
        self.harmony = template_speaks_harmony(tokenizer.chat_template)

    def _speaks_harmony(self, msg) -> bool:
        """Harmony's chat requests but those a grammar constrains (their output is read plain)."""
        return self.harmony and bool(msg.messages) and not constrained(msg.sampling)

    def keep_markers(self, msg) -> None:
        """Before the request is made: harmony's markers are special tokens its text must keep."""
        if self._speaks_harmony(msg):
            msg.sampling.skip_special_tokens = False

    def of(self, msg, prepared) -> AnswerFormat:
        """The format of msg's answer (prepared: msg made a request, whose prompt may open
        <think>).
        """
        if self._speaks_harmony(msg):
            return AnswerFormat(harmony=True)
        if not (self.thinks and msg.messages):
            return PLAIN
        tail = self.tokenizer.decode(prepared.prompt_token_ids[-8:], skip_special_tokens=False)
        return AnswerFormat(True, prompt_opens_thinking(tail))


class AnswerSplit:
    """Each sample's streamed text as new reasoning and new content once each is certain; a
    sample's last piece brings the rest and a harmony answer's calls.
    """

    def __init__(self, fmt: AnswerFormat) -> None:
        self.fmt = fmt
        self.readers: dict[int, Reader] = {}
        self.sent: dict[int, tuple[int, int]] = {}

    def add(self, index: int, piece: str, last: bool) -> tuple[str, str, list[tuple[str, str]]]:
        reader = self.readers.setdefault(index, self.fmt.reader())
        reasoning, content = reader.add(piece)
        calls: list[tuple[str, str]] = []
        if last:
            whole = self.fmt.split(reader.text)
            reasoning, content, calls = whole.reasoning, whole.content, whole.calls or []
        reasoning, content = reasoning or "", content or ""
        sent_r, sent_c = self.sent.get(index, (0, 0))
        self.sent[index] = (max(sent_r, len(reasoning)), max(sent_c, len(content)))
        return reasoning[sent_r:], content[sent_c:], calls
