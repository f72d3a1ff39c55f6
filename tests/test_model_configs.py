"""Models served right, or refused at start: every config field that changes the computation is either
implemented (and equals transformers) or makes the worker exit 2 naming the field and its value."""

import json

import pytest
import torch

from worker.model_config import ModelConfig, UnsupportedModel

BASE = dict(model_type="llama", vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

REFUSED = [
    ("hidden_act", dict(hidden_act="gelu_pytorch_tanh"), "'gelu_pytorch_tanh'"),
    ("mlp_bias", dict(mlp_bias=True), "True"),
    ("attention_bias", dict(attention_bias=True), "True"),  # Llama's includes an o_proj bias
    ("rope_scaling.rope_type", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "'yarn'"),
    ("rope_scaling.rope_type", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "'dynamic'"),
    ("partial_rotary_factor", dict(partial_rotary_factor=0.5), "0.5"),
    ("final_logit_softcapping", dict(final_logit_softcapping=30.0), "30.0"),
    ("attn_logit_softcapping", dict(attn_logit_softcapping=50.0), "50.0"),
    ("embedding_multiplier", dict(embedding_multiplier=12.0), "12.0"),
    ("num_local_experts", dict(num_local_experts=8), "8"),
    ("quantization_config.quant_method", dict(quantization_config=dict(quant_method="awq", bits=4)), "'awq'"),
    ("layer_types", dict(layer_types=["full_attention", "chunked_attention"] * 2), "'chunked_attention'"),
    ("model_type", dict(model_type="gemma2"), "'gemma2'"),
    ("attention_bias", dict(model_type="qwen3", attention_bias=True), "True"),
]


@pytest.mark.parametrize("name,overrides,shown", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_a_field_that_would_change_the_math_is_refused_by_name(name, overrides, shown):
    with pytest.raises(UnsupportedModel) as e:
        ModelConfig.from_dict({**BASE, **overrides})
    assert e.value.field_name == name and str(e.value).startswith(f"{name}={shown}")


@pytest.mark.parametrize("name,overrides,shown", [REFUSED[0], REFUSED[3], REFUSED[10]])
def test_the_worker_exits_2_at_start_naming_the_field(tmp_path, capsys, name, overrides, shown):
    import structlog

    import worker.main as worker_main
    from protos import EXIT_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **overrides}))
    try:
        code = worker_main.main(["--model", str(tmp_path), "--scheduler", "tcp://127.0.0.1:1", "--device", "cpu",
                                 "--load-format", "dummy", "--malloc", "glibc", "--log-format", "json"])
    finally:
        structlog.reset_defaults()  # main() pointed the logs at this test's captured stderr
    assert code == EXIT_CONFIG
    assert f"{name}={shown}" in capsys.readouterr().err


def _matches_transformers(tmp_path, hf, prompt):
    from tests.test_model import BLOCK, run_step
    from worker.kv_pool import KVPool
    from worker.weights import load_model

    hf.eval().save_pretrained(str(tmp_path))
    model, config = load_model(str(tmp_path), "auto", torch.float32, torch.device("cpu"))
    pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"))
    blocks = list(range(15, 15 - -(-len(prompt) // BLOCK), -1))
    _, hidden = run_step(model, config, pool, [(prompt, 0, blocks)])
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(hidden), hf(torch.tensor([prompt])).logits[0],
                                   atol=2e-4, rtol=1e-4)
    return config


def test_smollm3_nope_layers_equal_transformers(tmp_path):
    """SmolLM3 leaves RoPE out of every no_rope_layer_interval-th layer: those layers attend without positions."""
    import transformers

    torch.manual_seed(0)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    hf = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common))
    config = _matches_transformers(tmp_path, hf, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    assert config.rope_layers == (True, False, True, False)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_sliding_window_caps_the_context_and_is_exact_below_it(tmp_path, family):
    """A window applies to no sequence shorter than it: the model is served with its context capped at the
    window (said in the log), and equals transformers there."""
    import transformers

    torch.manual_seed(1)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    if family == "mistral":
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=32, **common))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(use_sliding_window=True, sliding_window=32,
                                                                    max_window_layers=0, **common))
    config = _matches_transformers(tmp_path, hf, list(range(3, 33)))
    assert config.max_position_embeddings == 32 and config.declared_context == 256


def test_llama3_and_linear_rope_scaling_equal_transformers(tmp_path):
    import transformers

    for i, rope in enumerate((dict(rope_type="linear", factor=4.0),
                              dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64))):
        torch.manual_seed(2)
        common = {k: v for k, v in BASE.items() if k != "model_type"}
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_scaling=rope, **common))
        _matches_transformers(tmp_path / str(i), hf, list(range(5, 45)))
