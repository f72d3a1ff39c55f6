"""Drafts for speculative decoding, made where the tokens are: prompt lookup over a sequence's own
tokens, n-grams shared across requests, a length the suffix match predicts, cut to what a drafted
row's measured cost repays (docs/ARCHITECTURE.md).
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


# How often a drafted token stands after an n-token match before any is seen (the last entry for
# longer ones): the edit workload's first drafted tokens (docs/BENCHMARKS.md, "How long a draft").
PRIOR_STANDS = (0.0, 0.3, 0.45, 0.8, 0.85, 0.9, 0.95)
PRIOR_WEIGHT = 4.0  # drafted tokens' worth of evidence the prior counts for
KEEP = 0.97  # weight an acceptance seen one draft ago keeps; a skipped match's fades by SKIP_FADE
SKIP_FADE = 0.99
ROWS_KEEP = 0.98  # weight a step's seconds keep a decode-only step later
MIN_SPREAD = 0.05  # the rows' variance below which the line's slope is not refit


class DraftCost:
    """Whether a drafted token pays (`--speculative auto`): a decode-only step's seconds as a line
    in its rows (a drafted token is a row), and per match length how often a drafted token stands.

    Drafting d tokens in a step of N rows taking t seconds buys N + p + p^2 + ... + p^d tokens for
    t + slope * d seconds: drafted only as far as that beats N tokens in t. Where rows are nearly
    free (a dense model's memory-bound step) a match drafts its full length; where each costs most
    of a step (a MoE's drafted tokens read other experts) only long, reliable matches draft.
    Until steps of two row counts are seen, rows are taken as free.
    """

    def __init__(self) -> None:
        self._rows = [0.0] * 5  # forgetting sums: weight, x, y, x*x, x*y (x: rows, y: seconds)
        self.slope: float | None = None  # seconds a row adds (None: not seen yet)
        n = len(PRIOR_STANDS)
        self._stood = [PRIOR_WEIGHT * p for p in PRIOR_STANDS]
        self._tried = [PRIOR_WEIGHT] * n

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows (drafted tokens included) took `seconds`."""
        sums = self._rows = [ROWS_KEEP * v for v in self._rows]
        for k, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            sums[k] += v
        w, x, y, xx, xy = sums
        var = xx / w - (x / w) ** 2
        if var > MIN_SPREAD:
            self.slope = max(0.0, (xy / w - x * y / w / w) / var)

    def seconds(self, rows: int) -> float:
        w, x, y, _, _ = self._rows
        if w <= 0:
            return 0.0
        return max(y / w + (self.slope or 0.0) * (rows - x / w), 1e-9)

    def stands(self, n: int) -> float:
        """How often a token drafted after an n-token match stands, each after the one before."""
        i = min(n, len(PRIOR_STANDS) - 1)
        return self._stood[i] / self._tried[i]

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` tokens stood after an n-token match (the first rejected ends
        it).
        """
        i = min(n, len(PRIOR_STANDS) - 1)
        if not drafted or not i:
            return
        self._stood[i] = KEEP * self._stood[i] + accepted
        self._tried[i] = KEEP * self._tried[i] + accepted + (accepted < drafted)

    def skipped(self, n: int) -> None:
        """A match drafted nothing: its evidence fades toward the prior, so it is tried again."""
        i = min(n, len(PRIOR_STANDS) - 1)
        if i:
            prior = PRIOR_WEIGHT * PRIOR_STANDS[i]
            self._stood[i] = prior + SKIP_FADE * (self._stood[i] - prior)
            self._tried[i] = PRIOR_WEIGHT + SKIP_FADE * (self._tried[i] - PRIOR_WEIGHT)

    def worth(self, n: int, k: int, rows: int) -> int:
        """Of k tokens an n-token match could draft in a step of `rows` rows, how many pay."""
        if not self.slope or k <= 0:
            return max(k, 0)
        p, base = self.stands(n), self.seconds(rows)
        best, best_rate = 0, rows / base
        gain, term = 0.0, 1.0
        for d in range(1, k + 1):
            term *= p
            gain += term
            rate = (rows + gain) / (base + self.slope * d)
            if rate > best_rate:
                best, best_rate = d, rate
        return best


class SequenceDrafter:
    """One sequence's n-gram index, length policy, and whether its next step drafts."""

    def __init__(
        self,
        tokens: list[int],
        max_k: int,
        shared: SharedNgrams | None,
        cost: DraftCost | None = None,
    ) -> None:
        self.index = NgramIndex(1, MAX_MATCH)
        self.index.extend(tokens)
        self.length = DraftLength(max_k)
        self.shared = shared
        self.cost = cost  # None: every match drafts its length (`--speculative ngram`)
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

    def length_for(self, n: int, rows: int) -> int:
        """Tokens to draft after an n-token match in a step of `rows` rows."""
        k = self.length.for_match(n)
        return k if self.cost is None else self.cost.worth(n, k, rows)

    def propose(self, room: int, rows: int = 1) -> list[int]:
        """This step's draft, at most `room` tokens, in a step of `rows` rows before it."""
        n, draft = self.match(self.length.max_k)
        k = min(self.length_for(n, rows), room, len(draft))
        if k <= 0:
            self.length.skipped(n)
            if self.cost is not None and draft:
                self.cost.skipped(n)
            self.matched = 0
            return []
        self.matched = n
        return draft[:k]

    def record(self, drafted: int, accepted: int) -> None:
        self.length.record(self.matched, drafted, accepted)
        if self.cost is not None:
            self.cost.record(self.matched, drafted, accepted)

    def look_ahead(self) -> None:
        """Whether the next step would draft (were it alone)."""
        n, draft = self.match(1)
        self.expects = bool(draft) and self.length_for(n, 1) > 0


def propose_draft(
    seq, drafter: SequenceDrafter, budget: int, max_model_len: int, rows: int = 1
) -> list[int]:
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
    draft = drafter.propose(room, rows)
    # only what the grammar allows (its masks follow the draft)
    if draft and seq.matcher is not None:
        draft = (
            []
            if seq.matcher.is_stopped() or seq.matcher.is_error()
            else draft[: seq.matcher.validate_tokens(draft)]
        )
    return draft
