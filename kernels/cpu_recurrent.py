"""The native CPU library's recurrent layers over the state pool (kernels/cpu/delta_rule.c): Gated
DeltaNet's decode (conv step, delta rule, gated norm) and its prompt chunks, and Mamba2's decode
(conv step with its bias, the state-space step): the part of NativeKernels around the state pool.
"""

from __future__ import annotations

import ctypes

import torch


class NativeRecurrent:
    """Recurrent-layer calls of the loaded library, bound by `_bind_recurrent`."""

    def _bind_recurrent(self, lib: ctypes.CDLL) -> None:
        self._conv_step, self._delta_step = lib.pagedserve_conv_step, lib.pagedserve_delta_rule_step
        self._gated_norm, self._delta_chunked = (
            lib.pagedserve_gated_norm,
            lib.pagedserve_delta_rule_chunked,
        )
        self._ssd_step = lib.pagedserve_ssd_step

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

    def mamba_decode(self, xbc, dt, a, d, conv_states, ssm_states, slots, conv, conv_bias, layer):
        # one function: each tensor's layout is checked where the library reads it
        """One token a row through Mamba2's conv (with its bias) and state-space step, conv and
        state slots advanced in place -> y fp32 [rows, heads * head_dim], the D skip added (the
        gated norm is the mixer's); None for a layout it does not take (as kernels/triton_ssd.py).

        xbc [rows, conv channels] (x, B, C before the conv), dt fp32 [rows, heads] (after
        softplus), a, d [heads], conv_states [slots, K-1, channels], ssm_states fp32 [slots,
        heads, head_dim, d_state], conv [channels, K], conv_bias [channels].
        """
        heads, head_dim, groups, d_state = layer
        rows, channels = xbc.shape
        f32 = torch.float32
        if not (
            all(t.dtype == f32 and t.device.type == "cpu" for t in (xbc, conv_states, ssm_states))
            and xbc.stride(1) == 1
            and conv_states.is_contiguous()
            and ssm_states.is_contiguous()
            and conv.dtype == conv_bias.dtype == f32
            and conv.is_contiguous()
            and conv_bias.is_contiguous()
            and channels == conv.shape[0] == conv_states.shape[2]
            and channels == heads * head_dim + 2 * groups * d_state
            and tuple(ssm_states.shape[1:]) == (heads, head_dim, d_state)
            and heads % groups == 0
        ):
            return None
        slots = slots.to(torch.int64).contiguous()
        y = torch.empty(rows, channels, dtype=f32)
        self._conv_step(
            xbc.data_ptr(),
            xbc.stride(0),
            conv_states.data_ptr(),
            slots.data_ptr(),
            conv.data_ptr(),
            conv_bias.data_ptr(),
            y.data_ptr(),
            rows,
            channels,
            conv.shape[1],
        )
        dt, a, d = (t.to(f32).contiguous() for t in (dt, a, d))
        out = torch.empty(rows, heads * head_dim, dtype=f32)
        self._ssd_step(
            y.data_ptr(),
            channels,
            dt.data_ptr(),
            a.data_ptr(),
            d.data_ptr(),
            ssm_states.data_ptr(),
            slots.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            groups,
            head_dim,
            d_state,
        )
        return out
