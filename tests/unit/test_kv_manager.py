"""Page tables on their own: growth, copy-on-write, refusals that
change nothing, forks and release.
"""

from scheduler_service.core.batch import make_sequences
from scheduler_service.core.kv_manager import KVCacheManager
from scheduler_service.core.sequence import Request, SamplingOptions


def _seq(prompt_len: int, n: int = 1, request_id: str = "r"):
    request = Request(
        request_id, list(range(1, prompt_len + 1)), SamplingOptions(max_tokens=8, n=n)
    )
    make_sequences(request)
    return request.seqs


def test_slots_grow_the_table_exactly_at_block_boundaries_and_lookahead_reserves_beyond():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    (seq,) = _seq(6)
    assert kv.admit(seq, [], 6) and len(seq.block_ids) == 2
    seq.num_computed_tokens = 6
    # 8 tokens still fit in 2 blocks
    assert kv.allocate_slots(seq, 2) == [] and len(seq.block_ids) == 2
    assert kv.allocate_slots(seq, 2, lookahead=3) == [] and len(seq.block_ids) == 3  # 6 + 5 tokens
    assert kv.allocator.num_available_blocks == 5
    kv.check_invariants([seq], [])


def test_a_growth_the_pool_cannot_hold_is_refused_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    (seq,) = _seq(8)
    assert kv.admit(seq, [], 8)
    seq.num_computed_tokens = 8
    assert kv.allocate_slots(seq, 4) == []  # the third block
    seq.num_computed_tokens = 12
    before = (list(seq.block_ids), kv.allocator.num_available_blocks)
    assert kv.allocate_slots(seq, 1) is None
    assert (seq.block_ids, kv.allocator.num_available_blocks) == before
    assert kv.tokens_that_fit(seq, 5) == 0
    (other,) = _seq(20, request_id="o")
    assert not kv.admit(other, [], 20) and other.block_ids == []
    kv.check_invariants([seq], [other])


def test_writing_into_a_shared_block_copies_it_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    leader, fork = _seq(6, n=2)
    assert kv.admit(leader, [], 6)
    leader.num_computed_tokens = 6
    kv.fork(leader, [fork])
    assert fork.block_ids == leader.block_ids and fork.num_computed_tokens == 5
    assert not kv.writes_in_place(fork, 5)  # its last block is the leader's too
    shared_last = fork.block_ids[1]
    copies = kv.allocate_slots(fork, 1)
    assert copies == [(1, shared_last, fork.block_ids[1])] and fork.block_ids[1] != shared_last
    assert fork.block_ids[0] == leader.block_ids[0]  # the block it only reads stays shared
    assert kv.allocator.refcount(shared_last) == 1 and kv.writes_in_place(leader, 6)
    kv.check_invariants([leader, fork], [])


def test_a_cached_prefix_is_found_shared_and_every_block_comes_back():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    (first,) = _seq(9, request_id="a")
    assert kv.admit(first, [], 9)
    first.num_computed_tokens = 9
    kv.register_full_blocks(first, 9)
    (second,) = _seq(9, request_id="b")  # the same prompt
    hits = kv.cached_prefix(second)
    assert hits == first.block_ids[:2]  # two full blocks; the last token is computed again
    assert kv.admit(second, hits, 1) and second.num_computed_tokens == 8
    assert kv.request_blocks(first.request) == 3 and kv.allocator.refcount(hits[0]) == 2
    kv.check_invariants([first, second], [])
    epoch = first.epoch
    kv.free(first)
    kv.free(second)
    assert first.block_ids == [] and first.epoch == epoch + 1
    assert kv.allocator.num_available_blocks == 6 and kv.allocator.num_cached_blocks == 2
    kv.check_invariants([], [first, second])


def test_blocks_behind_every_window_go_back_as_a_sequence_advances():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, kv_window=4)
    (seq,) = _seq(12)
    assert kv.admit(seq, [], 12)
    seq.num_computed_tokens = 12
    kv.drop_out_of_window(seq, 11)  # queries from 11 on read keys 7..: the first block is done
    assert seq.block_ids[0] == -1 and seq.num_dropped_blocks == 1
    kv.drop_out_of_window(seq, 12)  # from 12 on, keys 8..: the second too
    assert seq.block_ids[:2] == [-1, -1] and seq.num_dropped_blocks == 2
    assert kv.allocator.num_available_blocks == 7
    kv.check_invariants([seq], [])
