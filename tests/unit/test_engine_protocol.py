"""The engine protocol's requests in our shape, and the KV-event stream's bookkeeping (no
processes).
"""

import asyncio
import json
import re
from array import array

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from scheduler_service.api.engine_protocol_messages import to_generation_request
from scheduler_service.api.validation import InvalidRequest
from scheduler_service.core.block_allocator import BlockAllocator, block_hash
from scheduler_service.runtime.kv_events import KvEventPublisher, SubscriberGone, event_hash
from scheduler_service.text.structured import choice_regex


def request(**params):
    return vpb.GenerateRequest(
        request_id="r",
        tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vpb.SamplingParams(**params),
    )


def test_every_sampling_field_is_carried_over():
    out = to_generation_request(
        request(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.1,
            frequency_penalty=0.2,
            presence_penalty=-0.3,
            repetition_penalty=1.1,
            max_tokens=12,
            min_tokens=2,
            stop=["\n\n"],
            stop_token_ids=[9],
            skip_special_tokens=True,
            ignore_eos=True,
            n=3,
            logprobs=4,
            prompt_logprobs=2,
            seed=11,
            include_stop_str_in_output=True,
            logit_bias={17: -5.0},
            truncate_prompt_tokens=64,
            regex="[a-z]+",
        )
    )
    s = out.sampling
    assert list(out.prompt_token_ids) == [5, 6, 7] and out.request_id == "r"
    assert (s.temperature, s.top_p, s.top_k) == pytest.approx((0.5, 0.9, 40))
    assert (
        s.min_p,
        s.frequency_penalty,
        s.presence_penalty,
        s.repetition_penalty,
    ) == pytest.approx((0.1, 0.2, -0.3, 1.1))
    assert (s.max_tokens, s.min_tokens, list(s.stop), list(s.stop_token_ids)) == (
        12,
        2,
        ["\n\n"],
        [9],
    )
    assert s.skip_special_tokens and s.ignore_eos and s.n == 3 and s.include_stop_str_in_output
    assert (s.logprobs, s.prompt_logprobs, s.seed, dict(s.logit_bias)) == (4, 2, 11, {17: -5.0})
    assert s.truncate_prompt_tokens == 64 and s.regex == "[a-z]+"


def test_unset_fields_take_the_protocols_defaults():
    s = to_generation_request(request()).sampling
    assert s.temperature == 1.0  # unset temperature samples, as vLLM does
    assert (
        not s.HasField("top_p")
        and not s.HasField("repetition_penalty")
        and not s.HasField("max_tokens")
    )
    assert not s.HasField("logprobs") and not s.HasField("seed") and not s.skip_special_tokens
    text = to_generation_request(
        vpb.GenerateRequest(text="hello", sampling_params=vpb.SamplingParams())
    )
    assert text.prompt == "hello" and text.raw_prompt  # a text input is the prompt as it is


def test_json_object_and_choice_become_constraints_the_matcher_reads():
    schema = to_generation_request(request(json_object=True)).sampling.json_schema
    assert json.loads(schema) == {"type": "object"}
    choice = vpb.ChoiceConstraint(choices=["a.b", "c|d", "(x)"])
    rx = to_generation_request(request(choice=choice)).sampling.regex
    assert rx == choice_regex(["a.b", "c|d", "(x)"])
    assert re.fullmatch(rx, "c|d") and re.fullmatch(rx, "(x)") and not re.fullmatch(rx, "axb")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: request(structural_tag="{}"), "structural_tag is not served"),
        (lambda: request(logprobs=-1), "logprobs must lie in \\[0, 20\\]"),
        (lambda: request(prompt_logprobs=21), "prompt_logprobs must lie in \\[0, 20\\]"),
        (lambda: request(seed=-4), "seed must be >= 0"),
        # their uint32 past our int32: the client's number, not the server's ValueError
        (lambda: request(top_k=2**31), "sampling_params.top_k 2147483648 is out of range"),
        (lambda: request(logit_bias={-3: 1.0}), "negative token id -3"),
        (lambda: request(choice=vpb.ChoiceConstraint()), "choice has no choices"),
        (
            lambda: vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=[1]), data_parallel_rank=1
            ),
            "data_parallel_rank 1",
        ),
        (
            lambda: vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=[1]), kv_transfer_params_json="{}"
            ),
            "kv_transfer_params_json",
        ),
        (
            lambda: vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=[1]), media_refs=vpb.MediaRefs()
            ),
            "media_refs",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(build, message):
    with pytest.raises(InvalidRequest, match=message):
        to_generation_request(build())


def test_the_allocator_records_stored_evicted_and_cleared_prefixes():
    a = BlockAllocator(2, 4)
    a.events = []
    blocks = a.allocate(2)
    h0 = block_hash(None, [1, 2, 3, 4])
    h1 = block_hash(h0, [5, 6, 7, 8])
    a.register(blocks[0], h0, None, [1, 2, 3, 4])
    a.register(blocks[1], h1, h0, [5, 6, 7, 8])
    a.register(blocks[1], h1, h0, [5, 6, 7, 8])  # already held: nothing new
    a.free(blocks)
    a.allocate(1)  # evicts the least recently used prefix
    assert a.events == [
        ("stored", h0, None, [1, 2, 3, 4]),
        ("stored", h1, h0, [5, 6, 7, 8]),
        ("removed", h0),
    ]
    a.events.clear()
    assert a.reset_prefix_cache() == 1 and a.events == [("cleared",)] and a.lookup(h1) is None
    a.check_invariants()


def test_subscribers_get_numbered_batches_resume_from_history_and_a_slow_one_is_dropped():
    async def run():
        pub = KvEventPublisher(history=3, max_pending=2)
        live = pub.subscribe()
        h = block_hash(None, [1])
        for i in range(4):
            records = [("stored", h, None, [i])] if i % 2 == 0 else [("removed", h)]
            pub.collect(0, records)
            assert records == []  # handed over, list emptied
        first = await live.get()
        assert (first.sequence_number, first.events) == (
            1,
            [("stored", event_hash(h), None, array("I", [0]))],
        )
        assert (await live.get()).events == [("removed", event_hash(h))]
        gone = await live.get()  # it fell max_pending behind: told so, then nothing more
        assert isinstance(gone, SubscriberGone) and pub.num_subscribers == 0
        resumed = pub.subscribe(start_sequence_number=2)
        assert [(await resumed.get()).sequence_number for _ in range(2)] == [3, 4]
        pub.collect(1, [])  # nothing changed: no batch
        assert pub.sequence_number == 4

    asyncio.run(run())
