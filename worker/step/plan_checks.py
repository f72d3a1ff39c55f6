"""Every plan is checked before anything touches the pool: a malformed or out-of-range plan is
rejected with an error result, never a crash and never a write outside the pool.
"""

from __future__ import annotations

import numpy as np

from protos.codec import PlanArrays


class PlanError(ValueError):
    """The plan is malformed or out of range; the worker answers with an error result."""


def validate_plan(
    p: PlanArrays, num_blocks: int, block_size: int, vocab: int, max_pos: int, kv_window: int = 0
) -> None:
    """PlanError unless every array fits pool, vocabulary and context, alike on every rank."""
    s, t = p.num_seqs, p.num_tokens
    # a step that only moves blocks to or from the KV tiers
    if s == 0 and t == 0 and p.kv is not None:
        return
    if s == 0 or t == 0:
        raise PlanError("a plan needs at least one sequence and one token (or KV-tier work)")
    qsl = p.query_start_loc.astype(np.int64)
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != t or (q_lens < 1).any():
        raise PlanError(
            "query_start_loc must rise from 0 to num_tokens, at least one token per sequence"
        )
    mb = p.block_tables.shape[1]
    if (p.seq_lens < q_lens).any() or (p.seq_lens > mb * block_size).any():
        raise PlanError("seq_lens must cover this step's tokens and fit the block tables")
    if ((p.token_ids < 0) | (p.token_ids >= vocab)).any():
        raise PlanError(f"token id outside the vocabulary [0, {vocab})")
    if ((p.positions < 0) | (p.positions >= max_pos)).any():
        raise PlanError(f"position outside [0, {max_pos})")
    if ((p.slot_mapping < -1) | (p.slot_mapping >= num_blocks * block_size)).any():
        raise PlanError(f"slot outside the pool of {num_blocks * block_size} slots")
    if ((p.block_tables < -1) | (p.block_tables >= num_blocks)).any():
        raise PlanError(f"block id outside the pool of {num_blocks} blocks")
    needed = (p.seq_lens.astype(np.int64) + block_size - 1) // block_size
    used = np.arange(mb)[None, :] < needed[:, None]
    if kv_window > 0:  # keys before (first query's position) - kv_window are never read
        first = np.maximum(p.seq_lens.astype(np.int64) - q_lens - kv_window, 0) // block_size
        used &= np.arange(mb)[None, :] >= first[:, None]
    if (p.block_tables[used] < 0).any():
        raise PlanError("a block table has no block for part of its sequence")
    if ((p.block_copies < 0) | (p.block_copies >= num_blocks)).any():
        raise PlanError("block copy outside the pool")
    if not np.isfinite(p.temperature).all() or (p.temperature < 0).any():
        raise PlanError("temperature must be finite and >= 0")
    if not ((p.top_p > 0) & (p.top_p <= 1)).all():
        raise PlanError("top_p must lie in (0, 1]")
    validate_controls(p, q_lens, vocab)


MAX_PLAN_LOGPROBS = 20


def check_mask(bitmask: np.ndarray, p: PlanArrays, vocab: int) -> np.ndarray:
    """The masks that followed a plan must cover its constrained rows and the vocabulary."""
    need = 0
    if p.mask_rows is not None and p.mask_rows.size:  # a drafting row's masks follow its first
        last = p.mask_rows
        if p.num_draft is not None:
            last = np.where(p.mask_rows >= 0, p.mask_rows + p.num_draft, -1)
        need = int(last.max()) + 1
    if bitmask.shape[0] < need or bitmask.shape[1] * 32 < vocab:
        raise PlanError(
            f"the step's masks are {bitmask.shape[0]} x {bitmask.shape[1]} words; it needs "
            f"{need} x {(vocab + 31) // 32}"
        )
    return bitmask


def validate_controls(p: PlanArrays, q_lens: np.ndarray, vocab: int) -> None:
    """The request-control arrays of a plan (protos/wire.proto) must be consistent and in range."""

    # one function: one check per control, in the order the sampler applies them
    if p.repetition_penalty is not None:
        if p.presence_penalty is None or p.frequency_penalty is None:
            raise PlanError(
                "repetition_penalty, presence_penalty and frequency_penalty travel together"
            )
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(p, name)).all():
                raise PlanError(f"{name} must be finite")
        if (p.repetition_penalty <= 0).any():
            raise PlanError("repetition_penalty must be > 0")
    if p.min_p is not None and not ((p.min_p >= 0) & (p.min_p <= 1)).all():
        raise PlanError("min_p must lie in [0, 1]")
    if p.bias_offsets is not None:
        off = p.bias_offsets
        n = 0 if p.bias_token_ids is None else p.bias_token_ids.shape[0]
        if (
            off[0] != 0
            or (np.diff(off) < 0).any()
            or off[-1] != n
            or p.bias_values is None
            or p.bias_values.shape[0] != n
        ):
            raise PlanError("bias_offsets must rise from 0 to the number of bias entries")
        if n and (
            ((p.bias_token_ids < 0) | (p.bias_token_ids >= vocab)).any()
            or np.isnan(p.bias_values).any()
            or (p.bias_values == np.inf).any()
        ):
            raise PlanError(
                f"a bias token outside the vocabulary [0, {vocab}) or a bias that is NaN or +inf"
            )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and ((k < -1) | (k > MAX_PLAN_LOGPROBS)).any():
            raise PlanError(f"{name} must lie in [-1, {MAX_PLAN_LOGPROBS}]")
    if p.prompt_logprobs is not None:
        counts, targets = p.prompt_logprob_counts, p.prompt_logprob_targets
        if (
            counts is None
            or targets is None
            or (counts < 0).any()
            or (counts > q_lens).any()
            or ((counts > 0) & (p.prompt_logprobs < 0)).any()
            or targets.shape[0] != int(counts.sum())
        ):
            raise PlanError(
                "prompt_logprob_counts must lie within each row's new tokens and match the targets"
            )
        if ((targets < 0) | (targets >= vocab)).any():
            raise PlanError(f"a prompt logprob target outside the vocabulary [0, {vocab})")
    if p.num_draft is not None:
        validate_drafts(p, q_lens)
    if p.pooling is not None:
        if ((p.pooling < 0) | (p.pooling > 3)).any():
            raise PlanError("pooling must be 0 (none), 1 (last token), 2 (sum) or 3 (first token)")
        if p.num_draft is not None and ((p.pooling > 0) & (p.num_draft > 0)).any():
            raise PlanError("a pooling row does not draft")
    if p.lora_index is not None:
        count = len(p.loras or ())
        if ((p.lora_index < -1) | (p.lora_index >= count)).any():
            raise PlanError(f"lora_index must be -1 or name one of the plan's {count} adapters")
    if p.mask_follows and (p.mask_rows is None or p.token_bitmask is not None):
        raise PlanError("a plan whose masks follow it carries mask_rows and no token_bitmask")
    if p.mask_rows is not None and not p.mask_follows:
        masks = 0 if p.token_bitmask is None else p.token_bitmask.shape[0]
        if ((p.mask_rows < -1) | (p.mask_rows >= masks)).any():
            raise PlanError("mask_rows refers to a bitmask the plan does not carry")
        if masks and p.token_bitmask.shape[1] * 32 < vocab:
            raise PlanError(
                f"token_bitmask rows have {p.token_bitmask.shape[1]} words; {vocab} tokens need "
                f"{(vocab + 31) // 32}"
            )


def validate_drafts(p: PlanArrays, q_lens: np.ndarray) -> None:
    """A drafting row's shape, draws, masks and logprobs checked."""
    nd = p.num_draft
    if (nd < 0).any():
        raise PlanError("num_draft must be >= 0")
    rows = nd > 0
    if not rows.any():
        return
    if (~p.do_sample[rows]).any() or (q_lens[rows] != nd[rows] + 1).any():
        raise PlanError(
            "a drafting row samples and holds its last known token and its draft, nothing more"
        )
    if (p.sample_index[rows] < nd[rows]).any():
        raise PlanError("a drafting row's sample_index must count its drafted tokens")
    if p.prev_rows is not None:
        starts = p.query_start_loc[:-1][rows].astype(np.int64)
        spans = np.concatenate(
            [np.arange(a, a + q) for a, q in zip(starts, q_lens[rows], strict=True)]
        )
        if (p.prev_rows[spans] >= 0).any():
            raise PlanError(
                "a drafting row's tokens must all be known (none from the step in flight)"
            )
    uses = [
        ("logprobs", p.logprobs is not None and (p.logprobs[rows] >= 0).any()),
        (
            "prompt logprobs",
            p.prompt_logprob_counts is not None and (p.prompt_logprob_counts[rows] > 0).any(),
        ),
    ]
    for what, used in uses:
        if used:
            raise PlanError(f"a drafting row may not use {what}")
    if p.mask_rows is not None and not p.mask_follows:
        masks = 0 if p.token_bitmask is None else p.token_bitmask.shape[0]
        if ((p.mask_rows >= 0) & (p.mask_rows + nd >= masks)).any():
            raise PlanError("a constrained drafting row needs a mask for each of its positions")


def validate_states(p: PlanArrays, num_slots: int) -> None:
    """A hybrid's rows each have their own state slot; others have none."""
    slots = p.state_slots
    if not num_slots:
        if slots is not None:
            raise PlanError("the plan names state slots; this model keeps no recurrent state")
        return
    if p.num_seqs == 0:
        return
    if slots is None:
        raise PlanError("a hybrid model's plan must give each row a state slot")
    if ((slots < 0) | (slots >= num_slots)).any() or np.unique(slots).size != slots.size:
        raise PlanError(f"state slots must be distinct and in [0, {num_slots})")
    if p.num_draft is not None and (p.num_draft > 0).any():
        raise PlanError("a hybrid model's rows cannot draft: its recurrent state has no undo")
    validate_snapshots(p, num_slots)


def validate_snapshots(p: PlanArrays, num_slots: int) -> None:
    """Copies go from non-resuming slots into resuming ones; snapshots land in idle slots, once
    each.
    """
    copies = np.zeros(0, np.int32) if p.state_copies is None else p.state_copies
    saves = np.zeros(0, np.int32) if p.state_saves is None else p.state_saves
    if copies.size % 2 or saves.size % 3:
        raise PlanError("state_copies are (src, dst) pairs and state_saves (row, offset, dst)")
    copies, saves = copies.reshape(-1, 2), saves.reshape(-1, 3)
    live = set(p.state_slots.tolist())
    starts = p.query_start_loc[:-1]
    resuming = set(p.state_slots[p.positions[starts] > 0].tolist())
    written = copies[:, 1].tolist() + saves[:, 2].tolist()
    if (
        any(s in resuming or not 0 <= s < num_slots for s in copies[:, 0].tolist())
        or any(d not in resuming for d in copies[:, 1].tolist())
        or len(set(written)) != len(written)
    ):
        raise PlanError("a state copy must go from a snapshot slot to a resuming row's slot, once")
    rows = np.diff(p.query_start_loc)
    for row, offset, dst in saves.tolist():
        if not 0 <= row < p.num_seqs or not 0 < offset <= rows[row]:
            raise PlanError(f"a state snapshot at offset {offset} of row {row} is outside it")
        if dst in live or not 0 <= dst < num_slots:
            raise PlanError(f"a state snapshot goes to slot {dst}, which a row runs in")
