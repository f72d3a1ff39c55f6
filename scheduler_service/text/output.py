"""Per-sample output: incremental text, stop strings (after min_tokens; the text cut before one,
text that might begin one held back) and stream deltas. Other ends are core/results.py's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token id, logprob), most likely first
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Delta:
    """One stream message: new tokens and text; finish_reason and usage on the last."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # on the request's first delta, when it asked
    # the stop string or id that ended a STOP sample; None for end-of-sequence
    stop_reason: str | int | None = None
    embedding: np.ndarray | None = None  # an embedding request's one delta: its vector (float32)


class SampleOutput:
    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        self.seq = seq
        params = seq.request.sampling
        self._detok = IncrementalDetokenizer(
            tokenizer, seq.request.prompt_token_ids, params.skip_special_tokens
        )
        self._named_stop_ids = set(params.stop_token_ids)
        self._keep_stop_str = params.include_stop_str_in_output
        self._stops = params.stop
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = params.min_tokens
        self._wants_logprobs = params.logprobs is not None
        self.text = ""
        self._emitted = 0
        self._seen = seq.num_output_tokens  # tokens added so far (a step may bring several)
        self.finished = False

    def add_token(
        self, token: int, logprob: TokenLogprob | None = None
    ) -> tuple[Delta, FinishReason | None]:
        """One token in -> (delta, why the sample ends here or None)."""
        piece = self._detok.add(token)
        self.text += piece
        self._seen += 1
        seq = self.seq
        reason = seq.finish_reason if self._seen == seq.num_output_tokens else None
        stop_reason = (
            token if reason is FinishReason.STOP and token in self._named_stop_ids else None
        )
        if (
            self._stops
            and piece
            and reason in (None, FinishReason.LENGTH)
            and self._seen >= self._min_tokens
        ):
            start = max(0, len(self.text) - len(piece) - self._holdback)
            hits = [(i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, stop_reason = min(hits, key=lambda h: (h[0], -len(h[1])))
                self.text = self.text[: at + len(stop_reason) if self._keep_stop_str else at]
                reason = FinishReason.STOP
        if self._stops:
            text = self._take_text(final=reason is not None)
        else:  # nothing is held back: the new text goes out as it comes
            text, self._emitted = piece, len(self.text)
        self.finished = reason is not None
        logprobs = [logprob or TokenLogprob(token, float("nan"))] if self._wants_logprobs else None
        return Delta(
            seq.index, [token], text, reason, logprobs=logprobs, stop_reason=stop_reason
        ), reason

    def last_delta(self, reason: FinishReason) -> Delta:
        """A last delta for a sample ended from outside (abort, error)."""
        return Delta(self.seq.index, [], self._take_text(final=True), reason)

    def _take_text(self, final: bool) -> str:
        visible = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        piece = self.text[self._emitted : visible]
        self._emitted = visible
        return piece


class DeltaQueue:
    """A deque and one future: at a thousand streams asyncio.Queue cost as much as the rest."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)
