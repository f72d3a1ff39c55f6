"""What a request must fit: the model's context and vocabulary, the whole KV pool, the grammar
engine.
"""

from __future__ import annotations

import math

from scheduler_service.text.structured import GrammarEngine


class Limits:
    """What a request must fit: the model's context and vocabulary, and the whole KV pool."""

    def __init__(
        self,
        vocab_size: int,
        max_context: int,
        num_blocks: int,
        block_size: int,
        max_token_bytes: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        grammars: GrammarEngine | None = None,
        kv_window: int = 0,
        step_tokens: int = 0,
        default_max_tokens: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars  # None: structured output is refused
        self.max_context = max_context
        self.default_max_tokens = (
            default_max_tokens  # for a request that names no max_tokens; 0: to the end
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # all layers slide: a sequence holds at most its window and a step's tokens
        self.kv_window, self.step_tokens = kv_window, step_tokens
        # A text longer than this cannot fit the context: refused before tokenizing.
        self.max_prompt_bytes = max_context * max_token_bytes if max_token_bytes else None

    def sample_blocks(self, tokens: int, penalized: bool) -> int:
        """The most blocks one sample of `tokens` tokens holds at once."""
        full = math.ceil(tokens / self.block_size)
        # penalties read the whole context: nothing is given back
        if not self.kv_window or penalized:
            return full
        return min(full, math.ceil((self.kv_window + self.step_tokens) / self.block_size) + 2)
