"""KV tiers under the pool, scheduler side, with the simulated worker (whose tokens depend on every
block it reads): a prefix evicted from the pool is read back from the host or disk tier instead of
computed, answers stay exact through eviction, corruption, a restart and a flush, and every tier
stays within its size.
"""

import random

from protos.codec import TIER_DISK, TIER_HOST
from scheduler_service.core.kv_tiers import KvTiers
from scheduler_service.core.sequence import Request, SamplingOptions
from tests.support.simulated import Pipeline, drain, expected, make, step

BS = 4


def tiers(host=0, disk=0, held=()):
    return KvTiers(host, disk, list(held), bytes_per_block=1 << 20, block_size=BS)


def conversations(n_docs=4, turns=3, doc_len=40, seed=0):
    """Each conversation: a long shared document, then a growing tail turn by turn."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 900) for _ in range(doc_len)] for _ in range(n_docs)]
    rounds = []
    for t in range(turns):
        rounds.append(
            [
                Request(f"d{d}t{t}", doc + [900 + t] * (t + 1), SamplingOptions(max_tokens=4))
                for d, doc in enumerate(docs)
            ]
        )
    return rounds


def serve(sched, worker, rounds, one_at_a_time=True):
    """Each request to its end (one at a time: each evicts the one before), every answer checked; ->
    the prompt tokens computed.
    """
    computed = 0
    for reqs in rounds:
        for batch in ([r] for r in reqs) if one_at_a_time else [reqs]:
            for r in batch:
                sched.add_request(r)
            while sched.has_work:
                out = step(sched, worker)
                computed += out.num_prefill_tokens
                assert out.num_tokens <= sched.config.max_num_batched_tokens
            for r in batch:
                assert r.seqs[0].output_token_ids == expected(r, r.seqs[0]), r.request_id
    assert sched.allocator.num_available_blocks == sched.num_blocks, "a block was not given back"
    return computed


def test_a_prefix_evicted_from_the_pool_is_read_back_from_the_host_tier_not_computed():
    plain, w0 = make(24, BS, budget=64)
    base = serve(plain, w0, conversations())
    sched, worker = make(24, BS, budget=64, tiers=tiers(host=64))
    computed = serve(sched, worker, conversations())
    t = sched.kv.tiers
    assert worker.num_loaded > 0 and t.blocks.loaded[TIER_HOST] == worker.num_loaded
    assert computed < base / 2, (computed, base)  # later turns compute their tails only
    first = next(r for rs in conversations() for r in rs if r.request_id == "d0t2")
    assert first.prompt_len > 40
    assert t.load_failures == 0
    assert len(worker.host) <= 64 and len(t.host) <= 64


def test_cached_prompt_tokens_count_blocks_read_back_from_a_tier():
    sched, worker = make(12, BS, budget=64, tiers=tiers(host=32))
    rounds = conversations(n_docs=3, turns=2)
    serve(sched, worker, rounds)
    returning = rounds[1]
    assert all(r.cached_prompt_tokens >= 40 for r in returning), [
        r.cached_prompt_tokens for r in returning
    ]


def test_the_disk_tier_survives_a_restart_and_a_different_layout_reads_nothing():
    sched, worker = make(24, BS, budget=64, tiers=tiers(disk=200))
    first = serve(sched, worker, conversations(turns=1))
    assert len(worker.disk) == len(sched.kv.tiers.disk) > 0
    # a new scheduler and worker (an empty pool) over the same disk: the documents are read back
    again, w2 = make(24, BS, budget=64, tiers=tiers(disk=200, held=worker.disk))
    w2.disk = dict(worker.disk)
    after = serve(again, w2, conversations(turns=1))
    assert w2.num_loaded > 0 and after < first / 3, (after, first)
    # one whose workers hold nothing on disk (another model's folder): everything computed, answers
    # right
    cold, w3 = make(24, BS, budget=64, tiers=tiers(disk=200))
    assert serve(cold, w3, conversations(turns=1)) == first and w3.num_loaded == 0


def test_a_corrupt_block_is_a_miss_computed_instead_and_forgotten():
    sched, worker = make(24, BS, budget=64, tiers=tiers(host=64, disk=200))
    serve(sched, worker, conversations(turns=1))
    worker.corrupt = set(list(worker.disk)[::3])  # every third block's copies fail their check
    worker.host.clear()  # and the host tier's are lost
    serve(sched, worker, conversations(turns=2)[1:])
    t = sched.kv.tiers
    failures = t.load_failures
    assert failures > 0
    # each was forgotten, computed again and written down afresh: the next pass reads every block
    # back
    worker.corrupt = set()
    assert all(h in worker.disk for h in list(t.disk._lru))
    loaded = worker.num_loaded
    serve(sched, worker, conversations(turns=2)[1:])
    assert t.load_failures == failures and worker.num_loaded > loaded


def test_tiers_stay_within_their_sizes_under_a_long_load():
    sched, worker = make(16, BS, budget=48, tiers=tiers(host=10, disk=25))
    rng = random.Random(3)
    docs = [[rng.randrange(1, 900) for _ in range(rng.randint(9, 40))] for _ in range(12)]
    for i in range(60):
        doc = rng.choice(docs)
        r = Request(
            f"r{i}", doc + [rng.randrange(1, 900)], SamplingOptions(max_tokens=rng.randint(1, 6))
        )
        sched.add_request(r)
        if i % 3 == 2:
            drain(sched, worker)
        t = sched.kv.tiers
        assert len(t.host) <= 10 and len(t.disk) <= 25
        assert len(worker.host) <= 10 and len(worker.disk) <= 25
    drain(sched, worker)
    assert sched.allocator.num_available_blocks == sched.num_blocks
    assert worker.num_loaded > 0


def test_two_prompts_needing_the_same_blocks_load_them_once():
    sched, worker = make(32, BS, budget=128, tiers=tiers(host=64))
    serve(sched, worker, conversations(n_docs=1, turns=1))
    for _ in range(3):  # other documents push it out of the pool
        serve(sched, worker, conversations(n_docs=2, turns=1, seed=9 + _))
    loaded = worker.num_loaded
    twins = conversations(n_docs=1, turns=2)[1] + [
        Request(
            "twin",
            conversations(n_docs=1, turns=2)[1][0].prompt_token_ids,
            SamplingOptions(max_tokens=4),
        )
    ]
    serve(sched, worker, [twins], one_at_a_time=False)
    assert worker.num_loaded - loaded == 10  # the document's ten blocks, once


def test_loads_under_overlap_give_exact_answers():
    sched, worker = make(20, BS, budget=64, tiers=tiers(host=40, disk=100))
    got = {}
    pipe = Pipeline(sched, worker, overlap=True)
    for reqs in conversations(n_docs=5, turns=3, seed=4):
        for r in reqs:
            pipe.submit(r)
            got[r.request_id] = r
            for _ in range(3):
                pipe.step()
        while pipe.busy:
            pipe.step()
    pipe.close()
    assert worker.num_loaded > 0
    for r in got.values():
        assert r.seqs[0].output_token_ids == expected(r, r.seqs[0]), r.request_id
    assert sched.allocator.num_available_blocks == sched.num_blocks


def test_a_failed_step_gives_its_loads_blocks_back_and_the_prompt_is_computed():
    sched, worker = make(16, BS, budget=64, tiers=tiers(host=40))
    serve(sched, worker, conversations(n_docs=3, turns=1))
    r = conversations(n_docs=3, turns=2)[1][0]
    sched.add_request(r)
    out = sched.schedule()
    assert out.loads and not out.scheduled  # a step that only reads the prefix back
    sched.build_plan(out)
    sched.kv.settle_loads(out.step_id, None)  # its result never came: the step failed
    sched.check_invariants()
    assert sched.kv.tiers.load_failures == 10
    drain(sched, worker)
    assert r.seqs[0].output_token_ids == expected(r, r.seqs[0])
    assert sched.allocator.num_available_blocks == sched.num_blocks


def test_flushing_the_cache_empties_every_tier_and_deletes_the_disk_blocks():
    sched, worker = make(24, BS, budget=64, tiers=tiers(host=40, disk=100))
    serve(sched, worker, conversations(turns=1))
    assert sched.kv.reset_prefix_cache() > 0
    assert len(sched.kv.tiers.host) == len(sched.kv.tiers.disk) == 0
    computed = serve(sched, worker, conversations(turns=1))
    assert worker.num_loaded == 0 and computed >= 4 * 41
    assert len(worker.disk) == len(sched.kv.tiers.disk)


def test_loading_waits_where_computing_is_cheaper():
    t = tiers(host=40)
    t.seconds_per_token = 1e-9  # a prompt token costs next to nothing: loading a block does not pay
    sched, worker = make(16, BS, budget=64, tiers=t)
    serve(sched, worker, conversations(n_docs=3, turns=2))
    assert worker.num_loaded == 0
    found = [(b"x" * 16, TIER_DISK, -1)] * 4
    t.seconds_per_token = 1.0
    assert t.worth_loading(found, "r")


def test_prometheus_counts_the_tiers_by_difference_and_from_zero_after_a_replaced_worker():
    from scheduler_service.core.batch import SchedulerOutput, StepUpdate
    from scheduler_service.runtime.metrics import Metrics
    from scheduler_service.runtime.step_results import StepReport

    m = Metrics()
    t = tiers(host=8, disk=20)

    def report():
        return StepReport(SchedulerOutput(1), StepUpdate(kv_tiers=t.stats()), [], [], 0.01)

    def value(name, **labels):
        return m.registry.get_sample_value(name, {"replica": "0", **labels})

    t.blocks.loaded[TIER_HOST], t.blocks.stored[TIER_DISK] = 3, 5
    m.on_step(0, report())
    t.blocks.loaded[TIER_HOST], t.load_failures = 7, 2
    m.on_step(0, report())
    assert value("pagedserve_kv_tier_loaded_blocks_total", tier="host") == 7
    assert value("pagedserve_kv_tier_stored_blocks_total", tier="disk") == 5
    assert value("pagedserve_kv_tier_load_failures_total") == 2
    assert value("pagedserve_kv_tier_capacity_blocks", tier="disk") == 20
    t = tiers(host=8, disk=20)  # a new group: its counts start again
    t.blocks.loaded[TIER_HOST] = 1
    m.on_step(0, report())
    assert value("pagedserve_kv_tier_loaded_blocks_total", tier="host") == 8
