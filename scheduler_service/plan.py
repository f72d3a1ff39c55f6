"""Turn a scheduler step into the arrays of a StepPlan (protos/codec.py packs them), without a per-token
Python loop.

`PlanBuilder` keeps a numpy mirror of what changes rarely: each running sequence owns a row of a block-table
array (filled as its page table grows, a copy-on-write patching one entry) and of per-row sampling
parameters. A step then costs one short pass over its sequences (row, start, length) and a few vectorized
numpy operations: positions, slots, sequence lengths and the block tables are gathered, not rebuilt.

A row whose last input token is still pending (sampled by the step in flight; see sequence.py) carries a
placeholder in token_ids and, in prev_rows, the row of the previous step whose sampled token the worker
puts there.
"""

from __future__ import annotations

import numpy as np

from protos.codec import F32, I32, I64, U64, PlanArrays


class PlanBuilder:
    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.tables = np.full((max_seqs, max_blocks_per_seq), -1, dtype=I32)
        self.prompt_len = np.zeros(max_seqs, dtype=I64)
        self.temperature = np.zeros(max_seqs, dtype=F32)
        self.top_p = np.ones(max_seqs, dtype=F32)
        self.top_k = np.zeros(max_seqs, dtype=I32)
        self.seed = np.zeros(max_seqs, dtype=U64)
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    # --- rows --------------------------------------------------------------------------------------
    def attach(self, seq) -> None:
        """seq starts running (its block_ids were just set): give it a row."""
        if seq.row < 0:
            if not self._free_rows:
                raise RuntimeError("more running sequences than block-table rows")
            seq.row = row = self._free_rows.pop()
            params = seq.request.sampling
            self.prompt_len[row] = seq.prompt_len
            self.temperature[row], self.top_p[row] = params.temperature, params.top_p
            self.top_k[row], self.seed[row] = params.top_k, seq.sample_seed
        seq.num_mirrored_blocks = 0

    def detach(self, seq) -> None:
        """seq gave its blocks back: its row is cleared and free."""
        if seq.row >= 0:
            self.tables[seq.row] = -1
            self._free_rows.append(seq.row)
            seq.row = -1
        seq.num_mirrored_blocks = 0

    @staticmethod
    def replaced(seq, index: int) -> None:
        """seq.block_ids[index] changed (copy-on-write)."""
        seq.num_mirrored_blocks = min(seq.num_mirrored_blocks, index)

    # --- one step ----------------------------------------------------------------------------------
    def build(self, out) -> PlanArrays:
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        tables = self.tables
        rows = np.empty(num_seqs, dtype=I64)
        starts = np.empty(num_seqs, dtype=I64)
        q_lens = np.empty(num_seqs, dtype=I64)
        do_sample = np.empty(num_seqs, dtype=bool)
        tokens: list[int] = []
        pending: list[tuple[int, int]] = []  # (token offset, row of the previous step)
        max_blocks = 1
        offset = 0
        for i, item in enumerate(scheduled):
            seq = item.seq
            blocks = seq.block_ids
            n = len(blocks)
            if seq.num_mirrored_blocks < n:
                tables[seq.row, seq.num_mirrored_blocks : n] = blocks[seq.num_mirrored_blocks :]
                seq.num_mirrored_blocks = n
            if n > max_blocks:
                max_blocks = n
            start, q = item.start, item.num_new_tokens
            rows[i], starts[i], q_lens[i], do_sample[i] = seq.row, start, q, item.do_sample
            end = start + q
            known = seq.token_ids
            if end <= len(known):
                if q == 1:
                    tokens.append(known[start])
                else:
                    tokens.extend(known[start:end])
            else:  # the last input is the token the step in flight samples for this sequence
                tokens.extend(known[start : end - 1])
                tokens.append(0)
                pending.append((offset + q - 1, item.prev_row))
            offset += q
        num_tokens = offset
        query_start_loc = np.zeros(num_seqs + 1, dtype=I32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        seq_lens = starts + q_lens
        if num_tokens == num_seqs:  # decodes only
            positions, token_rows = starts, rows
        else:
            token_rows = np.repeat(rows, q_lens)
            positions = np.arange(num_tokens, dtype=I64) - np.repeat(query_start_loc[:-1] - starts, q_lens)
        bs = self.block_size
        slot_mapping = tables[token_rows, positions // bs].astype(I64) * bs + positions % bs
        prev_rows = None
        if pending:
            prev_rows = np.full(num_tokens, -1, dtype=I32)
            at, prev = zip(*pending)
            prev_rows[list(at)] = prev
        sample_index = np.maximum(seq_lens - self.prompt_len[rows], 0)
        return PlanArrays(
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
