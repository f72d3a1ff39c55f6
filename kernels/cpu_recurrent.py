"""The native CPU library's recurrent layers over the state pool (kernels/cpu/delta_rule.c): Gated
DeltaNet's decode (conv step, delta rule, gated norm) and its prompt chunks, and Mamba2's decode in
one call from in_proj's output to the gated norm (PsMamba, which the fused step reads too): the
part of NativeKernels around the state pool.
"""

from __future__ import annotations

import ctypes

import torch

_P, _I32, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
MAMBA_NORMS = {"none": 0, "gated": 1, "before_gate": 2}  # PsMamba.norm_kind


class PsMamba(ctypes.Structure):
    """kernels/cpu/pagedserve.h's PsMamba: a Mamba2 mixer's parameters and its layer of the state
    pool (worker/model/mamba2.py Mamba2.native builds one).
    """

    _fields_ = [
        *((name, _P) for name in ("conv", "conv_bias", "dt_bias", "a", "d", "norm")),
        ("conv_states", _P),
        ("ssm_states", _P),
        *((name, _I32) for name in ("heads", "head_dim", "groups", "d_state", "kernel")),
        ("norm_kind", _I32),
        ("dt_min", _F),
        ("eps", _F),
    ]


class PsDelta(ctypes.Structure):
    """kernels/cpu/pagedserve.h's PsDelta: a Gated DeltaNet layer's parameters and its layer of
    the state pool (worker/model/delta_net.py GatedDeltaNet.native builds one).
    """

    _fields_ = [
        *((name, _P) for name in ("conv", "dt_bias", "a_neg", "norm", "conv_states", "states")),
        *((name, _I32) for name in ("k_heads", "v_heads", "dk", "dv", "kernel", "tiled")),
        ("eps", _F),
        ("beta_scale", _F),
    ]


class PsConv(ctypes.Structure):
    """kernels/cpu/pagedserve.h's PsConv: an LFM short conv's weight and its layer of the state pool
    (worker/model/short_conv.py ShortConv.native builds one).
    """

    _fields_ = [("conv", _P), ("conv_states", _P), ("channels", _I32), ("kernel", _I32)]


class NativeRecurrent:
    """Recurrent-layer calls of the loaded library, bound by `_bind_recurrent`."""

    def _bind_recurrent(self, lib: ctypes.CDLL) -> None:
        self._conv_step, self._delta_step = lib.pagedserve_conv_step, lib.pagedserve_delta_rule_step
        self._gated_norm, self._delta_chunked = (
            lib.pagedserve_gated_norm,
            lib.pagedserve_delta_rule_chunked,
        )
        self._mamba_decode, self._delta_decode = (
            lib.pagedserve_mamba_decode,
            lib.pagedserve_delta_decode,
        )

    def delta_net_decode(self, x, z, g, beta, conv_states, states, slots, conv, norm, layer):
        # one function: each tensor's layout is checked where the library reads it
        """One token a row through Gated DeltaNet (conv, delta rule, gated norm), states moved in
        their slots -> [rows, v_heads * dv], or None for an unsupported layout.

        x [rows, conv_dim], z [rows, v_heads * dv], g, beta fp32 [rows, v_heads], conv_states
        [slots, K-1, conv_dim], states fp32 [slots, v_heads, dk, dv], conv [conv_dim, K], norm [dv].
        """
        k_heads, v_heads, dk, dv, tiled, eps = layer
        rows, channels = x.shape
        f32 = torch.float32
        ok = (
            all(t.dtype == f32 and t.device.type == "cpu" for t in (x, z, conv_states, states))
            and x.stride(1) == 1
            and z.stride(1) == 1
            and conv_states.is_contiguous()
            and states.is_contiguous()
            and conv.dtype == norm.dtype == f32
            and conv.is_contiguous()
            and norm.is_contiguous()
            and channels == conv.shape[0] == conv_states.shape[2]
            and tuple(states.shape[1:]) == (v_heads, dk, dv)
            and dv <= 512
            and v_heads % k_heads == 0
        )
        if not ok:
            return None
        slots = slots.to(torch.int64).contiguous()
        g, beta = g.to(f32).contiguous(), beta.to(f32).contiguous()
        y = torch.empty(rows, channels, dtype=f32)
        self._conv_step(
            x.data_ptr(),
            x.stride(0),
            conv_states.data_ptr(),
            slots.data_ptr(),
            conv.data_ptr(),
            None,
            y.data_ptr(),
            rows,
            channels,
            conv.shape[1],
        )
        o = torch.empty(rows, v_heads, dv, dtype=f32)
        if self._delta_step(
            y.data_ptr(),
            y.stride(0),
            g.data_ptr(),
            beta.data_ptr(),
            states.data_ptr(),
            slots.data_ptr(),
            o.data_ptr(),
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
            int(tiled),
        ):
            raise ValueError(f"delta_rule_step does not serve {v_heads} x {dv} value heads")
        out = torch.empty(rows, v_heads * dv, dtype=f32)
        self._gated_norm(
            o.data_ptr(),
            z.data_ptr(),
            z.stride(0),
            norm.data_ptr(),
            out.data_ptr(),
            rows,
            v_heads,
            dv,
            float(eps),
        )
        return out

    def delta_rule_chunked(self, y, g, beta, state, layer, chunk: int = 64):
        """One sequence through the delta rule in WY chunks: y fp32 [tokens, conv_dim], g, beta
        [tokens, v_heads], state fp32 [v_heads, dk, dv] in place -> fp32 [tokens, v_heads, dv], or
        None.
        """
        k_heads, v_heads, dk, dv, tiled, _ = layer
        f32 = torch.float32
        if not (
            y.dtype == state.dtype == f32
            and y.device.type == "cpu"
            and y.stride(1) == 1
            and state.is_contiguous()
            and tuple(state.shape) == (v_heads, dk, dv)
            and v_heads % k_heads == 0
        ):
            return None
        g, beta = g.to(f32).contiguous(), beta.to(f32).contiguous()
        out = torch.empty(y.shape[0], v_heads, dv, dtype=f32)
        if self._delta_chunked(
            y.data_ptr(),
            y.stride(0),
            g.data_ptr(),
            beta.data_ptr(),
            state.data_ptr(),
            out.data_ptr(),
            y.shape[0],
            k_heads,
            v_heads,
            dk,
            dv,
            int(tiled),
            chunk,
        ):
            return None
        return out

    def mamba_step(self, desc: PsMamba, proj: torch.Tensor, slots: torch.Tensor):
        """One token a row through a Mamba2 mixer: proj fp32 [rows, in_proj rows] (z, x B C, raw
        step sizes) -> fp32 [rows, heads * head_dim], gated-normed, each row's conv and SSD state
        advanced in its slot of desc's pool layer; None for a layout it does not take.
        """
        inner = desc.heads * desc.head_dim
        conv_dim = inner + 2 * desc.groups * desc.d_state
        width = (inner + conv_dim + desc.heads, inner, conv_dim + inner)
        return self._mixer_step(self._mamba_decode, desc, proj, slots, *width)

    def delta_step(self, desc: PsDelta, proj: torch.Tensor, slots: torch.Tensor):
        """One token a row through a Gated DeltaNet layer: proj fp32 [rows, in_proj rows] (q k v,
        z, b, a) -> fp32 [rows, v_heads * dv], gated-normed, states advanced in their slots; None
        for a layout it does not take.
        """
        v_size = desc.v_heads * desc.dv
        conv_dim = 2 * desc.k_heads * desc.dk + v_size
        width = (conv_dim + v_size + 2 * desc.v_heads, v_size, conv_dim + v_size)
        return self._mixer_step(self._delta_decode, desc, proj, slots, *width)

    @staticmethod
    def _mixer_step(fn, desc, proj, slots, in_rows: int, out_width: int, scratch_width: int):
        if not (
            proj.dtype == torch.float32
            and proj.device.type == "cpu"
            and proj.stride(1) == 1
            and proj.shape[1] == in_rows
        ):
            return None
        rows = proj.shape[0]
        slots = slots.to(torch.int64).contiguous()
        out, scratch = torch.empty(rows, out_width), torch.empty(rows, scratch_width)
        args = (proj.data_ptr(), proj.stride(0), slots.data_ptr(), rows, out.data_ptr())
        if fn(ctypes.addressof(desc), *args, scratch.data_ptr()):
            return None
        return out
