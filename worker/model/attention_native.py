"""The kernel-backed attention backends (`cpu`, `triton`) and `make_backend`, which picks one."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch

from worker.model.attention import (
    AttentionBackend,
    PrefillRows,
    TorchAttention,
    TorchAttentionMeta,
    prefill_row,
)

log = structlog.get_logger("worker.model.attention")


@dataclass
class CpuAttentionMeta:
    decode_rows: torch.Tensor  # int64 [n]: the query token of each decoding sequence
    decode_tables: torch.Tensor  # int32 [n, max_blocks]
    decode_lens: torch.Tensor  # int32 [n]
    prefill_starts: torch.Tensor  # int64 [p]: first query token of each sequence with more than one
    prefill_q_lens: torch.Tensor  # int32 [p]
    prefill_lens: torch.Tensor  # int32 [p]
    prefill_tables: torch.Tensor  # int32 [p, max_blocks]
    block_size: int
    _torch_prefills: list[PrefillRows] | None = None

    def torch_prefills(self) -> list[PrefillRows]:
        """The torch path's prefill metadata, built only where the native kernel cannot serve."""
        if self._torch_prefills is None:
            self._torch_prefills = [
                prefill_row(
                    self.prefill_tables[i : i + 1],
                    self.prefill_lens[i : i + 1].to(torch.int64),
                    int(self.prefill_starts[i]),
                    int(self.prefill_q_lens[i]),
                    self.block_size,
                )
                for i in range(self.prefill_starts.numel())
            ]
        return self._torch_prefills


class CpuAttention(TorchAttention):
    """Decodes in place through block tables, each key read once per GQA group; prompts as torch."""

    name = "cpu"
    # prompts over a bf16 pool in bf16 dot products
    prefill_bf16_dots = False

    def __init__(self) -> None:
        from kernels import cpu_native

        self._native = cpu_native.load()
        if self._native is None:
            raise RuntimeError(
                "the native CPU kernels could not be built (see the log); use "
                "--attention-backend torch"
            )

    @property
    def native(self):
        return self._native

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if not self._native.write_kv(k, v, k_cache, v_cache, slot_mapping):
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def supports(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> bool:
        return self._native.supports(n_heads, n_kv_heads, head_dim, block_size, dtype, kv_dtype)

    def prepare(
        self,
        block_tables,
        seq_lens,
        query_start_loc,
        block_size,
        max_seq_len,
        max_q_len,
        host_q_lens=None,
    ):
        qsl = query_start_loc.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        dec = (q_lens == 1).nonzero().flatten()
        pre = (q_lens > 1).nonzero().flatten()
        tables = block_tables.to(torch.int32)
        lens = seq_lens.to(torch.int32)
        return CpuAttentionMeta(
            decode_rows=qsl[dec].contiguous(),
            decode_tables=(tables if dec.numel() == tables.shape[0] else tables[dec]).contiguous(),
            decode_lens=lens[dec].contiguous(),
            prefill_starts=qsl[pre].contiguous(),
            prefill_q_lens=q_lens[pre].to(torch.int32).contiguous(),
            prefill_lens=lens[pre].contiguous(),
            prefill_tables=(tables if pre.numel() == tables.shape[0] else tables[pre]).contiguous(),
            block_size=block_size,
        )

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: CpuAttentionMeta,
        scale,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ):
        num_tokens, n_heads, head_dim = q.shape
        if sinks is not None:  # the kernels read fp32 sinks, one a query head
            sinks = sinks.float().contiguous()
        out = torch.empty(num_tokens, n_heads, head_dim, dtype=q.dtype, device=q.device)
        if meta.decode_rows.numel():
            q = q.contiguous()  # the decode kernel reads whole rows of a contiguous q
            self._native.paged_decode(
                q,
                k_cache,
                v_cache,
                out,
                meta.decode_rows,
                meta.decode_tables,
                meta.decode_lens,
                scale,
                window,
                softcap,
                sinks,
            )
        if meta.prefill_starts.numel():
            # a view of the fused QKV row reads in place
            if (
                self._native.supports_prefill(n_heads, k_cache.shape[2], head_dim)
                and q.stride(2) == 1
                and q.stride(1) == head_dim
            ):
                self._native.paged_prefill(
                    q,
                    k_cache,
                    v_cache,
                    out,
                    meta.prefill_starts,
                    meta.prefill_q_lens,
                    meta.prefill_lens,
                    meta.prefill_tables,
                    scale,
                    window,
                    softcap,
                    self.prefill_bf16_dots,
                    sinks,
                )
            else:
                TorchAttention.forward(
                    self,
                    q.contiguous(),
                    k_cache,
                    v_cache,
                    TorchAttentionMeta([], meta.torch_prefills()),
                    scale,
                    window,
                    softcap,
                    sinks,
                    out=out,
                )
        return out


@dataclass
class TritonAttentionMeta:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_q_len: int
    # a mixed step: kernels.triton_attention.MixedStep, gathered once for every layer
    mixed: object = None
    # the split scratch, allocated by the first layer only
    workspace: dict = field(default_factory=dict)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from kernels import (
            triton_attention,  # imported only when chosen: triton is a GPU dependency
        )

        self._kernels = triton_attention

    def prepare(
        self,
        block_tables,
        seq_lens,
        query_start_loc,
        block_size,
        max_seq_len,
        max_q_len,
        host_q_lens=None,
    ):
        """host_q_lens: query lengths on the host, so a mixed step splits without a sync."""
        meta = TritonAttentionMeta(block_tables, seq_lens, query_start_loc, max_seq_len, max_q_len)
        if host_q_lens is None:
            host_q_lens = (query_start_loc[1:] - query_start_loc[:-1]).cpu().numpy()
        decodes = host_q_lens == 1
        if decodes.any() and not decodes.all():
            index = torch.arange(len(host_q_lens), dtype=torch.int64)
            to = dict(device=block_tables.device, non_blocking=True)
            meta.mixed = self._kernels.split_mixed(
                block_tables,
                seq_lens,
                query_start_loc,
                index[torch.from_numpy(decodes)].to(**to),
                index[torch.from_numpy(~decodes)].to(**to),
            )
        return meta

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: TritonAttentionMeta,
        scale,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ):
        return self._kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_seq_len=meta.max_seq_len,
            max_q_len=meta.max_q_len,
            mixed=meta.mixed,
            workspace=meta.workspace,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend_name(device: torch.device) -> str:
    """triton on CUDA (torch, said out loud, where triton is not installed), cpu elsewhere."""
    if device.type != "cuda":
        return "cpu"
    if triton_available():
        return "triton"
    log.warning(
        "triton_missing",
        device=str(device),
        consequence="attention and the elementwise tail run in torch on the GPU, several times "
        "slower",
        fix="pip install triton (it comes with CUDA builds of torch)",
    )
    return "torch"


def make_backend(
    name: str | None,
    device: torch.device,
    shape: tuple | list[tuple] | None = None,
    bf16_prefill: bool = False,
) -> AttentionBackend:
    """The device's default unless named; `cpu` falls back to `torch` for shapes it cannot serve
    (shape: (heads, KV heads, head size, block, dtype, KV dtype), or one such a layer kind).
    """
    shapes = [shape] if isinstance(shape, tuple) else list(shape or ())
    chosen = name or default_backend_name(device)
    if chosen not in BACKENDS:
        raise ValueError(f"unknown attention backend {chosen!r}; choose from {sorted(BACKENDS)}")
    if chosen == "triton" and not triton_available():
        raise ValueError("--attention-backend triton needs the triton package (pip install triton)")
    if chosen == "cpu":
        try:
            backend = CpuAttention()
        except RuntimeError:
            if name:
                raise
            return TorchAttention()
        missed = [s for s in shapes if not backend.supports(*s)]
        if missed:
            if name:
                raise ValueError(
                    "the cpu attention backend does not cover heads/head_dim/block/dtype "
                    f"{missed[0]}"
                )
            return TorchAttention()
        kv_dtype = shapes[0][5] if shapes and len(shapes[0]) > 5 else None
        backend.prefill_bf16_dots = bool(
            bf16_prefill and kv_dtype == torch.bfloat16 and backend.native.prefill_bf16_dots
        )
        return backend
    return BACKENDS[chosen]()


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention, "cpu": CpuAttention}
