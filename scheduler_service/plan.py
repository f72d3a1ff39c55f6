"""Turn a scheduler step into the arrays of a self-contained StepPlan (protos/codec.py packs them)."""

from __future__ import annotations

import numpy as np

from protos.codec import F32, I32, I64, U64, PlanArrays
from scheduler_service.scheduler import SchedulerOutput


def build_plan(out: SchedulerOutput, block_size: int) -> PlanArrays:
    num_seqs = len(out.scheduled)
    token_parts: list[np.ndarray] = []
    position_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    seq_lens = np.empty(num_seqs, dtype=I32)
    q_lens = np.empty(num_seqs, dtype=I32)
    do_sample = np.empty(num_seqs, dtype=bool)
    sample_index = np.empty(num_seqs, dtype=I32)
    temperature = np.empty(num_seqs, dtype=F32)
    top_p = np.empty(num_seqs, dtype=F32)
    top_k = np.empty(num_seqs, dtype=I32)
    seed = np.empty(num_seqs, dtype=U64)
    max_blocks = max((len(s.seq.block_ids) for s in out.scheduled), default=0)
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=I32)
    for i, item in enumerate(out.scheduled):
        seq = item.seq
        end = item.start + item.num_new_tokens
        blocks = np.asarray(seq.block_ids, dtype=I64)
        positions = np.arange(item.start, end, dtype=I64)
        token_parts.append(np.asarray(seq.token_ids[item.start : end], dtype=I32))
        position_parts.append(positions)
        slot_parts.append(blocks[positions // block_size] * block_size + positions % block_size)
        block_tables[i, : len(blocks)] = blocks
        seq_lens[i] = end
        q_lens[i] = item.num_new_tokens
        do_sample[i] = item.do_sample
        sample_index[i] = seq.num_output_tokens
        params = seq.request.sampling
        temperature[i], top_p[i], top_k[i], seed[i] = params.temperature, params.top_p, params.top_k, seq.sample_seed
    query_start_loc = np.zeros(num_seqs + 1, dtype=I32)
    np.cumsum(q_lens, out=query_start_loc[1:])

    def cat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype=dtype)

    return PlanArrays(
        step_id=out.step_id,
        token_ids=cat(token_parts, I32),
        positions=cat(position_parts, I32),
        slot_mapping=cat(slot_parts, I64),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        do_sample=do_sample,
        sample_index=sample_index,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        block_copies=np.asarray(out.block_copies, dtype=I32).reshape(-1, 2),
    )
