"""How much prompt work a decoding step may carry. `EmbedPacer` measures the streams' slowdown and
keeps it near `--embed-slowdown`; `PromptPacer` sizes generation prompts' chunks so a decoding
stream's next token comes within `--max-decode-gap-ms`. Steps without decodes are not paced.
"""

from __future__ import annotations

from collections import deque

REFRESH = 16  # steps carrying embeddings between two base measurements
DOWN, UP = 0.7, 1.15
AIM = 0.8
EWMA = 0.3
FORGET = 0.7  # weight a point measured a step ago keeps (PromptPacer's lines)


def ewma(old: float | None, new: float) -> float:
    """A decode-only step's seconds, moved toward the newest."""
    return new if old is None else (1 - EWMA) * old + EWMA * new


class Line:
    """y against x fitted over recent points, each older one weighing FORGET as much again."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y

    def add(self, x: float, y: float) -> None:
        self._sums = [FORGET * v for v in self._sums]
        for k, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[k] += v

    def fit(self) -> tuple[float, float, float] | None:
        """(mean y, mean x, slope, never below 0); None before a point."""
        w, x, y, xx, xy = self._sums
        if w <= 0:
            return None
        var = xx / w - (x / w) ** 2
        slope = max(0.0, (xy / w - x * y / w / w) / var) if var > 1e-6 else 0.0
        return y / w, x / w, slope


class EmbedPacer:
    """Embedding tokens beside decodes, moved multiplicatively against a decode-only step's time."""

    def __init__(self, slowdown: float, max_tokens: int) -> None:
        if not 0.0 < slowdown <= 1.0:
            raise ValueError(f"embed slowdown must lie in (0, 1], got {slowdown}")
        # a stream keeping (1 - slowdown) of its speed: its steps may take 1 / (1 - slowdown) as
        # long
        self.limit_ratio = 1.0 / (1.0 - slowdown) if slowdown < 1.0 else float("inf")
        # aimed a little under: the tokens overshoot it before they come back down
        self.aim = 1.0 + AIM * (self.limit_ratio - 1.0)
        self.max_tokens = max_tokens
        self.tokens = 4.0  # embedding tokens a decoding step may carry now
        self.base: float | None = None  # seconds of a step that only decodes (EWMA)
        self.since_base = 0

    def room(self, budget: int) -> int:
        """Embedding tokens this decoding step may carry (0 on a measuring step)."""
        if self.limit_ratio == float("inf"):
            return budget
        if self.base is None or self.since_base >= REFRESH:
            return 0
        return min(budget, max(1, int(self.tokens)))

    def observe(self, decodes: int, embed_tokens: int, other_tokens: int, seconds: float) -> None:
        """A step's result: its decode rows, embedding and other prompt tokens, and the workers'
        seconds.
        """
        if not decodes or other_tokens:
            return
        if not embed_tokens:
            self.base, self.since_base = ewma(self.base, seconds), 0
            return
        self.since_base += 1
        if self.base is None:
            return
        factor = DOWN if seconds > self.base * self.aim else UP
        self.tokens = min(float(self.max_tokens), max(1.0, self.tokens * factor))


HEADROOM = 0.9  # of the gap a step's planned seconds may fill, times the misses' margin
MISSES = 64  # paced steps whose measured/planned seconds set the margin
MARGIN = 1.35  # the margin before 8 misses are known: the plan at 67% of the gap (a fresh
# server's first chunks, their cost extrapolated from few points, missed by up to 1.33x)
PROBE = 32  # prompt tokens of the first step beside decodes, before a token's cost is known
FLOOR = 16  # prompt tokens (at position 0) any step beside decodes may carry
REACH = 4  # a chunk beside decodes ends at most this many times deeper than any token measured


class PromptPacer:
    """Prompt tokens a decoding step may carry so the decode gap holds.

    The gap less a decode-only step's seconds, spent at a prompt token's cost: a line in its
    position (a deep token attends to more keys). The plan is shrunk by the margin the estimate
    has recently missed by (a busy machine's steps run long). 0 gap: not paced. A step calls
    `begin`, then `fit` and `spend` per chunk.
    """

    def __init__(self, gap: float) -> None:
        if gap < 0:
            raise ValueError(f"the decode gap must be at least 0 seconds, got {gap}")
        self.gap = gap
        self._base = Line()  # a decode-only step's seconds against its rows
        self.since_base = 0
        self._token = Line()  # a prompt token's seconds against its kilo-position
        self._left: float | None = None  # this step's seconds left (None: not paced)
        self._probe = 0  # ... or its probe tokens left, before any cost is known
        self._misses: deque[float] = deque(maxlen=MISSES)  # paced steps' measured / planned
        self._deepest = 0  # the deepest prompt position a measured step held

    def margin(self) -> float:
        """What a paced step's plan is divided by: its recent misses' largest (~p98 of 64)."""
        if len(self._misses) < 8:
            return MARGIN
        return min(2.0, max(1.0, max(self._misses)))

    def per_token(self) -> tuple[float, float, float] | None:
        """(mean seconds a token, the mean's kilo-position, seconds more per 1,000 positions); None
        if unknown.
        """
        fit = self._token.fit()
        return None if fit is None else (max(fit[0], 1e-7), fit[1], fit[2])

    def base(self, decodes: int) -> float | None:
        """Seconds of a step that only decodes `decodes` rows (a line in them: more streams, more
        arithmetic); None before one is measured.
        """
        fit = self._base.fit()
        if fit is None:
            return None
        mean, at, slope = fit
        return max(mean + slope * (decodes - at), 0.25 * mean)

    def cost(self, start: int, n: int) -> float:
        """Seconds of n tokens from `start`, never below the mean: no cost extrapolated to position
        0.
        """
        mean, at, slope = self.per_token() or (0.0, 0.0, 0.0)
        return n * (mean + slope * max(0.0, (start + n / 2) / 1000 - at))

    def begin(self, decodes: int, prompts: int = 0) -> None:
        """A step is planned: paced where it decodes (`decodes` streams, `prompts` requests that
        wait for a first token).

        The prompts' seconds are at least a decode-only step's, and that again for each prompt
        per stream beyond the first: the gap holds while a decode-only step takes at most half
        of it; past that (many streams on a slow model), or where more requests wait for a first
        token than stream (a burst), the gap gives way and a prompt's TTFT stays within
        (1 + min(1, streams / prompts))x of unpaced. Held to the gap alone, a 64-request burst
        on a 1B bf16 model came in 60-token sips beside 44 streams' 200 ms steps: TTFT 2x.
        """
        self._left = self._probe = None
        if not self.gap or not decodes:
            return
        base = self.base(decodes)
        if base is not None and self.since_base >= REFRESH:
            self._left = -1.0  # a decode-only step measures the base again
        elif self.per_token() is None:
            self._probe = PROBE
        else:
            aim, base = self.gap * HEADROOM / self.margin(), base or 0.0
            share = base * max(1.0, prompts / decodes)
            self._left = max(aim - base, share, self.cost(0, FLOOR))

    def fit(self, start: int, wanted: int) -> int:
        """Of `wanted` prompt tokens from position start, how many the step has room for: no
        deeper than REACH x the deepest measured, as a token's cost is only known where measured
        (the probe's tokens near position 0 know nothing of what attending 2,000 keys costs).
        """
        if self._probe is not None:
            return min(wanted, self._probe)
        if self._left is None:
            return wanted
        wanted = min(wanted, max(REACH * self._deepest - start, FLOOR))
        lo, hi = 0, wanted  # the most tokens whose cost fits: cost grows with n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cost(start, mid) <= self._left else (lo, mid - 1)
        return lo

    def spend(self, start: int, n: int) -> None:
        if self._probe is not None:
            self._probe -= n
        elif self._left is not None:
            self._left -= self.cost(start, n)

    def observe(
        self, decodes: int, prompt_tokens: int, positions: int, seconds: float, deepest: int
    ) -> None:
        """Learn from a step: decode rows, prompt tokens, their summed positions, the workers'
        seconds, and the deepest prompt position it held.
        """
        if not decodes or not self.gap:
            return
        self._deepest = max(self._deepest, deepest)
        if not prompt_tokens:
            self._base.add(decodes, seconds)
            self.since_base = 0
            return
        self.since_base += 1
        base = self.base(decodes)
        if self.per_token() is not None and base is not None:
            start = positions // prompt_tokens - prompt_tokens // 2  # one chunk centred likewise
            self._misses.append(seconds / (base + self.cost(start, prompt_tokens)))
        y = max(seconds - (base or 0.0), 0.0) / prompt_tokens
        self._token.add(positions / prompt_tokens / 1000, y)
