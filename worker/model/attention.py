"""Attention backends: writing K/V into the pool and attending
through block tables; `torch` here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference


class AttentionBackend:
    name = "abstract"

    def prepare(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        max_seq_len: int,
        max_q_len: int,
        host_q_lens=None,
    ) -> object:
        """Per-step metadata shared by every layer, built from the plan on the host: no sync."""
        raise NotImplementedError

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks=None,
    ) -> torch.Tensor:
        """window > 0: a query sees its last `window` keys; softcap > 0: Gemma 2's soft-capping;
        sinks [n_heads]: gpt-oss's extra logit per head in each softmax, which adds no value.
        """
        raise NotImplementedError


@dataclass
class PrefillRows:
    start: int  # first query token of the sequence in the step
    end: int
    slots: torch.Tensor  # int64 [seq_len]
    # bool [q_len, seq_len]: query i sees key j < seq_len - q_len + i + 1; None
    mask: torch.Tensor | None
    # when the chunk is the whole sequence: plain causal, which the fused kernel runs unmasked


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
    """A sliding layer's prefill mask; None where plain causal is exact."""
    n, q_len = p.slots.numel(), p.end - p.start
    if window <= 0 or n <= window:
        return p.mask
    # each query's position
    qpos = torch.arange(q_len, device=p.slots.device)[:, None] + (n - q_len)
    key = torch.arange(n, device=p.slots.device)[None, :]
    return (key <= qpos) & (key > qpos - window)


@dataclass
class TorchAttentionMeta:
    decodes: list[DecodeBucket]
    prefills: list[PrefillRows]


def prefill_rows(
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    qsl: torch.Tensor,
    q_lens: torch.Tensor,
    block_size: int,
) -> list[PrefillRows]:
    """Slots and causal masks of every multi-token row."""
    return [
        prefill_row(
            block_tables[i : i + 1], lens[i : i + 1], int(qsl[i]), int(q_lens[i]), block_size
        )
        for i in (q_lens > 1).nonzero().flatten().tolist()
    ]


def prefill_row(
    table: torch.Tensor, seq_len: torch.Tensor, start: int, q_len: int, block_size: int
) -> PrefillRows:
    """One row: table [1, max_blocks], seq_len [1], queries start .. start + q_len - 1."""
    n = int(seq_len[0])
    slots = reference.kv_slots(table, seq_len, block_size, n)[0]
    mask = None
    if q_len != n:
        qpos = torch.arange(q_len, device=seq_len.device)[:, None]
        mask = torch.arange(n, device=seq_len.device)[None, :] < n - q_len + qpos + 1
    return PrefillRows(start, start + q_len, slots, mask)


# Decode rows bucketed by length so short ones are not padded to the longest.
DECODE_BUCKET_ROWS = 16


class TorchAttention(AttentionBackend):
    """Each row's keys gathered for torch's SDPA: decodes batched, prompts one by one."""

    name = "torch"

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
        lens = seq_lens.to(torch.int64)
        dec = (q_lens == 1).nonzero().flatten()
        dec = dec[torch.argsort(lens[dec])]
        decodes = []
        for rows in dec.split(DECODE_BUCKET_ROWS) if dec.numel() else ():
            width = int(lens[rows].max())
            slots = reference.kv_slots(block_tables[rows], lens[rows], block_size, width)
            mask = (torch.arange(width, device=lens.device)[None, :] < lens[rows][:, None])[
                :, None, None, :
            ]
            decodes.append(DecodeBucket(qsl[rows], slots, mask, lens[rows]))
        return TorchAttentionMeta(
            decodes, prefill_rows(block_tables, lens, qsl, q_lens, block_size)
        )

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: TorchAttentionMeta,
        scale,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
        v_flat = v_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
        out = torch.empty_like(q) if out is None else out
        for b in meta.decodes:
            shape = (*b.slots.shape, n_kv_heads, head_dim)
            # index_select copies whole rows: ~2x faster than indexing
            flat_slots = b.slots.flatten()
            # [rows, n_kv, width, hd] in the queries' dtype
            keys = k_flat.index_select(0, flat_slots).view(shape).transpose(1, 2).to(q.dtype)
            values = v_flat.index_select(0, flat_slots).view(shape).transpose(1, 2).to(q.dtype)
            qd = q[b.tokens].unsqueeze(2)  # [rows, n_heads, 1, head_dim]
            o = _sdpa(qd, keys, values, b.window_mask(window), scale, softcap, sinks)
            out[b.tokens] = o.squeeze(2)
        for p in meta.prefills:
            # [1, n_kv, seq_len, hd]
            keys = k_flat.index_select(0, p.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            values = v_flat.index_select(0, p.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, n_heads, q_len, head_dim]
            mask = window_prefill_mask(p, window)
            if (softcap > 0 or sinks is not None) and mask is None:  # the explicit path's mask
                n = p.slots.numel()
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = _sdpa(qp, keys, values, mask, scale, softcap, sinks)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out


def _sdpa(q, keys, values, mask, scale: float, softcap: float, sinks=None) -> torch.Tensor:
    """SDPA over grouped heads; mask None = causal; soft caps and sinks take the explicit path."""
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit a row, its probability dropped
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).to(q.dtype)
