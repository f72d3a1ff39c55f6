"""Step execution: a StepPlan in, one batched forward and one sampler call, a StepResult out.

The plan is checked before anything touches the pool: a malformed or out-of-range plan is
rejected with an error result, never a crash and never a write outside the pool.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from protos import wire_pb2
from worker.attention import AttentionBackend
from worker.kv_pool import KVPool
from worker.model import LlamaModel, StepInputs
from worker.sampler import SamplingBatch, sample

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")


class PlanError(ValueError):
    """The plan is malformed or out of range; the worker answers with an error result."""


def _array(blob: bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(blob) != count * dtype.itemsize:
        raise PlanError(f"{what}: {len(blob)} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(blob, dtype=dtype)


class DecodedPlan:
    """The plan's arrays as numpy views, validated against the pool and the model."""

    def __init__(self, plan: wire_pb2.StepPlan, num_blocks: int, block_size: int, vocab: int, max_pos: int):
        s, t, mb = plan.num_seqs, plan.num_tokens, plan.max_blocks_per_seq
        self.token_ids = _array(plan.token_ids, I32, t, "token_ids")
        self.positions = _array(plan.positions, I32, t, "positions")
        self.slot_mapping = _array(plan.slot_mapping, I64, t, "slot_mapping")
        self.block_tables = _array(plan.block_tables, I32, s * mb, "block_tables").reshape(s, mb)
        self.seq_lens = _array(plan.seq_lens, I32, s, "seq_lens")
        self.query_start_loc = _array(plan.query_start_loc, I32, s + 1, "query_start_loc")
        self.do_sample = _array(plan.do_sample, np.dtype(np.uint8), s, "do_sample").astype(bool)
        self.sample_index = _array(plan.sample_index, I32, s, "sample_index")
        if len(plan.block_copies) % 8:
            raise PlanError("block_copies is not a whole number of (src, dst) pairs")
        self.block_copies = np.frombuffer(plan.block_copies, dtype=I32).reshape(-1, 2)
        if len(plan.sampling) != s:
            raise PlanError(f"{len(plan.sampling)} sampling rows for {s} sequences")
        if s == 0 or t == 0:
            raise PlanError("a plan needs at least one sequence and one token")
        qsl = self.query_start_loc.astype(np.int64)
        q_lens = np.diff(qsl)
        if qsl[0] != 0 or qsl[-1] != t or (q_lens < 1).any():
            raise PlanError("query_start_loc must rise from 0 to num_tokens, at least one token per sequence")
        if (self.seq_lens < q_lens).any() or (self.seq_lens > mb * block_size).any():
            raise PlanError("seq_lens must cover this step's tokens and fit the block tables")
        if ((self.token_ids < 0) | (self.token_ids >= vocab)).any():
            raise PlanError(f"token id outside the vocabulary [0, {vocab})")
        if ((self.positions < 0) | (self.positions >= max_pos)).any():
            raise PlanError(f"position outside [0, {max_pos})")
        if ((self.slot_mapping < -1) | (self.slot_mapping >= num_blocks * block_size)).any():
            raise PlanError(f"slot outside the pool of {num_blocks * block_size} slots")
        if ((self.block_tables < -1) | (self.block_tables >= num_blocks)).any():
            raise PlanError(f"block id outside the pool of {num_blocks} blocks")
        needed = (self.seq_lens.astype(np.int64) + block_size - 1) // block_size
        used = np.arange(mb)[None, :] < needed[:, None]
        if (self.block_tables[used] < 0).any():
            raise PlanError("a block table has no block for part of its sequence")
        if ((self.block_copies < 0) | (self.block_copies >= num_blocks)).any():
            raise PlanError("block copy outside the pool")


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, attn: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.attn = attn
        self.device = device
        self.config = model.config

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(array, copy=True)).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def execute(self, plan: wire_pb2.StepPlan) -> wire_pb2.StepResult:
        t0 = time.perf_counter()
        try:
            p = DecodedPlan(
                plan, self.pool.num_blocks, self.pool.block_size, self.config.vocab_size,
                self.config.max_position_embeddings,
            )
        except PlanError as e:
            return wire_pb2.StepResult(step_id=plan.step_id, error=f"rejected plan: {e}")
        block_tables = self._tensor(p.block_tables, torch.int32)
        seq_lens = self._tensor(p.seq_lens, torch.int32)
        qsl = self._tensor(p.query_start_loc, torch.int32)
        step = StepInputs(
            token_ids=self._tensor(p.token_ids, torch.int64),
            positions=self._tensor(p.positions, torch.int64),
            slot_mapping=self._tensor(p.slot_mapping, torch.int64),
            attn_meta=self.attn.prepare(block_tables, seq_lens, qsl, self.pool.block_size,
                                        max_seq_len=int(p.seq_lens.max()),
                                        max_q_len=int(np.diff(p.query_start_loc).max())),
        )
        self.pool.copy_blocks(self._tensor(p.block_copies, torch.int64))
        t1 = time.perf_counter()
        hidden = self.model(step, self.pool, self.attn)  # [num_tokens, hidden]
        rows = np.flatnonzero(p.do_sample)
        last_token = p.query_start_loc[1:].astype(np.int64) - 1
        logits = self.model.compute_logits(hidden[self._tensor(last_token[rows], torch.int64)])
        t2 = time.perf_counter()
        sampled = np.full(plan.num_seqs, -1, dtype=I32)
        if rows.size:
            params = [plan.sampling[i] for i in rows]
            batch = SamplingBatch(
                temperature=torch.tensor([r.temperature for r in params], dtype=torch.float32),
                top_p=torch.tensor([r.top_p for r in params], dtype=torch.float32),
                top_k=torch.tensor([r.top_k for r in params], dtype=torch.int64),
                seeds=[r.seed for r in params],
                sample_index=p.sample_index[rows].tolist(),
            )
            sampled[rows] = sample(logits, batch).cpu().numpy()
        t3 = time.perf_counter()
        return wire_pb2.StepResult(
            step_id=plan.step_id,
            sampled_token_ids=sampled.tobytes(),
            time_prepare=t1 - t0,
            time_forward=t2 - t1,
            time_sample=t3 - t2,
        )
