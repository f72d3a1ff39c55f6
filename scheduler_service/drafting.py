"""Drafts for speculative decoding, made where the tokens are (the scheduler; no torch): prompt lookup over
a sequence's own tokens, a bounded index of n-grams shared across requests, and a draft length that follows
each sequence's acceptance. Verification, and what a rejected draft gives back: docs/ARCHITECTURE.md."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of one token stream last ended, kept as tokens are appended:
    O(max_n) a token, so a long sequence drafts without scanning itself. Only accepted tokens are appended, so
    a rejected draft leaves nothing to undo."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest one is

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks, end = self.tokens, len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._next[tuple(toks[end - n:end])] = end  # the n-gram ending here is followed by `token`
        toks.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found ([]: none).
        The suffix itself is never its own match: an n-gram is indexed only once a token follows it."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """(length of the suffix matched, propose(k)); (0, []) when none is."""
        toks, end = self.tokens, len(self.tokens)
        if k <= 0:
            return 0, []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._next.get(tuple(toks[end - n:]))
            if at is not None:
                return n, toks[at:at + k]
        return 0, []


class SharedNgrams:
    """N-grams of earlier requests (their prompts and answers) and the tokens that followed them, shared by
    every sequence of a replica, least recently used first out past `max_entries`: what a sequence's own
    tokens cannot propose, a request seen before may (a template, a repeated document, a common answer)."""

    def __init__(self, max_entries: int = 200_000, min_n: int = 2, max_n: int = 4, span: int = 8) -> None:
        if max_entries < 1 or span < 1 or not 1 <= min_n <= max_n:
            raise ValueError("max_entries and span must be positive, and 1 <= min_n <= max_n")
        self.max_entries, self.min_n, self.max_n, self.span = max_entries, min_n, max_n, span
        self._follow: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._follow)

    def learn(self, tokens: list[int]) -> None:
        """Remember what followed every n-gram of `tokens` (a finished sequence's prompt and output)."""
        follow = self._follow
        for end in range(self.min_n, len(tokens)):
            after = tuple(tokens[end:end + self.span])
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                follow[key] = after
                follow.move_to_end(key)
        while len(follow) > self.max_entries:
            follow.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` in an earlier request ([]: none)."""
        return self.match(tokens, k)[1]

    def match(self, tokens: list[int], k: int, longer_than: int = 0) -> tuple[int, list[int]]:
        """(length of the suffix matched, propose(tokens, k)), looking only at suffixes longer than
        `longer_than`; (0, []) when none is."""
        if k <= 0:
            return 0, []
        for n in range(min(self.max_n, len(tokens)), max(self.min_n, longer_than + 1) - 1, -1):
            key = tuple(tokens[len(tokens) - n:])
            after = self._follow.get(key)
            if after is not None:
                self._follow.move_to_end(key)
                return n, list(after[:k])
        return 0, []


class DraftLength:
    """How many tokens to draft for one sequence: the most that paid lately. Each verification reports how
    many of the drafted tokens were accepted; the length follows a running mean of accepted tokens a step,
    and a sequence whose drafts keep failing pauses drafting (for `pause` tokens) rather than pay for them."""

    def __init__(self, max_k: int, decay: float = 0.5, pause: int = 8) -> None:
        if max_k < 1 or not 0.0 < decay < 1.0 or pause < 0:
            raise ValueError("max_k >= 1, 0 < decay < 1 and pause >= 0")
        self.max_k, self.decay, self.pause = max_k, decay, pause
        self.mean_accepted = float(max_k)  # optimistic until a draft says otherwise
        self.paused = 0

    def next(self) -> int:
        """Tokens to draft this step (0: decode one token the plain way)."""
        if self.paused:
            return 0
        return max(1, min(self.max_k, round(self.mean_accepted) + 1))

    def tick(self, tokens: int = 1) -> None:
        """The sequence got `tokens` more: a pause runs down by them."""
        self.paused = max(0, self.paused - tokens)

    def record(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if drafted == 0:
            return
        self.mean_accepted = self.decay * self.mean_accepted + (1 - self.decay) * accepted
        if self.mean_accepted < 0.5:  # fewer than one token in two pays: stop paying for a while
            self.paused = self.pause
            self.mean_accepted = 1.0  # and try again with a short draft


class SequenceDrafter:
    """One sequence's drafting state: its tokens' n-gram index (the prompt, then each accepted token), its
    draft length, and whether its last proposal found anything (`expects`: the scheduler then waits for the
    sequence's token in flight rather than plan a plain decode past it)."""

    def __init__(self, tokens: list[int], max_k: int, shared: SharedNgrams | None) -> None:
        self.index = NgramIndex(1, 3)
        self.index.extend(tokens)
        self.length = DraftLength(max_k)
        self.shared = shared
        self.expects = False

    def append(self, tokens: list[int] | tuple[int, ...]) -> None:
        self.index.extend(tokens)
        self.length.tick(len(tokens))

    def propose(self, k: int) -> list[int]:
        """Up to k drafted tokens from the longest suffix match: the sequence's own n-grams, or those of
        earlier requests where they match a longer suffix (a longer match predicts better)."""
        n, draft = self.index.match(k)
        if self.shared is not None:
            m, shared = self.shared.match(self.index.tokens, k, longer_than=n)
            if m > n:
                draft = shared
        return draft

    def record(self, drafted: int, accepted: int) -> None:
        self.length.record(drafted, accepted)

    def look_ahead(self) -> None:
        """After new tokens: whether the next step would draft (a proposal, and drafting not paused)."""
        self.expects = not self.length.paused and bool(self.propose(1))
