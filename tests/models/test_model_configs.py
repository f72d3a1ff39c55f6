"""Models served right, or refused at start: every config field that changes the computation is
either implemented (and equals transformers) or makes the worker exit 2 naming the field and its
value.
"""

import json

import pytest
import torch

from worker.model.config import ModelConfig
from worker.model.families import UnsupportedModel

BASE = dict(
    model_type="llama",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

REFUSED = [
    ("hidden_act", dict(hidden_act="gelu_pytorch_tanh"), "'gelu_pytorch_tanh'"),
    ("mlp_bias", dict(mlp_bias=True), "True"),
    ("attention_bias", dict(attention_bias=True), "True"),  # Llama's includes an o_proj bias
    (
        "rope_scaling.rope_type",
        dict(rope_scaling=dict(rope_type="longrope", factor=4.0)),
        "'longrope'",
    ),
    (
        "rope_scaling.rope_type",
        dict(rope_parameters=dict(rope_type="longrope", factor=2.0)),
        "'longrope'",
    ),
    ("partial_rotary_factor", dict(partial_rotary_factor=0.5), "0.5"),
    ("final_logit_softcapping", dict(final_logit_softcapping=30.0), "30.0"),
    ("attn_logit_softcapping", dict(attn_logit_softcapping=50.0), "50.0"),
    ("embedding_multiplier", dict(embedding_multiplier=12.0), "12.0"),
    ("num_local_experts", dict(num_local_experts=8), "8"),
    (
        "quantization_config.quant_method",
        dict(quantization_config=dict(quant_method="awq", bits=4)),
        "'awq'",
    ),
    (
        "layer_types",
        dict(layer_types=["full_attention", "chunked_attention"] * 2),
        "'chunked_attention'",
    ),
    ("model_type", dict(model_type="olmoe"), "'olmoe'"),
    (
        "model_type",
        dict(model_type="deepseek_v32"),
        "'deepseek_v32': deepseek_v32 is not served: it needs multi-head latent attention (MLA",
    ),
    ("attn_logit_softcapping", dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "50.0"),
    ("attention_bias", dict(model_type="qwen3", attention_bias=True), "True"),
    (
        "num_experts_per_tok",
        dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5),
        "5",
    ),
    ("num_experts", dict(model_type="qwen3", num_experts=4), "4"),
]


@pytest.mark.parametrize(
    "name,overrides,shown", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)]
)
def test_a_field_that_would_change_the_math_is_refused_by_name(name, overrides, shown):
    with pytest.raises(UnsupportedModel) as e:
        ModelConfig.from_dict({**BASE, **overrides})
    assert e.value.field_name == name and str(e.value).startswith(f"{name}={shown}")


@pytest.mark.parametrize("name,overrides,shown", [REFUSED[0], REFUSED[3], REFUSED[10]])
def test_the_worker_exits_2_at_start_naming_the_field(tmp_path, capsys, name, overrides, shown):
    from protos.base import EXIT_CONFIG
    from tests.support.server import worker_main_code

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **overrides}))
    code = worker_main_code(tmp_path, "--device", "cpu", "--load-format", "dummy")
    assert code == EXIT_CONFIG
    assert f"{name}={shown}" in capsys.readouterr().err


def _matches_transformers(tmp_path, hf, prompt):
    from tests.support.forward import BLOCK, run_step
    from worker.model.kv_pool import KVPool
    from worker.weights.loader import load_model

    hf.eval().save_pretrained(str(tmp_path))
    model, config = load_model(str(tmp_path), "auto", torch.float32, torch.device("cpu"))
    pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"))
    blocks = list(range(15, 15 - -(-len(prompt) // BLOCK), -1))
    _, hidden = run_step(model, config, pool, [(prompt, 0, blocks)])
    with torch.no_grad():
        torch.testing.assert_close(
            model.compute_logits(hidden), hf(torch.tensor([prompt])).logits[0], atol=2e-4, rtol=1e-4
        )
    return config


def test_smollm3_nope_layers_equal_transformers(tmp_path):
    """SmolLM3 leaves RoPE out of every no_rope_layer_interval-th layer: those layers attend without
    positions."""
    import transformers

    torch.manual_seed(0)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    hf = transformers.SmolLM3ForCausalLM(
        transformers.SmolLM3Config(
            no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common
        )
    )
    config = _matches_transformers(tmp_path, hf, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    assert config.rope_layers == (True, False, True, False)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_prompt_longer_than_its_sliding_window_equals_transformers(tmp_path, family):
    """Sliding-window layers see each token's last `sliding_window` keys, at the model's full
    context.
    """
    import transformers

    torch.manual_seed(1)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    if family == "mistral":
        hf = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=16, **common)
        )
    else:
        hf = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                use_sliding_window=True, sliding_window=16, max_window_layers=2, **common
            )
        )
    config = _matches_transformers(tmp_path, hf, [(7 * i) % 190 + 3 for i in range(60)])
    assert config.max_position_embeddings == 256
    assert config.layer_windows == ((16,) * 4 if family == "mistral" else (0, 0, 16, 16))


@pytest.mark.parametrize("window,partial", [(None, 1.0), (16, 1.0), (None, 0.75)])
def test_phi3_fused_weights_window_and_partial_rotary_equal_transformers(tmp_path, window, partial):
    """Phi-3 ships q/k/v and gate/up as single tensors (split here into this model's fused
    parameters), slides every layer when its config has a window (Phi-3-mini's 2047), and with a
    partial_rotary_factor (Phi-4-mini's 0.75) rotates only the first part of each head.
    """
    import transformers

    torch.manual_seed(4)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    hf = transformers.Phi3ForCausalLM(
        transformers.Phi3Config(
            sliding_window=window, pad_token_id=0, partial_rotary_factor=partial, **common
        )
    )
    config = _matches_transformers(tmp_path, hf, [(5 * i) % 190 + 3 for i in range(50)])
    assert config.model_type == "phi3" and config.layer_windows == (
        () if window is None else (16,) * 4
    )
    assert config.rotary_dim == int(16 * partial)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gemma3_equals_transformers(tmp_path, softcap):
    """Gemma 3: (1 + w) RMSNorms, norms on the attention and MLP outputs, GeGLU, q/k norm,
    embeddings times sqrt(hidden), query_pre_attn_scalar, sliding layers with their own RoPE (and
    the global ones with linear scaling), final-logit soft-capping; a prompt longer than the window.
    """
    import transformers

    torch.manual_seed(6)
    common = {k: v for k, v in BASE.items() if k not in ("model_type",)}
    cfg = transformers.Gemma3TextConfig(
        **common,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=12,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        final_logit_softcapping=softcap,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from their zero init, embeddings larger
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.02))
    config = _matches_transformers(tmp_path, hf, [(7 * i) % 190 + 3 for i in range(40)])
    assert config.layer_windows == (12, 0, 12, 0) and config.hidden_act == "gelu_tanh"
    assert (
        config.local_rope["rope_theta"] == 10000.0 and config.rope_scaling["rope_type"] == "linear"
    )


@pytest.mark.parametrize(
    "top_k,normalize,sparse_step,dense_layers",
    [
        (2, False, 1, []),
        (3, True, 1, [2]),
        (1, True, 2, []),
    ],
    ids=["top2", "top3-normalized-one-dense-layer", "top1-every-second-layer"],
)
def test_qwen3_moe_equals_transformers(tmp_path, top_k, normalize, sparse_step, dense_layers):
    """Qwen3-MoE: the router's softmax top-k (renormalized or not), the experts grouped per step,
    the layers decoder_sparse_step and mlp_only_layers leave dense; a prompt whose tokens spread
    over every expert.
    """
    import transformers

    torch.manual_seed(8)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    cfg = transformers.Qwen3MoeConfig(
        **common,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        norm_topk_prob=normalize,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=dense_layers,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers away from their zero init: tokens choose different experts
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    config = _matches_transformers(tmp_path, hf, [(7 * i) % 190 + 3 for i in range(40)])
    sparse = tuple(i not in dense_layers and (i + 1) % sparse_step == 0 for i in range(4))
    assert config.moe_layers == sparse and config.experts_per_token == top_k and config.qk_norm


@pytest.mark.parametrize("attn_cap,final_cap", [(None, None), (2.0, 5.0)])
def test_gemma2_equals_transformers(tmp_path, attn_cap, final_cap):
    """Gemma 2: Gemma's (1 + w) norms around attention and MLP, GeGLU, scaled embeddings and query
    scaling, sliding and global layers alternating over one RoPE, attention-logit soft-capping (a
    cap of 2 on scores of several units: it changes every softmax) and final-logit soft-capping; a
    prompt longer than the window.
    """
    import transformers

    torch.manual_seed(9)
    common = {k: v for k, v in BASE.items() if k not in ("model_type",)}
    cfg = transformers.Gemma2Config(
        **common,
        head_dim=16,
        query_pre_attn_scalar=8,
        sliding_window=12,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg._attn_implementation = "eager"  # transformers' soft-capped attention
    hf = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for (
            name,
            p,
        ) in hf.named_parameters():  # norms away from their zero init; q and k larger: big scores
            scale = 0.3 if "norm" in name else 0.1 if "q_proj" in name or "k_proj" in name else 0.02
            p.add_(torch.randn_like(p) * scale)
    config = _matches_transformers(tmp_path, hf, [(7 * i) % 190 + 3 for i in range(40)])
    assert (
        config.layer_windows == (12, 0, 12, 0)
        and config.hidden_act == "gelu_tanh"
        and not config.qk_norm
    )
    assert config.attn_softcap == (attn_cap or 0.0) and config.final_logit_softcap == (
        final_cap or 0.0
    )
    if attn_cap:  # the cap mattered: without it transformers' own logits move
        prompt = torch.tensor([[(7 * i) % 190 + 3 for i in range(40)]])
        with torch.no_grad():
            capped = hf(prompt).logits
            for layer in hf.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            assert (hf(prompt).logits - capped).abs().max() > 0.1


def test_mixtral_equals_transformers(tmp_path):
    """Mixtral: Mistral's attention (a window on every layer, crossed by the prompt), every MLP a
    mixture of intermediate_size-wide experts (block_sparse_moe's w1/w3/w2), the chosen experts'
    weights always renormalized.
    """
    import transformers

    torch.manual_seed(10)
    common = {k: v for k, v in BASE.items() if k != "model_type"}
    cfg = transformers.MixtralConfig(
        **common,
        head_dim=16,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.5)
    config = _matches_transformers(tmp_path, hf, [(7 * i) % 190 + 3 for i in range(40)])
    assert (
        config.moe_layers == (True,) * 4
        and config.norm_topk_prob
        and config.moe_intermediate_size == 96
    )
    assert config.layer_windows == (16,) * 4


def test_sliding_window_fields_that_do_not_slide():
    """Llama ignores sliding_window (as transformers does); Qwen2 without use_sliding_window does
    not slide.
    """
    assert ModelConfig.from_dict({**BASE, "sliding_window": 16}).layer_windows == ()
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen).layer_windows == ()
    typed = {**qwen, "layer_types": ["sliding_attention", "full_attention"] * 2}
    # transformers drops the window without the flag
    assert ModelConfig.from_dict(typed).layer_windows == ()
    assert ModelConfig.from_dict({**typed, "use_sliding_window": True}).layer_windows == (
        16,
        0,
        16,
        0,
    )
    smol = {
        **BASE,
        "model_type": "smollm3",
        "sliding_window": 16,
        "use_sliding_window": True,
        "no_rope_layer_interval": 2,
    }
    assert ModelConfig.from_dict(smol).layer_windows == (0, 16, 0, 16)  # its NoPE layers slide


def test_llama3_linear_yarn_and_dynamic_rope_scaling_equal_transformers(tmp_path):
    import transformers

    for i, rope in enumerate(
        (
            dict(rope_type="linear", factor=4.0),
            dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
            dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=32,
                beta_fast=16,
                mscale=0.707,
                mscale_all_dim=1.0,
            ),
            # dynamic NTK: transformers grows the base only past max_position_embeddings,
            # which the server never serves (its context is capped there)
            dict(rope_type="dynamic", factor=2.0),
        )
    ):
        torch.manual_seed(2)
        common = {k: v for k, v in BASE.items() if k != "model_type"}
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_scaling=rope, **common))
        _matches_transformers(tmp_path / str(i), hf, list(range(5, 45)))


def test_a_plan_may_leave_out_blocks_behind_every_window_and_no_others():
    """The worker accepts a table whose entries behind its queries' windows are -1 (given back by
    the scheduler) only when every layer slides that far; a hole inside a window is refused.
    """
    import numpy as np

    from tests.support.forward import STEP_BLOCK as BLOCK
    from tests.support.forward import step_inputs
    from worker.step.plan_checks import PlanError, validate_plan

    # a decode at position 69, a chunk over positions 50..65
    p, blocks = step_inputs([(1, 70), (16, 66)])
    p.block_tables = p.block_tables.copy()  # decoded from the wire: a read-only view
    args = (blocks + 1, BLOCK, 256, 512)
    validate_plan(p, *args)
    p.block_tables[0, :3] = -1  # keys 0..47: behind position 69's 20-key window (it reads 50..69)
    p.block_tables[1, :1] = -1  # keys 0..15: behind position 50's window (it reads 31..50)
    with pytest.raises(PlanError, match="no block for part of its sequence"):
        validate_plan(p, *args)  # full attention reads them
    validate_plan(p, *args, kv_window=20)
    p.block_tables[0, 3] = -1  # keys 48..63: position 69 reads 50..63
    with pytest.raises(PlanError, match="no block for part of its sequence"):
        validate_plan(p, *args, kv_window=20)
    assert np.all(p.block_tables[1, 1:4] >= 0)


@pytest.mark.parametrize("multiplier", [1.0, 1.3])
def test_a_released_lfm2_config_is_read_as_transformers_sizes_it(multiplier):
    """LFM2-1.2B's config.json as released (attention layers by full_attn_idxs, block_ff_dim,
    tie_embedding, a top-level rope_theta): its conv and attention layers, tied head, and the MLP's
    width as transformers' own model sizes it.
    """
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from tests.support.families import LFM2_1B

    released = dict(LFM2_1B, block_ffn_dim_multiplier=multiplier)
    config = ModelConfig.from_dict(released)
    expected = Lfm2MLP(Lfm2Config(**{**released, "hidden_size": 64})).w1.out_features
    assert config.intermediate_size == expected
    assert [i for i in range(16) if not config.is_conv(i)] == [2, 5, 8, 10, 12, 14]
    assert config.tie_word_embeddings and config.short_conv_kernel == 3
    assert not config.attn_head_gate and not config.sandwich_norms and config.qk_norm
    assert config.rope_theta == 1000000.0 and config.rms_norm_eps == 1e-5


def test_a_released_lfm2_moe_config_is_read_as_transformers_builds_it():
    """LFM2-8B-A1B's config.json: each layer's MLP dense or experts as transformers' own model
    builds it (on the meta device: no weights), their widths, and the router's rules.
    """
    import torch
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    from tests.support.families import LFM2_8B_A1B

    config = ModelConfig.from_dict(LFM2_8B_A1B)
    with torch.device("meta"):
        hf = Lfm2MoeForCausalLM(Lfm2MoeConfig(**LFM2_8B_A1B))
    for i, layer in enumerate(hf.model.layers):
        experts = getattr(layer.feed_forward, "experts", None)
        assert config.is_moe(i) == (experts is not None), i
        assert config.is_conv(i) == hasattr(layer, "conv"), i
        if experts is None:
            assert layer.feed_forward.w1.out_features == config.intermediate_size == 7168
        else:
            assert experts.down_proj.shape == (config.num_experts, 2048, 1792)
    assert config.experts_per_token == 4 and config.moe_intermediate_size == 1792
    assert config.sigmoid_router and config.router_correction and config.norm_topk_prob
    assert config.router_norm_eps == 1e-6 and config.routed_scale == 1.0
    assert config.tie_word_embeddings and not config.attn_head_gate and not config.sandwich_norms
