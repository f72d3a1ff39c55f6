"""Drafts for speculative decoding, made where the tokens are: prompt lookup over a sequence's own
tokens, n-grams shared across requests, a length the suffix match predicts (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

MAX_MATCH = 8  # the longest suffix looked up: a longer match than this predicts no better
SHARED_DISCOUNT = 2


class NgramIndex:
    """Where each n-gram of a stream last ended: O(max_n) a token, nothing to undo on rejection."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}"
            )
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[
            tuple[int, ...], int
        ] = {}  # n-gram -> where the token after its latest one is

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks, end = self.tokens, len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._next[tuple(toks[end - n : end])] = (
                end  # the n-gram ending here is followed by `token`
            )
        toks.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest occurrence of the longest suffix."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """(length of the suffix matched, propose(k)); (0, []) when none is."""
        toks, end = self.tokens, len(self.tokens)
        if k <= 0:
            return 0, []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._next.get(tuple(toks[end - n :]))
            if at is not None:
                return n, toks[at : at + k]
        return 0, []


class SharedNgrams:
    """N-grams of earlier requests shared by a replica's sequences (LRU past `max_entries`)."""

    def __init__(
        self, max_entries: int = 200_000, min_n: int = 2, max_n: int = 8, span: int = 10
    ) -> None:
        if max_entries < 1 or span < 1 or not 1 <= min_n <= max_n:
            raise ValueError("max_entries and span must be positive, and 1 <= min_n <= max_n")
        self.max_entries, self.min_n, self.max_n, self.span = max_entries, min_n, max_n, span
        self._follow: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._follow)

    def learn(self, tokens: list[int]) -> None:
        """Remember what followed every n-gram of `tokens` (a finished sequence's prompt and
        output).
        """
        follow = self._follow
        for end in range(self.min_n, len(tokens)):
            after = tuple(tokens[end : end + self.span])
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                follow[key] = after
                follow.move_to_end(key)
        while len(follow) > self.max_entries:
            follow.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix in an earlier request."""
        return self.match(tokens, k)[1]

    def match(self, tokens: list[int], k: int, longer_than: int = 0) -> tuple[int, list[int]]:
        """(suffix length, proposal) for suffixes longer than `longer_than`; (0, []) if none."""
        if k <= 0:
            return 0, []
        for n in range(min(self.max_n, len(tokens)), max(self.min_n, longer_than + 1) - 1, -1):
            key = tuple(tokens[len(tokens) - n :])
            after = self._follow.get(key)
            if after is not None:
                self._follow.move_to_end(key)
                return n, list(after[:k])
        return 0, []


# Tokens worth drafting after an n-token match (the last entry for longer ones): longer matches
# predict further (docs/BENCHMARKS.md, the speculative section).
DRAFT_BY_MATCH = (0, 1, 2, 3, 6, 6, 10)


class DraftLength:
    """Tokens to draft for a match length; short matches that keep failing stop drafting a while."""

    def __init__(
        self, max_k: int, threshold: float = 0.2, decay: float = 0.85, short: int = 2
    ) -> None:
        if max_k < 1 or not 0.0 <= threshold < 1.0 or not 0.0 < decay < 1.0 or short < 0:
            raise ValueError("max_k >= 1, 0 <= threshold < 1, 0 < decay < 1 and short >= 0")
        self.max_k, self.threshold, self.decay, self.short = max_k, threshold, decay, short
        self.short_rate = (
            0.5  # of short drafts whose first token stood (no evidence yet: worth a try)
        )

    def for_match(self, n: int) -> int:
        """Tokens to draft after an n-token match (0: a plain decode)."""
        if n <= 0 or (n <= self.short and self.short_rate < self.threshold):
            return 0
        return min(self.max_k, DRAFT_BY_MATCH[min(n, len(DRAFT_BY_MATCH) - 1)])

    def skipped(self, n: int) -> None:
        """A gated match drafted nothing: its rate creeps back."""
        if 0 < n <= self.short and self.short_rate < self.threshold:
            self.short_rate = (
                self.decay * self.short_rate + (1 - self.decay) * self.threshold * 1.01
            )

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` tokens stood after an n-token match."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if drafted and n <= self.short:
            self.short_rate = self.decay * self.short_rate + (1 - self.decay) * (accepted > 0)


class SequenceDrafter:
    """One sequence's n-gram index, length policy, and whether its next step drafts."""

    def __init__(self, tokens: list[int], max_k: int, shared: SharedNgrams | None) -> None:
        self.index = NgramIndex(1, MAX_MATCH)
        self.index.extend(tokens)
        self.length = DraftLength(max_k)
        self.shared = shared
        self.expects = False
        self.matched = 0  # the suffix match the last proposal drafted from

    def append(self, tokens: list[int] | tuple[int, ...]) -> None:
        self.index.extend(tokens)

    def match(self, k: int) -> tuple[int, list[int]]:
        """Its own match, or earlier requests' where longer by SHARED_DISCOUNT."""
        n, draft = self.index.match(k)
        if self.shared is not None:
            m, shared = self.shared.match(self.index.tokens, k, longer_than=n + SHARED_DISCOUNT)
            if m - SHARED_DISCOUNT > n:
                return m - SHARED_DISCOUNT, shared
        return n, draft

    def propose(self, room: int) -> list[int]:
        """This step's draft, at most `room` tokens."""
        n, draft = self.match(self.length.max_k)
        k = min(self.length.for_match(n), room)
        if k <= 0:
            self.length.skipped(n)
            self.matched = 0
            return []
        self.matched = n
        return draft[:k]

    def record(self, drafted: int, accepted: int) -> None:
        self.length.record(self.matched, drafted, accepted)

    def look_ahead(self) -> None:
        """Whether the next step would draft."""
        n, draft = self.match(1)
        self.expects = bool(draft) and self.length.for_match(n) > 0


def propose_draft(seq, drafter: SequenceDrafter, budget: int, max_model_len: int) -> list[int]:
    """The draft within budget, max_tokens and context; none before min_tokens; grammar-allowed
    only.
    """
    params = seq.request.sampling
    if seq.num_output_tokens < params.min_tokens:
        return []
    room = min(
        budget - 1,
        params.max_tokens - seq.num_output_tokens - 1,
        max_model_len - seq.num_tokens - 1,
    )
    if room <= 0:
        return []
    draft = drafter.propose(room)
    # only what the grammar allows (its masks follow the draft)
    if draft and seq.matcher is not None:
        draft = (
            []
            if seq.matcher.is_stopped() or seq.matcher.is_error()
            else draft[: seq.matcher.validate_tokens(draft)]
        )
    return draft
