"""Attention backends: how the model writes K/V into the pool and attends through block tables. `triton` (the
default wherever CUDA is present; under TRITON_INTERPRET=1 on a CPU, for tests), `cpu` (the CPU default
where the native library builds) and `torch` (the CPU fallback, tested against `kernels.reference`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch
import torch.nn.functional as F

from kernels import reference

log = structlog.get_logger("worker.model.attention")


class AttentionBackend:
    name = "abstract"

    def prepare(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
        block_size: int, max_seq_len: int, max_q_len: int, host_q_lens=None,
    ) -> object:
        """Per-step metadata, built once and shared by every layer (the maxima, and host_q_lens, the query
        lengths as numpy, come from the plan on the host: no sync)."""
        raise NotImplementedError

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def forward(self, q, k_cache, v_cache, meta, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        """window > 0: a sliding-window layer, each query sees only its last `window` keys (itself included).
        softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
        raise NotImplementedError


@dataclass
class PrefillRows:
    start: int  # first query token of the sequence in the step
    end: int
    slots: torch.Tensor  # int64 [seq_len]
    mask: torch.Tensor | None  # bool [q_len, seq_len]: query i sees key j < seq_len - q_len + i + 1; None
    # when the chunk is the whole sequence (q_len == seq_len): then plain causal, which the fused kernel
    # runs without materializing or applying a mask and skips the blocks above the diagonal


@dataclass
class DecodeBucket:
    tokens: torch.Tensor  # int64 [rows]: token index of each decode row in the step
    slots: torch.Tensor  # int64 [rows, width]: width = the longest sequence of the bucket
    mask: torch.Tensor  # bool [rows, 1, 1, width]
    lens: torch.Tensor  # int64 [rows]: keys of each sequence

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a sliding-window layer: only each row's last `window` keys."""
        if window <= 0:
            return self.mask
        pos = torch.arange(self.mask.shape[-1], device=self.lens.device)
        return self.mask & (pos[None, :] >= self.lens[:, None] - window)[:, None, None, :]


def window_prefill_mask(p: PrefillRows, window: int) -> torch.Tensor | None:
    """A prefill's mask in a sliding-window layer (None: plain causal is exact, no key is out of reach)."""
    n, q_len = p.slots.numel(), p.end - p.start
    if window <= 0 or n <= window:
        return p.mask
    qpos = torch.arange(q_len, device=p.slots.device)[:, None] + (n - q_len)  # each query's position
    key = torch.arange(n, device=p.slots.device)[None, :]
    return (key <= qpos) & (key > qpos - window)


@dataclass
class TorchAttentionMeta:
    decodes: list[DecodeBucket]
    prefills: list[PrefillRows]


def prefill_rows(block_tables: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor, q_lens: torch.Tensor,
                 block_size: int) -> list[PrefillRows]:
    """The slots and causal mask of every sequence with more than one query token this step."""
    return [prefill_row(block_tables[i : i + 1], lens[i : i + 1], int(qsl[i]), int(q_lens[i]), block_size)
            for i in (q_lens > 1).nonzero().flatten().tolist()]


def prefill_row(table: torch.Tensor, seq_len: torch.Tensor, start: int, q_len: int,
                block_size: int) -> PrefillRows:
    """One sequence's: table [1, max_blocks], seq_len [1] (keys), its query tokens start .. start + q_len -
    1."""
    n = int(seq_len[0])
    slots = reference.kv_slots(table, seq_len, block_size, n)[0]
    mask = None
    if q_len != n:
        qpos = torch.arange(q_len, device=seq_len.device)[:, None]
        mask = torch.arange(n, device=seq_len.device)[None, :] < n - q_len + qpos + 1
    return PrefillRows(start, start + q_len, slots, mask)


# Decode rows are sorted by length and cut into buckets of similar length, so that a short sequence is
# not padded to the longest one of the step: gathering keys is memory-bound on a CPU.
DECODE_BUCKET_ROWS = 16


class TorchAttention(AttentionBackend):
    """Gathers each sequence's keys through its block table once per layer and runs torch's fused
    scaled_dot_product_attention (GQA-aware, no repeated KV heads). Decode rows of a step go in one
    batched call; prefill rows (few, long) one call per sequence, so a long prompt never pads the decodes
    beside it."""
    name = "torch"

    def prepare(self, block_tables, seq_lens, query_start_loc, block_size, max_seq_len, max_q_len,
                host_q_lens=None):
        qsl = query_start_loc.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        lens = seq_lens.to(torch.int64)
        dec = (q_lens == 1).nonzero().flatten()
        dec = dec[torch.argsort(lens[dec])]
        decodes = []
        for rows in dec.split(DECODE_BUCKET_ROWS) if dec.numel() else ():
            width = int(lens[rows].max())
            slots = reference.kv_slots(block_tables[rows], lens[rows], block_size, width)
            mask = (torch.arange(width, device=lens.device)[None, :] < lens[rows][:, None])[:, None, None, :]
            decodes.append(DecodeBucket(qsl[rows], slots, mask, lens[rows]))
        return TorchAttentionMeta(decodes, prefill_rows(block_tables, lens, qsl, q_lens, block_size))

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: TorchAttentionMeta, scale, window: int = 0,
                softcap: float = 0.0, out: torch.Tensor | None = None):
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
        v_flat = v_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
        out = torch.empty_like(q) if out is None else out
        for b in meta.decodes:
            shape = (*b.slots.shape, n_kv_heads, head_dim)
            flat_slots = b.slots.flatten()  # index_select copies whole rows: ~2x faster than indexing
            # [rows, n_kv, width, hd], in the queries' dtype (a bf16 pool beside fp32 compute widens here)
            keys = k_flat.index_select(0, flat_slots).view(shape).transpose(1, 2).to(q.dtype)
            values = v_flat.index_select(0, flat_slots).view(shape).transpose(1, 2).to(q.dtype)
            qd = q[b.tokens].unsqueeze(2)  # [rows, n_heads, 1, head_dim]
            o = _sdpa(qd, keys, values, b.window_mask(window), scale, softcap)
            out[b.tokens] = o.squeeze(2)
        for p in meta.prefills:
            # [1, n_kv, seq_len, hd]
            keys = k_flat.index_select(0, p.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            values = v_flat.index_select(0, p.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, n_heads, q_len, head_dim]
            mask = window_prefill_mask(p, window)
            if softcap > 0 and mask is None:  # the explicit path needs the causal mask written out
                n = p.slots.numel()
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = _sdpa(qp, keys, values, mask, scale, softcap)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out


def _sdpa(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """q [b, n_heads, q_len, hd] over keys/values [b, n_kv, k_len, hd] (grouped heads); mask None = causal.
    Soft-capped scores take the explicit path (torch's fused attention has no soft-capping)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values.float()).to(q.dtype)


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
        """The torch path's prefill metadata, built only where the native kernel does not cover the shape."""
        if self._torch_prefills is None:
            self._torch_prefills = [
                prefill_row(self.prefill_tables[i : i + 1], self.prefill_lens[i : i + 1].to(torch.int64),
                            int(self.prefill_starts[i]), int(self.prefill_q_lens[i]), self.block_size)
                for i in range(self.prefill_starts.numel())]
        return self._torch_prefills


class CpuAttention(TorchAttention):
    """Decode rows attend in place through the block tables with the C kernel of kernels/cpu/paged_decode.c
    (no gathered copy, each key read once for all heads of its GQA group); prefill rows as `torch` does."""
    name = "cpu"
    # prompt chunks over a bf16 pool in bf16 dot products (set by the worker for a model served in bf16)
    prefill_bf16_dots = False

    def __init__(self) -> None:
        from kernels import cpu_native

        self._native = cpu_native.load()
        if self._native is None:
            raise RuntimeError("the native CPU kernels could not be built (see the log); use "
                               "--attention-backend torch")

    @property
    def native(self):
        return self._native

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if not self._native.write_kv(k, v, k_cache, v_cache, slot_mapping):
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def supports(self, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None) -> bool:
        return self._native.supports(n_heads, n_kv_heads, head_dim, block_size, dtype, kv_dtype)

    def prepare(self, block_tables, seq_lens, query_start_loc, block_size, max_seq_len, max_q_len,
                host_q_lens=None):
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

    def forward(self, q, k_cache, v_cache, meta: CpuAttentionMeta, scale, window: int = 0,
                softcap: float = 0.0):
        num_tokens, n_heads, head_dim = q.shape
        out = torch.empty(num_tokens, n_heads, head_dim, dtype=q.dtype, device=q.device)
        if meta.decode_rows.numel():
            q = q.contiguous()  # the decode kernel reads whole rows of a contiguous q
            self._native.paged_decode(q, k_cache, v_cache, out, meta.decode_rows, meta.decode_tables,
                                      meta.decode_lens, scale, window, softcap)
        if meta.prefill_starts.numel():
            if self._native.supports_prefill(n_heads, k_cache.shape[2], head_dim) and q.stride(2) == 1 \
                    and q.stride(1) == head_dim:  # a view of the fused QKV row reads in place
                self._native.paged_prefill(q, k_cache, v_cache, out, meta.prefill_starts, meta.prefill_q_lens,
                                           meta.prefill_lens, meta.prefill_tables, scale, window, softcap,
                                           self.prefill_bf16_dots)
            else:
                TorchAttention.forward(self, q.contiguous(), k_cache, v_cache,
                                       TorchAttentionMeta([], meta.torch_prefills()), scale, window, softcap,
                                       out=out)
        return out


@dataclass
class TritonAttentionMeta:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_q_len: int
    mixed: object = None  # a mixed step: kernels.triton_attention.MixedStep, gathered once for every layer
    workspace: dict = field(default_factory=dict)  # the split scratch, allocated by the first layer only


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from kernels import (
            triton_attention,  # imported only when chosen: triton is a GPU dependency
        )

        self._kernels = triton_attention

    def prepare(self, block_tables, seq_lens, query_start_loc, block_size, max_seq_len, max_q_len,
                host_q_lens=None):
        """host_q_lens: the plan's query lengths on the host (numpy), so a mixed step is split without a
        device sync; read back from query_start_loc where not given."""
        meta = TritonAttentionMeta(block_tables, seq_lens, query_start_loc, max_seq_len, max_q_len)
        if host_q_lens is None:
            host_q_lens = (query_start_loc[1:] - query_start_loc[:-1]).cpu().numpy()
        decodes = host_q_lens == 1
        if decodes.any() and not decodes.all():
            index = torch.arange(len(host_q_lens), dtype=torch.int64)
            to = dict(device=block_tables.device, non_blocking=True)
            meta.mixed = self._kernels.split_mixed(block_tables, seq_lens, query_start_loc,
                                                   index[torch.from_numpy(decodes)].to(**to),
                                                   index[torch.from_numpy(~decodes)].to(**to))
        return meta

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: TritonAttentionMeta, scale, window: int = 0,
                softcap: float = 0.0):
        return self._kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            max_seq_len=meta.max_seq_len, max_q_len=meta.max_q_len, mixed=meta.mixed,
            workspace=meta.workspace, window=window, softcap=softcap,
        )


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention, "cpu": CpuAttention}


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
    log.warning("triton_missing", device=str(device),
                consequence="attention and the elementwise tail run in torch on the GPU, several times "
                            "slower",
                fix="pip install triton (it comes with CUDA builds of torch)")
    return "torch"


def make_backend(name: str | None, device: torch.device, shape: tuple | None = None,
                 bf16_prefill: bool = False) -> AttentionBackend:
    """name None picks the device's default; on a CPU the native `cpu` backend falls back to `torch` where
    it cannot be built or does not cover shape = (n_heads, n_kv_heads, head_dim, block_size, dtype[,
    kv_dtype]). bf16_prefill (a model whose prompt chunks go through the bf16 GEMM): over a bf16 pool the
    `cpu` backend's prompt chunks attend in bf16 dot products too, where the CPU has them (queries and
    softmax weights rounded to bf16, fp32 sums: ~1.6x the fp32 arithmetic's rate, docs/BENCHMARKS.md)."""
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
        if shape is not None and not backend.supports(*shape):
            if name:
                raise ValueError("the cpu attention backend does not cover heads/head_dim/block/dtype "
                                 f"{shape}")
            return TorchAttention()
        kv_dtype = shape[5] if shape is not None and len(shape) > 5 else None
        backend.prefill_bf16_dots = bool(bf16_prefill and kv_dtype == torch.bfloat16
                                         and backend.native.prefill_bf16_dots)
        return backend
    return BACKENDS[chosen]()
