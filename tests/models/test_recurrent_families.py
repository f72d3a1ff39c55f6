"""Every family that keeps a recurrent state beside (or instead of) the paged KV, served on the one
state pool: a tiny random instance of each (every layer kind it mixes) equal to transformers token
for token while twelve requests share a small pool (prompts in chunks carrying the state,
preemptions giving it up and recomputing), n = 2 samples each holding its own state, and a
returning conversation resuming from a state snapshot, reported as cached prompt tokens.
"""

from __future__ import annotations

import random

import pytest

from tests.support.families import RECURRENT
from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import (
    hf_greedy,
    hf_recompute_greedy,
    make_tiny_llama,
    randomize_buffers,
)

pytestmark = pytest.mark.slow

FAMILIES = RECURRENT
# the routers' biases to choose experts by (saved as zeros): given values, so reading them counts
CHOICE_BIASES = ("e_score_correction_bias", "expert_bias")
# transformers floors Nemotron-H's Mamba2 step sizes in prompts but not in cached decode steps, so
# its cached greedy disagrees with its own recompute; served, they are floored in both, and the
# reference is the recompute
RECOMPUTED = {"nemotron_h"}


def reference(name: str):
    return hf_recompute_greedy if name in RECOMPUTED else hf_greedy


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, server_factory):
    name = request.param
    folder = make_tiny_llama(tmp_path_factory.mktemp(name), seed=3, family=name, **FAMILIES[name])
    randomize_buffers(folder, CHOICE_BIASES)
    # blocks of 4, 16 tokens a step, 6 sequences, 48 blocks: 12 requests of 40 + 32 tokens
    # cannot all run at once
    server = server_factory(
        folder,
        *("--block-size", "4", "--num-blocks", "48", "--max-num-batched-tokens", "16"),
        *("--max-num-seqs", "6", "--max-model-len", "128", "--metrics-port", "-1"),
    )
    return name, folder, server


def test_twelve_requests_on_a_small_pool_equal_transformers(family):
    name, folder, server = family
    rng = random.Random(5)
    items = [
        (f"{name}-{i}", [rng.randrange(3, 384) for _ in range(40)], 32, 0.0) for i in range(12)
    ]
    before = server.stats()
    results = submit_all(server, items, stream=True)
    for rid, prompt, n, _ in items:
        assert results[rid][0] == reference(name)(folder, prompt, n), rid
    after = server.stats()
    assert after.num_preemptions > before.num_preemptions
    assert after.num_state_slots > 0 and after.num_used_state_slots == 0
    assert_all_blocks_back(server)


def test_two_samples_each_keep_their_own_state(family):
    name, folder, server = family
    prompt = [5 + (7 * i) % 300 for i in range(21)]
    req = greedy_request(prompt, 24, f"{name}-n")
    req.sampling.n = 2
    resp = server.stub.Generate(req, timeout=120)
    assert [list(c.token_ids) for c in resp.choices] == [reference(name)(folder, prompt, 24)] * 2
    assert_all_blocks_back(server)


def test_a_returning_conversation_resumes_from_a_snapshot(family):
    name, folder, server = family

    def turn(prompt, rid):
        resp = server.stub.Generate(greedy_request(prompt, 12, rid), timeout=120)
        assert list(resp.choices[0].token_ids) == reference(name)(folder, prompt, 12), rid
        return list(resp.choices[0].token_ids), resp.usage.cached_prompt_tokens

    prompt = [7 + (5 * i) % 300 for i in range(33)]
    answer, cached = turn(prompt, f"{name}-turn-1")
    assert cached == 0
    # the first turn computed 33 + 11 tokens: the snapshot its decode took after 44
    _, cached = turn(prompt + answer + [11, 12, 13, 14, 15], f"{name}-turn-2")
    assert cached == 44
    assert_all_blocks_back(server)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_split_over_two_ranks_equals_transformers(tmp_path, server_factory, name):
    """Each rank takes its heads' or channels' rows (out of Qwen3-Next's per-key-head fused
    projections too; a Mamba2 mixer's heads with their B/C groups), half of every expert, and its
    share of every state."""
    folder = make_tiny_llama(tmp_path, seed=4, family=name, **FAMILIES[name])
    randomize_buffers(folder, CHOICE_BIASES)
    server = server_factory(
        folder,
        *("--tensor-parallel-size", "2", "--block-size", "4", "--max-num-batched-tokens", "16"),
        *("--max-model-len", "128", "--metrics-port", "-1"),
    )
    try:
        rng = random.Random(8)
        items = [(f"tp-{i}", [rng.randrange(3, 384) for _ in range(40)], 24, 0.0) for i in range(3)]
        results = submit_all(server, items, stream=True)
        for rid, prompt, n, _ in items:
            assert results[rid][0] == reference(name)(folder, prompt, n), rid
        assert_all_blocks_back(server)
    finally:
        server.stop()


def test_its_logprobs_are_transformers_log_softmax(family):
    """The whole distribution, not only its argmax: each generated token's logprob equals
    transformers' log-softmax of its logits (Granite's logit scaling included)."""
    import torch

    from tests.support.tiny import load_hf_cached

    name, folder, server = family
    prompt = [9 + (3 * i) % 300 for i in range(17)]
    req = greedy_request(prompt, 4, f"{name}-lp")
    req.sampling.logprobs = 1
    resp = server.stub.Generate(req, timeout=120)
    choice = resp.choices[0]
    tokens = list(choice.token_ids)
    with torch.no_grad():
        logits = load_hf_cached(str(folder))(torch.tensor([prompt + tokens])).logits[0]
    want = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
    got = [entry.logprob for entry in choice.logprobs]
    assert len(got) == len(tokens)
    for i, token in enumerate(tokens):
        assert abs(got[i] - float(want[i, token])) < 2e-3, (i, got[i], float(want[i, token]))
