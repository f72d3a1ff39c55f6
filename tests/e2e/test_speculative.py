"""Speculative decoding: drafts change how many steps an answer takes, never the answer. A tiny
random model rarely repeats itself, so its drafts come from an earlier run of the same request (the
n-grams shared across requests): the second run drafts what the first answered, and acceptance,
rejection and every guarantee around them are exercised on purpose.
"""

from __future__ import annotations

import json
import math
import random

import jsonschema
import numpy as np
import pytest
import torch

from protos import generation_pb2
from tests.support.default_model import MODEL_DIR, PERSON, has_model
from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, submit_all, workload
from tests.support.tiny import hf_greedy


@pytest.fixture(scope="module")
def spec(server_factory, tiny_model_dir):
    """Drafts in every step (ngram), blocks of 4, 16 tokens a step (prompts in chunks, drafts cut to
    the budget), a pool of 40 blocks (requests wait and are preempted), prefix caching on.
    """
    return server_factory(
        tiny_model_dir,
        "--speculative",
        "ngram",
        "--block-size",
        "4",
        "--num-blocks",
        "40",
        "--max-model-len",
        "160",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "6",
    )


def drafts(server) -> tuple[int, int]:
    st = server.stats()
    return st.num_draft_tokens, st.num_accepted_draft_tokens


def test_greedy_answers_equal_transformers_with_drafts_accepted_and_rejected(spec, tiny_model_dir):
    """Concurrent requests through chunked prefill, the prefix cache and preemption, twice: the
    second run drafts from the first and accepts most drafts; both equal transformers token for
    token.
    """
    # 8 at once, each up to 30 blocks of the 40: some must wait, some be preempted
    rng = random.Random(21)
    items = [
        (
            f"spec-{i}",
            [rng.randrange(3, 384) for _ in range(rng.randint(20, 40))],
            rng.randint(60, 80),
            0.0,
        )
        for i in range(8)
    ]
    expected = {
        rid: hf_greedy(tiny_model_dir, prompt, max_tokens) for rid, prompt, max_tokens, _ in items
    }
    before = drafts(spec)
    for _ in range(2):
        results = submit_all(spec, items, stream=True)
        assert {rid: r[0] for rid, r in results.items()} == expected
        assert_all_blocks_back(spec)
    drafted, accepted = (a - b for a, b in zip(drafts(spec), before, strict=True))
    assert accepted > 0 and drafted > accepted  # accepted drafts, and rejected ones
    assert spec.stats().num_preemptions > 0


def test_a_stop_token_inside_an_accepted_draft_ends_the_answer_there(spec, tiny_model_dir):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    first = list(
        spec.stub.Generate(greedy_request(prompt, 40, "stop-a"), timeout=120).choices[0].token_ids
    )
    stop_at = next(i for i in range(8, 40) if first[i] not in first[:i])  # its first occurrence
    before = drafts(spec)
    req = greedy_request(prompt, 40, "stop-b")
    req.sampling.stop_token_ids.append(first[stop_at])
    resp = spec.stub.Generate(req, timeout=120)
    c = resp.choices[0]
    assert list(c.token_ids) == first[: stop_at + 1]
    assert c.finish_reason == generation_pb2.STOP and resp.usage.completion_tokens == stop_at + 1
    assert drafts(spec)[1] > before[1]
    # max_tokens inside a draft
    short = spec.stub.Generate(greedy_request(prompt, 9, "stop-c"), timeout=120)
    assert list(short.choices[0].token_ids) == first[:9] and short.usage.completion_tokens == 9
    assert_all_blocks_back(spec)


def test_n_samples_and_seeded_sampling_repeat_with_drafts(spec, server_factory, tiny_model_dir):
    """n = 2 greedy samples equal transformers; seeded sampled requests draw the same tokens with
    drafts as a server without speculation.
    """
    prompt = [40 + (3 * i) % 200 for i in range(13)]
    req = greedy_request(prompt, 30, "n2")
    req.sampling.n = 2
    want = hf_greedy(tiny_model_dir, prompt, 30)
    for _ in range(2):
        resp = spec.stub.Generate(req, timeout=120)
        assert [list(c.token_ids) for c in resp.choices] == [want] * 2
    off = server_factory(
        tiny_model_dir,
        "--speculative",
        "off",
        "--block-size",
        "4",
        "--num-blocks",
        "40",
        "--max-model-len",
        "160",
    )
    try:
        for seed in (1, 2):
            sampled = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=generation_pb2.SamplingParams(
                    max_tokens=30, temperature=0.8, top_k=50, seed=seed, ignore_eos=True
                ),
            )
            reference = list(off.stub.Generate(sampled, timeout=120).choices[0].token_ids)
            before = drafts(spec)
            for _ in range(2):  # the second run drafts from the first
                assert (
                    list(spec.stub.Generate(sampled, timeout=120).choices[0].token_ids) == reference
                )
            assert drafts(spec)[1] > before[1]
    finally:
        off.stop()
    assert_all_blocks_back(spec)


def test_penalized_requests_draft_and_answer_as_without_speculation(
    spec, server_factory, tiny_model_dir
):
    """A drafted position's penalties count the drafted tokens before it: repetition, presence and
    frequency penalties, greedy and sampled, answer what a server without speculation answers, with
    drafts accepted.
    """
    prompt = [30 + (7 * i) % 170 for i in range(12)]
    params = generation_pb2.SamplingParams
    requests = [
        generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=params(max_tokens=30, temperature=t, seed=9, ignore_eos=True, **penalty),
        )
        for t, penalty in (
            (0.0, dict(repetition_penalty=1.3)),
            (0.0, dict(frequency_penalty=0.7)),
            (0.8, dict(presence_penalty=0.9, repetition_penalty=1.1)),
        )
    ]
    off = server_factory(
        tiny_model_dir,
        "--speculative",
        "off",
        "--block-size",
        "4",
        "--num-blocks",
        "40",
        "--max-model-len",
        "160",
    )
    try:
        want = [list(off.stub.Generate(r, timeout=120).choices[0].token_ids) for r in requests]
    finally:
        off.stop()
    before = drafts(spec)
    for _ in range(2):  # the second run drafts from the first
        assert [
            list(spec.stub.Generate(r, timeout=120).choices[0].token_ids) for r in requests
        ] == want
    assert drafts(spec)[1] > before[1]
    assert_all_blocks_back(spec)


def test_a_request_asking_logprobs_beside_a_drafting_one_gets_them(
    spec, server_factory, tiny_model_dir
):
    """A request asking logprobs decodes one token a step (its logprobs are a one-row step's, as
    without drafts), in the same steps as a sequence that drafts: both answers and the logprobs
    equal a server without speculation's.
    """
    drafting = greedy_request([90 + i for i in range(12)], 40, "beside-drafts")
    asking = generation_pb2.GenerateRequest(
        prompt_token_ids=[17, 4, 99, 23, 8, 61],
        sampling=generation_pb2.SamplingParams(
            max_tokens=30, temperature=0, logprobs=2, ignore_eos=True
        ),
    )
    off = server_factory(
        tiny_model_dir,
        "--speculative",
        "off",
        "--block-size",
        "4",
        "--num-blocks",
        "40",
        "--max-model-len",
        "160",
    )
    try:
        want = [off.stub.Generate(r, timeout=120).choices[0] for r in (drafting, asking)]
    finally:
        off.stop()
    spec.stub.Generate(drafting, timeout=120)  # its second run drafts from this one
    before = drafts(spec)
    futures = [spec.stub.Generate.future(r, timeout=120) for r in (drafting, asking)]
    got = [f.result().choices[0] for f in futures]
    assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in want]
    assert [(t.token_id, [x.token_id for x in t.top_logprobs]) for t in got[1].logprobs] == [
        (t.token_id, [x.token_id for x in t.top_logprobs]) for t in want[1].logprobs
    ]
    # (other rows in its steps move its logits in the last digits, with or without drafts)
    values = [t.logprob for t in want[1].logprobs]
    assert [t.logprob for t in got[1].logprobs] == pytest.approx(values, abs=1e-5)
    assert drafts(spec)[1] > before[1]
    assert_all_blocks_back(spec)


def test_a_tensor_parallel_pair_verifies_drafts(server_factory, tiny_model_dir):
    tp = server_factory(
        tiny_model_dir,
        "--tensor-parallel-size",
        "2",
        "--speculative",
        "ngram",
        "--block-size",
        "4",
        "--num-blocks",
        "96",
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "32",
    )
    try:
        items = workload(4, seed=22)
        for _ in range(2):
            results = submit_all(tp, items, stream=False)
            for rid, prompt, max_tokens, _ in items:
                assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
        assert drafts(tp)[1] > 0
        assert_all_blocks_back(tp)
    finally:
        tp.stop()


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty's normal approximation)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    k = observed.size - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_accepting_a_drafted_token_draws_the_target_distribution_and_the_same_tokens():
    """The rejection rule with a point-mass draft, as acceptance runs it: over many seeds the token
    after a draft position follows the target distribution (after temperature and top-k) whatever
    was drafted, a drafted token stands as often as its probability, and each seed draws exactly the
    token it draws without a draft.
    """
    from worker.step.sampler import SamplingBatch, sample_async
    from worker.step.speculation import Drafts, accept_drafts

    vocab, n = 12, 6000
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0, -4.0])
    temperature, top_k = 0.9, 8
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    target = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=0).numpy()
    # each seed: position 0 (the drafted token's) and position 1 (after it) of one row
    rows = torch.stack([logits] * (2 * n))
    batch = SamplingBatch(
        temperature=torch.full((2 * n,), temperature),
        top_p=torch.ones(2 * n),
        top_k=torch.full((2 * n,), top_k, dtype=torch.int64),
        seeds=[s for s in range(n) for _ in range(2)],
        sample_index=[5, 6] * n,
    )
    plain = sample_async(rows, batch)  # what each seed draws at token 5 and 6 without drafts
    for drafted in (0, 3, 9):  # likely, middling, outside top-k
        d = Drafts(
            rows=torch.arange(n),
            first=torch.arange(0, 2 * n, 2),
            tokens=torch.full((n, 1), drafted, dtype=torch.int64),
            offsets=np.zeros(0, np.int32),
            table_rows=np.zeros(0, np.int64),
        )
        tokens, accepted = torch.full((n,), -1), torch.zeros(n, dtype=torch.int64)
        accept_drafts(plain, d, tokens, accepted)
        first = torch.where(accepted == 1, drafted, tokens)  # the sequence's token 5 either way
        assert torch.equal(first, plain[0::2])
        assert torch.equal(tokens[accepted == 1], plain[1::2][accepted == 1])
        counts = np.bincount(first.numpy(), minlength=vocab)[:top_k]
        assert counts.sum() == n  # nothing outside top-k
        assert chi_square_p(counts, target[:top_k] * n) > 1e-3
        assert (
            abs(accepted.float().mean().item() - target[drafted]) < 4 * math.sqrt(0.25 / n) + 1e-9
        )


@has_model
@pytest.mark.real_model
def test_structured_output_with_drafts_is_valid_and_the_same_as_without(server_factory):
    """JSON under a schema, greedy and sampled: drafts are cut to what the grammar allows, each
    drafted position gets its own mask, the matcher takes the accepted tokens in turn; the answers
    validate and equal those of a server without speculation, and drafts were accepted (the second
    run drafts the first).
    """
    flags = (
        "--kv-cache-memory",
        "128MiB",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        "256",
    )
    on = server_factory(MODEL_DIR, "--speculative", "ngram", *flags)
    off = server_factory(MODEL_DIR, "--speculative", "off", *flags)
    try:
        for temperature, seed in ((0.0, 0), (0.9, 5)):
            req = generation_pb2.GenerateRequest(
                prompt="Describe a person as JSON.",
                sampling=generation_pb2.SamplingParams(
                    max_tokens=120,
                    temperature=temperature,
                    seed=seed,
                    json_schema=json.dumps(PERSON),
                ),
            )
            want = off.stub.Generate(req, timeout=180).choices[0]
            before = drafts(on)
            for _ in range(2):
                got = on.stub.Generate(req, timeout=180).choices[0]
                assert (list(got.token_ids), got.finish_reason) == (
                    list(want.token_ids),
                    want.finish_reason,
                )
                assert got.finish_reason == generation_pb2.STOP
                jsonschema.validate(json.loads(got.text), PERSON)
            assert drafts(on)[1] > before[1]
        assert_all_blocks_back(on)
    finally:
        on.stop()
        off.stop()
