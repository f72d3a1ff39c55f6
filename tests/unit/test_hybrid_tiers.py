"""A hybrid's KV tiers, scheduler side, with the simulated worker (each state slot holds exactly the
tokens its state has read, and a resume checks them): state snapshots go down to the host tier when
the state pool evicts them and to the disk as they are taken, and come back with their blocks, so a
returning conversation resumes instead of recomputing; through a restart, a corrupt snapshot, a
failed step and a flush, every answer stays exact and nothing is left held.
"""

import random

from protos.codec import TIER_HOST
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv_tiers import KvTiers
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions
from scheduler_service.runtime.step_results import prompt_block_hashes
from tests.support.simulated import SimulatedWorker, drain, expected, step

BS = 4


def hybrid(blocks=(0, 0, ()), snapshots=(0, 0, ()), num_blocks=24, slots=3):
    """A hybrid's scheduler (2 running, a state pool of 3 slots: one conversation's snapshot held
    beside a running one) over these tiers: (host, disk, hashes on disk) for blocks and for
    snapshots.
    """
    config = SchedulerConfig(
        block_size=BS,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        speculative="off",
        state_slots=slots,
        debug_invariants=True,
    )
    host, disk, held = blocks
    tiers = KvTiers(
        host,
        disk,
        list(held),
        bytes_per_block=1 << 16,
        block_size=BS,
        snapshots=(snapshots[0], snapshots[1], list(snapshots[2])),
        bytes_per_snapshot=1 << 20,
    )
    sched = Scheduler(config, num_blocks, max_model_len=4096, tiers=tiers)
    return sched, SimulatedWorker(num_blocks, BS, num_state_slots=slots)


def conversations(n_docs=4, turns=3, doc_len=40, seed=0):
    """Each conversation: a document, then a growing tail turn by turn."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 900) for _ in range(doc_len)] for _ in range(n_docs)]
    return [
        [
            Request(f"d{d}t{t}", doc + [900 + t] * (t + 1), SamplingOptions(max_tokens=4))
            for d, doc in enumerate(docs)
        ]
        for t in range(turns)
    ]


def serve(sched, worker, rounds):
    """Each request to its end, one at a time (each evicts the one before), every answer checked;
    -> the prompt tokens computed.
    """
    computed = 0
    for reqs in rounds:
        for r in reqs:
            sched.add_request(r)
            while sched.has_work:
                computed += step(sched, worker).num_prefill_tokens
            assert r.seqs[0].output_token_ids == expected(r, r.seqs[0]), r.request_id
    assert sched.allocator.num_available_blocks == sched.num_blocks, "a block was not given back"
    assert sched.pool_stats().num_used_state_slots == 0
    return computed


def test_snapshots_evicted_from_the_state_pool_come_back_from_the_host_tier_with_their_blocks():
    plain, w0 = hybrid()
    base = serve(plain, w0, conversations())
    sched, worker = hybrid(blocks=(64, 0, ()), snapshots=(8, 0, ()))
    rounds = conversations()
    computed = serve(sched, worker, rounds)
    t = sched.kv.tiers
    # four documents, two snapshot slots: every returning turn reads its document's state back
    assert worker.num_snapshots_loaded >= 6 and t.states.loaded[TIER_HOST] >= 6
    assert all(r.cached_prompt_tokens == 40 for rs in rounds[1:] for r in rs)
    # the first round's prompts, then only each returning turn's tail past its document
    assert base == 4 * (41 + 42 + 43) and computed == 4 * (41 + 2 + 3), computed
    assert t.load_failures == 0 and len(worker.host_states) <= 8
    assert t.stats().host_snapshots == len(t.states.host) > 0


def test_a_hybrids_disk_tier_survives_a_restart():
    sched, worker = hybrid(blocks=(0, 200, ()), snapshots=(0, 20, ()))
    first = serve(sched, worker, conversations(turns=1))
    assert len(worker.disk_states) == len(sched.kv.tiers.states.disk) >= 4
    # a new scheduler and worker (empty pools) over the same disk
    again, w2 = hybrid(blocks=(0, 200, worker.disk), snapshots=(0, 20, worker.disk_states))
    w2.disk, w2.disk_states = dict(worker.disk), dict(worker.disk_states)
    rounds = conversations(turns=2)
    after = serve(again, w2, rounds[1:])
    assert w2.num_snapshots_loaded == 4 and after <= 4 * 3, (after, first)
    assert all(r.cached_prompt_tokens == 40 for r in rounds[1])
    # without the snapshots, the blocks alone are no use to a hybrid: everything is computed
    cold, w3 = hybrid(blocks=(0, 200, worker.disk), snapshots=(0, 20, ()))
    w3.disk = dict(worker.disk)
    assert serve(cold, w3, conversations(turns=2)[1:]) == 4 * 42 and w3.num_loaded == 0


def test_a_corrupt_snapshot_is_computed_instead_and_forgotten():
    # a slot more: the last answer's decode snapshot beside the last prompt's
    sched, worker = hybrid(blocks=(64, 0, ()), snapshots=(8, 0, ()), slots=4)
    serve(sched, worker, conversations(turns=1))
    worker.corrupt = {h for h, _ in worker.host_states.values()}
    rounds = conversations(turns=2)
    serve(sched, worker, rounds[1:])
    t = sched.kv.tiers
    # two documents' snapshots were on the host tier, two still in the state pool
    assert t.load_failures >= 2
    assert sorted(r.cached_prompt_tokens for r in rounds[1]) == [0, 0, 40, 40]
    # each was forgotten, computed again and written down afresh: the next pass reads all back
    failures, worker.corrupt = t.load_failures, set()
    later = conversations(turns=3)[2]
    serve(sched, worker, [later])
    assert t.load_failures == failures and all(r.cached_prompt_tokens == 40 for r in later)


def test_a_failed_step_gives_back_the_slot_its_snapshot_was_read_into():
    sched, worker = hybrid(blocks=(64, 0, ()), snapshots=(8, 0, ()))
    serve(sched, worker, conversations(turns=1))
    r = conversations(turns=2)[1][0]
    sched.add_request(r)
    out = sched.schedule()
    assert out.loads and not out.scheduled  # a step that only reads the prefix back
    plan = sched.build_plan(out)
    assert plan.kv.states is not None and len(plan.kv.states.loads) == 1
    sched.kv.settle_loads(out.step_id, None)  # its result never came: the step failed
    sched.check_invariants()
    assert sched.kv.tiers.load_failures >= 1
    drain(sched, worker)
    assert r.seqs[0].output_token_ids == expected(r, r.seqs[0])
    assert sched.pool_stats().num_used_state_slots == 0


def test_flushing_the_cache_deletes_the_disk_snapshots_too():
    sched, worker = hybrid(blocks=(40, 100, ()), snapshots=(8, 20, ()))
    serve(sched, worker, conversations(turns=1))
    sched.kv.reset_prefix_cache()
    t = sched.kv.tiers
    assert len(t.states.host) == len(t.states.disk) == 0
    computed = serve(sched, worker, conversations(turns=1))
    assert worker.num_snapshots_loaded == 0 and computed == 4 * 41
    # on disk: the snapshots taken since, and only those: each prompt's and its answer's last
    assert set(worker.disk_states) == set(t.states.disk._lru) and len(worker.disk_states) == 8


def test_routing_counts_a_hybrids_prefix_only_up_to_a_kept_snapshot():
    """A replica is worth routing to for the blocks a prompt would resume after: up to the deepest
    block with a snapshot in the state pool or a tier, not every cached block.
    """
    sched, worker = hybrid(blocks=(64, 0, ()), snapshots=(8, 0, ()))
    serve(sched, worker, conversations(n_docs=1, turns=1))
    doc = conversations(n_docs=1, turns=1)[0][0].prompt_token_ids[:40] + [3]  # a question after it
    branch = doc[:22] + [7] * 19  # shares five blocks and a part, with no snapshot inside them
    hashes = lambda tokens: prompt_block_hashes(tokens, BS, None)  # noqa: E731
    kv = sched.kv
    assert kv.cached_blocks(hashes(doc)) == 10  # the snapshot after the document's tenth block
    assert kv.cached_blocks(hashes(branch)) == 0
    # the snapshot evicted to the host tier still counts
    serve(sched, worker, conversations(n_docs=3, turns=1, seed=5))
    assert not kv.states.has(hashes(doc)[-1]) and kv.tiers.states.holds(hashes(doc)[-1])
    assert kv.cached_blocks(hashes(doc)) == 10
