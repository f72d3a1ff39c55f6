"""How much prompt work a decoding step may carry. `EmbedPacer` measures the streams' slowdown and
keeps it near `--embed-slowdown`; `PromptPacer` sizes generation prompts' chunks so a decoding
stream's next token comes within `--max-decode-gap-ms`. Steps without decodes are not paced.
"""

from __future__ import annotations

REFRESH = 16  # steps carrying embeddings between two base measurements
DOWN, UP = 0.7, 1.15
AIM = 0.8
EWMA = 0.3


class EmbedPacer:
    """Decode-only step time (refreshed every `REFRESH` steps) against steps carrying embedding
    tokens; the embedding budget moves multiplicatively, down when over the target, up while under.
    """

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
        """Embedding tokens a step that decodes may carry (0 for a step that measures the base)."""
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
            self.base = seconds if self.base is None else (1 - EWMA) * self.base + EWMA * seconds
            self.since_base = 0
            return
        self.since_base += 1
        if self.base is None:
            return
        factor = DOWN if seconds > self.base * self.aim else UP
        self.tokens = min(float(self.max_tokens), max(1.0, self.tokens * factor))


GAP_AIM = 0.85  # of the gap: a chunk deeper into its prompt costs a little more than the last
PROBE = 32  # prompt tokens of the first step beside decodes, before a token's cost is known
FLOOR = 16  # prompt tokens any step beside decodes may carry (decodes alone past the gap)


class PromptPacer:
    """Prompt tokens a step that decodes may carry: the gap, less a decode-only step's seconds
    (EWMA, refreshed every `REFRESH` paced steps), over a prompt token's seconds (EWMA of the last
    steps that carried prompts beside decodes). 0 gap: not paced.
    """

    def __init__(self, gap: float) -> None:
        if gap < 0:
            raise ValueError(f"the decode gap must be at least 0 seconds, got {gap}")
        self.gap = gap
        self.base: float | None = None  # seconds of a step that only decodes
        self.per_token: float | None = None  # seconds a prompt token adds to a decoding step
        self.since_base = 0

    def room(self, budget: int) -> int:
        """Prompt tokens a step that decodes may carry (0 for a step that measures the base again;
        before any is measured, a prompt token's cost holds it too).
        """
        if not self.gap:
            return budget
        if self.base is not None and self.since_base >= REFRESH:
            return 0
        if self.per_token is None:
            return min(budget, PROBE)
        left = self.gap * GAP_AIM - (self.base or 0.0)
        return min(budget, max(FLOOR, int(left / self.per_token)))

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step's result: its decode rows, generation prompts' tokens and the workers' seconds."""
        if not decodes or not self.gap:
            return
        if not prompt_tokens:
            self.base = seconds if self.base is None else (1 - EWMA) * self.base + EWMA * seconds
            self.since_base = 0
            return
        self.since_base += 1
        cost = max(seconds - (self.base or 0.0), 0.0) / prompt_tokens
        self.per_token = cost if self.per_token is None else 0.5 * (self.per_token + cost)
