"""Request controls on the worker: logit biases, structured-output masks, penalties, logprobs. Each
is batched over its rows and a function of the plan and pool alone, so a replayed step sees the
same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog
import torch

from protos.codec import PlanArrays
from protos.result_codec import Logprobs

log = structlog.get_logger("worker.step.controls")


@dataclass
class StepControls:
    """A step's sampling controls on the device (None where unused)."""

    bias_rows: torch.Tensor | None = None  # int64 [N]: index into the sampled rows
    bias_ids: torch.Tensor | None = None  # int64 [N]
    bias_values: torch.Tensor | None = None  # float32 [N]
    mask_rows: torch.Tensor | None = None  # int64 [M]: sampled rows that are constrained
    bitmask: torch.Tensor | None = None  # int32 [M, words]
    penalty_rows: torch.Tensor | None = None  # int64 [P]
    penalty_tables: torch.Tensor | None = None  # int32 [P, blocks]
    penalty_lens: torch.Tensor | None = None  # int64 [P]: context length
    penalty_prompt_lens: torch.Tensor | None = None  # int64 [P]
    repetition: torch.Tensor | None = None  # float32 [P]
    presence: torch.Tensor | None = None  # float32 [P]
    frequency: torch.Tensor | None = None  # float32 [P]

    @property
    def is_empty(self) -> bool:
        return self.bias_rows is None and self.mask_rows is None and self.penalty_rows is None


def gather_controls(
    p: PlanArrays,
    rows: np.ndarray,
    block_tables: torch.Tensor,
    device: torch.device,
    table_rows: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
) -> StepControls:
    """Controls of the sampled rows; a drafting row repeats once per drafted position."""
    c = StepControls()

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # owned, writable
        return torch.from_numpy(np.array(a)).to(device=device, dtype=dtype, non_blocking=True)

    # each of `rows` (a drafting row's repeat too) takes its plan row's list
    if p.bias_offsets is not None:
        listed = p.bias_offsets.astype(np.int64)
        counts = (listed[1:] - listed[:-1])[rows]
        total = int(counts.sum())
        if total:
            ends = np.cumsum(counts)
            entries = np.repeat(listed[rows] - (ends - counts), counts) + np.arange(total)
            c.bias_rows = dev(np.repeat(np.arange(rows.size), counts), torch.int64)
            c.bias_ids = dev(p.bias_token_ids[entries], torch.int64)
            c.bias_values = dev(p.bias_values[entries], torch.float32)
    if p.mask_rows is not None and p.token_bitmask is not None:
        which = p.mask_rows[rows]
        at = np.flatnonzero(which >= 0)
        if at.size:
            c.mask_rows = dev(at, torch.int64)
            c.bitmask = dev(
                p.token_bitmask[which[at] + (0 if offsets is None else offsets[at])], torch.int32
            )
    if p.repetition_penalty is not None:
        rep, pres, freq = (
            p.repetition_penalty[rows],
            p.presence_penalty[rows],
            p.frequency_penalty[rows],
        )
        at = np.flatnonzero((rep != 1.0) | (pres != 0.0) | (freq != 0.0))
        if at.size:
            lens = p.seq_lens[rows[at]].astype(np.int64)
            prompt_lens = lens - p.sample_index[rows[at]]
            # a drafted position's context ends before it: the drafts before it count
            if offsets is not None:
                lens = lens - p.num_draft[rows[at]] + offsets[at]
            c.penalty_rows = dev(at, torch.int64)
            tables_at = rows[at] if table_rows is None else table_rows[rows[at]]
            c.penalty_tables = block_tables[dev(tables_at, torch.int64)]
            c.penalty_lens = dev(lens, torch.int64)
            c.penalty_prompt_lens = dev(prompt_lens, torch.int64)
            c.repetition = dev(rep[at], torch.float32)
            c.presence = dev(pres[at], torch.float32)
            c.frequency = dev(freq[at], torch.float32)
    return c


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [M, words] -> bool [M, vocab]: bit v % 32 of word v // 32 allows token v."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # tokens past the mask's words are not allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def apply_controls(logits: torch.Tensor, c: StepControls, pool) -> torch.Tensor:
    """Biases, grammar mask, then penalties -> new logits; an all -inf row keeps its own."""
    if c.is_empty:
        return logits
    rows, vocab = logits.shape
    # one scratch element after the logits catches padding's gathers and scatters
    flat = torch.empty(rows * vocab + 1, dtype=logits.dtype, device=logits.device)
    out = flat[:-1].view(rows, vocab)
    out.copy_(logits)
    ninf = float("-inf")
    if c.bias_rows is not None:
        out.index_put_((c.bias_rows, c.bias_ids), c.bias_values, accumulate=True)
    if c.mask_rows is not None:
        allowed = unpack_bitmask(c.bitmask, vocab)
        out[c.mask_rows] = out[c.mask_rows].masked_fill(~allowed, ninf)
    if c.penalty_rows is not None:  # sparse: O(context) per row, never a [rows, vocab] pass
        ctx = pool.context_tokens(c.penalty_tables, c.penalty_lens, pad=-1)
        valid = (ctx >= 0) & (ctx < vocab)
        at = c.penalty_rows[:, None] * vocab + ctx
        scratch = torch.full_like(at, rows * vocab)
        # each context token (repeats write identical values)
        every = torch.where(valid, at, scratch)
        values = flat[every]
        rep = c.repetition[:, None]
        flat[every] = torch.where(values > 0, values / rep, values * rep)
        pos = torch.arange(ctx.shape[1], device=ctx.device)
        generated = torch.where(
            valid & (pos[None, :] >= c.penalty_prompt_lens[:, None]), at, scratch
        )
        flat[generated] = flat[generated] - c.presence[:, None]  # once per distinct output token
        # per use
        flat.index_put_(
            (generated,), (-c.frequency[:, None]).expand(generated.shape), accumulate=True
        )
    dead = torch.isneginf(out).all(dim=-1) & ~torch.isneginf(logits).all(dim=-1)
    if bool(dead.any()):
        log.warning("controls_left_no_token", rows=dead.nonzero().flatten().tolist())
        out[dead] = logits[dead]
    return out


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ks: np.ndarray) -> Logprobs:
    """Chosen and top-K logprobs from raw fp32 logits, as vLLM returns them, in row order."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = (
        logp.gather(1, chosen.view(-1, 1).to(logp.device)).view(-1).cpu().numpy().astype(np.float32)
    )
    kmax = int(ks.max()) if ks.size else 0
    if kmax == 0:
        return Logprobs(picked, np.zeros(0, np.int32), np.zeros(0, np.float32))
    values, ids = logp.topk(min(kmax, logp.shape[1]), dim=-1)
    keep = np.arange(values.shape[1])[None, :] < ks[:, None]
    return Logprobs(
        picked,
        ids.cpu().numpy().astype(np.int32)[keep],
        values.cpu().numpy().astype(np.float32)[keep],
    )
