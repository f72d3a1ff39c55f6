"""A torch-free simulated worker, for scheduler tests and memory plots.

Its "KV pool" stores token ids at slots and its "model" predicts the next token as a hash of the whole
context read back through the block table. A paging bug (a block shared by mistake, a slot written
twice, a table that misses a block, a copy-on-write that did not happen, a cached block that was
evicted and reused) changes the output, so a test compares against `expected_output`."""

from __future__ import annotations

import hashlib

import numpy as np

from protos import wire_pb2
from protos.codec import decode_plan

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
        """Run a plan as it comes off the wire; -1 for rows that do not sample."""
        self.num_steps += 1
        p = decode_plan(plan)
        bs = self.block_size
        tables, qsl = p.block_tables.astype(np.int64), p.query_start_loc
        assert (p.slot_mapping >= 0).all()
        for i in range(p.num_seqs):  # a slot is where the position's block table entry says
            pos = p.positions[qsl[i]:qsl[i + 1]].astype(np.int64)
            assert (p.slot_mapping[qsl[i]:qsl[i + 1]] == tables[i][pos // bs] * bs + pos % bs).all()
        for src, dst in p.block_copies:  # copy-on-write, before the step's writes
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        self.pool[p.slot_mapping] = p.token_ids
        out = []
        for i in range(p.num_seqs):
            if not p.do_sample[i]:
                out.append(-1)
                continue
            pos = np.arange(p.seq_lens[i])
            ctx = self.pool[tables[i][pos // bs] * bs + pos % bs]
            assert (ctx >= 0).all(), "read a slot that was never written"
            seed = int(p.seed[i]) if p.temperature[i] > 0 else None
            out.append(next_token(ctx.tolist(), seed, int(p.sample_index[i])))
        return out
