"""The attention families of late 2026, served: a tiny random instance of each (every layer kind
it mixes, windows short enough that prompts outrun them) greedy-equal to transformers for 16
tokens past three prompts given as token ids, on one rank and split over two.
"""

from __future__ import annotations

import pytest

from tests.support.families import ATTENTION
from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import hf_greedy, make_tiny_llama, randomize_buffers

pytestmark = pytest.mark.slow

FAMILIES = ATTENTION
RANDOMIZED = ("e_score_correction_bias", "layer_scalar", "per_expert_scale", "router.scale")
PROMPTS = [[3 + (11 * i) % 370 for i in range(n)] for n in (5, 23, 61)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    name = request.param
    folder = make_tiny_llama(tmp_path_factory.mktemp(name), seed=7, family=name, **FAMILIES[name])
    for suffix in RANDOMIZED:
        randomize_buffers(folder, suffix)
    return folder


@pytest.mark.parametrize("ranks", [1, 2])
def test_three_prompts_equal_transformers(folder, server_factory, ranks):
    server = server_factory(
        folder,
        *("--tensor-parallel-size", str(ranks), "--block-size", "4"),
        *("--max-num-batched-tokens", "32", "--max-model-len", "128", "--metrics-port", "-1"),
    )
    try:
        items = [(f"p-{i}", prompt, 16, 0.0) for i, prompt in enumerate(PROMPTS)]
        results = submit_all(server, items, stream=True)
        for rid, prompt, n, _ in items:
            assert results[rid][0] == hf_greedy(folder, prompt, n), rid
        assert_all_blocks_back(server)
    finally:
        server.stop()


def test_a_gemma4_multimodal_folder_is_served_as_text(tmp_path, server_factory):
    """Gemma 4 as it ships (`Gemma4ForConditionalGeneration`: the language model under
    `model.language_model.`, a vision tower and its embedder beside it): the same tokens as the
    model itself gives, the tower unread (one log line); the two layers that read earlier layers'
    K/V hold none, and the worker says what that saves (2 of 6 layers' K/V: a third).
    """
    import json

    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.support.tiny import TINY, make_tokenizer, recompute_greedy

    text = dict(TINY, rms_norm_eps=1e-5, tie_word_embeddings=True, **FAMILIES["gemma4_text"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(5)
    model = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, vision_config=dict(vision, num_key_value_heads=2))
    ).eval()
    model.save_pretrained(str(tmp_path))
    make_tokenizer(tmp_path, TINY["vocab_size"])
    prompt = PROMPTS[2]
    want = recompute_greedy(model, prompt, 12)
    server = server_factory(tmp_path, "--max-model-len", "128", "--metrics-port", "-1")
    try:
        results = submit_all(server, [("mm", prompt, 12, 0.0)], stream=False)
        assert results["mm"][0] == want
        events = [json.loads(x) for x in server.log_path.read_text().splitlines() if x[:1] == "{"]
        by_name = {e.get("event"): e for e in events}
        assert by_name["text_only"]["skipped_tensors"] > 0
        shared = by_name["kv_shared_layers"]
        assert (shared["reading_earlier"], shared["saved_fraction"]) == (2, 0.333)
        assert_all_blocks_back(server)
    finally:
        server.stop()
