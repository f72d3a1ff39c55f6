"""Step execution: a StepPlan in, one batched forward and one sampler call, a StepResult out. The
plan is checked (worker/step/plan_checks.py) before anything touches the pool.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from protos import wire_pb2
from protos.codec import CodecError, PlanArrays, decode_plan
from protos.result_codec import encode_result
from worker.model.attention import AttentionBackend
from worker.model.delta_net import begin_state_step
from worker.model.kv_pool import KVPool
from worker.model.kv_tiers import KvTierStore, check_tiers
from worker.model.llama import LlamaModel, StepInputs
from worker.model.lora import LoraCache, StepLora
from worker.step.chain import TokenChain
from worker.step.controls import apply_controls, gather_controls, top_logprobs
from worker.step.plan_checks import PlanError, check_mask, validate_plan, validate_states
from worker.step.sampler import NonFiniteLogits, SamplingBatch, check_sampled, sample_async
from worker.step.speculation import accept_drafts, expand_drafts, stage_drafts
from worker.step.staging import InFlight, Staged, Staging, StepClock, pool_hidden

log = structlog.get_logger("worker.step.runner")


class StepDependencyError(RuntimeError):
    """A step took its input tokens from a step that failed after it was launched."""


class ModelRunner:
    def __init__(
        self, model: LlamaModel, pool: KVPool, attn: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.pool = pool
        # Blocks plans may address: the pool's size until the scheduler acknowledges its own count.
        self.num_blocks = pool.num_blocks
        self.attn = attn
        self.device = device
        self.config = model.config
        self.staging = Staging(device)
        # step/graphs.py DecodeGraphs, set once captured (CUDA, unless --enforce-eager)
        self.graphs = None
        self.adapters: LoraCache | None = None  # LoRA adapters held (--max-cpu-loras > 0)
        # the KV tiers' bytes (--kv-offload-size, --kv-offload-dir)
        self.tiers: KvTierStore | None = None
        self.chain = TokenChain(device)

    def preload_loras(self, loras: list[tuple[str, str]]) -> None:
        """Read the served adapters now; a failure is retried when a plan names it."""
        if self.adapters is not None and loras:
            self.adapters.preload(loras)

    @torch.inference_mode()
    def execute(self, plan: wire_pb2.StepPlan, await_mask=None) -> wire_pb2.StepResult:
        """Launch and land one step; await_mask(step_id) gives a mask_follows plan its masks."""
        launched = self.launch(plan, await_mask)
        return launched if isinstance(launched, wire_pb2.StepResult) else self.land(launched)

    @torch.inference_mode()
    def launch(self, plan: wire_pb2.StepPlan, await_mask=None) -> InFlight | wire_pb2.StepResult:
        """Queue a step's whole work without waiting; N+1 reads N's tokens on the device."""
        t0 = time.perf_counter()
        accepted = self._accept(plan, await_mask)
        if isinstance(accepted, wire_pb2.StepResult):
            return accepted
        p, pending, lora = accepted
        # before any copy
        kv_failed, kv_s = self.tiers.run(p.kv) if p.kv is not None else (None, 0.0)
        if not p.num_seqs:  # a step that only moves blocks between the pool and the tiers
            return encode_result(
                plan.step_id, np.zeros(0, np.int32), kv_load_failed=kv_failed, time_kv=kv_s
            )
        s = self._stage(p, pending, lora)
        clock = StepClock(self.device)
        t1 = time.perf_counter()
        clock.mark("start")
        if s.graphed:  # a decode step replays its bucket's graph: forward and LM head of every row
            hidden, all_logits = (
                None,
                self.graphs.run(
                    s.token_ids,
                    s.positions,
                    s.slot_mapping,
                    s.block_tables,
                    s.seq_lens,
                    int(p.seq_lens.max()),
                ),
            )
        else:
            # [num_tokens, hidden]
            hidden, all_logits = self.model(s.step, self.pool, self.attn), None
        t2 = time.perf_counter()
        logprobs = prompt_logprobs = None
        pooled = pool_hidden(hidden, p) if p.pooling is not None else None
        # every rank computes them too: compute_logits is a collective
        if p.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(p, all_logits, hidden)
        # the step's tokens, then (when it drafts) how many drafted tokens each row accepted
        drafting = s.drafts is not None
        out = torch.full(
            (2 * p.num_seqs if drafting else p.num_seqs,), -1, dtype=torch.int64, device=self.device
        )
        tokens, accepted = out[: p.num_seqs], (out[p.num_seqs :] if drafting else None)
        if drafting:
            accepted.zero_()
        # every rank of a group sees the same plan, so all of them take this branch or none
        if s.rows.size:
            raw = (
                all_logits[s.last_rows]
                if s.graphed
                else self.model.compute_logits(hidden[s.last_rows])
            )
            clock.mark("logits")
            t2 = time.perf_counter()
            if p.mask_follows:  # the forward is queued (or done): now the masks computed meanwhile
                t_mask = time.perf_counter()
                p.token_bitmask = check_mask(await_mask(plan.step_id), p, self.config.vocab_size)
                t2 += time.perf_counter() - t_mask  # waiting is neither forward nor sampling
            logprobs = self._sample(p, s, raw, tokens, accepted)
        else:
            clock.mark("logits")
        host = self.chain.host_buffer(out.numel())
        host.copy_(out, non_blocking=True)
        clock.mark("end")  # land waits for this, not for what is queued after it
        t3 = time.perf_counter()
        self.chain.link(plan.step_id, tokens, p.do_sample)
        return InFlight(
            plan.step_id,
            p.do_sample.copy(),
            host,
            clock,
            logprobs,
            prompt_logprobs,
            depends_on=p.prev_step_id if pending else 0,
            time_prepare=t1 - t0,
            host_forward=t2 - t1,
            host_sample=t3 - t2,
            pooled=pooled,
            kv=(kv_failed, kv_s),
        )

    def _accept(self, plan: wire_pb2.StepPlan, await_mask) -> tuple | wire_pb2.StepResult:
        """The plan decoded and validated, or the result rejecting it."""
        try:
            p = decode_plan(plan)
            pending = self.chain.pending_rows(p)
            validate_plan(
                p,
                self.num_blocks,
                self.pool.block_size,
                self.config.vocab_size,
                self.config.max_position_embeddings,
                self.config.max_window,
            )
            states = self.pool.states
            validate_states(p, states.num_slots if states is not None else 0)
            if p.mask_follows and await_mask is None:
                raise PlanError(
                    "the plan's masks follow it, and this worker has no socket to wait on them"
                )
            lora = None
            if p.lora_index is not None and (p.lora_index >= 0).any():
                if self.adapters is None:
                    raise PlanError(
                        "the plan names LoRA adapters; this worker holds none (--max-cpu-loras)"
                    )
                lora = self.adapters.step(
                    p.loras, p.lora_index, np.diff(p.query_start_loc), self.device
                )
            if p.kv is not None:
                check_tiers(self.tiers, p.kv, self.num_blocks)
        except (CodecError, PlanError, ValueError, OSError) as e:
            self.chain.forget()  # a plan that refers to this one's tokens must not run either
            return wire_pb2.StepResult(step_id=plan.step_id, error=f"rejected plan: {e}")
        return p, pending, lora

    def _stage(self, p: PlanArrays, pending: bool, lora: StepLora | None = None) -> Staged:
        """Host arrays moved in one transfer, copies queued; a draft runs a row a token."""
        rows = np.flatnonzero(p.do_sample)
        tables, seq_lens_h, qsl_h = p.block_tables, p.seq_lens, p.query_start_loc
        ends = p.query_start_loc[1:].astype(np.int64) - 1
        logit_rows, owner, drafted = ends[rows], rows, None
        if p.num_draft is not None and (p.num_draft > 0).any():
            ex_owner, seq_lens_h, qsl_h = expand_drafts(p)
            tables = p.block_tables[ex_owner]
            per_row = np.where(p.num_draft[rows] > 0, p.num_draft[rows] + 1, 1)
            owner = np.repeat(rows, per_row)
            offsets = np.arange(owner.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
            logit_rows = ends[owner] - p.num_draft[owner] + offsets
            drafted = offsets
        q_lens = np.diff(qsl_h)
        arrays = [
            (tables, torch.int32),
            (seq_lens_h, torch.int32),
            (qsl_h, torch.int32),
            (p.token_ids, torch.int64),
            (p.positions, torch.int64),
            (p.slot_mapping, torch.int64),
            (p.block_copies, torch.int64),
            (logit_rows, torch.int64),
        ]
        if pending:
            arrays.append((p.prev_rows, torch.int64))
        staged = self.staging.put(arrays)
        block_tables, seq_lens, qsl, token_ids, positions, slot_mapping, copies, last_rows = staged[
            :8
        ]
        if pending:  # tokens the step in flight (or done) sampled, read where they are
            prev = staged[8]
            token_ids = self.chain.read(prev, token_ids)
        graphed = (
            self.graphs is not None
            and p.pooling is None
            and lora is None
            and self.graphs.covers(q_lens, seq_lens_h)
        )
        step = None
        if not graphed:
            meta = self.attn.prepare(
                block_tables,
                seq_lens,
                qsl,
                self.pool.block_size,
                max_seq_len=int(seq_lens_h.max()),
                max_q_len=int(q_lens.max()),
                host_q_lens=q_lens,
            )
            step = StepInputs(
                token_ids=token_ids,
                positions=positions,
                slot_mapping=slot_mapping,
                attn_meta=meta,
                lora=lora,
                state=begin_state_step(self.pool.states, p, self.device),
            )
        self.pool.copy_blocks(copies)
        self.pool.record_tokens(slot_mapping, token_ids)
        drafts = (
            stage_drafts(p, rows, owner, drafted, ex_owner, self.device)
            if drafted is not None
            else None
        )
        return Staged(
            rows,
            owner,
            graphed,
            token_ids,
            positions,
            slot_mapping,
            block_tables,
            seq_lens,
            last_rows,
            step,
            drafts,
        )

    def _sample(
        self,
        p: PlanArrays,
        s: Staged,
        raw: torch.Tensor,
        tokens: torch.Tensor,
        accepted: torch.Tensor | None,
    ):
        """Controls, the draw into `tokens` (and accepted drafts into `accepted`), and the logprobs
        asked for.
        """
        rows, owner = s.rows, s.logit_owner
        d = s.drafts
        controls = gather_controls(
            p, owner, s.block_tables, self.device, d and d.table_rows, d and d.offsets
        )
        logits = apply_controls(raw, controls, self.pool)
        index = p.sample_index[owner]
        # the token at draft position j is the (index - drafted + j)-th generated
        if s.drafts is not None:
            index = index - p.num_draft[owner] + s.drafts.offsets
        batch = SamplingBatch(
            temperature=torch.from_numpy(p.temperature[owner].copy()),
            top_p=torch.from_numpy(p.top_p[owner].copy()),
            top_k=torch.from_numpy(p.top_k[owner].astype(np.int64)),
            seeds=[int(x) for x in p.seed[owner]],
            sample_index=index.tolist(),
            min_p=torch.from_numpy(p.min_p[owner].copy()) if p.min_p is not None else None,
        )
        sampled = sample_async(logits, batch)
        if s.drafts is not None:
            last = torch.from_numpy(np.flatnonzero(np.append(owner[1:] != owner[:-1], True))).to(
                self.device, non_blocking=True
            )
            tokens[torch.from_numpy(rows).to(self.device, non_blocking=True)] = sampled[last]
            accept_drafts(sampled, s.drafts, tokens, accepted)
        else:
            tokens[torch.from_numpy(rows).to(self.device, non_blocking=True)] = sampled
        # by logits row: a drafting row asks none, so each asking row has one
        ks = p.logprobs[owner] if p.logprobs is not None else np.zeros(0, dtype=np.int32)
        at = np.flatnonzero(ks >= 0)
        if not at.size:
            return None
        index = torch.from_numpy(at).to(raw.device)
        return top_logprobs(raw[index], sampled[index].clamp(min=0), ks[at].astype(np.int64))

    def land(self, f: InFlight) -> wire_pb2.StepResult:
        """Wait for a launched step's tokens -> its result (or the failure of the step it read
        from).
        """
        t = time.perf_counter()
        f.clock.wait()
        sampled = f.host_tokens.numpy().astype(np.int32)
        num_seqs = f.do_sample.shape[0]
        sampled, accepted = (
            sampled[:num_seqs],
            (sampled[num_seqs:] if sampled.shape[0] > num_seqs else None),
        )
        try:
            if f.depends_on and f.depends_on in self.chain.failed:
                raise StepDependencyError(
                    f"step {f.step_id} took its tokens from step {f.depends_on}, which failed"
                )
            check_sampled(sampled[f.do_sample])
        except (NonFiniteLogits, StepDependencyError):
            self.chain.fail(f.step_id)
            raise
        waited = time.perf_counter() - t
        forward, sampling = f.clock.split(f.host_forward, f.host_sample + waited)
        pooled = f.pooled.cpu().numpy() if f.pooled is not None else None
        return encode_result(
            f.step_id,
            sampled,
            logprobs=f.logprobs,
            prompt_logprobs=f.prompt_logprobs,
            num_accepted=accepted,
            pooled=pooled,
            time_prepare=f.time_prepare,
            time_forward=forward,
            time_sample=sampling,
            kv_load_failed=f.kv[0],
            time_kv=f.kv[1],
        )

    def _prompt_logprobs(self, p: PlanArrays, all_logits, hidden):
        """Logprobs of prompt tokens after each row's first `count`, from the logits there."""
        counts = p.prompt_logprob_counts.astype(np.int64)
        at = np.flatnonzero(counts > 0)
        if at.size == 0:
            return None
        starts = p.query_start_loc[at].astype(np.int64)
        index = np.repeat(
            starts - np.concatenate([[0], np.cumsum(counts[at])[:-1]]), counts[at]
        ) + np.arange(int(counts[at].sum()))
        where = torch.from_numpy(index).to(self.device)
        logits = (
            all_logits[where]
            if all_logits is not None
            else self.model.compute_logits(hidden[where])
        )
        ks = np.repeat(p.prompt_logprobs[at].astype(np.int64), counts[at])
        return top_logprobs(logits, torch.from_numpy(p.prompt_logprob_targets.astype(np.int64)), ks)
