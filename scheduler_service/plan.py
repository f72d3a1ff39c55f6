"""Encode a scheduler step as a self-contained StepPlan (and decode the worker's StepResult).

Integer arrays travel as packed little-endian numpy bytes; see protos/wire.proto for dtypes and shapes.
"""

from __future__ import annotations

import numpy as np

from protos import wire_pb2
from scheduler_service.scheduler import SchedulerOutput

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")


def build_plan(out: SchedulerOutput, block_size: int) -> wire_pb2.StepPlan:
    num_seqs = len(out.scheduled)
    token_parts: list[np.ndarray] = []
    position_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    seq_lens = np.empty(num_seqs, dtype=I32)
    q_lens = np.empty(num_seqs, dtype=I32)
    do_sample = np.empty(num_seqs, dtype=np.uint8)
    sample_index = np.empty(num_seqs, dtype=I32)
    max_blocks = max((len(s.seq.block_ids) for s in out.scheduled), default=0)
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=I32)
    sampling = []
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
        sampling.append(
            wire_pb2.SamplingRow(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seq.sample_seed
            )
        )
    query_start_loc = np.zeros(num_seqs + 1, dtype=I32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    cat = np.concatenate
    copies = np.asarray(out.block_copies, dtype=I32).reshape(-1, 2)
    return wire_pb2.StepPlan(
        step_id=out.step_id,
        num_seqs=num_seqs,
        num_tokens=int(query_start_loc[-1]),
        token_ids=cat(token_parts).astype(I32).tobytes() if token_parts else b"",
        positions=cat(position_parts).astype(I32).tobytes() if position_parts else b"",
        slot_mapping=cat(slot_parts).astype(I64).tobytes() if slot_parts else b"",
        block_tables=block_tables.tobytes(),
        max_blocks_per_seq=max_blocks,
        seq_lens=seq_lens.tobytes(),
        query_start_loc=query_start_loc.tobytes(),
        do_sample=do_sample.tobytes(),
        sample_index=sample_index.tobytes(),
        sampling=sampling,
        block_copies=copies.tobytes(),
    )


def sampled_tokens(result: wire_pb2.StepResult, num_seqs: int) -> list[int]:
    tokens = np.frombuffer(result.sampled_token_ids, dtype=I32)
    if tokens.shape[0] != num_seqs:
        raise ValueError(f"step {result.step_id}: {tokens.shape[0]} sampled tokens for {num_seqs} sequences")
    return tokens.tolist()
