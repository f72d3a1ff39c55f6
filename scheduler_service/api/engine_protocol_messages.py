"""The SMG engine protocol's messages in pagedserve's shape: its GenerateRequest as a pagedserve.v1 request
(then validated as any other), and logprobs back in its shape."""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2

from protos import generation_pb2
from scheduler_service.api.validation import MAX_LOGPROBS, InvalidRequest
from scheduler_service.text.structured import choice_regex


def to_generation_request(msg: vllm_engine_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    # one function: a field-by-field translation
    """The engine protocol's request as a pagedserve.v1 request, or InvalidRequest naming the field that
    cannot be served."""
    for name, what in (("mm_inputs", "multimodal inputs"), ("media_refs", "media references"),
                       ("kv_transfer_params", "KV transfer (disaggregated prefill)")):
        if msg.HasField(name):
            raise InvalidRequest(f"{name}: this engine serves text-only models without {what}")
    if msg.extra_mm_inputs:
        raise InvalidRequest("extra_mm_inputs: this engine serves text-only models without multimodal inputs")
    if msg.HasField("kv_transfer_params_json"):
        raise InvalidRequest("kv_transfer_params_json: this engine has no KV transfer (disaggregated "
                             "prefill)")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidRequest(f"data_parallel_rank {msg.data_parallel_rank}: this engine reports one rank and "
                             "balances its data-parallel replicas itself")
    out = generation_pb2.GenerateRequest(request_id=msg.request_id)
    kind = msg.WhichOneof("input")
    if kind == "tokenized":
        out.prompt_token_ids.extend(msg.tokenized.input_ids)
    elif kind == "text":
        out.prompt, out.raw_prompt = msg.text, True
    p = msg.sampling_params
    s = out.sampling
    s.temperature = p.temperature if p.HasField("temperature") else 1.0
    if p.top_p:
        s.top_p = p.top_p
    s.top_k = p.top_k
    s.min_p, s.presence_penalty, s.frequency_penalty = p.min_p, p.presence_penalty, p.frequency_penalty
    if p.repetition_penalty:
        s.repetition_penalty = p.repetition_penalty
    if p.HasField("max_tokens"):
        s.max_tokens = p.max_tokens
    s.min_tokens = p.min_tokens
    s.stop.extend(p.stop)
    s.stop_token_ids.extend(p.stop_token_ids)
    s.skip_special_tokens = p.skip_special_tokens
    s.ignore_eos = p.ignore_eos
    s.n = p.n
    s.include_stop_str_in_output = p.include_stop_str_in_output
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name):
            value = getattr(p, name)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"sampling_params.{name} must lie in [0, {MAX_LOGPROBS}], got {value} "
                                     "(-1, every token, is not served)")
            setattr(s, name, value)
    if p.HasField("seed"):
        if p.seed < 0:
            raise InvalidRequest(f"sampling_params.seed must be >= 0, got {p.seed}")
        s.seed = p.seed
    for token, bias in p.logit_bias.items():
        if token < 0:
            raise InvalidRequest(f"sampling_params.logit_bias has a negative token id {token}")
        s.logit_bias[token] = bias
    if p.HasField("truncate_prompt_tokens"):
        s.truncate_prompt_tokens = p.truncate_prompt_tokens
    constraint = p.WhichOneof("constraint")
    if constraint in ("json_schema", "regex", "grammar"):
        setattr(s, constraint, getattr(p, constraint))
    elif constraint == "json_object":
        if p.json_object:
            s.json_schema = '{"type": "object"}'
    elif constraint == "choice":
        if not p.choice.choices:
            raise InvalidRequest("sampling_params.choice has no choices")
        s.regex = choice_regex(list(p.choice.choices))
    elif constraint == "structural_tag":
        raise InvalidRequest("sampling_params.structural_tag is not served: use json_schema, regex or "
                             "grammar")
    return out


def output_logprobs(entries) -> vllm_engine_pb2.OutputLogProbs | None:
    if not entries:
        return None
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries],
        top_logprobs=[vllm_engine_pb2.TopLogProbs(values=[v for _, v in e.top],
                                                  token_ids=[t for t, _ in e.top])
                      for e in entries])


def input_logprobs(prompt_ids: list[int], entries) -> vllm_engine_pb2.InputLogProbs:
    """The prompt's logprobs: none for its first token, then one entry per token."""
    out = vllm_engine_pb2.InputLogProbs(token_ids=prompt_ids)
    out.token_logprobs.add()
    out.top_logprobs.add()
    for e in entries:
        out.token_logprobs.add(value=e.logprob)
        out.top_logprobs.add(values=[v for _, v in e.top], token_ids=[t for t, _ in e.top])
    return out
