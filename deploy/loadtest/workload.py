"""What a load test sends: synthetic prompts or a dataset, and when (arrival gaps)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    output_len: int = 128


def synthetic(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    shared_prefix_len: int,
    vocab: int,
    seed: int,
) -> list[Item]:
    """Token prompts of input_len +- range_ratio (uniform), every one starting with the same shared
    prefix.
    """
    rng = random.Random(seed)
    low_id = min(100, vocab // 2)
    prefix = [rng.randrange(low_id, vocab) for _ in range(shared_prefix_len)]

    def around(x: int) -> int:
        return max(
            1, rng.randint(math.floor(x * (1 - range_ratio)), math.ceil(x * (1 + range_ratio)))
        )

    return [
        Item(
            prompt_token_ids=prefix
            + [rng.randrange(low_id, vocab) for _ in range(around(input_len))],
            output_len=around(output_len),
        )
        for _ in range(n)
    ]


def load_dataset(
    path: Path, output_len: int, shared_prefix_len: int, vocab: int, seed: int
) -> list[Item]:
    """JSON or JSONL of token lists, strings, or objects with `prompt` or `prompt_token_ids`."""
    text = path.read_text()
    if path.suffix == ".json":
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = random.Random(seed)
    prefix = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(shared_prefix_len)]
    items = []
    for row in rows:
        if isinstance(row, list):
            item = Item(prompt_token_ids=[int(t) for t in row], output_len=output_len)
        elif isinstance(row, str):
            item = Item(prompt=row, output_len=output_len)
        else:
            ids = row.get("prompt_token_ids")
            item = Item(
                prompt_token_ids=[int(t) for t in ids] if ids is not None else None,
                prompt=row.get("prompt"),
                output_len=int(row.get("output_len", output_len)),
            )
        if item.prompt_token_ids is not None:
            item.prompt_token_ids = prefix + item.prompt_token_ids
        items.append(item)
    if not items:
        raise SystemExit(f"{path}: no prompts")
    return items


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gamma-distributed gaps of mean 1/rate (burstiness 1 is Poisson, lower burstier; inf: at
    once).
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]
