"""GenerateRequest (protobuf) → a validated Request, or InvalidRequest with a message that says what
is wrong.
"""

from __future__ import annotations

import math
import secrets
import uuid

from google.protobuf import json_format

from protos import generation_pb2
from scheduler_service.core.adapters import AdapterRegistry
from scheduler_service.core.sequence import Request, SamplingOptions
from scheduler_service.text import json_gate
from scheduler_service.text.limits import Limits
from scheduler_service.text.structured import Constraint, GrammarError
from scheduler_service.text.tokenizer import Tokenizer

MAX_SAMPLES = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_MESSAGES = 1024
MAX_TOOLS = 128
# Temperatures below this are greedy: dividing logits by them overflows to inf and NaN
# probabilities.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """Bad client input; answered with INVALID_ARGUMENT and this message."""


def request_from_proto(
    msg: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    limits: Limits,
    adapters: AdapterRegistry | None = None,
) -> Request:
    # one function: the one validation path, in the order a request is read
    """The one validation path, for pagedserve.v1 and (converted) engine-protocol requests."""
    given = [
        name
        for name, present in (
            ("prompt", bool(msg.prompt)),
            ("prompt_token_ids", len(msg.prompt_token_ids) > 0),
            ("messages", len(msg.messages) > 0),
        )
        if present
    ]
    if len(given) > 1:
        raise InvalidRequest(
            f"set exactly one of prompt, prompt_token_ids and messages, not {' and '.join(given)}"
        )
    if not given:
        raise InvalidRequest("the prompt is empty: set prompt (text), prompt_token_ids or messages")
    if not msg.messages:
        chat_only = {
            "tools": len(msg.tools) > 0,
            "chat_template_kwargs": msg.HasField("chat_template_kwargs"),
            "add_generation_prompt": msg.HasField("add_generation_prompt"),
            "continue_final_message": msg.continue_final_message,
        }
        for field, present in chat_only.items():
            if present:
                raise InvalidRequest(f"{field} applies to messages only")
    lora = None
    if msg.lora:
        if adapters is None:
            raise InvalidRequest(f"unknown LoRA adapter {msg.lora!r}: this model serves none")
        try:
            lora = adapters.get(msg.lora)
        except KeyError as e:
            raise InvalidRequest(e.args[0]) from None
    if given[0] == "messages":
        prompt_ids = _chat_prompt(msg, tokenizer, limits)
    elif given[0] == "prompt_token_ids":
        prompt_ids = list(msg.prompt_token_ids)
        bad = [t for t in prompt_ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt_token_ids has {len(bad)} id(s) outside the vocabulary [0, "
                f"{limits.vocab_size}), e.g. {bad[0]}"
            )
    else:
        size = len(msg.prompt.encode())
        if limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
            raise InvalidRequest(
                f"the prompt is {size} bytes, more than any {limits.max_context}-token context "
                f"can hold ({limits.max_prompt_bytes} bytes at most)"
            )
        try:
            prompt_ids = tokenizer.encode_prompt(msg.prompt, raw=msg.raw_prompt)
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        if not prompt_ids:
            raise InvalidRequest("the prompt encodes to no tokens")
    prompt_ids = _truncate(prompt_ids, msg.sampling, limits)
    prompt_len = len(prompt_ids)
    if prompt_len >= limits.max_context:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the model's context is {limits.max_context} "
            "tokens and at least one must be left to generate"
        )
    sampling = _sampling(msg.sampling, prompt_len, limits)
    seq_tokens = prompt_len + sampling.max_tokens
    # Samples share the prompt's blocks but recompute its last token; a prompt ending on a block
    # boundary has that block copied per sample.
    shared = (prompt_len - 1) // limits.block_size
    need = shared + sampling.n * (math.ceil(seq_tokens / limits.block_size) - shared)
    if limits.kv_window:  # a sliding window holds a bounded stretch of each sample at a time
        need = min(need, sampling.n * limits.sample_blocks(seq_tokens, sampling.is_penalized))
    if need > limits.num_blocks:
        raise InvalidRequest(
            f"the request needs up to {need} KV blocks ({sampling.n} sample(s) of up to "
            f"{seq_tokens} tokens) but the whole pool has {limits.num_blocks} blocks of "
            f"{limits.block_size} tokens; lower max_tokens or n"
        )
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    constraint = _constraint(msg.sampling, limits)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        constraint=constraint,
        lora=lora,
    )


def _chat_prompt(
    msg: generation_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits
) -> list[int]:
    if len(msg.messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages, got {len(msg.messages)}")
    if len(msg.tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools, got {len(msg.tools)}")
    messages = []
    size = 0
    for i, m in enumerate(msg.messages):
        if not m.role:
            raise InvalidRequest(f"messages[{i}].role is empty (system, user, assistant or tool)")
        entry: dict = {"role": m.role, "content": m.content}
        if m.name:
            entry["name"] = m.name
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest(
                    f"messages[{i}] has tool_calls but its role is {m.role!r}, not assistant"
                )
            calls = []
            for j, c in enumerate(m.tool_calls):
                if not c.name:
                    raise InvalidRequest(f"messages[{i}].tool_calls[{j}].name is empty")
                try:
                    arguments = json_gate.parse(
                        c.arguments or "{}", f"messages[{i}].tool_calls[{j}].arguments"
                    )
                except json_gate.BadJson as e:
                    raise InvalidRequest(str(e)) from None
                calls.append(
                    {
                        "id": c.id,
                        "type": c.type or "function",
                        "function": {"name": c.name, "arguments": arguments},
                    }
                )
            entry["tool_calls"] = calls
        size += len(m.content.encode())
        messages.append(entry)
    if limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
        raise InvalidRequest(
            f"the messages hold {size} bytes of text, more than any "
            f"{limits.max_context}-token context can hold ({limits.max_prompt_bytes} bytes "
            "at most)"
        )
    tools = [json_format.MessageToDict(t) for t in msg.tools] or None
    kwargs = {}
    if msg.HasField("chat_template_kwargs"):
        kwargs = json_format.MessageToDict(msg.chat_template_kwargs)
    reserved = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}: use the "
            "request's fields"
        )
    add_generation_prompt = (
        msg.add_generation_prompt
        if msg.HasField("add_generation_prompt")
        else not msg.continue_final_message
    )
    try:
        ids = tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=msg.continue_final_message,
            template_kwargs=kwargs,
        )
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    if not ids:
        raise InvalidRequest("the messages render to no tokens")
    return ids


def _truncate(prompt_ids: list[int], p: generation_pb2.SamplingParams, limits: Limits) -> list[int]:
    """truncate_prompt_tokens: keep the prompt's last K tokens (-1: as
    many as the context allows).
    """
    if not p.HasField("truncate_prompt_tokens") or p.truncate_prompt_tokens == 0:
        return prompt_ids
    keep = p.truncate_prompt_tokens
    if keep == -1:
        keep = limits.max_context - 1
    elif keep < -1:
        raise InvalidRequest(
            f"sampling.truncate_prompt_tokens must be -1, 0 or positive, got {keep}"
        )
    elif keep >= limits.max_context:
        raise InvalidRequest(
            f"sampling.truncate_prompt_tokens is {keep} but the model's context is "
            f"{limits.max_context} tokens and one must be left to generate"
        )
    return prompt_ids[-keep:]


def _constraint(p: generation_pb2.SamplingParams, limits: Limits) -> Constraint | None:
    given = [(k, getattr(p, k)) for k in ("json_schema", "regex", "grammar") if getattr(p, k)]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(
            "set at most one of json_schema, regex and grammar, not "
            f"{' and '.join(k for k, _ in given)}"
        )
    kind, text = given[0]
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"sampling.{kind} is longer than {MAX_GRAMMAR_CHARS} characters")
    if limits.grammars is None:
        raise InvalidRequest("this server has no structured-output engine")
    try:
        return Constraint(limits.grammars, limits.grammars.compile(**{kind: text}), kind)
    except GrammarError as e:
        raise InvalidRequest(
            f"sampling.{e}" if str(e).startswith(kind) else f"sampling.{kind}: {e}"
        ) from e


def _max_tokens(p: generation_pb2.SamplingParams, prompt_len: int, limits: Limits) -> int:
    """What the context leaves after the prompt, at most; the server default if unset."""
    room = limits.max_context - prompt_len
    if p.HasField("max_tokens"):
        if p.max_tokens < 1:
            raise InvalidRequest("sampling.max_tokens must be at least 1")
        if p.max_tokens > room:
            raise InvalidRequest(
                f"sampling.max_tokens is {p.max_tokens} but the prompt ({prompt_len} tokens) "
                f"leaves only {room} of the model's {limits.max_context}-token context"
            )
        max_tokens = p.max_tokens
    else:
        max_tokens = min(room, limits.default_max_tokens) if limits.default_max_tokens else room
    return max_tokens


def _check_stops(p: generation_pb2.SamplingParams, limits: Limits) -> None:
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    if any(s == "" for s in p.stop):
        raise InvalidRequest("a stop string is empty")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    bad = [t for t in p.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"stop_token_ids has id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
        )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}"
        )


def _penalties(p: generation_pb2.SamplingParams) -> float:
    """Penalties within their ranges; the repetition penalty (1 is off)."""
    repetition = 1.0
    if p.HasField("repetition_penalty"):
        if not (math.isfinite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= 2.0):
            raise InvalidRequest(
                "sampling.repetition_penalty must lie in (0, 2] (1 is off), got "
                f"{p.repetition_penalty}"
            )
        repetition = p.repetition_penalty
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidRequest(f"sampling.{name} must lie in [-2, 2] (0 is off), got {value}")
    if not (math.isfinite(p.min_p) and 0.0 <= p.min_p <= 1.0):
        raise InvalidRequest(f"sampling.min_p must lie in [0, 1] (0 is off), got {p.min_p}")
    return repetition


def _logit_bias(p: generation_pb2.SamplingParams, limits: Limits) -> list[tuple[int, float]]:
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling.logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    bias = []
    for token, value in sorted(p.logit_bias.items()):
        if token >= limits.vocab_size:
            raise InvalidRequest(
                f"sampling.logit_bias has token id {token} outside the vocabulary "
                f"[0, {limits.vocab_size})"
            )
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise InvalidRequest(
                f"sampling.logit_bias[{token}] must lie in [-100, 100], got {value}"
            )
        if value:
            bias.append((int(token), float(value)))
    return bias


def _sampling(p: generation_pb2.SamplingParams, prompt_len: int, limits: Limits) -> SamplingOptions:
    max_tokens = _max_tokens(p, prompt_len, limits)
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(
            f"sampling.temperature must be >= 0 (0 is greedy), got {p.temperature}"
        )
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
    _check_stops(p, limits)
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and getattr(p, name) > MAX_LOGPROBS:
            raise InvalidRequest(
                f"sampling.{name} must lie in [0, {MAX_LOGPROBS}], got {getattr(p, name)}"
            )
    repetition = _penalties(p)
    if p.min_tokens > max_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens ({p.min_tokens}) is more than max_tokens ({max_tokens})"
        )
    if p.min_tokens and any(getattr(p, k) for k in ("json_schema", "regex", "grammar")):
        raise InvalidRequest(
            "sampling.min_tokens cannot be combined with structured output: the structure "
            "decides where the output ends"
        )
    bias = _logit_bias(p, limits)
    ban = tuple(
        sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(limits.eos_token_ids)))
    )
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
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        repetition_penalty=float(repetition),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        min_p=float(p.min_p),
        min_tokens=int(p.min_tokens),
        logit_bias=tuple(bias),
        min_tokens_ban=ban if p.min_tokens else (),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
    )
