"""The native CPU library's per-head work: head norms, RoPE, KV writes and paged attention
(kernels/cpu/paged_*.c): the part of NativeKernels around the KV pool."""

from __future__ import annotations

import ctypes

import torch


class NativeAttention:
    """Attention calls of the loaded library, bound by `_bind_attention`."""

    def _bind_attention(self, lib: ctypes.CDLL) -> None:
        self._decode, self._prefill = lib.pagedserve_paged_decode, lib.pagedserve_paged_prefill
        self._write_kv, self._prefill_tiles = lib.pagedserve_write_kv, lib.pagedserve_prefill_tiles
        self._head_rms_norm, self._rope = lib.pagedserve_head_rms_norm, lib.pagedserve_rope
        limits = (ctypes.c_int32 * 3)()
        lib.pagedserve_decode_limits(limits)
        self.max_group, self.max_head_dim, self.max_block = limits[0], limits[1], limits[2]
        lib.pagedserve_prefill_limits(limits)
        self.prefill_state, self.prefill_max_head_dim = limits[0], limits[1]
        # a bf16 pool's prefill can run in bf16 dot products here (AVX512_BF16; see paged_prefill.c)
        self.prefill_bf16_dots = bool(lib.pagedserve_prefill_bf16_dots())

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """Write k, v at their slots (-1: none); False (nothing written) otherwise."""
        tokens, heads, dim = k.shape
        ok = (
            k.dtype == v.dtype == torch.float32
            and k.stride() == v.stride()
            and k.stride(2) == 1
            and k.stride(1) == dim
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in KV_DTYPES
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k.device.type == "cpu"
            and tuple(k_cache.shape[2:]) == (heads, dim)
            and tuple(v.shape) == tuple(k.shape)
            and slots.numel() == tokens
        )
        if not ok:
            return False
        slots = slots.to(torch.int64).contiguous()
        self._write_kv(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            tokens,
            heads * dim,
            int(k_cache.dtype == torch.bfloat16),
        )
        return True

    def prefill_tiles(self, use: bool | None = None) -> bool:
        """Whether bf16 prompt attention runs on AMX tiles; `use` sets it for the process."""
        return bool(self._prefill_tiles(-1 if use is None else int(use)))

    def paged_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        starts: torch.Tensor,
        q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        bf16_dots: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of prompt chunks over paged keys: row i's queries are the last q_lens[i]
        of seq_lens[i]. bf16_dots: bf16 products, fp32 sums; sinks: fp32 [n_heads] (gpt-oss).
        """
        n = starts.numel()
        if n == 0:
            return
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        kv = _kv_dtype(k_cache, v_cache, "paged_prefill")
        for t, dt in (
            (q, torch.float32),
            (out, torch.float32),
            (k_cache, kv),
            (v_cache, kv),
            (starts, torch.int64),
            (q_lens, torch.int32),
            (seq_lens, torch.int32),
            (block_tables, torch.int32),
        ):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(
                    f"paged_prefill needs {dt} tensors on the CPU, got {t.dtype} on {t.device}"
                )
        if not (
            q.stride(2) == 1
            and q.stride(1) == head_dim
            and out.is_contiguous()
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and starts.is_contiguous()
            and q_lens.is_contiguous()
            and seq_lens.is_contiguous()
            and block_tables.stride(1) == 1
        ):
            raise ValueError(
                "paged_prefill needs each token's query heads contiguous and contiguous tensors"
            )
        self._prefill(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            starts.data_ptr(),
            q_lens.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            n,
            q.shape[1],
            n_kv_heads,
            head_dim,
            block_size,
            float(scale),
            int(window),
            float(softcap),
            int(kv == torch.bfloat16),
            int(bool(bf16_dots)),
            _sinks(sinks, q.shape[1]),
        )

    def supports_prefill(self, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        group = n_heads // n_kv_heads
        return (
            group <= 16
            and head_dim <= self.prefill_max_head_dim
            and group * head_dim <= self.prefill_state
        )

    def supports(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> bool:
        """dtype: the queries' (fp32); kv_dtype: the pool's (fp32 or bf16; None: dtype)."""
        return (
            dtype == torch.float32
            and (kv_dtype or dtype) in KV_DTYPES
            and n_heads % n_kv_heads == 0
            and n_heads // n_kv_heads <= self.max_group
            and head_dim <= self.max_head_dim
            and block_size <= self.max_block
        )

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """One query a sequence over its paged keys; window, softcap, sinks as paged_prefill."""
        n = rows.numel()
        if n == 0:
            return
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        kv = _kv_dtype(k_cache, v_cache, "paged_decode")
        for t, dt in (
            (q, torch.float32),
            (out, torch.float32),
            (k_cache, kv),
            (v_cache, kv),
            (rows, torch.int64),
            (seq_lens, torch.int32),
            (block_tables, torch.int32),
        ):
            if t.dtype != dt or t.device.type != "cpu":
                raise TypeError(
                    f"paged_decode needs {dt} tensors on the CPU, got {t.dtype} on {t.device}"
                )
        if not (
            q.is_contiguous()
            and out.is_contiguous()
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and rows.is_contiguous()
            and seq_lens.is_contiguous()
            and block_tables.stride(1) == 1
        ):
            raise ValueError("paged_decode needs contiguous tensors")
        self._decode(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            rows.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            n,
            q.shape[1],
            n_kv_heads,
            head_dim,
            block_size,
            float(scale),
            int(window),
            float(softcap),
            _sinks(sinks, q.shape[1]),
            int(kv == torch.bfloat16),
        )

    def head_rms_norm(
        self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """In-place RMSNorm of the first `heads` heads of each row of x; weight [head_dim]."""
        self._head_rms_norm(
            x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, weight.data_ptr(), float(eps)
        )

    def rope(
        self,
        x: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate-half RoPE on the first `heads` heads; cos, sin [max_pos, rotary_dim / 2]."""
        self._rope(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            cos.shape[1],
        )


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the attention kernels read a pool in (kv_rows.h)


def _kv_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> torch.dtype:
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"{what} reads a KV pool of float32 or bfloat16 (K and V alike), got {k_cache.dtype} "
            f"and {v_cache.dtype}"
        )
    return k_cache.dtype


def _sinks(sinks: torch.Tensor | None, n_heads: int) -> int:
    """The sinks' address for the kernels (0: none), checked: fp32, contiguous, one a head."""
    if sinks is not None and not (
        sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == n_heads
    ):
        raise ValueError(f"sinks must be {n_heads} contiguous fp32 values, one a query head")
    return 0 if sinks is None else sinks.data_ptr()
