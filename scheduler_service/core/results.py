"""A step's result for one row, as plain functions of its sequence: the tokens the row gives (a
draft's accepted tokens, then the sampled one, cut where a grammar ends) and where the sequence
stops: a stop id or end-of-sequence, its grammar's end, max_tokens or the context. The scheduler
applies them (core/queues.py `update`), so a sequence's end is decided in one place.
"""

from __future__ import annotations

from scheduler_service.core.sequence import FinishReason, Sequence


def row_tokens(seq: Sequence, draft: tuple[int, ...], token: int, accepted: int) -> tuple[int, ...]:
    """The tokens a sampling row gives seq, in order: its accepted draft, then the sampled token; a
    grammar takes them up to the one that completes or breaks it (a refused token ends the sample
    there).
    """
    tokens = (*draft[:accepted], token) if draft else (token,)
    if seq.matcher is None:
        return tokens
    for n, t in enumerate(tokens, 1):
        seq.matcher.consume_token(t)
        if seq.matcher.is_stopped() or seq.matcher.is_error():
            return tokens[:n]
    return tokens


def ends_with(seq: Sequence, token: int, count: int, max_model_len: int) -> FinishReason | None:
    """Why seq ends with `token` as its count-th output token (None: it goes on): a stop id or
    end-of-sequence once min_tokens are out, then max_tokens or the context."""
    params = seq.request.sampling
    if token in seq.request.stop_ids and count >= params.min_tokens:
        return FinishReason.STOP
    if count >= params.max_tokens or seq.request.prompt_len + count >= max_model_len:
        return FinishReason.LENGTH
    return None


def stop_at(
    seq: Sequence, tokens: tuple[int, ...], max_model_len: int
) -> tuple[int, FinishReason | None]:
    """How many of `tokens` (new to seq, in order) it keeps, and why it ends after the last of them
    (None: it goes on); a grammar ends where row_tokens cut."""
    done = seq.num_output_tokens
    matcher = seq.matcher
    for n, t in enumerate(tokens, 1):
        if (
            n == len(tokens)
            and matcher is not None
            and (matcher.is_stopped() or matcher.is_error())
        ):
            return n, FinishReason.ERROR if matcher.is_error() else FinishReason.STOP
        reason = ends_with(seq, t, done + n, max_model_len)
        if reason is not None:
            return n, reason
    return len(tokens), None
