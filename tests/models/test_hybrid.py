"""A hybrid model served end to end: a tiny random Qwen3.5 (three Gated DeltaNet layers to one gated
attention layer), equal to transformers token for token while prompts go in chunks, requests are
preempted and recomputed, and samples run side by side; each running sequence holds one slot of
the recurrent-state pool, given back with its blocks, and prompts resume from state snapshots.
"""

from __future__ import annotations

import random

import pytest

from protos import generation_pb2
from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import hf_greedy, make_tiny_llama

pytestmark = pytest.mark.slow

QWEN3_5 = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, server_factory):
    folder = make_tiny_llama(
        tmp_path_factory.mktemp("qwen3_5"), seed=3, family="qwen3_5_text", **QWEN3_5
    )
    # blocks of 4, 16 tokens a step (prompts go in chunks that carry the state across), 6 slots,
    # a pool of 48 blocks: 12 requests of 40 + 48 tokens cannot all run at once
    server = server_factory(
        folder,
        "--block-size",
        "4",
        "--num-blocks",
        "48",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "6",
        "--max-model-len",
        "128",
        "--metrics-port",
        "-1",
    )
    return folder, server


def test_the_worker_reads_which_layers_keep_state(hybrid):
    from worker.model.config import ModelConfig

    config = ModelConfig.from_folder(hybrid[0])
    assert config.linear_layers == (True, True, True, False)
    assert config.num_kv_layers == 1 and config.conv_dim == 2 * 2 * 16 + 4 * 16
    assert config.rotary_dim == 4  # a quarter of each 16-value head


def test_twelve_requests_at_once_equal_transformers_through_chunks_and_preemption(hybrid):
    folder, server = hybrid
    rng = random.Random(5)
    items = [(f"hy-{i}", [rng.randrange(3, 384) for _ in range(40)], 48, 0.0) for i in range(12)]
    expected = {rid: hf_greedy(folder, prompt, n) for rid, prompt, n, _ in items}
    before = server.stats()
    results = submit_all(server, items, stream=True)
    assert {rid: r[0] for rid, r in results.items()} == expected
    after = server.stats()
    assert after.num_preemptions > before.num_preemptions
    assert_all_blocks_back(server)
    # six running, six snapshots
    assert (after.num_state_slots, after.num_used_state_slots) == (12, 0)
    assert after.bytes_per_state_slot == 3 * (4 * 16 * 16 * 4 + 3 * 128 * 4)


def test_a_returning_conversation_resumes_from_a_state_snapshot_and_stays_equal(hybrid):
    """The state after a prompt's last full block is kept with the block, and the state where
    its answer last ended a block: the next turn (the prompt, its answer and more) resumes after
    the answer, the same prompt again after its last full block, reported as cached; a prompt that
    leaves the cached one mid-way recomputes, snapshotting where it left it, so the next one
    sharing that much resumes there. Snapshots fall inside 16-token chunks.
    """
    folder, server = hybrid

    def turn(prompt, rid, cached):
        resp = server.stub.Generate(greedy_request(prompt, 12, rid), timeout=120)
        assert list(resp.choices[0].token_ids) == hf_greedy(folder, prompt, 12), rid
        assert resp.usage.cached_prompt_tokens == cached, rid
        return list(resp.choices[0].token_ids)

    prompt = [7 + (5 * i) % 300 for i in range(33)]
    answer = turn(prompt, "hy-turn-1", 0)
    before = server.stats()
    # 33 + 11 tokens computed in the first turn: its decode's snapshot after 44
    turn(prompt + answer + [11, 12, 13, 14, 15, 16, 17], "hy-turn-2", 44)
    turn(prompt, "hy-again", 32)
    after = server.stats()
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 8 + 1
    assert after.num_state_snapshots >= 2
    turn(prompt[:22] + [40, 41, 42, 43, 44, 45], "hy-branch", 0)
    turn(prompt[:22] + [50, 51, 52, 53, 54], "hy-branch-2", 20)
    assert_all_blocks_back(server)


def test_its_snapshots_go_down_to_the_kv_tiers_and_survive_a_restart(
    hybrid, server_factory, tmp_path
):
    """Three documents on a pool too small for two of them and two state slots: each returning
    turn reads its document's blocks and the state after them back from the host tier; after a
    restart, from the disk tier; equal to transformers all the way.
    """
    folder, _ = hybrid
    disk = tmp_path / "kv"
    flags = ("--block-size", "4", "--num-blocks", "16", "--max-model-len", "64")
    flags += ("--max-num-seqs", "2", "--state-snapshots", "0", "--metrics-port", "-1")
    flags += ("--kv-offload-size", "2MiB", "--kv-offload-dir", str(disk))
    rng = random.Random(9)
    docs = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(3)]

    def turns(server, t):
        for d, doc in enumerate(docs):
            prompt = doc + [380 + t] * (t + 1)
            resp = server.stub.Generate(greedy_request(prompt, 6, f"hy-tier-{t}-{d}"), timeout=120)
            assert list(resp.choices[0].token_ids) == hf_greedy(folder, prompt, 6)
            assert resp.usage.cached_prompt_tokens == (40 if t else 0), (t, d)
        assert_all_blocks_back(server)

    first = server_factory(folder, *flags)
    try:
        turns(first, 0)
        turns(first, 1)
        stats = first.stats()
        assert stats.host_tier_loaded > 0 and stats.host_tier_snapshots > 0
        assert stats.disk_tier_snapshots >= 3 and stats.kv_load_failures == 0
    finally:
        first.stop()
    assert len(list(disk.rglob("*.st"))) >= 3 and len(list(disk.rglob("*.kv"))) >= 30
    again = server_factory(folder, *flags)
    try:
        turns(again, 2)
        assert again.stats().disk_tier_loaded >= 30
    finally:
        again.stop()


def test_by_default_its_running_sequences_fit_the_state_within_half_the_pool(
    hybrid, server_factory
):
    """Without --max-num-seqs, a model whose state slots are large runs fewer sequences at once
    (the state within half the KV budget) rather than being refused at start.
    """
    folder, _ = hybrid
    per_slot = 3 * (4 * 16 * 16 * 4 + 3 * 128 * 4)
    server = server_factory(folder, "--kv-cache-memory", "1MiB", "--max-model-len", "64")
    try:
        stats = server.stats()
        live = (1 << 20) // 2 // per_slot // 2
        assert stats.num_state_slots == 2 * live and live < 32
        prompt = [5 + (3 * i) % 300 for i in range(20)]
        resp = server.stub.Generate(greedy_request(prompt, 8, "hy-fit"), timeout=120)
        assert list(resp.choices[0].token_ids) == hf_greedy(folder, prompt, 8)
    finally:
        server.stop()


def test_n_samples_each_keep_their_own_state(hybrid):
    folder, server = hybrid
    prompt = [5 + (7 * i) % 300 for i in range(21)]
    req = greedy_request(prompt, 36, "hy-n")
    req.sampling.n = 3
    resp = server.stub.Generate(req, timeout=120)
    want = hf_greedy(folder, prompt, 36)
    assert [list(c.token_ids) for c in resp.choices] == [want] * 3
    assert all(c.finish_reason == generation_pb2.LENGTH for c in resp.choices)
    assert_all_blocks_back(server)


def test_a_tensor_parallel_pair_splits_the_delta_net_heads_and_equals_transformers(
    hybrid, server_factory
):
    """Each rank holds half the key and value heads of every Gated DeltaNet layer (their conv
    channels, decays and state slots) and half the attention heads; out_proj sums over ranks.
    """
    folder, _ = hybrid
    tp = tp_pair(server_factory, folder, "16", "--state-snapshots", "0", "--no-prefix-caching")
    try:
        results = equal_at_once(tp, folder, "hy-tp", 3, 24, seed=8)
        stats = tp.stats()
        assert stats.bytes_per_state_slot == 3 * (4 * 16 * 16 * 4 + 3 * 128 * 4)  # both halves
        # no prefix cache: a returning prompt is computed again, no snapshot is taken
        prompt = results["hy-tp-0"][1]
        again = tp.stub.Generate(greedy_request(prompt, 24, "hy-tp-again"), timeout=120)
        assert list(again.choices[0].token_ids) == results["hy-tp-0"][0]
        assert again.usage.cached_prompt_tokens == 0 and tp.stats().num_state_snapshots == 0
        assert_all_blocks_back(tp)
    finally:
        tp.stop()


def test_a_multimodal_folder_is_served_as_text(tmp_path, server_factory):
    """Qwen3.5 as it ships (`Qwen3_5ForConditionalGeneration`: the language model under
    `model.language_model.`, a vision tower beside it): its text served, the tower not loaded.
    """
    import torch
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    from tests.support.tiny import TINY, make_tokenizer, recompute_greedy

    text = dict(TINY, rms_norm_eps=1e-5, tie_word_embeddings=False, **QWEN3_5)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(4)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision)
    ).eval()
    model.save_pretrained(str(tmp_path))
    make_tokenizer(tmp_path, TINY["vocab_size"])
    prompt = [9 + (13 * i) % 350 for i in range(40)]
    want = recompute_greedy(model, prompt, 12)
    server = server_factory(tmp_path, "--max-model-len", "128", "--metrics-port", "-1")
    try:
        resp = server.stub.Generate(greedy_request(prompt, 12, "hy-vl"), timeout=120)
        assert list(resp.choices[0].token_ids) == want
        assert "text_only" in server.log_path.read_text()
    finally:
        server.stop()


def test_the_moe_sibling_routes_experts_beside_a_gated_shared_expert(tmp_path, server_factory):
    """Qwen3.5's MoE (`qwen3_5_moe_text`): every layer's MLP is four routed experts (two a token,
    renormalized) plus a shared expert scaled by a per-token sigmoid gate; equal to transformers
    over 48 tokens past 40-token prompts, four at once, split over two ranks (each holding a
    slice of every expert and of the shared one).
    """
    folder = make_tiny_llama(
        tmp_path,
        seed=6,
        family="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **QWEN3_5,
    )
    server = tp_pair(server_factory, folder, "32")
    try:
        equal_at_once(server, folder, "hy-moe", 4, 48, seed=9)
        assert_all_blocks_back(server)
    finally:
        server.stop()


def tp_pair(server_factory, folder, step_tokens: str, *flags):
    """A tensor-parallel pair on folder: blocks of 4, step_tokens a step, a 128-token context."""
    return server_factory(
        folder,
        "--tensor-parallel-size",
        "2",
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        step_tokens,
        "--max-model-len",
        "128",
        "--metrics-port",
        "-1",
        *flags,
    )


def equal_at_once(server, folder, prefix: str, count: int, new_tokens: int, seed: int) -> dict:
    """count random 40-token prompts at once, each answer equal to transformers'; -> {request id:
    (tokens, prompt)}.
    """
    rng = random.Random(seed)
    items = [
        (f"{prefix}-{i}", [rng.randrange(3, 384) for _ in range(40)], new_tokens, 0.0)
        for i in range(count)
    ]
    results = submit_all(server, items, stream=True)
    for rid, prompt, n, _ in items:
        assert results[rid][0] == hf_greedy(folder, prompt, n), rid
    return {rid: (results[rid][0], prompt) for rid, prompt, _, _ in items}


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_a_qwen35_gguf_is_read_on_its_own_blocks_and_equals_transformers(
    tmp_path, server_factory, family
):
    """A file as llama.cpp's converter writes it (tests/support/qwen35_gguf.py: the layout checked
    against convert_hf_to_gguf.py --no-mtp of llama-cpp-python 0.3.36): its config read from the
    header, norms and A put back, value heads read in their tiled order; equal to transformers on
    the weights the file holds, through chunks and a returning prompt's snapshot.
    """
    from tests.support.qwen35_gguf import make_qwen35_gguf

    moe = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    shape = {**QWEN3_5, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    served, ref = make_qwen35_gguf(
        tmp_path, family, seed=12, **shape, **(moe if "moe" in family else {})
    )
    server = server_factory(
        served, "--block-size", "4", "--max-num-batched-tokens", "16", "--metrics-port", "-1"
    )
    try:
        # every projection on its blocks: each layer's four (the gated attention's query and gate
        # rows taken head by head), and the LM head (the MoE's: its shared expert's gate/up, whose
        # down is F32, 48 columns wide, and each of its 4 experts' gate/up and down in 4 layers)
        blocks = 13 + 4 * 2 * 4 if "moe" in family else 17
        assert f'"matrices": {{"Q8_0": {blocks}' in server.log_path.read_text()
        rng = random.Random(13)
        prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(2)]
        for i, prompt in enumerate(prompts + prompts[:1]):
            resp = server.stub.Generate(greedy_request(prompt, 48, f"gguf-{i}"), timeout=120)
            assert list(resp.choices[0].token_ids) == hf_greedy(ref, prompt, 48), i
        assert resp.usage.cached_prompt_tokens == 36  # the returning prompt's snapshot
        with pytest.raises(RuntimeError, match="--tp 1"):
            server_factory(served, "--tp", "2", "--metrics-port", "-1")
    finally:
        server.stop()
