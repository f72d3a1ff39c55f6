"""gpt-oss from its GGUF as llama.cpp ships it after `llama-quantize ... MXFP4_MOE`: the experts
served on their MXFP4 blocks (never dense), sinks, biases and the clamped SwiGLU read from the
file's own tensors, greedy-equal to transformers on the file's values.
"""

from __future__ import annotations

import json

import pytest

from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import hf_greedy, make_tiny_gpt_oss_gguf

pytestmark = pytest.mark.slow

# 2 sliding + 2 full layers past a 16-token window, 8 experts (2 a token)
SHAPE = dict(
    sliding_window=16,
    num_hidden_layers=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
)


# blocks of 4 in a pool of 384 tokens, as the family tests serve them
FLAGS = (
    "--block-size",
    "4",
    "--num-blocks",
    "96",
    "--max-model-len",
    "128",
    "--metrics-port",
    "-1",
)


# prompts on the fp32 copy: where the CPU has AMX, auto takes a bf16 one, whose rounding
# moves these random weights' near-equal logits (every other CPU takes the fp32 copy at this size)
FP32_PROMPTS = ("--quantized-prefill", "dense")


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    return make_tiny_gpt_oss_gguf(tmp_path_factory.mktemp("gpt-oss-gguf"), seed=3, **SHAPE)


def test_an_mxfp4_gguf_is_served_on_its_blocks_as_transformers_answers(gguf_folder, server_factory):
    server = server_factory(gguf_folder, *FLAGS, *FP32_PROMPTS, "--max-num-batched-tokens", "16")
    try:
        log = server.log_path.read_text()
        line = next(x for x in log.splitlines() if '"quantized_weights"' in x)
        matrices = json.loads(line)["matrices"]
        # every expert's gate/up and down on MXFP4 blocks; attention on Q8_0
        assert matrices.get("MXFP4") == 2 * 8 * 4 and matrices.get("Q8_0") == 2 * 4
        # prompts whose every greedy choice leads the runner-up by >= 0.012 (the first prompts
        # held a 0.0017 tie at the 43rd token that 8-bit activations took either way by CPU)
        items = [
            (f"oss-{i}", [8 + (13 * i + 7 * j) % 380 for j in range(18 + 9 * i)], 48, 0.0)
            for i in range(3)
        ]
        results = submit_all(server, items, stream=True)
        for rid, prompt, max_tokens, _ in items:
            margins: list[float] = []
            expected = hf_greedy(gguf_folder, prompt, max_tokens, margins=margins)
            assert results[rid][0] == expected, rid
            assert min(margins) >= 0.012, rid
        # two choices decoded side by side: the same tokens as alone
        n = greedy_request(items[0][1], 48, "oss-n")
        n.sampling.n = 2
        resp = server.stub.Generate(n, timeout=120)
        assert [list(c.token_ids) for c in resp.choices] == [results["oss-0"][0]] * 2
        assert_all_blocks_back(server)
    finally:
        server.stop()


def test_an_mxfp4_checkpoint_is_served_as_it_ships(tmp_path, server_factory):
    """openai/gpt-oss-20b's layout: experts as `*_blocks` and `*_scales`, quantization_config
    mxfp4. On a CPU they are served as MXFP4 blocks; with --dequantize (as on a GPU) widened to
    fp32; both greedy-equal to transformers on the dequantized values.
    """
    from tests.support.tiny import make_tiny_gpt_oss_mxfp4

    served, reference = make_tiny_gpt_oss_mxfp4(tmp_path, seed=5, **SHAPE)
    items = [
        (f"mx-{i}", [5 + (11 * i + 3 * j) % 370 for j in range(20 + 7 * i)], 48, 0.0)
        for i in range(2)
    ]
    want = {rid: hf_greedy(reference, prompt, n) for rid, prompt, n, _ in items}
    for extra in (FP32_PROMPTS, ("--dequantize",)):
        server = server_factory(served, *FLAGS, *extra)
        try:
            log = server.log_path.read_text()
            if extra == FP32_PROMPTS:
                line = next(x for x in log.splitlines() if '"quantized_weights"' in x)
                assert json.loads(line)["matrices"]["MXFP4"] == 2 * 8 * 4
            else:
                assert '"quantized_weights"' not in log
            results = submit_all(server, items, stream=True)
            assert {rid: r[0] for rid, r in results.items()} == want, extra
            assert_all_blocks_back(server)
        finally:
            server.stop()


def test_a_gpt_oss_files_header_gives_the_models_config(gguf_folder):
    """transformers' GGUF reader fails on gpt-oss's rope-scaling keys; the header is read here, as
    llama.cpp's converter writes it, into the config the checkpoint has (YaRN truncated as llama.cpp
    rotates).
    """
    from worker.model.config import ModelConfig
    from worker.weights.gguf_header import GGUFHeader, gpt_oss_config

    header = GGUFHeader(gguf_folder / "tiny.MXFP4_MOE.gguf")
    got = ModelConfig.from_dict(gpt_oss_config(header))
    want = ModelConfig.from_folder(gguf_folder)
    assert got.layer_windows == want.layer_windows == (16, 0, 16, 0)
    assert (got.num_experts, got.experts_per_token, got.moe_intermediate_size) == (8, 2, 32)
    assert (got.head_dim, got.attn_sinks, got.swiglu_limit, got.swiglu_alpha) == (
        16,
        True,
        7.0,
        1.702,
    )
    assert got.rope_scaling["rope_type"] == "yarn" and got.rope_scaling["factor"] == 32.0
    assert got.rope_attention_factor() == want.rope_attention_factor()
    assert got.tie_word_embeddings is False


def test_a_gpt_oss_file_ends_its_answers_on_return_and_call(gguf_folder, tmp_path):
    """Prepared from its GGUF with a harmony tokenizer beside it: the config's end tokens are the
    tokenizer's end of sequence and harmony's <|return|> and <|call|> (a tool call ends the turn),
    as llama.cpp ends on them; without them an answer would run on to max_tokens.
    """
    import shutil

    from tokenizers import Tokenizer

    from deploy.prepare_model import prepare
    from tests.support.scripted import make_harmony_tokenizer

    folder = make_harmony_tokenizer(tmp_path / "file", vocab_size=384)
    shutil.copy(gguf_folder / "tiny.MXFP4_MOE.gguf", folder)
    out = prepare(folder / "tiny.MXFP4_MOE.gguf", tmp_path / "prepared", "tiny", dense=False)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = [vocab.token_to_id("<|return|>"), vocab.token_to_id("<|call|>")]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == want
