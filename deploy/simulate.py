"""A torch-free simulated worker, for scheduler tests and memory plots.

Its "KV pool" stores token ids at slots and its "model" predicts the next token as a hash of the whole
context read back through the block table. A paging bug (a block shared by mistake, a slot written
twice, a table that misses a block, a copy-on-write that did not happen, a cached block that was
evicted and reused) changes the output, so a test compares against `expected_output`."""

from __future__ import annotations

import hashlib

import numpy as np

from protos import wire_pb2

VOCAB = 1000


def next_token(context: list[int], seed: int | None = None, index: int = 0) -> int:
    """Greedy (seed None): a function of the context. Sampled: also of the seed and the token's index,
    so samples of one prompt diverge, as they do with a real sampler."""
    key = list(context) if seed is None else list(context) + [seed, index]
    digest = hashlib.blake2b(np.asarray(key, dtype=np.uint64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def expected_output(prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    ctx = list(prompt)
    for i in range(max_tokens):
        ctx.append(next_token(ctx, seed, i))
    return ctx[len(prompt):]


class SimulatedWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.num_steps = 0

    def execute(self, plan: wire_pb2.StepPlan) -> list[int]:
        self.num_steps += 1
        tokens = np.frombuffer(plan.token_ids, dtype="<i4")
        slots = np.frombuffer(plan.slot_mapping, dtype="<i8")
        tables = np.frombuffer(plan.block_tables, dtype="<i4").reshape(plan.num_seqs, plan.max_blocks_per_seq)
        seq_lens = np.frombuffer(plan.seq_lens, dtype="<i4")
        do_sample = np.frombuffer(plan.do_sample, dtype=np.uint8)
        positions = np.frombuffer(plan.positions, dtype="<i4")
        sample_index = np.frombuffer(plan.sample_index, dtype="<i4")
        qsl = np.frombuffer(plan.query_start_loc, dtype="<i4")
        assert (slots >= 0).all()
        for i in range(plan.num_seqs):  # a slot is where the position's block table entry says
            pos = positions[qsl[i]:qsl[i + 1]].astype(np.int64)
            expect = tables[i][pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
            assert (slots[qsl[i]:qsl[i + 1]] == expect).all()
        copies = np.frombuffer(plan.block_copies, dtype="<i4").reshape(-1, 2)
        for src, dst in copies:  # copy-on-write, before the step's writes
            bs = self.block_size
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        self.pool[slots] = tokens
        out = []
        for i in range(plan.num_seqs):
            if not do_sample[i]:
                out.append(-1)
                continue
            pos = np.arange(seq_lens[i])
            ctx = self.pool[tables[i][pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size]
            assert (ctx >= 0).all(), "read a slot that was never written"
            row = plan.sampling[i]
            seed = int(row.seed) if row.temperature > 0 else None
            out.append(next_token(ctx.tolist(), seed, int(sample_index[i])))
        return out
