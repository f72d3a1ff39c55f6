"""The attention families of late 2026, served: a tiny random instance of each (every layer kind
it mixes, windows short enough that prompts outrun them) greedy-equal to transformers for 16
tokens past three prompts given as token ids, on one rank and split over two.
"""

from __future__ import annotations

import pytest

from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import hf_greedy, make_tiny_llama, randomize_buffers

pytestmark = pytest.mark.slow

FAMILIES = {
    # q/k RMSNorm over the whole projection, norms after attention and MLP only, 3 sliding : 1 full
    # with a RoPE set each
    "olmo3": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # whole-projection q/k norm, partial RoPE, every MLP experts chosen by sigmoid score plus a
    # correction bias
    "minimax_m2": dict(
        num_hidden_layers=3,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        rotary_dim=8,
    ),
}
PROMPTS = [[3 + (11 * i) % 370 for i in range(n)] for n in (5, 23, 61)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    name = request.param
    folder = make_tiny_llama(tmp_path_factory.mktemp(name), seed=7, family=name, **FAMILIES[name])
    randomize_buffers(folder, "e_score_correction_bias")
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
