"""Step execution: a StepPlan in, one batched forward and one sampler call, a StepResult out.

The plan is checked before anything touches the pool: a malformed or out-of-range plan is
rejected with an error result, never a crash and never a write outside the pool.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from protos import wire_pb2
from protos.codec import CodecError, PlanArrays, decode_plan, encode_result, resolve_tokens
from worker.attention import AttentionBackend
from worker.kv_pool import KVPool
from worker.model import LlamaModel, StepInputs
from worker.sampler import SamplingBatch, sample


class PlanError(ValueError):
    """The plan is malformed or out of range; the worker answers with an error result."""


def validate_plan(p: PlanArrays, num_blocks: int, block_size: int, vocab: int, max_pos: int) -> None:
    """Raise PlanError unless every array fits the pool, the vocabulary and the context.

    num_blocks is the count the scheduler acknowledged, not this rank's own pool: every rank of a
    group then accepts or rejects the same plan alike, so none waits in a collective for the others."""
    s, t = p.num_seqs, p.num_tokens
    if s == 0 or t == 0:
        raise PlanError("a plan needs at least one sequence and one token")
    qsl = p.query_start_loc.astype(np.int64)
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != t or (q_lens < 1).any():
        raise PlanError("query_start_loc must rise from 0 to num_tokens, at least one token per sequence")
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
    if (p.block_tables[used] < 0).any():
        raise PlanError("a block table has no block for part of its sequence")
    if ((p.block_copies < 0) | (p.block_copies >= num_blocks)).any():
        raise PlanError("block copy outside the pool")
    if not np.isfinite(p.temperature).all() or (p.temperature < 0).any():
        raise PlanError("temperature must be finite and >= 0")
    if not ((p.top_p > 0) & (p.top_p <= 1)).all():
        raise PlanError("top_p must lie in (0, 1]")


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, attn: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        # Blocks plans may address: the pool's size until the scheduler acknowledges its own count.
        self.num_blocks = pool.num_blocks
        self.attn = attn
        self.device = device
        self.config = model.config
        # The tokens sampled by the last step that succeeded: the next plan may refer to them (overlap).
        self.last_step_id = 0
        self.last_sampled: np.ndarray | None = None

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(array, copy=True)).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def execute(self, plan: wire_pb2.StepPlan) -> wire_pb2.StepResult:
        t0 = time.perf_counter()
        try:
            p = decode_plan(plan)
            token_ids = resolve_tokens(p, self.last_step_id, self.last_sampled)
            p.token_ids = token_ids
            validate_plan(p, self.num_blocks, self.pool.block_size, self.config.vocab_size,
                          self.config.max_position_embeddings)
        except (CodecError, PlanError) as e:
            self.last_sampled = None  # a plan that refers to this one's tokens must not run either
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
        sampled = np.full(p.num_seqs, -1, dtype=np.int32)
        t2 = t3 = time.perf_counter()
        if rows.size:  # every rank of a group sees the same plan, so all of them take this branch or none
            last_token = p.query_start_loc[1:].astype(np.int64) - 1
            logits = self.model.compute_logits(hidden[self._tensor(last_token[rows], torch.int64)])
            t2 = time.perf_counter()
            batch = SamplingBatch(
                temperature=torch.from_numpy(p.temperature[rows].copy()),
                top_p=torch.from_numpy(p.top_p[rows].copy()),
                top_k=torch.from_numpy(p.top_k[rows].astype(np.int64)),
                seeds=[int(x) for x in p.seed[rows]],
                sample_index=p.sample_index[rows].tolist(),
            )
            sampled[rows] = sample(logits, batch).cpu().numpy()
            t3 = time.perf_counter()
        self.last_step_id, self.last_sampled = plan.step_id, sampled
        return encode_result(plan.step_id, sampled, time_prepare=t1 - t0, time_forward=t2 - t1, time_sample=t3 - t2)
