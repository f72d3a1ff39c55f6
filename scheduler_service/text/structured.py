"""Structured output (JSON Schema, regex, Lark) as llguidance token masks. The matchers live in the
scheduler beside the tokens, so restarts and preemptions keep their state; workers apply the bitmask
each plan carries.
"""

from __future__ import annotations

import json
import threading

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from scheduler_service.text import json_gate


class GrammarError(ValueError):
    """A schema, regex or grammar llguidance refused; the message is its own."""


class GrammarEngine:
    """Compiles constraints and fills a step's masks in one parallel llguidance call."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.2 s for a 49k vocabulary), from the tokenizer.json text alone."""
        with self._lock:
            if self._tok is None:
                self._tok = llguidance.LLTokenizer(
                    self._tokenizer_json,
                    n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None,
                )
            return self._tok

    def compile(self, json_schema: str = "", regex: str = "", grammar: str = "") -> str:
        """The llguidance grammar of the one constraint given; GrammarError with the engine's
        message.
        """
        if json_schema:
            try:
                schema = json_gate.parse(json_schema, "json_schema")
            except json_gate.BadJson as e:
                raise GrammarError(str(e)) from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("json_schema must be a JSON object (or true/false)")
            try:
                # JSON without free whitespace unless the schema says otherwise: models waste tokens
                # on blanks
                compiled = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults={"whitespace_flexible": False}
                )
            except ValueError as e:
                raise GrammarError(f"json_schema: {e}") from e
            what = "json_schema"
        elif regex:
            compiled, what = llguidance.LLMatcher.grammar_from_regex(regex), "regex"
        else:
            compiled, what = llguidance.LLMatcher.grammar_from_lark(grammar), "grammar"
        error = llguidance.LLMatcher.validate_grammar(compiled, self.tokenizer)
        if error:
            raise GrammarError(f"{what} is not valid: {error.strip()}")
        return compiled

    def matcher(self, compiled: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m

    def fill_masks(
        self, matchers: list[llguidance.LLMatcher], drafts: list[tuple[int, ...]] | None = None
    ) -> np.ndarray:
        """int32 [masks, words]: each matcher's next-token bitmask, plus one after each drafted
        token.
        """
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        if drafts is None or not any(drafts):
            masks = np.zeros((len(matchers), self.words), dtype=np.int32)
            fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], masks
            )
            return masks
        starts = np.cumsum([0] + [1 + len(d) for d in drafts])
        masks = np.zeros((int(starts[-1]), self.words), dtype=np.int32)
        at = list(zip(matchers, starts.tolist(), drafts, strict=False))
        # (llguidance refuses an empty draft, and an empty list)
        plain = [(m, i) for m, i, d in at if not d]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, masks)
        drafting = [(m, i, list(d)) for m, i, d in at if d]
        fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, masks)
        return masks


class Constraint:
    """A request's compiled constraint: each of its samples gets its own matcher from it."""

    __slots__ = ("engine", "compiled", "kind")

    def __init__(self, engine: GrammarEngine, compiled: str, kind: str) -> None:
        self.engine = engine
        self.compiled = compiled
        self.kind = kind

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.engine.matcher(self.compiled)


REGEX_META = set('\\.^$|?*+()[]{}-/#&~"')


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the choices (each escaped character by character)."""
    escaped = ("".join("\\" + c if c in REGEX_META else c for c in text) for text in choices)
    return "(" + "|".join(escaped) + ")"
