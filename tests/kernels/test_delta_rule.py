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
