"""A scheduler step as StepPlan arrays without a per-token loop: `PlanBuilder` mirrors what changes
rarely (each running sequence's table row and sampling parameters) and gathers the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protos.codec import F32, I32, I64, POOL_FIRST, POOL_LAST, POOL_SUM, U64, PlanArrays, TierOps

_POOL_KINDS = {"last": POOL_LAST, "mean": POOL_SUM, "cls": POOL_FIRST}


class MaskFiller(Protocol):
    """What fills structured-output masks (text/structured.py GrammarEngine)."""

    def fill_masks(
        self, matchers: list, drafts: list[tuple[int, ...]] | None = None
    ) -> np.ndarray: ...


@dataclass
class DeferredMasks:
    """Masks computed once the step before is applied, sent before any later plan."""

    filler: MaskFiller
    matchers: list
    drafts: list[tuple[int, ...]] | None

    def fill(self) -> np.ndarray:
        return self.filler.fill_masks(self.matchers, self.drafts)


@dataclass
class ReadBack:
    """What a plan asked of its result: logprobs, masks, pooling rows, tier work."""

    logprobs_k: np.ndarray | None = None
    prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    deferred_masks: DeferredMasks | None = None
    embed_rows: np.ndarray | None = None
    pooling: np.ndarray | None = None
    kv_ops: TierOps | None = None


class PlanBuilder:
    """Each running sequence owns a mirror row, so a plan is one pass and a few numpy ops."""

    def __init__(
        self, max_seqs: int, max_blocks_per_seq: int, block_size: int, keeps_state: bool = False
    ) -> None:
        self.block_size = block_size
        self.keeps_state = keeps_state  # a hybrid: each row names its recurrent-state slot
        self.max_blocks = max_blocks_per_seq
        self.tables = np.full((max_seqs, max_blocks_per_seq), -1, dtype=I32)
        self.prompt_len = np.zeros(max_seqs, dtype=I64)
        self.temperature = np.zeros(max_seqs, dtype=F32)
        self.top_p = np.ones(max_seqs, dtype=F32)
        self.top_k = np.zeros(max_seqs, dtype=I32)
        self.seed = np.zeros(max_seqs, dtype=U64)
        self.repetition = np.ones(max_seqs, dtype=F32)
        self.presence = np.zeros(max_seqs, dtype=F32)
        self.frequency = np.zeros(max_seqs, dtype=F32)
        self.min_p = np.zeros(max_seqs, dtype=F32)
        self.logprobs = np.full(max_seqs, -1, dtype=I32)
        self.penalized = np.zeros(max_seqs, dtype=bool)
        # rows with a ragged part: logit_bias or min_tokens, prompt logprobs, a structured-output
        # matcher
        self.special = np.zeros(max_seqs, dtype=bool)
        # embeddings: how a row's sequence pools (0: it does not; POOL_LAST, POOL_SUM, POOL_FIRST)
        self.pool_kind = np.zeros(max_seqs, dtype=I32)
        # the row's LoRA adapter's id (-1: the base model)
        self.lora = np.full(max_seqs, -1, dtype=I64)
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._owners: list = [None] * max_seqs  # the sequence each row mirrors
        self._filled = [0] * max_seqs  # entries written in each row (the rest are -1)

    # --- rows -------------------------------------------------------------------------------------
    def _row(self, seq) -> int:
        """seq's row, given at its first step; finished sequences' rows are reclaimed when none is
        free.
        """
        row = seq.mirror.row
        if row >= 0 and self._owners[row] is seq:
            return row
        if not self._free_rows:
            self._reclaim()
        row = seq.mirror.row = self._free_rows.pop()
        self._owners[row] = seq
        self.tables[row, : self._filled[row]] = -1
        self._filled[row] = 0
        seq.mirror.blocks = 0
        params = seq.request.sampling
        self.prompt_len[row] = seq.prompt_len
        self.temperature[row], self.top_p[row] = params.temperature, params.top_p
        self.top_k[row], self.seed[row] = params.top_k, seq.sample_seed
        self.repetition[row], self.presence[row] = (
            params.repetition_penalty,
            params.presence_penalty,
        )
        self.frequency[row], self.min_p[row] = params.frequency_penalty, params.min_p
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.penalized[row] = params.is_penalized
        embed = seq.request.embed
        self.pool_kind[row] = 0 if embed is None else _POOL_KINDS[embed.spec.pooling]
        self.lora[row] = -1 if seq.request.lora is None else seq.request.lora.id
        self.special[row] = (
            params.has_bias
            or seq.matcher is not None
            or (params.prompt_logprobs is not None and seq.index == 0)
        )
        return row

    def _reclaim(self) -> None:
        for row, owner in enumerate(self._owners):
            if owner is not None and (not owner.is_running or owner.mirror.row != row):
                self._owners[row] = None
                if owner.mirror.row == row:
                    owner.mirror.row = -1
                self._free_rows.append(row)
        if not self._free_rows:
            raise RuntimeError("more running sequences than block-table rows")

    def _sync(self, seq, row: int, n: int) -> None:
        """Copy seq's page table (n entries) into its row from the first entry that changed."""
        blocks, mirror = seq.block_ids, seq.mirror
        if mirror.blocks < n:
            self.tables[row, mirror.blocks : n] = blocks[mirror.blocks :]
        if self._filled[row] > n:  # the table lost its tail (a rejected draft's blocks)
            self.tables[row, n : self._filled[row]] = -1
        mirror.blocks = self._filled[row] = n

    def check(self, running) -> None:
        """Every running sequence's mirrored entries are its page table's (debug_invariants)."""
        for seq in running:
            row = seq.mirror.row
            if row >= 0 and self._owners[row] is seq:
                b = seq.mirror.blocks
                if self.tables[row, :b].tolist() != seq.block_ids[:b]:
                    raise AssertionError(
                        f"{seq}: the plan's row {row} no longer mirrors its page table"
                    )

    # --- one step ---------------------------------------------------------------------------------
    def build(self, out) -> tuple[PlanArrays, ReadBack]:
        """The step's plan: its rows gathered from the sequences, then every per-token array
        vectorized.
        """
        rows, starts, q_lens, do_sample, tokens, pending, max_blocks, drafts = self._gather(
            out.scheduled
        )
        read = ReadBack()
        num_seqs, num_tokens = len(rows), len(tokens)
        tables = self.tables
        query_start_loc = np.zeros(num_seqs + 1, dtype=I32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        seq_lens = starts + q_lens
        if num_tokens == num_seqs:  # decodes only
            positions, token_rows = starts, rows
        else:
            token_rows = np.repeat(rows, q_lens)
            positions = np.arange(num_tokens, dtype=I64) - np.repeat(
                query_start_loc[:-1] - starts, q_lens
            )
        bs = self.block_size
        slot_mapping = tables[token_rows, positions // bs].astype(I64) * bs + positions % bs
        prev_rows = None
        if pending:
            prev_rows = np.full(num_tokens, -1, dtype=I32)
            at, prev = zip(*pending, strict=True)
            prev_rows[list(at)] = prev
        sample_index = np.maximum(seq_lens - self.prompt_len[rows], 0)
        plan = PlanArrays(
            step_id=out.step_id,
            token_ids=np.asarray(tokens, dtype=I32),
            positions=positions.astype(I32),
            slot_mapping=slot_mapping,
            block_tables=tables[rows, :max_blocks],
            seq_lens=seq_lens.astype(I32),
            query_start_loc=query_start_loc,
            do_sample=do_sample,
            sample_index=sample_index.astype(I32),
            temperature=self.temperature[rows],
            top_p=self.top_p[rows],
            top_k=self.top_k[rows],
            seed=self.seed[rows],
            block_copies=np.asarray(out.block_copies, dtype=I32).reshape(-1, 2),
            prev_step_id=out.step_id - 1 if pending else 0,
            prev_rows=prev_rows,
        )
        if self.keeps_state:
            plan.state_slots = np.fromiter(
                (item.seq.state_slot for item in out.scheduled), dtype=I32, count=num_seqs
            )
            if out.state_copies:
                plan.state_copies = np.asarray(out.state_copies, dtype=I32).ravel()
            if out.state_saves:
                plan.state_saves = np.asarray(out.state_saves, dtype=I32).ravel()
        if drafts:
            plan.num_draft = np.zeros(num_seqs, dtype=I32)
            at, counts = zip(*drafts, strict=True)
            plan.num_draft[list(at)] = counts
        self._controls(out.scheduled, plan, read, rows, starts, q_lens, do_sample)
        self._adapters(out.scheduled, plan, rows)
        self._pooling(plan, read, rows, starts, seq_lens)
        return plan, read

    def _pooling(self, plan: PlanArrays, read: ReadBack, rows, starts, seq_lens) -> None:
        """Mean sums every chunk; last pools in the last chunk, cls in the first."""
        kinds = self.pool_kind[rows]
        if not kinds.any():
            return
        read.embed_rows = kinds
        ends = seq_lens == self.prompt_len[rows]
        at = (
            (kinds == POOL_SUM)
            | ((kinds == POOL_LAST) & ends)
            | ((kinds == POOL_FIRST) & (starts == 0))
        )
        if at.any():
            plan.pooling = read.pooling = np.where(at, kinds, 0).astype(I32)

    def _adapters(self, scheduled, plan: PlanArrays, rows: np.ndarray) -> None:
        """The step's adapters once each, and each row's index (-1: base)."""
        lora = self.lora[rows]
        if (lora >= 0).any():
            ids, index = np.unique(lora, return_inverse=True)
            first = ids[0] < 0  # the base model's -1 sorts first
            by_id = {
                item.seq.request.lora.id: item.seq.request.lora
                for item in scheduled
                if item.seq.request.lora is not None
            }
            plan.loras = [(by_id[i].identity, by_id[i].path) for i in ids[int(first) :].tolist()]
            plan.lora_index = (index - int(first)).astype(I32)

    def _gather(self, scheduled):
        """One pass over the scheduled sequences, mirroring new table entries on the way."""
        num_seqs = len(scheduled)
        rows = np.empty(num_seqs, dtype=I64)
        starts = np.empty(num_seqs, dtype=I64)
        q_lens = np.empty(num_seqs, dtype=I64)
        do_sample = np.empty(num_seqs, dtype=bool)
        tokens: list[int] = []
        pending: list[tuple[int, int]] = []  # (token offset, row of the previous step)
        drafts: list[tuple[int, int]] = []  # (row, tokens drafted)
        max_blocks = 1
        offset = 0
        owners = self._owners
        for i, item in enumerate(scheduled):
            seq = item.seq
            row = seq.mirror.row
            if row < 0 or owners[row] is not seq:
                row = self._row(seq)
            n = len(seq.block_ids)
            if seq.mirror.blocks != n or self._filled[row] != n:
                self._sync(seq, row, n)
            if n > max_blocks:
                max_blocks = n
            start, q = item.start, item.num_new_tokens
            rows[i], starts[i], q_lens[i], do_sample[i] = row, start, q, item.do_sample
            end = start + q
            known = seq.token_ids
            if item.draft:  # the known last token, then the draft
                tokens.append(known[start])
                tokens.extend(item.draft)
                drafts.append((i, len(item.draft)))
            elif end <= len(known):
                if q == 1:
                    tokens.append(known[start])
                else:
                    tokens.extend(known[start:end])
            else:  # the last input is the token the step in flight samples for this sequence
                tokens.extend(known[start : end - 1])
                tokens.append(0)
                pending.append((offset + q - 1, item.prev_row))
            offset += q
        return rows, starts, q_lens, do_sample, tokens, pending, max_blocks, drafts

    def _controls(
        self,
        scheduled,
        plan: PlanArrays,
        read: ReadBack,
        rows: np.ndarray,
        starts: np.ndarray,
        q_lens: np.ndarray,
        do_sample: np.ndarray,
    ) -> None:
        # one function: each control's arrays, in the order the wire lists them
        """The request-control arrays of the step's plan; `out` keeps what decoding its result
        needs.
        """
        if self.penalized[rows].any():
            plan.repetition_penalty = self.repetition[rows]
            plan.presence_penalty = self.presence[rows]
            plan.frequency_penalty = self.frequency[rows]
        if self.min_p[rows].any():
            plan.min_p = self.min_p[rows]
        lp = self.logprobs[rows]
        if (lp >= 0).any():
            plan.logprobs = np.where(do_sample, lp, -1).astype(I32)
            read.logprobs_k = plan.logprobs
        special = np.flatnonzero(self.special[rows])
        if special.size == 0:
            return
        num_seqs = len(scheduled)
        bias_rows: list[tuple[int, list[tuple[int, float]]]] = []
        matchers, mask_at, drafted, engine = [], [], [], None
        plp_k = plp_counts = None
        plp_targets: list[int] = []
        for i in special.tolist():
            seq = scheduled[i].seq
            params = seq.request.sampling
            if do_sample[i]:
                generated = int(starts[i] + q_lens[i]) - seq.prompt_len
                entries = list(params.logit_bias)
                if generated < params.min_tokens:
                    entries += [(t, float("-inf")) for t in params.min_tokens_ban]
                if entries:
                    bias_rows.append((i, entries))
                if seq.matcher is not None:
                    matchers.append(seq.matcher)
                    mask_at.append(i)
                    drafted.append(scheduled[i].draft)
                    engine = seq.request.constraint.engine
            if params.prompt_logprobs is not None and seq.index == 0:
                start = int(starts[i])
                count = min(start + int(q_lens[i]), seq.prompt_len - 1) - start
                if count > 0:
                    if plp_k is None:
                        plp_k = np.full(num_seqs, -1, dtype=I32)
                        plp_counts = np.zeros(num_seqs, dtype=I32)
                    plp_k[i], plp_counts[i] = params.prompt_logprobs, count
                    plp_targets.extend(seq.request.prompt_token_ids[start + 1 : start + 1 + count])
        if bias_rows:
            offsets = np.zeros(num_seqs + 1, dtype=I32)
            ids, values = [], []
            for i, entries in bias_rows:
                offsets[i + 1] = len(entries)
                ids.extend(t for t, _ in entries)
                values.extend(v for _, v in entries)
            plan.bias_offsets = np.cumsum(offsets, dtype=I32)
            plan.bias_token_ids = np.asarray(ids, dtype=I32)
            plan.bias_values = np.asarray(values, dtype=F32)
        # a drafting row's masks: its first position's, then one after each drafted token
        if matchers:
            plan.mask_rows = np.full(num_seqs, -1, dtype=I32)
            plan.mask_rows[mask_at] = np.cumsum([0] + [1 + len(d) for d in drafted[:-1]], dtype=I32)
            if any(scheduled[i].prev_row >= 0 for i in mask_at):
                # the step in flight samples this row's last token, so its masks follow once that
                # result is in
                plan.mask_follows = True
                read.deferred_masks = DeferredMasks(engine, matchers, drafted)
            else:
                plan.token_bitmask = engine.fill_masks(matchers, drafted)
        if plp_k is not None:
            plan.prompt_logprobs, plan.prompt_logprob_counts = plp_k, plp_counts
            plan.prompt_logprob_targets = np.asarray(plp_targets, dtype=I32)
            read.prompt_logprobs = (plp_k, plp_counts)
