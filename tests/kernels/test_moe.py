"""The mixture-of-experts MLP: the grouped torch loop (the CPU path, and the definition), the Triton
grouped matmuls against it (natively on CUDA, under TRITON_INTERPRET=1 elsewhere), its
tensor-parallel split, and the layout `align` hands the kernel.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tests.support.quant import quantized_experts
from worker.model.config import ModelConfig
from worker.model.elementwise import TorchOps
from worker.model.moe import MoE, clamped_swiglu, grouped_experts, relu_squared
from worker.model.parallel import make_shard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def naive(h, weights, ids, gate_up, down):
    """Every token through each of its experts, one at a time:
    what the grouped versions must equal.
    """
    out = torch.zeros_like(h, dtype=torch.float32)
    inter = gate_up.shape[1] // 2
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = F.linear(h[t].float(), gate_up[e].float())
            out[t] += weights[t, j].float() * F.linear(
                F.silu(gu[:inter]) * gu[inter:], down[e].float()
            )
    return out


def case(tokens, experts, top_k, hidden, inter, dtype, seed=0, unused=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, list(unused)] = -1.0  # experts no token chooses
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    return h, weights.to(DEVICE, dtype), ids.to(DEVICE), gate_up, down


SHAPES = [  # tokens, experts, top_k, hidden, intermediate, experts nobody chooses
    (1, 8, 2, 48, 40, ()),
    (5, 8, 1, 64, 32, (0, 7)),
    (37, 6, 3, 40, 24, (2,)),
    (19, 4, 4, 32, 16, ()),  # every token through every expert
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}" for s in SHAPES])
def test_grouped_loop_equals_each_token_through_its_experts(shape):
    tokens, experts, top_k, hidden, inter, unused = shape
    h, w, ids, gate_up, down = case(
        tokens, experts, top_k, hidden, inter, torch.float32, unused=unused
    )
    h, w, ids, gate_up, down = (x.cpu() for x in (h, w, ids, gate_up, down))
    got = grouped_experts(h, w, ids, gate_up, down, TorchOps().silu_mul)
    torch.testing.assert_close(got, naive(h, w, ids, gate_up, down), atol=2e-5, rtol=2e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}" for s in SHAPES])
def test_triton_grouped_matmuls_equal_the_grouped_loop(shape, dtype):
    triton_moe = pytest.importorskip("kernels.triton_moe", reason="triton is not installed")
    tokens, experts, top_k, hidden, inter, unused = shape
    h, w, ids, gate_up, down = case(
        tokens, experts, top_k, hidden, inter, dtype, seed=1, unused=unused
    )
    got = triton_moe.fused_moe(h, w, ids, gate_up, down, TorchOps().silu_mul)
    assert got.shape == h.shape and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), naive(h, w, ids, gate_up, down), **TOL[dtype])


@pytest.mark.kernels
def test_align_groups_every_pair_once_by_expert_with_padded_runs():
    triton_moe = pytest.importorskip("kernels.triton_moe", reason="triton is not installed")
    g = torch.Generator().manual_seed(3)
    for tokens, experts, top_k in [(1, 8, 2), (13, 5, 2), (40, 16, 4), (3, 64, 8)]:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(
            DEVICE
        )
        pairs = tokens * top_k
        sorted_pairs, block_expert = triton_moe.align(ids, experts, block_m=4)
        sorted_pairs, block_expert, flat = (
            sorted_pairs.cpu(),
            block_expert.cpu(),
            ids.reshape(-1).cpu(),
        )
        real = sorted_pairs[sorted_pairs < pairs]
        assert sorted(real.tolist()) == list(range(pairs))  # each pair exactly once
        assert (sorted_pairs[sorted_pairs >= pairs] == pairs).all()  # padding names no pair
        for b, e in enumerate(block_expert.tolist()):
            run = sorted_pairs[4 * b : 4 * b + 4]
            run = run[run < pairs]
            if e < 0:
                assert run.numel() == 0
            else:
                # a block holds one expert's pairs
                assert run.numel() > 0 and (flat[run.long()] == e).all()
                assert run.tolist() == sorted(run.tolist())  # in token order


def moe_config(**fields) -> ModelConfig:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        moe_layers=(True,),
        num_experts=6,
        experts_per_token=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    )
    return ModelConfig(**{**base, **fields})


def test_tensor_parallel_slices_of_every_expert_sum_to_the_whole():
    """Two ranks, each with half of every expert's intermediate dimension and the whole router,
    route the same and their partial outputs add up to one rank's (what the layer's all-reduce
    does).
    """
    config = moe_config()
    torch.manual_seed(0)
    whole = MoE(config, make_shard(2, 2, 64, 64, expert_intermediate_size=24))
    for p in whole.parameters():
        p.data.normal_()
    h = torch.randn(9, 32)
    ops = TorchOps()
    parts = []
    for rank in range(2):
        shard = make_shard(2, 2, 64, 64, rank, 2, expert_intermediate_size=24)
        lo, hi = shard.expert_intermediate
        part = MoE(config, shard)
        part.router.data.copy_(whole.router)
        part.gate_up.data.copy_(
            torch.cat([whole.gate_up[:, lo:hi], whole.gate_up[:, 24 + lo : 24 + hi]], 1)
        )
        part.down.data.copy_(whole.down[:, :, lo:hi])
        parts.append(part(h, ops))
    torch.testing.assert_close(parts[0] + parts[1], whole(h, ops), atol=1e-4, rtol=1e-4)


def test_routing_renormalizes_only_where_asked():
    torch.manual_seed(1)
    h = torch.randn(5, 32)
    for normalize in (False, True):
        moe = MoE(
            moe_config(norm_topk_prob=normalize),
            make_shard(2, 2, 64, 64, expert_intermediate_size=24),
        )
        moe.router.data.normal_()
        weights, ids = moe.route(h)
        probs = torch.softmax(h @ moe.router.T, -1)
        assert (ids == probs.topk(2, -1).indices).all()
        want = probs.topk(2, -1).values
        torch.testing.assert_close(
            weights, want / want.sum(-1, keepdim=True) if normalize else want
        )


def test_an_expert_split_that_does_not_divide_is_refused():
    from worker.model.parallel import ParallelConfigError

    with pytest.raises(ParallelConfigError, match="experts' intermediate size 30"):
        make_shard(4, 4, 64, 64, 0, 4, expert_intermediate_size=30)


@pytest.mark.kernels
def test_a_whole_model_through_the_triton_experts_equals_the_grouped_loop(tmp_path):
    """A Qwen3-MoE model's step (a prompt and a batch of decodes) with the experts on the Triton
    kernels gives the logits of the grouped loop: the layer hands both the same routing and adds the
    result alike. On a GPU machine both run on the GPU (the native kernels take device tensors);
    elsewhere in the interpreter.
    """
    pytest.importorskip("kernels.triton_moe", reason="triton is not installed")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from tests.support.forward import BLOCK, run_step
    from tests.support.tiny import make_tiny_llama
    from worker.model.kv_pool import KVPool
    from worker.weights.loader import load_model

    folder = make_tiny_llama(
        tmp_path,
        seed=5,
        family="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    model, config = load_model(str(folder), "auto", torch.float32, device)
    # a prompt, and two sequences of one token (decode rows over only their own key: no unwritten
    # slot read)
    seqs = [([(5 * i) % 300 + 3 for i in range(9)], 0, [0, 1, 2]), ([7], 0, [3]), ([11], 0, [5])]
    logits = {}
    for backend in ("torch", "triton"):
        for layer in model.layers:
            layer.moe.backend = backend
        pool = KVPool(config, 8, BLOCK, torch.float32, device)
        logits[backend] = run_step(model, config, pool, seqs)[0]
    assert torch.isfinite(logits["torch"]).all()
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def naive_gpt_oss(h, weights, ids, gate_up, down, gu_bias, d_bias, limit=7.0, alpha=1.702):
    """gpt-oss's experts as transformers writes them: biases, gate clamped from above, up within
    the limit, (up + 1) * gate * sigmoid(alpha * gate).
    """
    out = torch.zeros_like(h, dtype=torch.float32)
    inter = gate_up.shape[1] // 2
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = F.linear(h[t].float(), gate_up[e].float(), gu_bias[e].float())
            gate, up = gu[:inter].clamp(max=limit), gu[inter:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, j].float() * F.linear(act, down[e].float(), d_bias[e].float())
    return out


@pytest.mark.parametrize("path", ["grouped", pytest.param("triton", marks=pytest.mark.kernels)])
def test_gpt_oss_experts_with_biases_and_the_clamped_swiglu(path):
    """Biases on both projections and activations large enough that the clamp bites, through the
    grouped loop and the Triton grouped matmuls alike.
    """
    tokens, experts, top_k, hidden, inter = 23, 8, 2, 48, 40
    dtype = DTYPES[0] if path == "triton" else torch.float32
    device = DEVICE if path == "triton" else "cpu"
    h, w, ids, gate_up, down = (
        x.to(device) for x in case(tokens, experts, top_k, hidden, inter, dtype, seed=4)
    )
    h = h * 6.0  # gates and ups of several units: some past the limit of 7
    g = torch.Generator().manual_seed(5)
    gu_bias = torch.randn(experts, 2 * inter, generator=g).to(device, dtype)
    d_bias = torch.randn(experts, hidden, generator=g).to(device, dtype)
    act = partial(clamped_swiglu, 7.0, 1.702)
    pre = F.linear(h.float(), gate_up[ids[:, 0]].float()[0])
    assert (pre.abs() > 7).any()  # the clamp is exercised
    want = naive_gpt_oss(h, w, ids, gate_up, down, gu_bias, d_bias)
    if path == "grouped":
        got = grouped_experts(h, w, ids, gate_up, down, act, gu_bias, d_bias)
    else:
        triton_moe = pytest.importorskip("kernels.triton_moe", reason="triton is not installed")
        got = triton_moe.fused_moe(h, w, ids, gate_up, down, act, gu_bias, d_bias)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("qtype", ["MXFP4", "Q4_K", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("activations", ["int16", "int8", "fp32"])
@pytest.mark.parametrize("kind", ["silu", "gpt-oss", "relu2"])
@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_one_native_call_equals_the_grouped_loop_on_the_same_blocks(
    native, qtype, activations, kind, tokens
):
    """The experts on their blocks in one native call (pagedserve_moe_experts) give what the grouped
    loop gives through the same library, expert by expert: packed with 16- or 8-bit activations, or
    unpacked with fp32 ones; SiLU-mul, gpt-oss's biases and clamped SwiGLU, or Nemotron-H's relu² of
    up alone; experts no token chose skipped; and what both give is the dequantized experts'
    answer.
    """
    from types import SimpleNamespace

    from worker.model.moe import NativeExperts
    from worker.model.quant_weights import ExpertBlocks
    from worker.model.quantized import QuantizedMatmul

    experts, top_k, hidden, inter = 6, 2, 256, 256
    g = torch.Generator().manual_seed(tokens)
    lib = QuantizedMatmul(
        native,
        dense=None,
        max_kernel_rows=64,
        int8_activations=activations == "int8",
        packing=activations != "fp32",
        pack_q8=True,
    )
    gpt_oss, relu2 = kind == "gpt-oss", kind == "relu2"
    gate_up, gu_values = quantized_experts(g, experts, (1 if relu2 else 2) * inter, hidden, qtype)
    down, d_values = quantized_experts(g, experts, hidden, inter, qtype)
    blocks = ExpertBlocks([lib.pack(w) for w in gate_up], [lib.pack(w) for w in down])
    assert NativeExperts.serves(blocks, lib)
    h = torch.randn(tokens, hidden, generator=g) * (6.0 if gpt_oss else 1.0)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 3] = -1.0  # an expert no token chooses
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    biases = (
        (torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, hidden, generator=g))
        if gpt_oss
        else (None, None)
    )
    moe = SimpleNamespace(
        gate_up_bias=biases[0],
        down_bias=biases[1],
        limit=7.0 if gpt_oss else None,
        alpha=1.702,
        gated=not relu2,
    )
    act = partial(clamped_swiglu, 7.0, 1.702) if gpt_oss else TorchOps().silu_mul
    act = relu_squared if relu2 else act
    got = NativeExperts(moe, blocks, lib)(h, weights, ids)
    loop = grouped_experts(h, weights, ids, blocks.gate_up, blocks.down, act, *biases, lib)
    # 8-bit activations: the native SiLU (AVX-512: reciprocal and Newton step) may sit an ulp from
    # torch's, and a value on a rounding edge then moves one int8 step (19 tokens, Q4_0: 8.5e-4)
    tol = 2e-3 if activations == "int8" else 2e-4
    torch.testing.assert_close(got, loop, atol=tol, rtol=tol)
    dense = grouped_experts(h, weights, ids, gu_values, d_values, act, *biases)
    assert (got - dense).norm() / dense.norm() < (5e-2 if activations == "int8" else 2e-3)
