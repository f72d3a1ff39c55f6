"""The simulated worker: a torch-free model whose output depends on every paging decision, so the
scheduler's memory management is checked token for token without a model (tests/unit, the overlap
benchmark).
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np

from protos import wire_pb2
from protos.codec import decode_plan, resolve_tokens
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler

VOCAB = 1000


def next_token(context: list[int], seed: int | None = None, index: int = 0) -> int:
    """Greedy (seed None): a function of the context. Sampled: also of the seed and the token's
    index, so samples of one prompt diverge, as they do with a real sampler.
    """
    key = list(context) if seed is None else list(context) + [seed, index]
    digest = hashlib.blake2b(np.asarray(key, dtype=np.uint64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def expected_output(
    prompt: list[int], max_tokens: int, seed: int | None = None, window: int = 0
) -> list[int]:
    """window > 0: a sliding-window model, each token a function
    of the last `window` tokens only.
    """
    ctx = list(prompt)
    for i in range(max_tokens):
        ctx.append(next_token(ctx[-window:] if window else ctx, seed, i))
    return ctx[len(prompt) :]


class SimulatedWorker:
    def __init__(
        self, num_blocks: int, block_size: int, window: int = 0, num_state_slots: int = 0
    ) -> None:
        """window > 0: the model reads only each token's last `window` positions (a sliding window),
        so the scheduler may give back blocks before it; reading one of those would change the
        output. num_state_slots: a hybrid's state pool.
        """
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.snapshots_taken = 0
        self.window = window
        self.pool = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.num_steps = 0
        self.num_drafted = self.num_accepted = (
            0  # drafted tokens the steps applied by `step` verified, stood
        )
        self.last_step_id = 0
        self.last_sampled: np.ndarray | None = (
            None  # kept for the next plan's pending tokens (overlap)
        )
        self.last_accepted: list[int] | None = (
            None  # drafted tokens each row of the last step accepted
        )
        # what the last step's pooling rows gave back: a hidden state of two values, [sum of the
        # token ids the row reads, how many]: a mean sums its own tokens, the last token reads its
        # whole context, the first token itself (a stand-in for a model whose last hidden state
        # depends on the whole context)
        self.last_pooled: np.ndarray | None = None
        self.states: dict[int, list[int]] = {}  # a hybrid's state slots: the tokens each has read
        # KV tiers: the host tier's slots (hash, the block's token ids), the disk's blocks by hash,
        # those whose copy below the pool reads back as corrupt, and the loads of the last step that
        # failed
        self.host: dict[int, tuple[bytes, np.ndarray]] = {}
        self.disk: dict[bytes, np.ndarray] = {}
        self.corrupt: set[bytes] = set()
        self.last_failed: set[int] = set()
        self.num_loaded = 0
        # a hybrid's snapshots on the tiers: host slots (hash, the tokens its state has read), the
        # disk's by hash
        self.host_states: dict[int, tuple[bytes, list[int]]] = {}
        self.disk_states: dict[bytes, list[int]] = {}
        self.num_snapshots_loaded = 0

    def step(self, sched, out) -> list:
        """Plan, run and apply one scheduler step (its drafts' acceptance included): what it did."""
        from protos.codec import encode_plan

        tokens = self.execute(encode_plan(sched.build_plan(out)))
        update = sched.update(out, tokens, self.last_accepted, self.last_pooled, self.last_failed)
        self.num_drafted += update.num_drafted
        self.num_accepted += update.num_accepted
        return update

    def execute(self, plan: wire_pb2.StepPlan) -> list[int]:
        """Run a plan as it comes off the wire; -1 for rows that do not sample. A drafting row's
        drafted tokens stand while each is the token the model gives at its position
        (`last_accepted` says how many), and its token is the one after them, as the worker's
        sampler does.
        """
        self.num_steps += 1
        p = decode_plan(plan)
        token_ids = resolve_tokens(p, self.last_step_id, self.last_sampled)
        bs = self.block_size
        tables, qsl = p.block_tables.astype(np.int64), p.query_start_loc
        assert (p.slot_mapping >= 0).all()
        for i in range(p.num_seqs):  # a slot is where the position's block table entry says
            pos = p.positions[qsl[i] : qsl[i + 1]].astype(np.int64)
            assert (
                p.slot_mapping[qsl[i] : qsl[i + 1]] == tables[i][pos // bs] * bs + pos % bs
            ).all()
        self._tiers(p)
        for src, dst in p.block_copies:  # copy-on-write, before the step's writes
            self.pool[dst * bs : (dst + 1) * bs] = self.pool[src * bs : (src + 1) * bs]
        self.pool[p.slot_mapping] = token_ids
        if p.state_slots is not None:
            self._advance_states(p, tables, token_ids)
        out, accepted = [], [0] * p.num_seqs
        for i in range(p.num_seqs):
            if not p.do_sample[i]:
                out.append(-1)
                continue
            drafted = int(p.num_draft[i]) if p.num_draft is not None else 0
            seed = int(p.seed[i]) if p.temperature[i] > 0 else None
            # each draft position in turn, then the token after the draft
            for j in range(drafted + 1):
                end = int(p.seq_lens[i]) - drafted + j
                token = next_token(
                    self._context(tables[i], end), seed, int(p.sample_index[i]) - drafted + j
                )
                if j == drafted or token != token_ids[qsl[i + 1] - drafted + j]:
                    break
                accepted[i] += 1
            out.append(token)
        self.last_step_id, self.last_sampled = p.step_id, np.asarray(out, dtype=np.int32)
        self.last_accepted = accepted if p.num_draft is not None else None
        self.last_pooled = self._pool(p, tables, token_ids) if p.pooling is not None else None
        return out

    def _advance_states(self, p, tables: np.ndarray, token_ids: np.ndarray) -> None:
        """A hybrid's state slots as a worker keeps them: each holds exactly its sequence's tokens
        so far, a row at position 0 starting it afresh, a resuming row from the snapshot copied in;
        a snapshot holds its row's tokens up to where it was taken. The plan passes the worker's
        own checks; a slot shared or lost mid-sequence fails.
        """
        from worker.step.plan_checks import validate_states

        validate_states(p, self.num_state_slots)
        pairs = [] if p.state_copies is None else p.state_copies.reshape(-1, 2).tolist()
        copied = [list(self.states.get(src, [])) for src, _ in pairs]
        for (_, dst), held in zip(pairs, copied, strict=True):
            self.states[dst] = held
        saves = [] if p.state_saves is None else p.state_saves.reshape(-1, 3).tolist()
        qsl = p.query_start_loc
        for i, slot in enumerate(p.state_slots.tolist()):
            first = int(p.positions[qsl[i]])
            held = [] if first == 0 else self.states.get(slot, [])
            assert len(held) == first, (
                f"slot {slot} holds {len(held)} tokens; row starts at {first}"
            )
            new = token_ids[qsl[i] : qsl[i + 1]].tolist()
            self.states[slot] = held + new
            assert self.states[slot] == self._context(tables[i], int(p.seq_lens[i]))
            for _, offset, dst in (save for save in saves if save[0] == i):
                self.states[dst] = held + new[:offset]
                self.snapshots_taken += 1

    def _tiers(self, p) -> None:
        """The plan's KV-tier work, as a worker runs it: stores, then loads (checked by hash), then
        drops.
        """
        self.last_failed = set()
        if p.kv is None:
            return
        self._blocks_tiers(p)
        if p.kv.states is not None:
            self._state_tiers(p.kv.states, len(p.kv.loads))

    def _state_tiers(self, ops, first: int) -> None:
        """A hybrid's snapshots on the tiers: a slot's tokens written down, read back by hash;
        failures numbered after the blocks' loads.
        """
        n = len(ops.stores)
        for i, (slot, tier, host) in enumerate(ops.stores.tolist()):
            assert slot in self.states, "a snapshot written down was never taken"
            held = (ops.hashes[i], list(self.states[slot]))
            if tier == 1:
                self.host_states[host] = held
            else:
                self.disk_states[ops.hashes[i]] = held[1]
        for j, (slot, tier, host) in enumerate(ops.loads.tolist()):
            h = ops.hashes[n + j]
            held = self.host_states.get(host) if tier == 1 else None
            if tier != 1 and h in self.disk_states:
                held = (h, self.disk_states[h])
            if held is None or held[0] != h or h in self.corrupt:
                self.last_failed.add(first + j)
                continue
            self.states[slot] = list(held[1])
            self.num_snapshots_loaded += 1
        for h in ops.drops:
            self.disk_states.pop(h, None)

    def _blocks_tiers(self, p) -> None:
        bs, n = self.block_size, len(p.kv.stores)
        for i, (block, tier, slot) in enumerate(p.kv.stores.tolist()):
            row = self.pool[block * bs : (block + 1) * bs].copy()
            assert (row >= 0).all(), "a block written down was never computed"
            if tier == 1:
                self.host[slot] = (p.kv.hashes[i], row)
            else:
                self.disk[p.kv.hashes[i]] = row
        for j, (block, tier, slot) in enumerate(p.kv.loads.tolist()):
            h = p.kv.hashes[n + j]
            held = (
                self.host.get(slot) if tier == 1 else (h, self.disk[h]) if h in self.disk else None
            )
            if held is None or held[0] != h or h in self.corrupt:
                self.last_failed.add(j)
                continue
            self.pool[block * bs : (block + 1) * bs] = held[1]
            self.num_loaded += 1
        for h in p.kv.drops:
            self.disk.pop(h, None)

    def _pool(self, p, tables: np.ndarray, token_ids: np.ndarray) -> np.ndarray | None:
        from protos.codec import POOL_FIRST, POOL_SUM

        rows = []
        for i in np.flatnonzero(p.pooling).tolist():
            start, end = int(p.query_start_loc[i]), int(p.query_start_loc[i + 1])
            if p.pooling[i] == POOL_SUM:
                ids = token_ids[start:end]
            elif p.pooling[i] == POOL_FIRST:
                ids = token_ids[start : start + 1]
            else:
                ids = np.asarray(self._context(tables[i], int(p.seq_lens[i])))
            rows.append([float(np.sum(ids)), float(len(ids))])
        return np.asarray(rows, dtype=np.float32) if rows else None

    def _context(self, table: np.ndarray, end: int) -> list[int]:
        """The tokens the model reads for the token at position `end` (its window's, with one)."""
        bs = self.block_size
        pos = np.arange(max(end - self.window, 0) if self.window else 0, end)
        assert (table[pos // bs] >= 0).all(), "a block the window reads was given back"
        ctx = self.pool[table[pos // bs] * bs + pos % bs]
        assert (ctx >= 0).all(), "read a slot that was never written"
        return ctx.tolist()


class SimulatedClient:
    """A WorkerClient over one SimulatedWorker, in process: a plan runs when it is sent (in order,
    as a worker takes plans), and its result is handed back once `release` lets one more through.
    """

    def __init__(self, worker: SimulatedWorker) -> None:
        self.worker = worker
        self.sent = 0
        self._released = asyncio.Semaphore(0)

    def release(self) -> None:
        self._released.release()

    def step_limit(self, plan) -> float:
        return 60.0

    async def execute(self, replica, plan, queued_behind=0.0, sent=None):
        from protos.result_codec import encode_result

        self.sent += 1
        if sent is not None:
            sent.set()
        w = self.worker
        sampled = np.asarray(w.execute(plan), dtype=np.int32)
        accepted = (
            np.asarray(w.last_accepted, dtype=np.int32) if w.last_accepted is not None else None
        )
        failed = np.asarray(sorted(w.last_failed), dtype=np.int32) if w.last_failed else None
        # a prompt token costs a millisecond of the model's time, a tier's block far less (so loads
        # pay)
        result = encode_result(
            plan.step_id,
            sampled,
            num_accepted=accepted,
            pooled=w.last_pooled,
            kv_load_failed=failed,
            time_forward=1e-3 * plan.num_tokens,
            time_kv=1e-5,
        )
        await self._released.acquire()
        return result

    async def send_mask(self, replica, mask) -> None:
        pass

    async def drop_group(self, replica, reason) -> None:
        pass


class Pipeline:
    """The replica's real step loop (runtime/step_loop.py) over a SimulatedWorker, let through one
    result at a time: with overlap, step N+1 is planned and sent before step N's result is applied.
    Requests arrive and are aborted through the loop, between results.
    """

    def __init__(self, sched, worker: SimulatedWorker, overlap: bool = True) -> None:
        from dataclasses import replace

        from scheduler_service.runtime.step_loop import StepLoop

        self.sched = sched
        self.client = SimulatedClient(worker)
        self.landed = 0
        self.lost: str | None = None
        self.events = asyncio.new_event_loop()
        self.loop = StepLoop(0, replace(sched.config, overlap=overlap), self.client, self)
        self.events.run_until_complete(self._start())

    async def _start(self) -> None:
        self.loop.serve(self.sched)

    # the step loop's sink
    def on_step(self, loop, report) -> None:
        self.landed += 1

    def on_step_failed(self, loop, out, message) -> None:
        self.landed += 1
        self.lost = f"step {out.step_id} failed: {message}"

    def on_unschedulable(self, loop, request, message) -> None:
        self.lost = message

    async def on_lost(self, loop, message) -> None:
        self.lost = message

    @property
    def busy(self) -> bool:
        return self.sched.has_work or self.landed < self.client.sent

    def submit(self, request) -> None:
        self.loop.submit(request, [])

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def step(self) -> bool:
        """Let one result through and run the loop until it is applied (and the next plans are
        sent); False when there was nothing to apply.
        """
        if not self.busy:
            return False
        target = self.landed + 1
        self.client.release()
        self.events.run_until_complete(
            self._settle(lambda: self.landed >= target or self.lost is not None)
        )
        assert self.lost is None, self.lost
        return self.landed >= target

    async def _settle(self, done, turns: int = 1000) -> None:
        for _ in range(turns):
            if done():
                return
            await asyncio.sleep(0)

    def close(self) -> None:
        self.events.run_until_complete(self.loop.stop())
        self.events.close()


def expected(req, seq, window=0):
    """What the simulated model gives this sample: greedy, or drawn with the sample's own seed."""
    seed = seq.sample_seed if req.sampling.temperature > 0 else None
    return expected_output(req.prompt_token_ids, req.sampling.max_tokens, seed, window)


def step(sched, worker):
    """One step, in order: scheduled, run, applied (the scheduler ends what stops); invariants
    around it.
    """
    out = sched.schedule()
    sched.check_invariants()
    if not out.is_empty:
        worker.step(sched, out)
        sched.check_invariants()
    return out


def drain(sched, worker, limit=20_000):
    for _ in range(limit):
        if not sched.has_work:
            return
        assert not step(sched, worker).is_empty, "work left but nothing scheduled"
    raise AssertionError("did not finish")


def make(
    num_blocks,
    block_size=4,
    budget=32,
    caching=True,
    chunked=True,
    max_seqs=16,
    window=0,
    speculative="auto",
    tiers=None,
):
    """tiers: the KV tiers under the pool (scheduler_service/core/kv_tiers.py KvTiers)."""
    config = SchedulerConfig(
        block_size=block_size,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        debug_invariants=True,
        speculative=speculative,
    )
    return (
        Scheduler(config, num_blocks, max_model_len=4096, kv_window=window, tiers=tiers),
        SimulatedWorker(num_blocks, block_size, window),
    )
