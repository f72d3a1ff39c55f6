"""The fused CPU decode step (model/fused_decode.py, kernels/cpu/decode_step.c) against the layer
path it stands in for: the same hidden states and the same K/V written, for every layer variant the
model code serves (Llama, Qwen2's QKV bias, Qwen3's q/k norm, SmolLM3's layers without RoPE,
Granite 4's multipliers and Mamba2 layers, Qwen3.5's Gated DeltaNet layers and gated attention,
their states in the state pool, Gemma 2 and 3's sandwich norms, GeGLU, soft-capped scores and
second RoPE table), for
dense fp32 and GGUF blocks, at one and several sequences whose contexts cross blocks; steps it does
not cover take the layer path; and a server decodes the same greedy tokens with it as with
--cpu-decode layers.
"""

import platform
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels import cpu_native
from tests.support.forward import STEP_BLOCK as BLOCK
from tests.support.forward import step_inputs
from tests.support.tiny import make_tiny_gguf, make_tiny_llama
from worker.model.attention_native import make_backend
from worker.model.kv_pool import KVPool
from worker.model.linear import DenseMatmul
from worker.model.llama import StepInputs
from worker.weights.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="native CPU kernels not built")

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.25,
)


def _hf_model(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **COMMON))
    if kind == "smollm3":
        return transformers.SmolLM3ForCausalLM(
            transformers.SmolLM3Config(no_rope_layer_interval=2, **COMMON)
        )
    # every layer slides over 20 keys: the decodes below are shorter and longer
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=20, **COMMON)
        )
    # fused checkpoint tensors, a window on every layer, half of each head rotated
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(
            transformers.Phi3Config(sliding_window=24, partial_rotary_factor=0.5, **COMMON)
        )
    # Granite 4's multipliers: embeddings, each block's output, attention scores (logits after)
    scales = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2)
    # Granite 4's hybrid: Mamba2 mixers (8 heads of 16 in 2 groups, a 16-wide state) beside a NoPE
    # attention layer, a dense MLP in every layer
    if kind == "granite4-hybrid":
        config = transformers.GraniteMoeHybridConfig(
            **scales,
            **dict(COMMON, num_hidden_layers=4),
            layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            num_local_experts=0,
            shared_intermediate_size=96,
            position_embedding_type="nope",
        )
        return transformers.GraniteMoeHybridForCausalLM(config)
    # Qwen3.5: Gated DeltaNet layers (2 key heads, 4 value heads of 16) beside a gated attention
    # layer with q/k norms and partial RoPE
    if kind == "qwen3_5-hybrid":
        config = transformers.AutoConfig.for_model(
            "qwen3_5_text",
            **dict(COMMON, num_hidden_layers=4),
            layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
        return transformers.AutoModelForCausalLM.from_config(config)
    # Gemma 3: norms on both blocks' outputs, GeGLU, q/k norms, sliding layers (12 keys) with RoPE
    # of their own, the global ones scaled; Gemma 2: its attention scores soft-capped
    gemma = dict(
        COMMON, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=12
    )
    if kind == "gemma3":
        ropes = {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        config = transformers.Gemma3TextConfig(
            **gemma, sliding_window_pattern=2, rope_parameters=ropes
        )
        return transformers.Gemma3ForCausalLM(config)
    if kind == "gemma2":
        return transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**gemma, attn_logit_softcapping=5.0)
        )
    # LFM2: gated short convs (B x through a 3-tap causal conv, times C) beside attention with q/k
    # norms; LFM3: sandwich norms, a sliding layer, proportional partial RoPE, a gate a head
    if kind in ("lfm2", "lfm3"):
        from tests.support.families import RECURRENT

        shape = dict(RECURRENT[kind], num_hidden_layers=4)
        shape["layer_types"] = shape["layer_types"][:4]
        if kind == "lfm3":
            shape.update(sliding_window=12)
        config = transformers.AutoConfig.for_model(kind, **{**COMMON, **shape})
        return transformers.AutoModelForCausalLM.from_config(config)
    # Nemotron-H: one block a layer (an MLP first, two mixers in a row, a mixer last): Mamba2,
    # NoPE attention, relu² MLPs of up alone
    if kind == "nemotron_h":
        from tests.support.families import RECURRENT

        mamba = {
            k: v
            for k, v in RECURRENT[kind].items()
            if k.startswith(("mamba", "n_g", "ssm", "conv"))
        }
        blocks = ["mlp", "linear_attention", "full_attention", "mlp", "linear_attention"]
        config = transformers.AutoConfig.for_model(
            kind,
            **{**COMMON, "intermediate_size": 64, "num_hidden_layers": 5},
            **mamba,
            layers_block_type=blocks,
        )
        return transformers.AutoModelForCausalLM.from_config(config)
    # Falcon-H1: Mamba2 beside attention in every layer, their outputs summed; µP multipliers
    if kind == "falcon_h1":
        from tests.support.families import RECURRENT

        config = transformers.AutoConfig.for_model(kind, **{**COMMON, **RECURRENT[kind]})
        return transformers.AutoModelForCausalLM.from_config(config)
    # mixtures of experts, routed in the step: Qwen3-MoE's softmax over 8 (a dense layer first);
    # LFM2-MoE's sigmoid plus a bias, scaled, after a dense layer; Granite 4's experts beside an
    # ungated shared MLP between Mamba2 layers; Qwen3.5-MoE's beside a sigmoid-gated shared expert
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            head_dim=16, **COMMON, **experts, mlp_only_layers=[0], norm_topk_prob=True
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if kind == "lfm2_moe":
        from tests.support.families import RECURRENT

        shape = dict(RECURRENT[kind], num_hidden_layers=4, num_experts=8)
        shape["layer_types"] = shape["layer_types"][:4]
        config = transformers.AutoConfig.for_model(kind, **{**COMMON, **shape})
        model = transformers.AutoModelForCausalLM.from_config(config)
        for layer in model.model.layers[1:]:  # saved as zeros: values that change the choice
            layer.feed_forward.expert_bias.copy_(torch.rand(8) * 0.5)
        return model
    if kind == "granite4-moe":
        config = transformers.GraniteMoeHybridConfig(
            **scales,
            **dict(COMMON, num_hidden_layers=3, intermediate_size=32),
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
        )
        return transformers.GraniteMoeHybridForCausalLM(config)
    if kind == "qwen3_5_moe-hybrid":
        config = transformers.AutoConfig.for_model(
            "qwen3_5_moe_text",
            **dict(COMMON, num_hidden_layers=2),
            **experts,
            shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
        return transformers.AutoModelForCausalLM.from_config(config)
    # Nemotron-H's experts: relu² of up alone, chosen by sigmoid plus a bias within the best of two
    # groups, scaled, beside a shared relu² MLP; a relu² MLP layer and a Mamba2 one beside them
    if kind == "nemotron_h-moe":
        from tests.support.families import RECURRENT

        shape = dict(RECURRENT["nemotron_h"], intermediate_size=64)
        shape["moe_shared_expert_intermediate_size"] = 64
        shape["layers_block_type"] = ["moe", "linear_attention", "full_attention", "mlp", "moe"]
        config = transformers.AutoConfig.for_model("nemotron_h", **{**COMMON, **shape})
        model = transformers.AutoModelForCausalLM.from_config(config)
        for i in (0, 4):  # saved as zeros: values that change the choice
            model.model.layers[i].mixer.gate.e_score_correction_bias.copy_(torch.rand(8) * 0.5)
        return model
    # gpt-oss: sinks, sliding and full layers alternating, biases on q/k/v/o, the router and the
    # experts, its clamped SwiGLU
    if kind == "gpt_oss":
        config = transformers.GptOssConfig(
            **dict(COMMON, num_hidden_layers=4, intermediate_size=32),
            head_dim=16,
            sliding_window=12,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():  # sinks as trained ones are: a share of each softmax worth having
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.rand(4) * 3)
        return model
    # OLMo 3: q/k normed over the whole projection, the residual stream into each block unnormed,
    # the blocks' outputs normed, 3 sliding : 1 full; MiniMax-M2: the same q/k norms, partial RoPE,
    # experts by sigmoid plus a correction; OLMo-hybrid: OLMo 3's attention beside Gated DeltaNet
    if kind in ("olmo3", "minimax_m2", "olmo_hybrid"):
        from tests.support.families import ATTENTION, RECURRENT

        shape = {**ATTENTION, **RECURRENT}[kind]
        config = transformers.AutoConfig.for_model(kind, **{**COMMON, **shape})
        model = transformers.AutoModelForCausalLM.from_config(config)
        if kind == "minimax_m2":  # saved as zeros: values that change the choice
            for layer in model.model.layers:
                layer.mlp.e_score_correction_bias.copy_(torch.rand(8) * 0.5)
        return model
    if kind == "qwen2-sliding":  # layer 0 full, layers 1-2 sliding
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                use_sliding_window=True, sliding_window=13, max_window_layers=1, **COMMON
            )
        )
    raise ValueError(kind)


def _model(tmp_path, kind: str, packing: bool = False, int8: bool = False):
    """(model with the fused step attached, config) of a tiny random model of that family (GGUF Q4
    blocks packed for the integer kernel with packing, meeting 8-bit activations with int8).
    """
    from worker.serve.choices import use_fused_decode

    if kind == "llama":
        folder = make_tiny_llama(tmp_path / kind)
    elif kind.startswith("gguf-"):
        folder = make_tiny_gguf(tmp_path / kind, qtype=kind.split("-")[1])
    else:
        folder = tmp_path / kind
        with torch.no_grad():
            for p in (hf := _hf_model(kind)).parameters():  # norms and biases away from 1 and 0 too
                p.add_(torch.randn_like(p) * 0.1)
        hf.eval().save_pretrained(str(folder))
    model, config = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    if kind.startswith("gguf-"):
        from worker.model.quantized import QuantizedMatmul
        from worker.weights.gguf_blocks import GGUFQuantSource, find_gguf
        from worker.weights.gguf_plan import read_quantized

        source = GGUFQuantSource(
            find_gguf(folder), config.num_heads, config.num_kv_heads, config.head_dim
        )
        lib = QuantizedMatmul(
            cpu_native.load(),
            DenseMatmul(),
            packing=packing,
            pack_q8=packing,
            int8_activations=int8,
        )
        model.use_quantized(read_quantized(model, source), lib, keep_dense=True)
    else:
        model.use_matmul(DenseMatmul())
    use_fused_decode(model, 1, "int8" if int8 else "fp32")
    assert model.fused is not None
    return model, config


def _run(model, config, seqs, fused: bool, kv_dtype=torch.float32):
    """The hidden states of one step over a pool of random K/V, and every layer's pool after it."""
    p, blocks = step_inputs(seqs)
    pool = KVPool(config, blocks + 1, BLOCK, kv_dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    attn = make_backend(
        "cpu",
        torch.device("cpu"),
        (config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, kv_dtype),
    )
    lens = torch.from_numpy(p.seq_lens.astype("int32"))
    step = StepInputs(
        torch.from_numpy(p.token_ids.astype("int64")),
        torch.from_numpy(p.positions.astype("int64")),
        torch.from_numpy(p.slot_mapping.astype("int64")),
        attn.prepare(
            torch.from_numpy(p.block_tables.copy()),
            lens,
            torch.from_numpy(p.query_start_loc.astype("int32")),
            BLOCK,
            int(lens.max()),
            int(np.diff(p.query_start_loc).max()),
        ),
    )
    if config.keeps_state:  # a hybrid: random states, each sequence in its own slot, out of order
        from worker.model.delta_net import StateStep
        from worker.model.state_pool import StatePool

        pool.states = StatePool(config, len(seqs) + 2, torch.float32, torch.device("cpu"))
        for t in pool.states.tensors():
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        slots = torch.randperm(len(seqs) + 2, generator=g)[: len(seqs)]
        step.state = StateStep(slots, list(range(len(seqs) + 1)))
    saved = model.fused
    model.fused = saved if fused else None
    try:
        with torch.inference_mode():
            hidden = model(step, pool, attn).clone()
    finally:
        model.fused = saved
    return hidden, pool


# one and two long sequences: their keys cut into ranges; 20 rows: past the row kernels, the dense
# copy through sgemm
DECODES = [
    [(1, 9)],
    [(1, 40)],
    [(1, 100)],
    [(1, 130), (1, 70)],
    [(1, 17), (1, 70), (1, 33)],
    [(1, n) for n in range(5, 85, 10)],
    [(1, n) for n in range(5, 205, 10)],
]


@pytest.mark.parametrize(
    "kind",
    [
        *("llama", "qwen2", "qwen3", "smollm3", "mistral", "qwen2-sliding", "phi3"),
        *("granite4-hybrid", "qwen3_5-hybrid", "gemma2", "gemma3", "lfm2", "lfm3"),
        *("nemotron_h", "falcon_h1"),
        *("qwen3_moe", "lfm2_moe", "granite4-moe", "qwen3_5_moe-hybrid", "nemotron_h-moe"),
        *("gpt_oss", "olmo3", "minimax_m2", "olmo_hybrid"),
    ],
)
def test_the_fused_step_equals_the_layer_path_on_fp32_weights(tmp_path, kind):
    model, config = _model(tmp_path, kind)
    assert config.layer_windows == {
        "mistral": (20, 20, 20),
        "qwen2-sliding": (0, 13, 13),
        "phi3": (24, 24, 24),
        "gemma2": (12, 0, 12, 0),
        "gemma3": (12, 0, 12, 0),
        "lfm3": (0, 12, 0, 0),
        "gpt_oss": (12, 0, 12, 0),
        "olmo3": (8, 8, 8, 0),
    }.get(kind, ())
    for seqs in DECODES:
        want, want_pool = _run(model, config, seqs, fused=False)
        got, got_pool = _run(model, config, seqs, fused=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for a, b in zip(got_pool.k + got_pool.v, want_pool.k + want_pool.v, strict=True):
            # this step's K/V written at its slots (sums in another order than the sgemm's: ~1e-5
            # of the keys' scale apart; gpt-oss's reach 10: AVX-512's order left one 4.7e-5 off)
            scale = float(b.abs().amax()) if b.numel() else 0.0  # a recurrent layer holds no K/V
            torch.testing.assert_close(a, b, atol=1e-5 * max(3.0, scale), rtol=1e-4)
        if config.keeps_state:  # every slot's conv and SSD state as the layer path leaves it
            for a, b in zip(got_pool.states.tensors(), want_pool.states.tensors(), strict=True):
                torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)


# gpt-oss on an fp32 pool only: on a bf16 one a key a sum's last bit away rounds to the next bf16
# value, which its larger activations carry past the hidden states' 1e-4
@pytest.mark.parametrize(
    ("kind", "kv_dtype"),
    [
        *((k, d) for k in ("llama", "qwen3", "mistral") for d in (torch.float32, torch.bfloat16)),
        ("olmo3", torch.float32),
        ("gpt_oss", torch.float32),
    ],
)
def test_drafting_rows_as_decode_rows_equal_their_tokens_as_one_prompt_chunk(
    tmp_path, kind, kv_dtype
):
    """A drafting sequence's tokens run as one decode row each (step/speculation.py), whose keys the
    fused step reads once for the run: the same hidden states and K/V as those tokens as one chunk
    on the layer path (causal over the chunk, windows included: mistral's 20 keys are crossed inside
    the run; gpt-oss's sinks in every row's softmax).
    """
    model, config = _model(tmp_path, kind)
    # 16 rows: a run longer than one item's tile where hd is big; a lone drafting sequence: its run
    # cut into parts so that every thread has work
    for seqs in ([(6, 40), (1, 17), (4, 60), (16, 90)], [(6, 40)], [(9, 33)]):
        _check_drafting_rows(model, config, seqs, kv_dtype)


def _check_drafting_rows(model, config, seqs, kv_dtype):
    from worker.step.speculation import expand_drafts

    want, want_pool = _run(model, config, seqs, fused=False, kv_dtype=kv_dtype)
    p, blocks = step_inputs(seqs)
    p.num_draft = np.array([q - 1 for q, _ in seqs], dtype="<i4")
    owner, seq_lens, qsl = expand_drafts(p)
    pool = KVPool(config, blocks + 1, BLOCK, kv_dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    attn = make_backend(
        "cpu",
        torch.device("cpu"),
        (config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, kv_dtype),
    )
    lens = torch.from_numpy(seq_lens)
    tables = torch.from_numpy(p.block_tables[owner].copy())
    step = StepInputs(
        torch.from_numpy(p.token_ids.astype("int64")),
        torch.from_numpy(p.positions.astype("int64")),
        torch.from_numpy(p.slot_mapping.astype("int64")),
        attn.prepare(tables, lens, torch.from_numpy(qsl), BLOCK, int(lens.max()), 1),
    )
    assert model.fused.covers(step, p.num_tokens)
    with torch.inference_mode():
        got = model(step, pool, attn).clone()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # a later layer's K/V may round to the next bf16 value (fp32: sums in another order, ~1e-5 apart
    # past gpt-oss's experts)
    tol = (3e-5, 1e-4) if kv_dtype == torch.float32 else (8e-3, 8e-3)
    for a, b in zip(pool.k + pool.v, want_pool.k + want_pool.v, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_on_a_bf16_kv_pool_the_fused_step_writes_the_same_bits_and_attends_as_the_layer_path(
    tmp_path, kind
):
    """--kv-cache-dtype bf16: the step's K/V rounded to bf16 as torch rounds them (nearest even, bit
    for bit against the fp32 pool's values), and attention over the bf16 keys (contexts across
    blocks, a sliding window) as the layer path's; close to the fp32 pool's result, not equal to it.
    """
    model, config = _model(tmp_path, kind)
    for seqs in DECODES:
        want, want_pool = _run(model, config, seqs, fused=False, kv_dtype=torch.bfloat16)
        got, got_pool = _run(model, config, seqs, fused=True, kv_dtype=torch.bfloat16)
        assert got_pool.k[0].dtype == torch.bfloat16
        for a, b in zip(got_pool.k + got_pool.v, want_pool.k + want_pool.v, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=2**-7)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        fp32, fp32_pool = _run(model, config, seqs, fused=True)
        # the first layer's K/V (its inputs are the same either way) are the fp32 pool's rounded as
        # torch rounds
        assert torch.equal(got_pool.k[0], fp32_pool.k[0].to(torch.bfloat16))
        assert torch.equal(got_pool.v[0], fp32_pool.v[0].to(torch.bfloat16))
        torch.testing.assert_close(got, fp32, atol=5e-2, rtol=5e-2)  # close to fp32's, not equal
        assert not torch.equal(got, fp32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "BF16"])
@pytest.mark.parametrize("mode", ["file-layout", "packed", "packed-int8"])
def test_the_fused_step_on_gguf_blocks_is_the_layer_path_bit_for_bit(tmp_path, qtype, mode):
    """Same dot products in the same order: the same floats, not merely close ones — on the file's
    blocks, and on blocks packed for the integer kernel (the same 16-bit, or 8-bit, rounding of each
    matmul's input; Q5_0, Q5_1 and BF16 stay in the file's layout, BF16 on AMX tiles where the CPU
    has them).
    """
    from worker.model.quant_weights import PACKED_FROM, PACKED_TYPES

    packing = mode != "file-layout"
    model, config = _model(tmp_path, f"gguf-{qtype}", packing, int8=mode == "packed-int8")
    packed = packing and qtype in PACKED_FROM
    assert all((w.q.qtype in PACKED_TYPES) == packed for w in model.layers[0].w.values())
    for seqs in DECODES:
        want, want_pool = _run(model, config, seqs, fused=False)
        got, got_pool = _run(model, config, seqs, fused=True)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_pool.k, want_pool.k, strict=True))


def test_threads_the_host_holds_up_change_no_float_of_the_step(tmp_path):
    """Seven threads on this machine's cores: the host takes them away mid-stage and the others take
    the rest of its chunks, every stage of every layer: step after step, the hidden states and the
    K/V written are the layer path's, bit for bit.
    """
    model, config = _model(tmp_path, "gguf-Q4_0", packing=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(7)  # (attention's key ranges follow the thread count: the same here)
        want = [_run(model, config, seqs, fused=False) for seqs in DECODES]
        for _ in range(4):
            for seqs, (hidden, pool) in zip(DECODES, want, strict=True):
                got, got_pool = _run(model, config, seqs, fused=True)
                assert torch.equal(got, hidden)
                assert all(torch.equal(a, b) for a, b in zip(got_pool.k, pool.k, strict=True))
    finally:
        torch.set_num_threads(threads)


def test_steps_it_does_not_cover_take_the_layer_path(tmp_path, monkeypatch):
    model, config = _model(tmp_path, "llama")
    calls = []
    kernels = model.fused.kernels
    real = kernels.decode_step
    monkeypatch.setattr(kernels, "decode_step", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    _run(model, config, [(1, 20), (1, 30)], fused=True)
    assert calls == [2]
    _run(model, config, [(5, 20), (1, 30)], fused=True)  # a prompt chunk beside a decode
    assert calls == [2]
    more = [(1, 20 + i) for i in range(model.fused.max_rows + 1)]
    # more rows than the row kernels serve: the dense copy through sgemm
    if kernels.sgemm is not None:
        assert model.fused.sgemm == kernels.sgemm
        _run(model, config, more, fused=True)
        assert calls == [2, len(more)]
    before = list(calls)
    # no BLAS in the process: more rows take the layer path
    monkeypatch.setattr(model.fused, "sgemm", None)
    _run(model, config, more, fused=True)
    assert calls == before


def test_the_fused_step_finds_a_blas_sgemm_where_torch_carries_mkl():
    if "BLAS_INFO=mkl" not in torch.__config__.show():
        pytest.skip("torch without MKL here")
    assert cpu_native.load().sgemm is not None


def test_a_model_the_step_cannot_serve_says_why():
    from worker.model.config import ModelConfig
    from worker.model.fused_decode import FusedDecode
    from worker.model.llama import LlamaModel

    config = ModelConfig.from_dict(
        {**COMMON, "model_type": "llama", "hidden_size": 72, "head_dim": 18}
    )
    assert "multiples of 32" in FusedDecode.unsupported(LlamaModel(config), 1)
    assert "tensor parallel" in FusedDecode.unsupported(LlamaModel(config), 2)


@pytest.mark.slow
def test_a_server_decodes_the_same_greedy_tokens_fused_and_layer_by_layer(server_factory, tmp_path):
    from protos import generation_pb2 as pb

    folder = make_tiny_gguf(tmp_path / "q4", qtype="Q4_1")
    prompts = [[1, 5 + i, 9, 30 + 2 * i, 7] * (1 + i) for i in range(6)]
    outputs = []
    for mode in ("fused", "layers"):
        # the fp32 copy past the row kernels: with AMX's bf16 one, each server's timed row limit
        # would decide which rows round to bf16
        server = server_factory(
            folder, "--block-size", "4", "--cpu-decode", mode, "--quantized-prefill", "dense"
        )
        futures = [
            server.stub.Generate.future(
                pb.GenerateRequest(
                    prompt_token_ids=p,
                    sampling=pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                )
            )
            for p in prompts
        ]
        outputs.append([list(f.result(timeout=120).choices[0].token_ids) for f in futures])
        assert ('"fused_decode"' in server.log_path.read_text()) == (mode == "fused")
        server.stop()
    assert outputs[0] == outputs[1]


def test_int8_activations_start_a_worker_on_the_packed_kernel_alone(tmp_path):
    """`--quantized-activations int8` as the worker starts it: packed weights meeting 8-bit
    activations in the layer path and the fused step, no fp32 copy for prefill and no timed row
    limit, so every step runs one arithmetic whatever the batch (the fused step equals the layer
    path: the tests above).
    """
    from worker.serve.main import build_parser
    from worker.serve.startup import load, start_device

    if not cpu_native.load().packed_fast:
        pytest.skip("no byte dot products here: nothing is packed")
    folder = make_tiny_gguf(tmp_path / "q4", qtype="Q4_1")
    args = build_parser().parse_args(
        [
            "--model",
            str(folder),
            "--scheduler",
            "tcp://127.0.0.1:1",
            "--device",
            "cpu",
            "--quantized-activations",
            "int8",
            "--num-blocks",
            "8",
        ]
    )
    device, dtype = start_device(args)
    loaded = load(args, device, dtype, 1)
    lib = loaded.model.mm
    assert lib.int8_activations and lib.packing and loaded.quantized_prefill == "dequantize"
    assert lib.max_kernel_rows >= 1 << 30 and loaded.model.fused is not None
    assert loaded.model.fused.max_rows == lib.max_kernel_rows
    assert all(
        w.dense is None and w.q.qtype.endswith("_x16")
        for w in loaded.model.layers[0].w.values()
        if hasattr(w, "q") and w.q.out_dim % 16 == 0
    )


def test_auto_activations_are_8_bit_where_prefill_keeps_no_dense_copy_and_16_bit_where_it_does(
    tmp_path,
):
    """A model past the dense copy's limit (here: asked for with --quantized-prefill dequantize)
    serves at llama.cpp's precision, prompts at the 8-bit kernel's speed and nothing held in fp32; a
    small model keeps its copy and 16-bit activations (the default model's answers); an explicit
    int16 is kept either way.
    """
    from worker.serve.choices import activations_of
    from worker.serve.main import build_parser
    from worker.serve.startup import load, start_device

    if not cpu_native.load().packed_fast:
        pytest.skip("no byte dot products here: nothing is packed")
    folder = make_tiny_gguf(tmp_path / "q4", qtype="Q4_1")

    def start(*flags):
        args = build_parser().parse_args(
            [
                "--model",
                str(folder),
                "--scheduler",
                "tcp://127.0.0.1:1",
                "--device",
                "cpu",
                "--num-blocks",
                "8",
                *flags,
            ]
        )
        device, dtype = start_device(args)
        loaded = load(args, device, dtype, 1)
        return loaded, loaded.model.mm

    loaded, lib = start("--quantized-prefill", "dequantize")
    assert activations_of(lib) == "int8" and lib.max_kernel_rows >= 1 << 30
    assert "8-bit activations" in loaded.weights
    assert all(w.dense is None for w in loaded.model.layers[0].w.values() if hasattr(w, "dense"))
    loaded, lib = start()
    from worker.model.linear import OneDNNBf16Matmul

    assert activations_of(lib) == "int16"
    assert loaded.quantized_prefill == ("bf16" if OneDNNBf16Matmul.tiles() else "dense")
    loaded, lib = start("--quantized-prefill", "dequantize", "--quantized-activations", "int16")
    assert activations_of(lib) == "int16"


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets only")
def test_the_portable_paths_built_for_avx2_compute_the_same(tmp_path):
    """This CPU has AVX-512, so the kernels' portable loops (what an AVX2 or ARM machine runs) never
    run here otherwise: built for x86-64-v3 into a cache of their own, the quantized matmuls, the
    fused step (dense and GGUF blocks), decode and prefill attention and the elementwise tail pass
    the same checks against their references.
    """
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PAGEDSERVE_NATIVE_MARCH": "x86-64-v3",
        "PAGEDSERVE_CACHE": str(tmp_path / "cache"),
    }
    isa = subprocess.run(
        [sys.executable, "-c", "from kernels import cpu_native; print(cpu_native.load().isa)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if isa.returncode != 0 or not isa.stdout.strip():
        pytest.skip(f"no x86-64-v3 build here: {isa.stderr[-300:]}")
    assert isa.stdout.strip() == "256"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            "tests/kernels/test_fused_decode.py",
            "tests/kernels/test_quantized.py",
            "tests/kernels/test_attention.py",
            "tests/kernels/test_fused.py",
            "-k",
            "not cuda and not triton and not torch",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]


@pytest.mark.parametrize("mode", ["file-layout", "packed", "packed-int8"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_fused_step_on_k_quant_blocks_is_the_layer_path_and_the_dequantized_model(
    tmp_path, qtype, mode
):
    """Every projection as random K-quant blocks (256-value blocks: a model 256 wide), the QKV
    stack's values in the other K type: the fused step gives the layer path's floats, and both the
    dense model's on gguf's dequantization of the same blocks — on the file's layout with fp32
    activations, and packed for the integer kernel (16-bit activations, or 8-bit ones), the stack's
    two segments each packed in its own type.
    """
    from tests.support.quant import random_k_blocks
    from worker.model.quant_weights import QuantLinear, QuantWeight
    from worker.model.quantized import QuantizedMatmul
    from worker.serve.choices import use_fused_decode

    folder = make_tiny_llama(
        tmp_path / "wide",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.02,
    )
    model, config = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    dense_model, _ = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    dense_model.use_matmul(DenseMatmul())
    rng = np.random.default_rng(0)
    packing, int8 = mode != "file-layout", mode == "packed-int8"
    lib = QuantizedMatmul(
        cpu_native.load(), DenseMatmul(), max_kernel_rows=16, packing=packing, int8_activations=int8
    )
    for layer, twin in zip(model.layers, dense_model.layers, strict=True):
        layer.w = {}
        for name in layer.MATMUL_WEIGHTS:
            out_dim, in_dim = getattr(layer, name).shape
            q, reference = random_k_blocks(rng, out_dim, in_dim, qtype)
            # v in the other K type, as a Q4_K_M file has it: a stack of two segments
            if name == "qkv":
                other = "Q4_K" if qtype == "Q6_K" else "Q6_K"
                kv = config.num_kv_heads * config.head_dim
                v, v_ref = random_k_blocks(rng, kv, in_dim, other)
                q = QuantWeight.cat([q.rows(slice(0, out_dim - kv)), v])
                reference[out_dim - kv :] = v_ref
                assert [p.qtype for p in q.segments] == [qtype, other]
            packed = lib.pack(q)
            assert all(p.qtype.endswith("_x16") == packing for p in packed.segments)
            layer.w[name] = QuantLinear(packed, None)
            getattr(twin, name).data.copy_(reference)
        layer.mm = lib
    model.head, model.mm, model.head_mm = DenseMatmul().prepare(model.lm_head), lib, lib
    use_fused_decode(model, 1, "int8" if int8 else "int16" if packing else "fp32")
    assert model.fused is not None
    for seqs in DECODES:
        want, want_pool = _run(model, config, seqs, fused=False)
        got, got_pool = _run(model, config, seqs, fused=True)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_pool.k, want_pool.k, strict=True))
        dense, _ = _run(dense_model, config, seqs, fused=False)
        if int8:  # each matmul's input rounded to 8 bits (~0.6% of each output), eight matmuls deep
            assert (got - dense).norm() / dense.norm() < 5e-2
        else:
            torch.testing.assert_close(got, dense, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("packing", [False, True], ids=["file-layout", "packed"])
def test_the_fused_step_routes_rows_to_experts_on_their_blocks_as_the_layer_path(tmp_path, packing):
    """A Qwen3-MoE 256 wide, every projection random Q4_K blocks, its experts' down Q6_K (packed for
    the integer kernel, or as the file lays them out): the fused step routes each row as the layer
    path does and runs the chosen experts through the same kernel (moe_experts.c), whatever rows
    share an expert; only the router's sums differ in order.
    """
    import transformers

    from tests.support.quant import quantized_experts, random_k_blocks
    from worker.model.quant_weights import ExpertBlocks, QuantLinear
    from worker.model.quantized import QuantizedMatmul
    from worker.serve.choices import use_fused_decode

    shape = dict(COMMON, hidden_size=256, head_dim=64, num_hidden_layers=2, initializer_range=0.02)
    config = transformers.Qwen3MoeConfig(
        **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(str(tmp_path / "moe"))
    model, config = load_model(str(tmp_path / "moe"), "auto", torch.float32, torch.device("cpu"))
    model.use_matmul(DenseMatmul())
    lib = QuantizedMatmul(cpu_native.load(), DenseMatmul(), max_kernel_rows=16, packing=packing)
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for layer in model.layers:
        layer.w = {
            n: QuantLinear(lib.pack(random_k_blocks(rng, *layer.shapes[n], "Q4_K")[0]), None)
            for n in ("qkv", "o_proj")
        }
        layer.mm = lib
        gate_up, _ = quantized_experts(g, 8, 512, 256, "Q4_K")
        down, _ = quantized_experts(g, 8, 256, 256, "Q6_K")
        layer.moe.use_blocks(
            ExpertBlocks([lib.pack(w) for w in gate_up], [lib.pack(w) for w in down]), lib
        )
        assert layer.moe.native is not None
    model.mm = lib
    use_fused_decode(model, 1, "int16" if packing else "fp32")
    assert model.fused is not None
    for seqs in DECODES:
        want, _ = _run(model, config, seqs, fused=False)
        got, _ = _run(model, config, seqs, fused=True)
        assert (got - want).norm() / want.norm() < 1e-5


def test_the_fused_step_on_packed_blocks_stays_with_the_fp32_activations(tmp_path):
    """Rounding each matmul's input to 16 bits moves a whole model's hidden states by about 1e-4 of
    their size (int8 activations move them by about 1e-2): the packed step, fused and layer by
    layer, against the same blocks multiplied with fp32 activations.
    """
    packed, config = _model(tmp_path / "p", "gguf-Q4_1", packing=True)
    plain, _ = _model(tmp_path / "f", "gguf-Q4_1")
    for seqs in DECODES:
        want, _ = _run(plain, config, seqs, fused=True)
        for fused in (True, False):
            got, _ = _run(packed, config, seqs, fused=fused)
            assert (got - want).norm() / want.norm() < 1e-3


def test_a_few_rows_logits_on_the_native_head_are_the_matmuls(tmp_path):
    """A decode step's logits (up to eight rows) on plain fp32 head rows go through the native rows
    kernel: the matmul library's logits up to summation order; more rows take the library; a
    quantized head (its own kernel) is left alone.
    """
    from worker.model.fused_decode import NativeHead
    from worker.serve.choices import FUSED_DENSE_ROWS

    model, config = _model(tmp_path, "llama")
    weight = NativeHead.weight_of(model)
    assert weight is not None and weight.shape == (config.vocab_size, config.hidden_size)
    head = NativeHead(cpu_native.load(), weight, FUSED_DENSE_ROWS)
    for rows in (1, 5, FUSED_DENSE_ROWS):
        hidden = torch.randn(rows, config.hidden_size)
        want = model.compute_logits(hidden)
        model.native_head = head
        try:
            torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)
        finally:
            model.native_head = None
    assert not head.covers(torch.randn(FUSED_DENSE_ROWS + 1, config.hidden_size))
    from worker.model.quant_weights import QuantLinear, QuantWeight

    blocks = QuantWeight(
        torch.zeros(config.vocab_size, 34 * 2, dtype=torch.uint8), "Q8_0", config.hidden_size
    )
    tied_quantized = SimpleNamespace(
        head=QuantLinear(blocks), lm_head=None, embed=model.embed, shard=model.shard
    )
    # not the fp32 embeddings in the Q8_0 head's place
    assert NativeHead.weight_of(tied_quantized) is None


def test_the_steps_own_profile_times_every_stage_and_changes_nothing(tmp_path):
    """The fused step's profile (what `make bench-budget` prints): on, each step counts once and
    every stage it ran took time; the hidden states are the same bits as without it; off, nothing is
    counted.
    """
    kernels = cpu_native.load()
    # packed: the rounding stage runs too
    model, config = _model(tmp_path, "gguf-Q4_1", packing=True)
    seqs = DECODES[2]
    want, _ = _run(model, config, seqs, fused=True)
    kernels.decode_profile(True)
    try:
        got, _ = _run(model, config, seqs, fused=True)
        _run(model, config, seqs, fused=True)
        prof = kernels.decode_profile(False)
    finally:
        kernels.decode_profile(False)
    assert torch.equal(got, want)
    assert prof["steps"] == 2
    assert set(prof) == set(cpu_native.DECODE_STAGES) | {"steps"}
    assert all(
        prof[s] > 0 for s in cpu_native.DECODE_STAGES if s not in ("lora", "mamba", "experts")
    ), prof
    # no adapter in these steps: the stage never ran (tests/models/test_lora.py)
    assert prof["lora"] == 0
    _run(model, config, seqs, fused=True)
    assert kernels.decode_profile(False) == dict.fromkeys(cpu_native.DECODE_STAGES, 0.0) | {
        "steps": 0
    }


def test_the_per_token_budget_accounts_for_the_whole_step(tmp_path, capsys):
    """`make bench-budget` builds the worker as `serve` does and splits one stream's step into parts
    that add up to it: the fused step's stages, the LM head, sampling, the worker's own Python.
    """
    from deploy.bench import budget

    folder = make_tiny_gguf(tmp_path / "m", qtype="Q4_1")
    runner = budget.build_worker(str(folder), ["--threads", "1", "--num-blocks", "64"])
    assert runner.model.fused is not None
    res = budget.budget(runner, context=40, steps=3)
    parts = res["parts"]
    unused = ("rounding", "lora", "mamba", "experts")  # no packed weights, adapters, Mamba2, MoE
    assert all(parts[f"stage {s}"] > 0 for s in cpu_native.DECODE_STAGES if s not in unused), parts
    assert parts["lm_head"] > 0 and parts["sampling"] > 0
    assert sum(parts.values()) == pytest.approx(res["step"], rel=0.02)
    mats = budget.matrix_bytes(runner.model)
    # the tiny model's gate and up are each down's size
    assert mats["gate_up"] == 2 * mats["down"] > 0
    budget.print_budget(
        res, 1e10, mats, budget.head_bytes(runner.model), budget.kv_bytes(runner, 40)
    )
    out = capsys.readouterr().out
    assert "gate_up" in out and "worker Python and staging" in out and "read limit" in out


def test_a_quantized_files_prompt_copy_is_bf16_where_the_cpu_multiplies_bf16_in_tiles(tmp_path):
    """On AMX `auto` holds a 4-8 bit file's copy for prompt steps in bf16, in oneDNN's blocked
    layout (half an fp32 copy's bytes, several times its rate): its products within bf16's rounding
    of the fp32 copy's, the decode rows' kernels and the fused step's untouched, the choice in the
    ready line; `dense` keeps fp32 (the dequantized model's arithmetic, exactly), and `bf16` where
    the CPU has no bf16 is refused. With the bf16 copy the KV pool is bf16 too (`--kv-cache-dtype
    auto`), and prompt attention runs on tiles.
    """
    from worker.model.linear import OneDNNBf16Matmul
    from worker.serve.main import build_parser
    from worker.serve.startup import Refused, load, start_device

    folder = make_tiny_gguf(tmp_path / "q4", qtype="Q4_1")

    def start(*flags):
        args = build_parser().parse_args(
            [
                "--model",
                str(folder),
                "--scheduler",
                "tcp://127.0.0.1:1",
                "--device",
                "cpu",
                "--num-blocks",
                "8",
                *flags,
            ]
        )
        device, dtype = start_device(args)
        return load(args, device, dtype, 1)

    auto, fp32 = start(), start("--quantized-prefill", "dense")
    assert fp32.quantized_prefill == "dense" and fp32.model.mm.copies is None
    assert (
        "bf16" not in fp32.weights
        and fp32.model.layers[0].w["gate_up"].dense.dtype == torch.float32
    )
    if not OneDNNBf16Matmul.available():
        with pytest.raises(Refused, match="multiplies bf16"):
            start("--quantized-prefill", "bf16")
    if not OneDNNBf16Matmul.tiles():
        assert auto.quantized_prefill == "dense"
        return
    assert auto.quantized_prefill == "bf16" and "prompts on a bf16 copy" in auto.weights
    assert auto.kv_dtype == torch.bfloat16 and fp32.kv_dtype == torch.float32
    # AVX512_BF16 in this build
    assert auto.attn.prefill_bf16_dots == cpu_native.load().prefill_bf16_dots
    assert not getattr(fp32.attn, "prefill_bf16_dots", False)
    model = auto.model
    w, w32 = model.layers[0].w["gate_up"], fp32.model.layers[0].w["gate_up"]
    assert w.dense.dtype == torch.bfloat16 and w.dense.is_mkldnn
    x = torch.randn(64, w.q.in_dim, generator=torch.Generator().manual_seed(0))
    saved = model.mm.max_kernel_rows, fp32.model.mm.max_kernel_rows
    model.mm.max_kernel_rows = fp32.model.mm.max_kernel_rows = 8  # 64 rows: the copies
    got, want = model.mm(x, w), fp32.model.mm(x, w32)
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-2, err  # bf16 activations and weights: 2^-8 steps
    # decode rows: the same kernel
    assert torch.equal(model.mm(x[:4], w), fp32.model.mm(x[:4], w32))
    # the fused step never reads bf16 as fp32
    assert model.fused is not None and model.fused.sgemm is None
    # a prompt step past the row limit: between the bf16 GEMMs the norms take and give bf16 rows,
    # with the same values
    from tests.support.forward import run_step
    from worker.model.elementwise import NativeOps
    from worker.model.kv_pool import KVPool

    seqs = [(list(range(5, 45)), 0, list(range(10))), (list(range(60, 90)), 0, list(range(10, 18)))]
    calls = []
    kernels = cpu_native.load()
    mixed = kernels.add_rms_norm_mixed
    kernels.add_rms_norm_mixed = lambda *a: (calls.append(1), mixed(*a))[1]
    try:
        outs = []
        for between in (True, False):
            calls.clear()
            model.ops = NativeOps(kernels)
            model.ops.mixed_bf16 = between
            pool = KVPool(model.config, 24, 4, torch.bfloat16, torch.device("cpu"))
            outs.append(run_step(model, model.config, pool, seqs, backend="cpu"))
            assert bool(calls) == between
    finally:
        kernels.add_rms_norm_mixed = mixed
        model.mm.max_kernel_rows, fp32.model.mm.max_kernel_rows = saved
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
