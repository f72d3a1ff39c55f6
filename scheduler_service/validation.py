"""GenerateRequest (protobuf) → a validated Request, or InvalidRequest with a message that says what is wrong."""

from __future__ import annotations

import math
import secrets
import uuid

from protos import generation_pb2
from scheduler_service.sequence import Request, SamplingOptions
from scheduler_service.tokenizer import Tokenizer

MAX_SAMPLES = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
# Temperatures below this are greedy: dividing logits by them overflows to inf and NaN probabilities.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """Bad client input; answered with INVALID_ARGUMENT and this message."""


class Limits:
    """What a request must fit: the model's context and vocabulary, and the whole KV pool."""

    def __init__(self, vocab_size: int, max_context: int, num_blocks: int, block_size: int,
                 max_token_bytes: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A text prompt longer than this cannot fit the context whatever it says: refused before tokenizing.
        self.max_prompt_bytes = max_context * max_token_bytes if max_token_bytes else None


def request_from_proto(msg: generation_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> Request:
    has_text = bool(msg.prompt)
    has_ids = len(msg.prompt_token_ids) > 0
    if has_text and has_ids:
        raise InvalidRequest("set exactly one of prompt and prompt_token_ids, not both")
    if not has_text and not has_ids:
        raise InvalidRequest("the prompt is empty: set prompt (text) or prompt_token_ids")
    if has_ids:
        prompt_ids = list(msg.prompt_token_ids)
        bad = [t for t in prompt_ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt_token_ids has {len(bad)} id(s) outside the vocabulary [0, {limits.vocab_size}), "
                f"e.g. {bad[0]}"
            )
    else:
        size = len(msg.prompt.encode())
        if limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
            raise InvalidRequest(
                f"the prompt is {size} bytes, more than any {limits.max_context}-token context can hold "
                f"({limits.max_prompt_bytes} bytes at most)")
        try:
            prompt_ids = tokenizer.encode_prompt(msg.prompt, raw=msg.raw_prompt)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        if not prompt_ids:
            raise InvalidRequest("the prompt encodes to no tokens")
    prompt_len = len(prompt_ids)
    if prompt_len >= limits.max_context:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the model's context is {limits.max_context} tokens and at "
            "least one must be left to generate"
        )
    sampling = _sampling(msg.sampling, prompt_len, limits)
    seq_tokens = prompt_len + sampling.max_tokens
    # Samples share the prompt's blocks up to the one holding its last token, which each sample recomputes
    # to draw its own first token: when the prompt ends on a block boundary that block is copied per sample.
    shared = (prompt_len - 1) // limits.block_size
    need = shared + sampling.n * (math.ceil(seq_tokens / limits.block_size) - shared)
    if need > limits.num_blocks:
        raise InvalidRequest(
            f"the request needs up to {need} KV blocks ({sampling.n} sample(s) of up to {seq_tokens} tokens) but "
            f"the whole pool has {limits.num_blocks} blocks of {limits.block_size} tokens; lower max_tokens or n"
        )
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    return Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling)


def _sampling(p: generation_pb2.SamplingParams, prompt_len: int, limits: Limits) -> SamplingOptions:
    room = limits.max_context - prompt_len
    if p.HasField("max_tokens"):
        if p.max_tokens < 1:
            raise InvalidRequest("sampling.max_tokens must be at least 1")
        if p.max_tokens > room:
            raise InvalidRequest(
                f"sampling.max_tokens is {p.max_tokens} but the prompt ({prompt_len} tokens) leaves only {room} "
                f"of the model's {limits.max_context}-token context"
            )
        max_tokens = p.max_tokens
    else:
        max_tokens = room
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be >= 0 (0 is greedy), got {p.temperature}")
    top_p = 1.0
    if p.HasField("top_p"):
        if not (0.0 < p.top_p <= 1.0):
            raise InvalidRequest(f"sampling.top_p must lie in (0, 1], got {p.top_p}")
        top_p = p.top_p
    if p.top_k < -1:
        raise InvalidRequest(f"sampling.top_k must be >= 0 (0 or -1 turn it off), got {p.top_k}")
    n = p.n or 1
    if n > MAX_SAMPLES:
        raise InvalidRequest(f"sampling.n must be at most {MAX_SAMPLES}, got {n}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    if any(s == "" for s in p.stop):
        raise InvalidRequest("a stop string is empty")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    bad = [t for t in p.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids has id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=float(p.temperature) if p.temperature >= MIN_TEMPERATURE else 0.0,
        top_p=float(top_p),
        top_k=max(0, p.top_k),
        seed=p.seed if p.HasField("seed") else secrets.randbits(63),
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=n,
    )
