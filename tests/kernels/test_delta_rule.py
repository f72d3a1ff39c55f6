"""Gated DeltaNet's pieces (kernels/delta_rule.py) against transformers' own reference functions:
a prompt in chunks of the WY form, one step at a time, and any split of a sequence between the
two, state carried, as chunked prefill and decoding split it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.delta_rule import (
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    gated_delta_rule_step,
)


def inputs(length: int, k_heads: int = 2, v_heads: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, k_heads, 16, generator=g)
    k = torch.randn(length, k_heads, 16, generator=g)
    v = torch.randn(length, v_heads, 8, generator=g)
    decay = -torch.rand(length, v_heads, generator=g) * 2
    beta = torch.rand(length, v_heads, generator=g)
    state = torch.randn(v_heads, 16, 8, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 17, 64, 150])
@pytest.mark.parametrize("k_heads", [2, 4])
def test_the_chunked_form_equals_transformers(length, k_heads):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, decay, beta, state = inputs(length, k_heads)
    out, new = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    ref, ref_state = torch_chunk_gated_delta_rule(
        *(x[None] for x in (q, k, v, decay, beta)),
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new, ref_state[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 40, 64, 99])
def test_a_prompt_split_anywhere_then_decoded_step_by_step_gives_the_same(split):
    q, k, v, decay, beta, state = inputs(120, seed=1)
    whole, final = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    first, s = chunk_gated_delta_rule(
        q[:split], k[:split], v[:split], decay[:split], beta[:split], state
    )
    rest = []
    s = s[None]
    for t in range(split, 120):
        o, s = gated_delta_rule_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], s
        )
        rest.append(o)
    torch.testing.assert_close(torch.cat([first, *rest]), whole, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(s[0], final, atol=3e-5, rtol=1e-4)


def test_one_step_over_many_rows_equals_each_row_alone():
    rows = [inputs(1, seed=s) for s in range(5)]
    q, k, v, decay, beta = (torch.cat([r[i] for r in rows]) for i in range(5))
    states = torch.stack([r[5] for r in rows])
    out, new = gated_delta_rule_step(q, k, v, decay, beta, states)
    for i, r in enumerate(rows):
        alone, s = chunk_gated_delta_rule(*r)
        torch.testing.assert_close(out[i], alone[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(new[i], s, atol=2e-6, rtol=1e-5)


def test_the_causal_conv_reads_its_last_inputs_and_keeps_the_newest():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(10, 12, generator=g), torch.randn(12, 4, generator=g)
    state = torch.randn(3, 12, generator=g)
    out, new = causal_conv(x, state, weight)
    ref = F.conv1d(torch.cat([state, x]).t()[None], weight[:, None, :], groups=12)[0].t()
    torch.testing.assert_close(out, F.silu(ref))
    assert torch.equal(new, x[-3:])
    # one input at a time, many rows at once, the same
    states = state[None].repeat(2, 1, 1)
    for t in range(10):
        step, states = causal_conv_step(x[t : t + 1].repeat(2, 1), states, weight)
        torch.testing.assert_close(step[1], out[t])
    assert np.array_equal(states[0].numpy(), new.numpy())


def decode_kernels(backend: str):
    """The native library, or the Triton kernels (natively on CUDA, interpreted elsewhere), and
    the device their tensors live on.
    """
    if backend == "triton":
        from kernels.triton_elementwise import TritonElementwise

        return TritonElementwise, "cuda" if torch.cuda.is_available() else "cpu"
    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        pytest.skip("no C compiler here: torch runs the decode")
    return native, "cpu"


def assert_decoded_in_place(got, want, pools, new, slots, before) -> None:
    """A decode kernel's output as the definition's; its rows' conv and recurrent states in their
    slots as the definition leaves them, the other slots (1, 3, 5) untouched."""
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pools[0][slots].cpu(), new[0])
    torch.testing.assert_close(pools[1][slots].cpu(), new[1], atol=2e-6, rtol=1e-5)
    others = [1, 3, 5]
    for pool, old in zip(pools, before, strict=True):
        assert torch.equal(pool[others].cpu(), old[others])


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("tiled", [False, True])
def test_the_decode_kernels_equal_the_definition_in_place_in_each_rows_slot(backend, tiled):
    """conv, delta rule and gated norm in single passes: each row's output, and the states in its
    slot (others untouched), as the torch pieces give them; rows in any slot order.
    """
    kernels, device = decode_kernels(backend)
    kh, vh, dk, dv, kernel, rows = 2, 4, 16, 8, 4, 3
    g = torch.Generator().manual_seed(4)
    conv_dim = 2 * kh * dk + vh * dv
    proj = torch.randn(rows, conv_dim + vh * dv + 2 * vh, generator=g)
    x, z, b, a = proj.split([conv_dim, vh * dv, vh, vh], -1)
    beta, decay = torch.sigmoid(b), -F.softplus(a) * 0.7
    conv_w = torch.randn(conv_dim, kernel, generator=g) * 0.3
    norm_w = torch.rand(dv, generator=g) + 0.5
    conv_states = torch.randn(6, kernel - 1, conv_dim, generator=g)
    states = torch.randn(6, vh, dk, dv, generator=g) * 0.1
    slots = torch.tensor([4, 0, 2])
    # the definition, each row alone
    y, conv_new = causal_conv_step(x, conv_states[slots], conv_w)
    q, k, v = y.split([kh * dk, kh * dk, vh * dv], -1)
    q, k = q.reshape(rows, kh, dk), k.reshape(rows, kh, dk)
    if tiled:  # value head j reads key head j % kh
        q, k = q.repeat(1, vh // kh, 1), k.repeat(1, vh // kh, 1)
    o, state_new = gated_delta_rule_step(q, k, v.reshape(rows, vh, dv), decay, beta, states[slots])
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (norm_w * normed * F.silu(z.reshape(rows, vh, dv))).reshape(rows, vh * dv)
    before = conv_states.clone(), states.clone()
    shape = (kh, vh, dk, dv, tiled, 1e-6)
    proj, conv_states, states, slots, conv_w, norm_w = (
        t.to(device) for t in (proj, conv_states, states, slots, conv_w, norm_w)
    )
    x, z = proj[:, :conv_dim], proj[:, conv_dim : conv_dim + vh * dv]
    decay, beta = decay.to(device), beta.to(device)
    got = kernels.delta_net_decode(
        x, z, decay, beta, conv_states, states, slots, conv_w, norm_w, shape
    )
    assert_decoded_in_place(got, want, (conv_states, states), (conv_new, state_new), slots, before)
    # a layout it does not take (a float64 state) is left to torch, with nothing changed
    wide = states.double()
    assert (
        kernels.delta_net_decode(x, z, decay, beta, conv_states, wide, slots, conv_w, norm_w, shape)
        is None
    )
    assert torch.equal(wide.float(), states)


@pytest.mark.parametrize("length", [2, 63, 64, 150])
@pytest.mark.parametrize("tiled", [False, True])
def test_the_native_chunked_prompt_equals_the_definition(length, tiled):
    """A prompt through the library's WY chunks, its slot's state moved on in place: the same
    outputs and state as the torch chunks (head groups read in either order).
    """
    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        pytest.skip("no C compiler here: torch runs the prompt")
    q, k, v, decay, beta, state = inputs(length, seed=length)
    kh, vh = q.shape[1], v.shape[1]
    y = torch.cat([q.reshape(length, -1), k.reshape(length, -1), v.reshape(length, -1)], -1)
    qr, kr = (q, k) if not tiled else (q.repeat(1, vh // kh, 1), k.repeat(1, vh // kh, 1))
    want, want_state = chunk_gated_delta_rule(qr, kr, v, decay, beta, state)
    slot = state.clone()
    got = native.delta_rule_chunked(y, decay, beta, slot, (kh, vh, 16, 8, tiled, 1e-6))
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(slot, want_state, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens,chunk", [(1, 64), (37, 8), (64, 64), (130, 64)])
def test_mamba2_scan_in_chunks_equals_one_token_at_a_time(tokens, chunk):
    """The chunked SSD (prompts) and the step form (decodes) carry the same state: a prompt's
    output and final state equal its tokens fed one by one from the same initial state."""
    from kernels.delta_rule import ssd_chunked, ssd_step

    gen = torch.Generator().manual_seed(tokens)
    heads, head_dim, groups, d_state = 4, 8, 2, 6
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    dt = torch.rand(tokens, heads, generator=gen) * 0.5
    a = -torch.rand(heads, generator=gen) * 2
    b = torch.randn(tokens, groups, d_state, generator=gen)
    c = torch.randn(tokens, groups, d_state, generator=gen)
    state = torch.randn(heads, head_dim, d_state, generator=gen)
    step_state, outs = state[None].clone(), []
    for t in range(tokens):
        out, step_state = ssd_step(
            x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], step_state
        )
        outs.append(out)
    y, final = ssd_chunked(x, dt, a, b, c, state, chunk=chunk)
    torch.testing.assert_close(y, torch.cat(outs), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, step_state[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton"])
def test_the_mamba2_decode_equals_the_definition_in_place_in_each_rows_slot(backend):
    """Conv step (with its bias) and the state-space step in two Triton launches: each row's
    output and the states in its slot as the torch pieces give them, other slots untouched; a
    layout it does not take (a float64 state) left to torch with nothing changed. (The native
    library takes the whole mixer in one call: the next test.)"""
    from kernels.delta_rule import ssd_step

    kernels, device = decode_kernels(backend)
    heads, head_dim, groups, d_state, kernel, rows = 4, 8, 2, 6, 4, 3
    g = torch.Generator().manual_seed(7)
    inner = heads * head_dim
    channels = inner + 2 * groups * d_state
    xbc = torch.randn(rows, channels, generator=g)
    dt = torch.rand(rows, heads, generator=g) * 0.5
    a, d = -torch.rand(heads, generator=g) * 2, torch.randn(heads, generator=g)
    conv_w = torch.randn(channels, kernel, generator=g) * 0.3
    bias = torch.randn(channels, generator=g) * 0.1
    conv_states = torch.randn(6, kernel - 1, channels, generator=g)
    states = torch.randn(6, heads, head_dim, d_state, generator=g) * 0.1
    slots = torch.tensor([4, 0, 2])
    y, conv_new = causal_conv_step(xbc, conv_states[slots], conv_w, True, bias)
    x, b, c = y.split([inner, groups * d_state, groups * d_state], -1)
    x = x.reshape(rows, heads, head_dim)
    shape = (rows, groups, d_state)
    want, state_new = ssd_step(x, dt, a, b.reshape(shape), c.reshape(shape), states[slots])
    want = (want + d[:, None] * x).reshape(rows, inner)
    before = conv_states.clone(), states.clone()
    layer = (heads, head_dim, groups, d_state)
    args = [t.to(device) for t in (xbc, dt, a, d, conv_states, states, slots, conv_w, bias)]
    got = kernels.mamba_decode(*args, layer)
    conv_states, states = args[4], args[5]
    assert_decoded_in_place(got, want, (conv_states, states), (conv_new, state_new), slots, before)
    wide = states.double()
    args[5] = wide
    assert kernels.mamba_decode(*args, layer) is None
    assert torch.equal(wide.float(), states)


def mixer_config(**fields):
    """A one-layer ModelConfig around a stateful mixer of the given fields."""
    from worker.model.config import ModelConfig

    common = dict(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1)
    return ModelConfig(**common, num_heads=2, num_kv_heads=2, head_dim=16, **fields)


def assert_decodes_as_torch(mixer, pool_shapes, ops, seed: int) -> None:
    """Three decode rows in slots 2, 0, 3 of a 4-slot pool through the mixer twice, on its torch
    path and through ops: the same output, and every slot's states as the torch path leaves them."""
    from worker.model.delta_net import StateStep

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    proj = torch.randn(3, mixer.in_rows, generator=g)
    step = StateStep(torch.tensor([2, 0, 3]), [0, 1, 2, 3])
    pools = [tuple(torch.randn(4, *shape, generator=g) for shape in pool_shapes)]
    pools.append(tuple(t.clone() for t in pools[0]))
    want = mixer(proj, step, *pools[0])
    got = mixer(proj, step, *pools[1], ops=ops)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for ours, theirs in zip(pools[1], pools[0], strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("norm", ["gated", "before_gate", "none"])
def test_a_mamba2_mixer_decodes_through_the_fast_ops_as_through_torch(backend, norm):
    """The mixer hands its decode rows to the native library (one call from in_proj's output to
    the gated norm, each of its norm kinds) or the Triton kernels (CUDA; interpreted here) where
    the ops have them: the output and every slot's states as its torch path leaves them."""
    from worker.model.elementwise import NativeOps, TritonOps
    from worker.model.mamba2 import Mamba2

    ops = TritonOps() if backend == "triton" else NativeOps(decode_kernels(backend)[0])
    config = mixer_config(
        mamba_layers=(True,),
        mamba_heads=4,
        mamba_head_dim=8,
        mamba_groups=2,
        mamba_d_state=6,
        mamba_conv_kernel=4,
        mamba_norm=norm,
        mamba_dt_min=0.3,  # some heads' step sizes floored
    )
    mixer = Mamba2(config)
    assert_decodes_as_torch(mixer, [(3, mixer.conv_dim), (4, 8, 6)], ops, seed=3)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_a_gated_delta_net_layer_decodes_in_one_native_call_as_through_torch(tiled, beta_scale):
    """The layer hands its decode rows to the native library in one call (decay, beta, conv, delta
    rule, gated norm; OLMo-Hybrid's beta scale; llama.cpp's tiled value heads): the output and
    every slot's states as its torch path leaves them."""
    from worker.model.delta_net import GatedDeltaNet
    from worker.model.elementwise import NativeOps

    config = mixer_config(
        linear_layers=(True,),
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=16,
        linear_v_dim=8,
        linear_conv_kernel=4,
        linear_tiled_values=tiled,
        linear_beta_scale=beta_scale,
    )
    layer = GatedDeltaNet(config, 2, 4)
    ops = NativeOps(decode_kernels("native")[0])
    assert_decodes_as_torch(layer, [(3, layer.conv_dim), (4, 16, 8)], ops, seed=5)
