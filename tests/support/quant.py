"""Quantized blocks for tests: random K-quant weights beside gguf's own dequantization of them, and
the check that a model served on a file's blocks computes the projections its dense copy does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.model.quant_weights import QUANT_TYPES, QuantWeight

gguf = pytest.importorskip("gguf")


def random_k_blocks(rng, out_dim: int, in_dim: int, qtype: str) -> tuple[QuantWeight, torch.Tensor]:
    """Random K-quant blocks (any bytes are a valid block once its fp16 scales are finite and
    modest) and gguf's own dequantization of them: gguf cannot quantize to the K types, only read
    them.
    """
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    _, values, bb = QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, (out_dim, in_dim // values, bb), dtype=np.uint8)
    scales = (
        rng.uniform(0.002, 0.02, (out_dim, in_dim // values, 2)).astype(np.float16).view(np.uint8)
    )
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin first
        blocks[..., 0:4] = scales.reshape(out_dim, in_dim // values, 4)
    else:  # Q6_K: d last
        blocks[..., 208:210] = scales[..., 0:2]
    blocks = blocks.reshape(out_dim, -1)
    reference = gguf.quants.dequantize(blocks, kind).reshape(out_dim, in_dim)
    return QuantWeight(torch.from_numpy(blocks), qtype, in_dim), torch.from_numpy(
        np.ascontiguousarray(reference)
    )


def assert_projections_match(model, dense) -> None:
    """Every projection of `model` (on its matmul library) multiplies as `dense`'s loaded parameter
    does.
    """
    x = torch.randn(3, model.config.hidden_size)
    for layer, dense_layer in zip(model.layers, dense.layers, strict=True):
        for name in layer.matmul_names:
            w = getattr(dense_layer, name)
            inp = x if w.shape[1] == model.config.hidden_size else torch.randn(3, w.shape[1])
            torch.testing.assert_close(
                layer.mm(inp, layer.w[name]), inp @ w.T, atol=2e-4, rtol=1e-3
            )


def quantized_experts(g, experts, rows, cols, qtype):
    """Random experts as GGUF blocks (QuantWeight each) and their dequantized values."""
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    blocks, values = [], []
    for e in range(experts):
        if qtype.endswith("_K"):  # gguf reads the K types but cannot write them
            w, v = random_k_blocks(np.random.default_rng(e), rows, cols, qtype)
            blocks.append(w)
            values.append(v)
            continue
        w = (torch.randn(rows, cols, generator=g) / cols**0.5).numpy()
        q = gguf.quants.quantize(w, kind)
        blocks.append(QuantWeight(torch.from_numpy(np.ascontiguousarray(q)), qtype, cols))
        values.append(torch.from_numpy(gguf.quants.dequantize(q, kind).reshape(rows, cols)))
    return blocks, torch.stack(values)
