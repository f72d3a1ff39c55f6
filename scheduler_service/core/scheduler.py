"""Continuous batching over kv_manager.py's memory: decodes, then prompt chunks, then admissions,
within the token budget; `_victim` picks whom to preempt. A step is planned while the last one runs.
"""

from __future__ import annotations

import itertools
import time

from protos.codec import PlanArrays
from scheduler_service.core.batch import ScheduledSeq, SchedulerOutput
from scheduler_service.core.drafting import DraftCost, SequenceDrafter, propose_draft
from scheduler_service.core.kv_manager import BlockCopy
from scheduler_service.core.pacing import EmbedPacer, PromptPacer
from scheduler_service.core.queues import Queues
from scheduler_service.core.sequence import Sequence, SequenceStatus


class Scheduler(Queues):
    def __init__(self, *args, **kwargs) -> None:
        """As Queues (the books), with the policy's own state: step ids, the embeddings' pace."""
        super().__init__(*args, **kwargs)
        self._step_ids = itertools.count(1)
        self.pacer = EmbedPacer(self.config.embed_slowdown, self.config.max_num_batched_tokens)
        gap = self.config.max_decode_gap if self.config.enable_chunked_prefill else 0.0
        self.prompt_pacer = PromptPacer(gap)
        # auto drafts only as far as a drafted row's measured cost repays
        self.draft_cost = DraftCost() if self.config.speculative == "auto" else None

    # --- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step: running sequences first (decodes, then chunks), then waiting ones while room
        allows.
        """
        out = SchedulerOutput(step_id=next(self._step_ids))
        scheduled: set[int] = set()
        if (states := self.kv.states) is not None:
            states.new_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, scheduled)
        self._admit_waiting(out, budget, scheduled)
        if states is not None:
            out.state_copies = states.copies
        out.loads = out.loads or (self.kv.tiers is not None and self.kv.tiers.has_ops)
        if self.config.debug_invariants:
            self.check_invariants()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, scheduled: set[int]) -> int:
        # one function: the order decodes, drafts and prompt chunks are taken in is the policy
        """Every decode a token, then prompt chunks -> the budget left."""
        kv = self.kv
        decodes, prefills, drafting_now = [], [], 0
        for s in self.running:
            left = len(s.token_ids) + s.pending.count - s.num_computed_tokens
            if left == 1 and s.request.embed is None:
                decodes.append(s)
            elif left > 0:  # (an embedding's last prompt token too: it never decodes)
                prefills.append(s)
            # a draft in flight (its tokens count as computed until its result)
            elif s.request.embed is None:
                drafting_now += 1
        # auto drafts only in small steps with no prompt to compute, where drafted rows are nearly
        # free
        small = (
            len(decodes) <= self.config.speculative_max_rows and not prefills and not self.waiting
        )
        drafting = self.speculating and (self.config.speculative == "ngram" or small)
        for seq in decodes:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            drafter = self._drafter(seq) if drafting else None
            if seq.pending.count and (
                self._at_limit(seq) or (drafter is not None and drafter.expects)
            ):
                # the step in flight samples its last token, or it drafts once that is known
                continue
            pos = seq.num_computed_tokens
            draft = []
            if drafter is not None and not seq.pending.count:
                t = time.perf_counter()
                rows = len(decodes) + sum(len(s.draft) for s in out.scheduled)
                draft = propose_draft(seq, drafter, budget, self.max_model_len, rows)
                out.draft_seconds += time.perf_counter() - t
            # fast path: into the sequence's own last block
            if not draft and kv.writes_in_place(seq, pos):
                self._add(out, seq, 1, scheduled)
                budget -= 1
                continue
            # blocks behind the window go back before any is asked for
            self.kv.drop_out_of_window(seq, pos)
            if draft:  # a draft takes free blocks only: it never preempts anyone, or it is dropped
                copies = kv.allocate_slots(seq, 1 + len(draft))
                if copies is not None:
                    self._copies(out, copies)
                    self._add(out, seq, 1 + len(draft), scheduled, tuple(draft))
                    budget -= 1 + len(draft)
                    continue
            if self._reserve(seq, 1, scheduled, out):
                self._add(out, seq, 1, scheduled)
                budget -= 1
        # Embeddings ride only in steps decoding one token a row, paced while any stream decodes.
        out.num_decodes = len(decodes) + drafting_now
        plain = out.scheduled and not any(s.draft for s in out.scheduled)
        cap = self.config.embed_step_tokens or budget
        out.embed_room = (
            min(budget, cap) if not out.num_decodes else self.pacer.room(budget) if plain else 0
        )
        # generation prompts beside decodes: as many tokens as keep the streams within the gap
        pacer = self.prompt_pacer
        pacer.begin(out.num_decodes, len(prefills) + len(self.waiting))
        for seq in prefills:
            if budget == 0:
                break
            embed, start = seq.request.embed is not None, seq.num_computed_tokens
            wanted = min(seq.num_uncomputed_tokens, budget)
            room = min(wanted, out.embed_room) if embed else pacer.fit(start, wanted)
            if seq.status is not SequenceStatus.RUNNING or not room:
                continue
            self.kv.drop_out_of_window(seq, start)
            num_new = self._reserve(seq, room, scheduled, out)
            if num_new:
                self._add(out, seq, num_new, scheduled)
                budget -= num_new
                if not embed:
                    pacer.spend(start, num_new)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, scheduled: set[int]) -> None:
        """Admit in arrival order while budget and pool allow; none in a step that preempted."""
        kv = self.kv
        at = 0  # the queue's head, or past embeddings while a decoding step has no room for them
        adapters = (
            None  # the LoRA adapters of the running sequences, once a waiting one has an adapter
        )
        while (
            at < len(self.waiting)
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[at]
            # preempted while its last token was in flight: admitted once it is known
            if seq.pending.count:
                break
            embed = seq.request.embed is not None
            room = out.embed_room if embed else budget
            lora = seq.request.lora
            if lora is not None:
                adapters = adapters if adapters is not None else self._running_adapters()
                if lora.id not in adapters and len(adapters) >= self.config.max_loras:
                    room = 0  # no adapter slot: it waits, and requests behind it may go
            if not room:
                at += 1
                continue
            hits = kv.cached_prefix(seq)
            if kv.tiers is not None and kv.load_from_tiers(seq, hits, out.step_id):
                # its prefix is read back from the tiers first: admitted once that step is done
                at += 1
                continue
            num_cached = len(hits) * self.block_size
            num_new = seq.num_tokens - num_cached
            if not embed:  # beside decodes: what keeps their gap
                room = self.prompt_pacer.fit(num_cached, num_new)
                if not room:
                    at += 1
                    continue
            if num_new > min(budget, room):
                if not self.config.enable_chunked_prefill:
                    if room < budget:  # an embedding beside decodes: it waits for a step with room
                        at += 1
                        continue
                    break
                num_new = min(budget, room)
            if not kv.admit(seq, hits, num_new):
                break
            del self.waiting[at]
            self._start(out, seq, num_cached, num_new, scheduled)
            budget -= num_new
            if lora is not None and adapters is not None:
                adapters.add(lora.id)

    def _start(
        self, out: SchedulerOutput, seq: Sequence, num_cached: int, num_new: int, scheduled
    ) -> None:
        """An admitted seq runs: its first num_new tokens after num_cached from the prefix cache."""
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached
        if seq.request.cached_prompt_tokens is None:
            seq.request.cached_prompt_tokens = min(num_cached, seq.prompt_len)
        seq.pooling.sum = None  # (an embedding recomputed after a preemption pools again)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add(out, seq, num_new, scheduled)
        if seq.request.embed is None:
            self.prompt_pacer.spend(num_cached, num_new)

    def _running_adapters(self) -> set:
        return {s.request.lora.id for s in self.running if s.request.lora is not None}

    def _drafter(self, seq: Sequence) -> SequenceDrafter | None:
        """seq's drafting state, made at its first decode; None for
        a sequence that asks logprobs.
        """
        if seq.drafter is None:
            if not seq.request.sampling.may_draft:
                return None
            seq.drafter = SequenceDrafter(
                seq.token_ids,
                self.config.num_speculative_tokens,
                self.shared_ngrams,
                self.draft_cost,
            )
            seq.drafter.look_ahead()
        return seq.drafter

    def _at_limit(self, seq: Sequence) -> bool:
        """The step in flight samples seq's last allowed token: nothing to plan."""
        return (
            seq.num_planned_tokens - seq.prompt_len >= seq.request.sampling.max_tokens
            or seq.num_planned_tokens >= self.max_model_len
        )

    def build_plan(self, out: SchedulerOutput) -> PlanArrays:
        """The step's plan arrays (scheduler_service/core/plan.py), with the KV tiers' work decided
        since the last one.
        """
        if out.scheduled:
            plan, out.read = self.planner.build(out)
        else:
            plan = PlanArrays.empty(out.step_id)
        if self.kv.tiers is not None:
            plan.kv = out.read.kv_ops = self.kv.tiers.take_ops()
        return plan

    def observe(self, out: SchedulerOutput, seconds: float, tier_seconds: float) -> None:
        """A step's worker time: it paces embeddings and prompts, prices a drafted row, and weighs
        a tier load against computing.
        """
        other_prefill = out.num_prefill_tokens - out.num_embed_tokens
        decoding = all(s.num_new_tokens == 1 + len(s.draft) for s in out.scheduled)
        if self.draft_cost is not None and out.scheduled and decoding and not out.loads:
            self.draft_cost.observe(out.num_tokens, seconds)
        self.pacer.observe(out.num_decodes, out.num_embed_tokens, other_prefill, seconds)
        if self.prompt_pacer.gap:
            rows = [
                s for s in out.scheduled if s.num_new_tokens > 1 and s.seq.request.embed is None
            ]
            tokens = sum(s.num_new_tokens for s in rows)
            at = sum(s.num_new_tokens * (2 * s.start + s.num_new_tokens) // 2 for s in rows)
            deepest = max((s.start + s.num_new_tokens for s in rows), default=0)
            self.prompt_pacer.observe(out.num_decodes, tokens, at, seconds, deepest)
        if self.kv.tiers is not None:
            self.kv.tiers.observe(out.read.kv_ops, tier_seconds, out.num_prefill_tokens, seconds)

    # --- memory ----------------------------------------------------------------------------------
    def _add(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        num_new: int,
        scheduled: set[int],
        draft: tuple[int, ...] = (),
    ) -> None:
        """Commit num_new tokens of seq (a draft's all pending until the result says how many
        stand).
        """
        start = seq.num_computed_tokens
        self.kv.drop_out_of_window(seq, start)
        known = len(seq.token_ids)
        if seq.request.embed is not None:  # prompt chunks only, paced beside decodes
            do_sample = False
            out.embed_room -= num_new
            out.num_embed_tokens += num_new
        else:
            do_sample = start + num_new == known + seq.pending.count or bool(draft)
        item = ScheduledSeq(seq, start, num_new, do_sample, seq.epoch, draft=draft)
        if self.kv.states is not None and self.caching:
            self._snapshots(out, seq, start, num_new)
        if draft:
            if seq.pending.count or start + 1 != known or num_new != 1 + len(draft):
                raise RuntimeError(f"{seq}: a draft follows the known last token, nothing else")
        elif start + num_new > known:  # its input is the token the step in flight samples
            if seq.pending.step != out.step_id - 1 or start + num_new != known + 1:
                raise RuntimeError(
                    f"{seq}: step {out.step_id} would read a token not sampled by the previous step"
                )
            item.prev_row = seq.pending.row
        if do_sample:
            seq.pending.count += 1
            seq.pending.step, seq.pending.row = out.step_id, len(out.scheduled)
        out.scheduled.append(item)
        seq.num_computed_tokens = start + num_new
        scheduled.add(seq.seq_id)

    def _reserve(
        self, seq: Sequence, num_new: int, scheduled: set[int], out: SchedulerOutput
    ) -> int:
        """Room for num_new tokens, preempting others if needed -> tokens reserved (0: seq was
        preempted).
        """
        while True:
            copies = self.kv.allocate_slots(seq, num_new)
            if copies is not None:
                self._copies(out, copies)
                return num_new
            if self.config.enable_chunked_prefill and num_new > 1:
                fits = self.kv.tokens_that_fit(seq, num_new)
                if 1 <= fits < num_new:
                    num_new = fits
                    continue
            victim = self._victim(scheduled)
            if victim is None:  # everyone else already runs this step: wait for them to finish
                return 0
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _snapshots(self, out: SchedulerOutput, seq: Sequence, start: int, num_new: int) -> None:
        """A hybrid row's state snapshots at kept block boundaries, and where it ends a decoded
        block.
        """
        bs, states, row = self.block_size, self.kv.states, len(out.scheduled)
        points = states.points(seq, start, num_new, bs)
        for at in points:
            slot = states.save(seq.block_hash(at // bs - 1, bs))
            if slot is not None:
                out.state_saves.append((row, at - start, slot))
        end = start + num_new
        # a decode ending a block: its snapshot is keyed at the result (its input may be in flight)
        if end % bs == 0 and end >= seq.prompt_len and end not in points:
            slot = states.save_later(seq)
            if slot is not None:
                out.state_saves.append((row, num_new, slot))
                out.state_trails.append((row, slot))

    @staticmethod
    def _copies(out: SchedulerOutput, copies: list[BlockCopy]) -> None:
        """A step's copies-on-write: the worker runs them before the forward."""
        out.block_copies.extend((c.src, c.dst) for c in copies)

    def _victim(self, scheduled: set[int]) -> Sequence | None:
        """The most recently admitted runner not in this step: cheapest to recompute."""
        return next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
