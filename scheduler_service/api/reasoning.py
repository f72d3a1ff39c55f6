"""Reasoning models' <think> blocks (Qwen3 and Qwen3.5, SmolLM3, DeepSeek-R1): whether a chat
template thinks, whether a prompt opened the block for the model, and an answer cut into its
reasoning and the rest, whole or while it streams.
"""

from __future__ import annotations

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


class ReasoningSplit:
    """Streamed text cut into reasoning and content as each becomes certain."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.text: dict[int, str] = {}
        self.sent: dict[int, tuple[int, int]] = {}

    def add(self, index: int, piece: str, last: bool) -> tuple[str, str]:
        text = self.text[index] = self.text.get(index, "") + piece
        if last:
            reasoning, rest = split_reasoning(text, True, self.opened)
        else:
            reasoning, rest = streamed_regions(text, True, self.opened)
        reasoning, rest = reasoning or "", rest or ""
        sent_r, sent_c = self.sent.get(index, (0, 0))
        self.sent[index] = (max(sent_r, len(reasoning)), max(sent_c, len(rest)))
        return reasoning[sent_r:], rest[sent_c:]
