"""The numpy codec of the wire: StepPlan and StepResult arrays <-> packed little-endian bytes.

One place knows every array's dtype and shape (protos/wire.proto documents them); the scheduler
encodes with it, the worker and the simulated worker decode with it. Decoding checks sizes only:
whether values fit a pool or a vocabulary is the worker's business (worker/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import wire_pb2

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
U8 = np.dtype("u1")
U64 = np.dtype("<u8")
F32 = np.dtype("<f4")


class CodecError(ValueError):
    """An array of a plan or result has the wrong number of bytes."""


@dataclass
class PlanArrays:
    """One step's plan as arrays (shapes: S sequences, T tokens, B blocks per sequence, C copies)."""

    step_id: int
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T]; -1 writes nothing
    block_tables: np.ndarray  # int32 [S, B]; unused entries -1
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]
    do_sample: np.ndarray  # bool [S]
    sample_index: np.ndarray  # int32 [S]
    temperature: np.ndarray  # float32 [S]
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]; 0 = off
    seed: np.ndarray  # uint64 [S]
    block_copies: np.ndarray  # int32 [C, 2] of (src, dst)
    prev_step_id: int = 0
    prev_rows: np.ndarray | None = None  # int32 [T]: -1, or the row of step prev_step_id whose token goes here

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def encode_plan(p: PlanArrays) -> wire_pb2.StepPlan:
    def b(a: np.ndarray, dtype: np.dtype) -> bytes:
        return np.ascontiguousarray(a, dtype=dtype).tobytes()

    return wire_pb2.StepPlan(
        step_id=p.step_id,
        num_seqs=p.num_seqs,
        num_tokens=p.num_tokens,
        token_ids=b(p.token_ids, I32),
        positions=b(p.positions, I32),
        slot_mapping=b(p.slot_mapping, I64),
        block_tables=b(p.block_tables, I32),
        max_blocks_per_seq=int(p.block_tables.shape[1]) if p.block_tables.ndim == 2 else 0,
        seq_lens=b(p.seq_lens, I32),
        query_start_loc=b(p.query_start_loc, I32),
        do_sample=b(p.do_sample, U8),
        sample_index=b(p.sample_index, I32),
        temperature=b(p.temperature, F32),
        top_p=b(p.top_p, F32),
        top_k=b(p.top_k, I32),
        seed=b(p.seed, U64),
        block_copies=b(p.block_copies, I32),
        prev_rows=b(p.prev_rows, I32) if p.prev_rows is not None else b"",
        prev_step_id=p.prev_step_id,
    )


def _array(blob: bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(blob) != count * dtype.itemsize:
        raise CodecError(f"{what}: {len(blob)} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(blob, dtype=dtype)


def decode_plan(msg: wire_pb2.StepPlan) -> PlanArrays:
    """Read-only numpy views of the plan's bytes; raises CodecError when a size does not match."""
    s, t, mb = msg.num_seqs, msg.num_tokens, msg.max_blocks_per_seq
    if len(msg.block_copies) % (2 * I32.itemsize):
        raise CodecError("block_copies is not a whole number of (src, dst) pairs")
    return PlanArrays(
        step_id=msg.step_id,
        token_ids=_array(msg.token_ids, I32, t, "token_ids"),
        positions=_array(msg.positions, I32, t, "positions"),
        slot_mapping=_array(msg.slot_mapping, I64, t, "slot_mapping"),
        block_tables=_array(msg.block_tables, I32, s * mb, "block_tables").reshape(s, mb),
        seq_lens=_array(msg.seq_lens, I32, s, "seq_lens"),
        query_start_loc=_array(msg.query_start_loc, I32, s + 1, "query_start_loc"),
        do_sample=_array(msg.do_sample, U8, s, "do_sample").astype(bool),
        sample_index=_array(msg.sample_index, I32, s, "sample_index"),
        temperature=_array(msg.temperature, F32, s, "temperature"),
        top_p=_array(msg.top_p, F32, s, "top_p"),
        top_k=_array(msg.top_k, I32, s, "top_k"),
        seed=_array(msg.seed, U64, s, "seed"),
        block_copies=np.frombuffer(msg.block_copies, dtype=I32).reshape(-1, 2),
        prev_step_id=msg.prev_step_id,
        prev_rows=_array(msg.prev_rows, I32, t, "prev_rows") if msg.prev_rows else None,
    )


def resolve_tokens(p: PlanArrays, last_step_id: int, last_sampled: np.ndarray | None) -> np.ndarray:
    """The plan's token ids with every pending one filled from the tokens this worker sampled in its last
    step (`last_sampled`, int32, -1 where a row did not sample). Raises CodecError when the plan refers to
    a step or a row the worker has no token for (a restarted worker, a failed step)."""
    if p.prev_rows is None:
        return p.token_ids
    at = np.flatnonzero(p.prev_rows >= 0)
    if at.size == 0:
        return p.token_ids
    if last_sampled is None or p.prev_step_id != last_step_id:
        raise CodecError(f"the plan needs tokens sampled in step {p.prev_step_id}, which this worker does not have "
                         f"(its last completed step is {last_step_id})")
    src = p.prev_rows[at]
    if (src >= last_sampled.shape[0]).any() or (last_sampled[src] < 0).any():
        raise CodecError(f"the plan refers to rows of step {p.prev_step_id} that sampled no token")
    tokens = p.token_ids.copy()
    tokens[at] = last_sampled[src]
    return tokens


def encode_result(step_id: int, sampled: np.ndarray, **timings: float) -> wire_pb2.StepResult:
    """sampled: int32 [S], -1 where the sequence did not sample."""
    return wire_pb2.StepResult(step_id=step_id, sampled_token_ids=np.ascontiguousarray(sampled, I32).tobytes(),
                               **timings)


def decode_result(msg: wire_pb2.StepResult, num_seqs: int) -> np.ndarray:
    """-> int32 [num_seqs] sampled token ids; raises CodecError when the count is wrong."""
    tokens = np.frombuffer(msg.sampled_token_ids, dtype=I32)
    if tokens.shape[0] != num_seqs:
        raise CodecError(f"step {msg.step_id}: {tokens.shape[0]} sampled tokens for {num_seqs} sequences")
    return tokens
