"""Command-line parsing shared by every pagedserve command: argparse types that check ranges where a
value is parsed, and a parser whose errors are one line (what is wrong, where to look) with exit
code 2.
"""

from __future__ import annotations

import argparse
import re
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def int_range(low: int | None = None, high: int | None = None):
    """An int within [low, high] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                raise argparse.ArgumentTypeError(f"{value} is below {low}: give {low} or more")
            if low is None:
                raise argparse.ArgumentTypeError(f"{value} is above {high}: give {high} or less")
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value

    parse.__name__ = "int"
    return parse


def float_range(low: float | None = None, high: float | None = None, low_open: bool = False):
    """A finite float within [low, high] ((low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        below = low is not None and (value <= low if low_open else value < low)
        if below or (high is not None and value > high):
            left = ("(" if low_open else "[") + ("-inf" if low is None else str(low))
            right = ("inf" if high is None else str(high)) + "]"
            raise argparse.ArgumentTypeError(f"{value} is outside {left}, {right}")
        return value

    parse.__name__ = "float"
    return parse


PORT = int_range(0, 65535)
PORT_OR_ANY = int_range(-1, 65535)  # -1: any free port (written to --port-file)
COUNT = int_range(0)
POSITIVE = int_range(1)
SECONDS = float_range(0.0, low_open=True)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def memory_size(text: str) -> str:
    """argparse type for a memory size (2GiB, 512MiB, 1000000), checked and passed on as written."""
    try:
        if parse_bytes(text) < 1:
            raise ValueError(f"{text!r} is no memory at all")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
