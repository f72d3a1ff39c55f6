"""A step's result for one row, as plain functions: the tokens it gives and where its sequence stops
(stop id, end of sequence, grammar's end, max_tokens, context). Applied by core/queues.py `update`.
"""

from __future__ import annotations

from scheduler_service.core.sequence import FinishReason, Sequence


def row_tokens(seq: Sequence, draft: tuple[int, ...], token: int, accepted: int) -> tuple[int, ...]:
    """A row's tokens for seq: accepted draft, then the sample, cut where a grammar ends."""
    tokens = (*draft[:accepted], token) if draft else (token,)
    if seq.matcher is None:
        return tokens
    for n, t in enumerate(tokens, 1):
        seq.matcher.consume_token(t)
        if seq.matcher.is_stopped() or seq.matcher.is_error():
            return tokens[:n]
    return tokens


def ends_with(seq: Sequence, token: int, count: int, max_model_len: int) -> FinishReason | None:
    """Why seq ends at its count-th token (None: it goes on)."""
    params = seq.request.sampling
    if token in seq.request.stop_ids and count >= params.min_tokens:
        return FinishReason.STOP
    if count >= params.max_tokens or seq.request.prompt_len + count >= max_model_len:
        return FinishReason.LENGTH
    return None


def stop_at(
    seq: Sequence, tokens: tuple[int, ...], max_model_len: int
) -> tuple[int, FinishReason | None]:
    """(how many tokens seq keeps, why it ends after them or None)."""
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
