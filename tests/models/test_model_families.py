"""Model families beyond Llama served end to end, each equal to transformers token for token: tiny
random models of the family made here, a server that chunks prompts, caches prefixes, preempts and
verifies drafts, and generations long enough to cross the family's sliding window several times.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos import generation_pb2
from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, run_stream, submit_all
from tests.support.tiny import hf_greedy, make_tiny_llama

pytestmark = pytest.mark.slow

# family -> (config fields, each layer's window as the worker must read it, extra server flags)
FAMILIES = {
    # every layer slides over 12 keys: blocks behind the window go back as a sequence advances (full
    # ones into the prefix cache, which a pool of 200 keeps for the second round)
    "mistral": (dict(sliding_window=12), (12, 12, 12), ("--num-blocks", "200")),
    # Phi-3: q/k/v and gate/up each one tensor in the checkpoint (split per rank under tensor
    # parallelism), every layer sliding as Mistral's, three quarters of each head rotated
    # (Phi-4-mini's factor)
    "phi3": (
        dict(sliding_window=12, pad_token_id=0, partial_rotary_factor=0.75),
        (12, 12, 12),
        ("--num-blocks", "200"),
    ),
    # Gemma 3: sliding and global layers alternating (pattern 2 here), each kind with its own RoPE,
    # GeGLU, (1 + w) norms around attention and MLP, scaled embeddings, query_pre_attn_scalar,
    # soft-capped logits
    "gemma3_text": (
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=10,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            final_logit_softcapping=30.0,
            pad_token_id=0,
            hidden_activation="gelu_pytorch_tanh",
        ),
        (10, 0, 10),
        ("--num-blocks", "36", "--max-model-len", "128"),
    ),
    # Gemma 2: Gemma 3's norms, GeGLU and scalings without q/k norm, sliding and global layers
    # alternating over one RoPE, attention scores soft-capped (at 5: scores of several units bend)
    # and final logits too
    "gemma2": (
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=10,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            pad_token_id=0,
            hidden_activation="gelu_pytorch_tanh",
        ),
        (10, 0, 10),
        ("--num-blocks", "36", "--max-model-len", "128"),
    ),
    # Qwen2's default layout: layers from max_window_layers on slide (here 1 and 2), layer 0 reads
    # everything (every block is kept, so the context must fit the pool)
    "qwen2": (
        dict(use_sliding_window=True, sliding_window=10, max_window_layers=1),
        (0, 10, 10),
        ("--num-blocks", "36", "--max-model-len", "128"),
    ),
    # Mixtral: Mistral's window on every layer (blocks behind it go back) and every MLP 6 experts, 2
    # a token
    "mixtral": (
        dict(sliding_window=12, num_local_experts=6, num_experts_per_tok=2, intermediate_size=48),
        (12, 12, 12),
        ("--num-blocks", "200"),
    ),
    # Qwen3: per-head q/k norm; its last layer slides (layer_types), the others read everything
    "qwen3": (
        dict(
            use_sliding_window=True,
            sliding_window=10,
            layer_types=["full_attention", "full_attention", "sliding_attention"],
        ),
        (0, 0, 10),
        ("--num-blocks", "36", "--max-model-len", "128"),
    ),
    # Qwen3-MoE: 8 experts, 2 a token (renormalized), layer 1 a dense MLP (mlp_only_layers); no
    # window
    "qwen3_moe": (
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        (0, 0, 0),
        ("--num-blocks", "36", "--max-model-len", "128"),
    ),
    # gpt-oss: attention sinks, sliding and full layers alternating past a 16-token window, biases
    # on q/k/v/o, the router and the experts, 8 experts (2 a token) through its clamped SwiGLU,
    # YaRN x32 (its own defaults)
    "gpt_oss": (
        dict(
            sliding_window=16,
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
        ),
        (16, 0, 16, 0),
        ("--num-blocks", "48", "--max-model-len", "128"),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, server_factory):
    name = request.param
    fields, windows, flags = FAMILIES[name]
    folder = make_tiny_llama(tmp_path_factory.mktemp(f"tiny-{name}"), seed=3, family=name, **fields)
    # blocks of 4, 16 tokens a step (prompts go in chunks), a pool too small for all requests at
    # once (they wait, and are preempted), prefix caching on, drafts verified in every step
    server = server_factory(
        folder,
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "8",
        "--metrics-port",
        "-1",
        "--speculative",
        "ngram",
        *flags,
    )
    return name, folder, windows, server


def workload(seed: int, n: int = 8) -> list[tuple[str, list[int], int, float]]:
    """Prompts sharing prefixes (the cache), 20-50 tokens, then 30-45 generated: every sequence
    outgrows the windows several times over.
    """
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 384) for _ in range(rng.randint(16, 30))] for _ in range(2)]
    return [
        (
            f"fam-{seed}-{i}",
            rng.choice(prefixes) + [rng.randrange(3, 384) for _ in range(rng.randint(4, 20))],
            rng.randint(30, 45),
            rng.uniform(0, 0.3),
        )
        for i in range(n)
    ]


def test_the_worker_reads_each_layers_window(family):
    from worker.model.config import ModelConfig

    name, folder, windows, _ = family
    config = ModelConfig.from_folder(folder)
    assert config.layer_windows == (windows if any(windows) else ())
    assert config.max_position_embeddings == 512  # the declared context: no cap at the window


def test_greedy_outputs_equal_transformers_across_windows_chunks_cache_and_preemption(family):
    name, folder, _, server = family
    # every greedy choice at least 2.7e-3 ahead of the next (no near-ties)
    items = workload(seed=11)
    expected = {rid: hf_greedy(folder, prompt, max_tokens) for rid, prompt, max_tokens, _ in items}
    before = server.stats()
    # the first round all at once: the pool cannot hold them together, whatever the host's speed
    # (at their delays a fast host finished the first before the last arrived: no preemption);
    # the second at the workload's delays finds the shared prefixes cached, drafts the first's
    # answers
    for batch in ([(rid, p, n, 0.0) for rid, p, n, _ in items], items):
        results = submit_all(server, batch, stream=True)
        assert {rid: r[0] for rid, r in results.items()} == expected
        assert_all_blocks_back(server)
    after = server.stats()
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert after.num_accepted_draft_tokens > before.num_accepted_draft_tokens
    # every block kept: the pool is too small for all of them at once
    if not all(FAMILIES[name][1]):
        assert after.num_preemptions > before.num_preemptions


def test_preempted_sliding_window_sequences_recompute_the_same_tokens(family, server_factory):
    """Where every layer slides, a decoding sequence gives a block back for each it takes, so it
    never grows and nobody is preempted for it; a sequence with a repetition penalty keeps every
    block (the penalty reads its whole context), grows, and in a 24-block pool gets others
    preempted. Every output equals transformers', penalized ones with transformers' own penalty.
    """
    name, folder, windows, _ = family
    if not all(windows):
        pytest.skip("covered by the shared server's pool above")
    tight = server_factory(
        folder,
        "--block-size",
        "4",
        "--num-blocks",
        "24",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "96",
        "--no-prefix-caching",
        "--metrics-port",
        "-1",
    )
    try:
        items = workload(seed=13)

        def one(k):
            rid, prompt, max_tokens, _ = items[k]
            req = greedy_request(prompt, max_tokens, rid)
            if k % 2:
                req.sampling.repetition_penalty = 1.3
            return run_stream(tight.stub, req)[0][0]

        with ThreadPoolExecutor(len(items)) as pool:
            got = list(pool.map(one, range(len(items))))
        for k, (rid, prompt, max_tokens, _) in enumerate(items):
            assert got[k] == hf_greedy(folder, prompt, max_tokens, 1.3 if k % 2 else 1.0), rid
        assert tight.stats().num_preemptions > 0
        assert_all_blocks_back(tight)
    finally:
        tight.stop()


def test_n_greedy_samples_all_equal_transformers(family):
    name, folder, _, server = family
    prompt = [5 + (7 * i) % 300 for i in range(21)]
    req = greedy_request(prompt, 36, f"fam-n-{name}")
    req.sampling.n = 2
    resp = server.stub.Generate(req, timeout=120)
    want = hf_greedy(folder, prompt, 36)
    assert [list(c.token_ids) for c in resp.choices] == [want] * 2
    assert all(c.finish_reason == generation_pb2.LENGTH for c in resp.choices)
    assert_all_blocks_back(server)


def test_a_sliding_window_model_serves_sequences_longer_than_its_pool(family, server_factory):
    """Every layer sliding: a 200-token prompt and 200 more tokens through a pool of 80 token slots
    (the model's context is 512), equal to transformers; the blocks behind the window went back to
    the pool as it advanced.
    """
    name, folder, windows, _ = family
    if not all(windows):
        pytest.skip("a layer reads the whole context: every block is kept")
    small = server_factory(
        folder,
        "--block-size",
        "4",
        "--num-blocks",
        "20",
        "--max-num-batched-tokens",
        "16",
        "--metrics-port",
        "-1",
    )
    try:
        prompt = [3 + (11 * i) % 380 for i in range(200)]
        resp = small.stub.Generate(greedy_request(prompt, 200, f"fam-long-{name}"), timeout=300)
        assert list(resp.choices[0].token_ids) == hf_greedy(folder, prompt, 200)
        assert_all_blocks_back(small)
    finally:
        small.stop()


def test_a_tensor_parallel_pair_equals_transformers(family, server_factory):
    name, folder, _, _ = family
    tp = server_factory(
        folder,
        "--tensor-parallel-size",
        "2",
        "--block-size",
        "4",
        "--num-blocks",
        "160",
        "--max-num-batched-tokens",
        "16",
        "--max-model-len",
        "128",
        "--metrics-port",
        "-1",
    )
    try:
        items = workload(seed=14, n=4)  # no near-ties: TP sums in another order
        results = submit_all(tp, items, stream=True)
        for rid, prompt, max_tokens, _ in items:
            assert results[rid][0] == hf_greedy(folder, prompt, max_tokens), rid
        assert_all_blocks_back(tp)
    finally:
        tp.stop()
