"""Speculative decoding on the worker: drafting rows run as decode rows, one a token, and acceptance
keeps the drafts the sampler itself draws there (docs/ARCHITECTURE.md, the worker step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protos.codec import PlanArrays


@dataclass
class Drafts:
    """A step's drafting rows (protos/wire.proto StepPlan.num_draft), as acceptance reads them."""

    rows: torch.Tensor  # int64 [D]: the plan rows that draft
    first: torch.Tensor  # int64 [D]: each one's first logits row
    tokens: torch.Tensor  # int64 [D, K]: the drafted tokens, -1 past each row's count
    # int32 [L]: each logits row's place in its row's draft positions (0 for others)
    offsets: np.ndarray
    # int64 [S]: each plan row's first row in the step's (expanded) block tables
    table_rows: np.ndarray


def accept_drafts(
    sampled: torch.Tensor, d: Drafts, tokens: torch.Tensor, accepted: torch.Tensor
) -> None:
    """A draft stands while it equals the token sampled before it (same seeds: same answers)."""
    k = d.tokens.shape[1]
    at = (d.first[:, None] + torch.arange(k, device=sampled.device)[None, :]).clamp(
        max=sampled.shape[0] - 1
    )
    same = (sampled[at] == d.tokens) & (d.tokens >= 0)
    n = torch.cumprod(same.to(torch.int64), dim=1).sum(dim=1)
    tokens[d.rows] = sampled[d.first + n]
    accepted[d.rows] = n


def expand_drafts(p: PlanArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each drafting row as one decode row per token, so the step stays a decode step."""
    q_lens = np.diff(p.query_start_loc.astype(np.int64))
    split = p.num_draft > 0
    per_row = np.where(split, q_lens, 1)
    owner = np.repeat(np.arange(p.num_seqs), per_row)
    first_of_row = np.cumsum(per_row) - per_row
    j = np.arange(owner.size) - first_of_row[owner]  # place within the plan row
    seq_lens = np.where(split[owner], p.seq_lens[owner] - q_lens[owner] + j + 1, p.seq_lens[owner])
    ex_q = np.where(split[owner], 1, q_lens[owner])
    qsl = np.zeros(owner.size + 1, dtype=np.int64)
    np.cumsum(ex_q, out=qsl[1:])
    return owner, seq_lens.astype(np.int32), qsl.astype(np.int32)


def stage_drafts(
    p: PlanArrays,
    rows: np.ndarray,
    owner: np.ndarray,
    offsets: np.ndarray,
    ex_owner: np.ndarray,
    device: torch.device,
) -> Drafts:
    """What acceptance needs of a drafting step's rows: their first
    logits rows and drafted tokens.
    """
    nd = p.num_draft.astype(np.int64)
    which = np.flatnonzero(nd[rows] > 0)
    drafting = rows[which]
    first = np.searchsorted(owner, drafting)  # owner is sorted: a row's logits rows are contiguous
    counts = nd[drafting]
    k = int(counts.max())
    ends = p.query_start_loc[1:].astype(np.int64)[drafting]
    at = ends[:, None] - counts[:, None] + np.arange(k)[None, :]
    tokens = np.where(
        np.arange(k)[None, :] < counts[:, None], p.token_ids[np.minimum(at, p.num_tokens - 1)], -1
    ).astype(np.int64)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(
            device, non_blocking=True
        )

    return Drafts(
        dev(drafting),
        dev(first),
        dev(tokens),
        offsets.astype(np.int32),
        np.searchsorted(ex_owner, np.arange(p.num_seqs)),
    )
