"""The block allocator: paged accounting, growth at block boundaries, all-or-nothing allocation."""

import math

import pytest

from scheduler_service.core.block_allocator import BlockAllocator, OutOfBlocks
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions


def test_paged_vs_static_accounting():
    """Lengths 32, 128, 64, 256 with block size 16: 30 blocks paged against 64 for static
    reservation.
    """
    block_size = 16
    lengths = [32, 128, 64, 256]
    alloc = BlockAllocator(num_blocks=64, block_size=block_size)
    tables = [alloc.allocate(alloc.blocks_for_tokens(n)) for n in lengths]
    assert [len(t) for t in tables] == [2, 8, 4, 16]
    assert alloc.num_used_blocks == 30
    static = len(lengths) * math.ceil(max(lengths) / block_size)
    assert static == 64
    assert len({b for t in tables for b in t}) == 30  # no block handed out twice
    for t in tables:
        alloc.free(t)
    assert alloc.num_free_blocks == 64
    alloc.check_invariants()


def test_page_table_grows_exactly_at_block_boundaries():
    # a token a step
    sched = Scheduler(
        SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, speculative="off"),
        16,
        256,
    )
    req = Request("r", [1, 2, 3], SamplingOptions(max_tokens=10))
    sched.add_request(req)
    seq = req.seqs[0]
    history = []
    for _ in range(8):
        out = sched.schedule()
        history.append(
            (out.scheduled[0].start + out.scheduled[0].num_new_tokens, len(seq.block_ids))
        )
        sched.update(out, [7])
    # (tokens held after the step, blocks held): a new block appears exactly with token 5 and token
    # 9
    assert history == [(3, 1), (4, 1), (5, 2), (6, 2), (7, 2), (8, 2), (9, 3), (10, 3)]
    sched.abort_request("r")
    assert sched.allocator.num_available_blocks == 16


def test_allocation_that_cannot_be_satisfied_changes_nothing():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    held = alloc.allocate(5)
    before = (alloc.num_free_blocks, [alloc.refcount(b) for b in range(8)])
    assert not alloc.can_allocate(4)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(4)
    assert (alloc.num_free_blocks, [alloc.refcount(b) for b in range(8)]) == before
    alloc.free(held)
    assert alloc.num_free_blocks == 8
    alloc.check_invariants()


def test_shared_blocks_return_only_when_the_last_reference_goes():
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    blocks = alloc.allocate(2)
    alloc.share(blocks)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 2 and all(alloc.refcount(b) == 1 for b in blocks)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 4
    alloc.check_invariants()


def test_double_free_is_refused_without_damage():
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([b, a])
    assert alloc.refcount(b) == 1  # the valid half of the call did not happen either
    alloc.free([b])
    alloc.check_invariants()
    assert alloc.num_free_blocks == 4


def test_a_request_that_cannot_be_admitted_holds_nothing():
    """Admission is all-or-nothing: a prompt bigger than the free blocks waits and owns no block."""
    sched = Scheduler(
        SchedulerConfig(
            block_size=4, max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=False
        ),
        4,
        256,
    )
    big = Request("big", list(range(1, 13)), SamplingOptions(max_tokens=4))  # 3 blocks
    small = Request("small", list(range(1, 5)), SamplingOptions(max_tokens=8))  # 1 block, grows
    sched.add_request(small)
    out = sched.schedule()
    sched.update(out, [5])
    sched.add_request(big)
    # 3 free blocks: big fits (3 blocks); take one more so it cannot.
    held = sched.allocator.allocate(1)
    out = sched.schedule()
    assert [s.seq.request.request_id for s in out.scheduled] == ["small"]
    assert big.seqs[0].block_ids == [] and sched.waiting[0] is big.seqs[0]
    sched.allocator.free(held)
    sched.check_invariants()
    sched.abort_request("small")
    sched.abort_request("big")
    assert sched.allocator.num_available_blocks == 4
