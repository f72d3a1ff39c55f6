"""Tool calls: `tool_choice` "required" or a named function constrains the output with the grammar
engine so it always parses; "auto" parses Hermes-style <tool_call> blocks out of the text; "none"
offers the tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: object) -> dict:
    """One entry of a message's tool_calls; arguments always a JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def parameters_schema(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The output of tool_choice "required": calls of the offered functions, as a JSON array."""
    items = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": parameters_schema(f),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    schema = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[dict] | None:
    """A "required" answer's calls; None if cut short by max_tokens."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    return [call(item["name"], item["parameters"]) for item in items]


def parse_named(name: str, text: str) -> list[dict] | None:
    try:
        json.loads(text)
    except ValueError:
        return None
    return [call(name, text)]


def template_writes_tool_calls(chat_template: str | None) -> bool:
    """Whether a chat template writes calls as <tool_call> blocks (the format "auto" parses)."""
    return bool(chat_template) and TOOL_CALL_OPEN in chat_template


@dataclass
class AutoParse:
    content: str | None
    calls: list[dict]


def parse_auto(text: str) -> AutoParse:
    """<tool_call> blocks parsed out; a bad block stays in the content."""
    if TOOL_CALL_OPEN not in text:
        return AutoParse(text, [])
    calls, kept = [], []
    last = 0
    for m in _BLOCK.finditer(text):
        kept.append(text[last : m.start()])
        last = m.end()
        try:
            item = json.loads(m.group(1))
            calls.append(call(item["name"], item.get("arguments", item.get("parameters", {}))))
        except (ValueError, KeyError, TypeError):
            kept.append(m.group(0))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return AutoParse(content or None, calls)


def held_back(text: str) -> int:
    """Characters at the end that might open a <tool_call>, held until the next token."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
