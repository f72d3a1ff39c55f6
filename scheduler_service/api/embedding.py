"""Embed: many inputs in one call, each a prefill-only request through the same engine, answered in
input order; each model refuses the other task.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass

import numpy as np

from scheduler_service.api.validation import MAX_REQUEST_ID_CHARS, InvalidRequest
from scheduler_service.core.sequence import EmbedOptions, Request, SamplingOptions
from scheduler_service.runtime.errors import EngineUnavailable

MAX_INPUTS = 2048  # inputs of one call (OpenAI's /v1/embeddings takes up to 2048 too)


@dataclass
class EmbedInputs:
    """One call's inputs, protobuf-free: exactly one of texts and token id lists."""

    request_id: str = ""
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    dimensions: int = 0
    truncate_prompt_tokens: int = 0
    prompt_name: str = ""
    prompt: str = ""


@dataclass
class EmbedResult:
    index: int
    vector: np.ndarray  # float32
    prompt_tokens: int
    cached_prompt_tokens: int


def refuse_task(engine, embedding: bool) -> None:
    """InvalidRequest when the served model is not for this kind of request."""
    pooling = engine.spec.pooling
    if embedding and pooling is None:
        raise InvalidRequest(
            f"{engine.spec.name} generates text and serves no embeddings; start the server "
            "with an embedding model, or with --task embed to pool this one's hidden states"
        )
    if not embedding and not engine.spec.generates:
        raise InvalidRequest(
            f"{engine.spec.name} is served as an embedding model (--task embed): use Embed "
            "(/v1/embeddings); it does not generate (--task both serves both)"
        )


def embed_requests(inputs: EmbedInputs, engine) -> list[Request]:
    """The call's inputs as validated, tokenized requests (one per input, ids `<id>-<i>` when
    several).
    """
    refuse_task(engine, embedding=True)
    spec, limits, tokenizer = engine.spec.pooling, engine.limits, engine.tokenizer
    if (inputs.texts is None) == (inputs.token_ids is None):
        raise InvalidRequest("set exactly one of texts and inputs (token ids)")
    items = inputs.texts if inputs.texts is not None else inputs.token_ids
    if not items:
        raise InvalidRequest("no input to embed: texts (or inputs) is empty")
    most = min(MAX_INPUTS, engine.config.max_queue_len)
    if len(items) > most:
        raise InvalidRequest(f"{len(items)} inputs in one call; at most {most} (--max-queue-len)")
    dims = inputs.dimensions
    if dims < 0 or dims > engine.spec.hidden_size:
        raise InvalidRequest(
            f"dimensions is {dims}; this model's vectors have {engine.spec.hidden_size} "
            f"(0 or 1 to {engine.spec.hidden_size})"
        )
    keep = inputs.truncate_prompt_tokens
    if keep < -1:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1, 0 or positive, got {keep}")
    keep = limits.max_context if keep == -1 else keep
    if keep > limits.max_context:
        raise InvalidRequest(
            f"truncate_prompt_tokens is {keep} but the model's context is "
            f"{limits.max_context} tokens"
        )
    instruction = _instruction(inputs, spec) if inputs.texts is not None else ""
    if inputs.token_ids is not None and (inputs.prompt or inputs.prompt_name):
        raise InvalidRequest("prompt and prompt_name apply to texts, not to token ids")
    # (the answer says which it was)
    rid = inputs.request_id = inputs.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS - 6:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS - 6} characters")
    options = EmbedOptions(spec, dims or None)
    requests = []
    for i, item in enumerate(items):
        texts = inputs.texts is not None
        ids = _tokens(i, item, instruction, tokenizer, limits, keep) if texts else list(item)
        what = f"input {i}" if len(items) > 1 else "the input"
        if not ids:
            raise InvalidRequest(f"{what} is empty")
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{what} has {len(bad)} token id(s) outside the vocabulary "
                f"[0, {limits.vocab_size}), e.g. {bad[0]}"
            )
        if keep:
            ids = ids[-keep:]
        if len(ids) > limits.max_context:
            raise InvalidRequest(
                f"{what} has {len(ids)} tokens; the model's context is {limits.max_context} "
                "(set truncate_prompt_tokens to keep the last ones)"
            )
        if math.ceil(len(ids) / limits.block_size) > limits.num_blocks:
            raise InvalidRequest(
                f"{what} has {len(ids)} tokens; the whole KV pool holds "
                f"{limits.num_blocks * limits.block_size}"
            )
        requests.append(
            Request(
                request_id=f"{rid}-{i}" if len(items) > 1 else rid,
                prompt_token_ids=ids,
                sampling=SamplingOptions(max_tokens=1),
                embed=options,
            )
        )
    return requests


def _instruction(inputs: EmbedInputs, spec) -> str:
    """What goes before each text: the caller's prompt, a named one, or the model's default."""
    if inputs.prompt and inputs.prompt_name:
        raise InvalidRequest("set prompt or prompt_name, not both")
    if inputs.prompt_name:
        if inputs.prompt_name not in spec.prompts:
            names = ", ".join(sorted(spec.prompts)) or "none"
            raise InvalidRequest(
                f"prompt_name {inputs.prompt_name!r} is not one of the model's prompts ({names})"
            )
        return spec.prompts[inputs.prompt_name]
    if inputs.prompt:
        return inputs.prompt
    return spec.prompts.get(spec.default_prompt, "") if spec.default_prompt else ""


def _tokens(i: int, text: str, instruction: str, tokenizer, limits, keep: int) -> list[int]:
    if not text:
        raise InvalidRequest(f"text {i} is empty")
    size = len(text.encode()) + len(instruction.encode())
    if not keep and limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
        raise InvalidRequest(
            f"text {i} is {size} bytes, more than any {limits.max_context}-token context "
            "holds (set truncate_prompt_tokens to keep its last tokens)"
        )
    try:
        return tokenizer.encode(instruction + text, add_special_tokens=True)
    except ValueError as e:
        raise InvalidRequest(f"text {i}: {e}") from e


async def prepare_embeddings(engine, inputs: EmbedInputs) -> list[Request]:
    """Validated and tokenized off the event loop, so many long texts never stall others."""
    if engine.limits is None:
        raise EngineUnavailable(engine.unavailable_reason)
    return await asyncio.to_thread(embed_requests, inputs, engine)


async def run_embeddings(engine, requests: list[Request]) -> list[EmbedResult]:
    """Every input's vector in input order; one failure ends the call and aborts the rest."""
    tasks = [asyncio.ensure_future(_one(engine, r)) for r in requests]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    pairs = zip(requests, done, strict=True)
    return [EmbedResult(i, v, r.prompt_len, cached) for i, (r, (v, cached)) in enumerate(pairs)]


async def _one(engine, request: Request) -> tuple[np.ndarray, int]:
    vector = cached = None
    async for delta in engine.generate(request):
        if delta.embedding is not None:
            vector = delta.embedding
        if delta.usage is not None:
            cached = delta.usage.cached_prompt_tokens
    if vector is None:  # ended without its vector (aborted by an Abort RPC, or the server stopping)
        raise EngineUnavailable(
            f"request {request.request_id} ended before its vector was computed"
        )
    return vector, cached or 0
