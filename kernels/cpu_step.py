"""The fused CPU decode step's structs as ctypes mirrors of kernels/cpu/pagedserve.h's (PsSegment,
PsMatrix, PsLayer, PsModel, PsLoraProj, PsLora, PsExperts): worker/model/fused_decode.py fills
them, and the library's own sizes are checked against these before a step runs.
"""

from __future__ import annotations

import ctypes

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class PsSegment(ctypes.Structure):
    _fields_ = [("w", _P), ("rows", _I64), ("type", _I32), ("pad", _I32)]


MAX_SEGMENTS = 3  # decode_step.c: a projection's row ranges of different types (a stack of q, k, v)


class PsMatrix(ctypes.Structure):
    _fields_ = [
        ("seg", PsSegment * MAX_SEGMENTS),
        ("out_dim", _I64),
        ("in_dim", _I64),
        ("dense", _P),
    ]


class PsLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", PsMatrix),
        ("o_proj", PsMatrix),
        ("gate_up", PsMatrix),
        ("down", PsMatrix),
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv_bias", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("rope", _I32),
        ("window", _I32),
        ("mamba", _P),  # a PsMamba (kernels/cpu_recurrent.py) where the layer is Mamba2
        ("delta", _P),  # a PsDelta where it is Gated DeltaNet
        ("attn_gate", _I32),  # gates after q, k, v: 1 a query value's (Qwen3.5), 2 a head's (LFM3)
        ("qk_whole", _I32),  # q/k norms over each token's whole projection (OLMo 3, MiniMax-M2)
        ("attn_out_norm", _P),  # Gemma's norms of the two blocks' outputs
        ("mlp_out_norm", _P),
        ("cos", _P),  # the layer's own RoPE tables (Gemma 3's sliding layers), or NULL
        ("sin", _P),
        ("conv", _P),  # a PsConv (kernels/cpu_recurrent.py) where the layer is an LFM short conv
        ("beside", _P),  # a PsLayer of Falcon-H1's Mamba2 beside attention, or NULL
        (
            "experts",
            _P,
        ),  # a PsExperts where the MLP is a mixture of experts (gate_up: its shared one)
        ("shared_gate", _P),  # [hidden]: the shared expert's output times sigmoid(shared_gate . x)
        ("sinks", _P),  # [n_heads]: gpt-oss's extra logit a head in each softmax, or NULL
        ("o_bias", _P),  # [hidden]: added to o_proj's output (gpt-oss), or NULL
    ]


class PsExperts(ctypes.Structure):
    """A mixture-of-experts MLP: router, each expert's blocks' addresses, the routing's rules."""

    _fields_ = [
        ("router", _P),
        ("correction", _P),
        ("router_bias", _P),
        ("gate_up", _P),
        ("down", _P),
        ("gate_up_bias", _P),
        ("down_bias", _P),
        ("gate_up_type", _I32),
        ("down_type", _I32),
        ("experts", _I32),
        ("top_k", _I32),
        ("inter", _I32),
        ("sigmoid", _I32),
        ("normalize", _I32),
        ("relu2", _I32),
        ("groups", _I32),
        ("topk_groups", _I32),
        ("pad", _I32),
        ("norm_eps", _F),
        ("scale", _F),
        ("limit", _F),
        ("alpha", _F),
    ]


class PsModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I32),
        ("hidden", _I32),
        ("n_heads", _I32),
        ("n_kv_heads", _I32),
        ("head_dim", _I32),
        ("intermediate", _I32),
        ("block_size", _I32),
        ("rotary_half", _I32),
        ("eps", _F),
        ("scale", _F),
        ("cos", _P),
        ("sin", _P),
        ("final_norm", _P),
        ("layers", ctypes.POINTER(PsLayer)),
        ("sgemm", _P),
        ("gemm_rows", _I32),
        ("kv_bf16", _I32),
        ("x8", _I32),
        ("residual_scale", _F),
        ("gelu", _I32),  # the MLP's activation: 0 SiLU, 1 GELU-tanh
        ("softcap", _F),  # Gemma 2's attention scores capped; 0: off
    ]


class PsLoraProj(ctypes.Structure):
    _fields_ = [
        ("a", _P),
        ("b", _P * MAX_SEGMENTS),
        ("a_rows", _I32),
        ("out_lo", _I32),
        ("out_hi", _I32),
        ("n_parts", _I32),
        ("part", (_I32 * 4) * MAX_SEGMENTS),
    ]


class PsLora(ctypes.Structure):
    _fields_ = [("proj", _P), ("row_adapter", _P), ("n_adapters", _I32), ("pad", _I32)]


def mirrors_match(kernels) -> bool:
    """Whether the ctypes structs here have the sizes the library's own (kernels/cpu/pagedserve.h)
    have.
    """
    return (
        tuple(
            ctypes.sizeof(t)
            for t in (PsSegment, PsMatrix, PsLayer, PsModel, PsLoraProj, PsLora, PsExperts)
        )
        == kernels.struct_sizes
    )
