"""Where a client's JSON is read: every HTTP body, and every JSON text inside a gRPC field (a
json_schema, a tool call's arguments), passes `parse`. It refuses, naming the field where there is
one: nesting deeper than MAX_DEPTH (measured on the bytes, before the parser recurses), NaN and
Infinity and numbers past a float's range, bytes that are not UTF-8, and strings that are not
Unicode scalar values (a lone surrogate such as "\\ud800" cannot be encoded or tokenized).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

# arrays and objects inside one another: what a google.protobuf.Struct carries in a gRPC message
# (protobuf parses 100 message levels, three for each JSON object in a Struct), so a tool's schema
# taken over HTTP can always be passed on as gRPC's is
MAX_DEPTH = 32

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadJson(ValueError):
    """A body refused at the gate: the message, and the field it names (or None)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def depth(raw: bytes) -> int:
    """How deep arrays and objects nest in raw JSON (brackets inside strings not counted)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())


def _constant(name: str):
    raise BadJson(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"the number {text[:40]} is past a float's range")
    return value


def parse(raw: bytes | str, what: str = "the request body"):
    """raw as JSON, or BadJson saying what is wrong with `what`."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if (deep := depth(raw)) > MAX_DEPTH:
        raise BadJson(f"{what} nests {deep} levels deep; at most {MAX_DEPTH} are taken")
    try:
        data = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except BadJson:
        raise
    except ValueError as e:  # bytes that are not UTF-8, bad syntax, an integer of 4,300+ digits
        raise BadJson(f"{what} is not valid JSON: {e}") from None
    if (where := _lone_surrogate(data)) is not None:
        raise BadJson(
            f"{where or what}: a string holds a lone surrogate (U+D800-U+DFFF), "
            "which is not Unicode text",
            where or None,
        )
    return data


def _lone_surrogate(data) -> str | None:
    """The path of the first string (value or key) holding a surrogate, '' for the top level."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                at = f"{path}.{k}" if path else str(k)
                if not k.isascii() and _SURROGATE.search(k):
                    return path
                stack.append((v, at))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None
