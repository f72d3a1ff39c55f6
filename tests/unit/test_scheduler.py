"""The scheduler with a fake worker: admission under a small pool, preemption, every block back."""

import random

import pytest

from scheduler_service.core.batch import DuplicateRequestId
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import FinishReason, Request, SamplingOptions
from tests.support.simulated import Pipeline, SimulatedWorker, expected_output


def run_to_completion(sched, worker, arrivals, max_steps=10_000):
    """arrivals: {step: [Request]}; runs until everything finished; returns per-step (running,
    waiting).
    """
    trace = []
    step = 0
    while step < max_steps:
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if not sched.has_work and step > max(arrivals):
            break
        step += 1
        if not sched.has_work:
            continue
        out = sched.schedule()
        sched.check_invariants()
        assert not out.is_empty, "a step with work to do scheduled nothing"
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        worker.step(sched, out)
        trace.append((len(sched.running), len(sched.waiting)))
    return trace


def make_requests(n, seed, prompt_range=(3, 40), out_range=(1, 30)):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(*prompt_range))]
        reqs.append(Request(f"r{i}", prompt, SamplingOptions(max_tokens=rng.randint(*out_range))))
    return reqs


@pytest.mark.parametrize("chunked", [True, False])
def test_small_pool_waits_preempts_and_finishes_everything(chunked):
    block_size, num_blocks = 4, 24
    config = SchedulerConfig(
        block_size=block_size,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enable_chunked_prefill=chunked,
        debug_invariants=True,
    )
    sched = Scheduler(config, num_blocks, max_model_len=512)
    worker = SimulatedWorker(num_blocks, block_size)
    reqs = make_requests(12, seed=1)
    arrivals = {0: reqs[:6], 3: reqs[6:9], 7: reqs[9:]}
    trace = run_to_completion(sched, worker, arrivals)

    assert any(waiting for _, waiting in trace), "the pool never made a request wait"
    assert sched.num_preemptions > 0, "a pool this small must preempt"
    assert sum(s.num_preemptions for r in reqs for s in r.seqs) == sched.num_preemptions
    for r in reqs:
        seq = r.seqs[0]
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens), (
            r.request_id
        )
    assert sched.allocator.num_available_blocks == num_blocks
    assert not sched.requests


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_going():
    config = SchedulerConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=16, debug_invariants=True
    )
    sched = Scheduler(config, 64, max_model_len=512)
    worker = SimulatedWorker(64, 4)
    short = Request("short", [5, 6, 7], SamplingOptions(max_tokens=20))
    long = Request("long", list(range(1, 61)), SamplingOptions(max_tokens=3))
    sched.add_request(short)
    out = sched.schedule()
    worker.step(sched, out)
    sched.add_request(long)
    chunks = []
    while long.seqs[0].num_output_tokens == 0:
        out = sched.schedule()
        ids = {s.seq.request.request_id: s for s in out.scheduled}
        assert "short" in ids, "a decode was stalled behind a long prompt"
        chunks.append(ids["long"].num_new_tokens)
        assert not ids["long"].do_sample or sum(chunks) == 60
        worker.step(sched, out)
    assert chunks == [15, 15, 15, 15]
    sched.abort_request("short")
    sched.abort_request("long")
    assert sched.allocator.num_available_blocks == 64


def test_abort_frees_blocks_at_once_waiting_or_running():
    config = SchedulerConfig(
        block_size=4, max_num_seqs=1, max_num_batched_tokens=64, debug_invariants=True
    )
    sched = Scheduler(config, 16, max_model_len=512)
    a = Request("a", list(range(1, 10)), SamplingOptions(max_tokens=5))
    b = Request("b", list(range(1, 10)), SamplingOptions(max_tokens=5))
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    assert a.seqs[0].block_ids and not b.seqs[0].block_ids
    sched.abort_request("b")  # waiting
    sched.abort_request("a")  # running
    assert sched.allocator.num_available_blocks == 16
    assert [s.finish_reason for s in a.seqs + b.seqs] == [FinishReason.ABORT] * 2
    assert not sched.has_work and not sched.requests


def test_result_of_a_step_that_raced_an_abort_is_dropped():
    config = SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(config, 16, max_model_len=512)
    a = Request("a", [1, 2, 3], SamplingOptions(max_tokens=5))
    sched.add_request(a)
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update(out, [9]).tokens == []
    assert a.seqs[0].output_token_ids == []


def test_duplicate_live_request_id_is_refused():
    sched = Scheduler(SchedulerConfig(), 16, max_model_len=512)
    sched.add_request(Request("x", [1], SamplingOptions(max_tokens=1)))
    with pytest.raises(DuplicateRequestId):
        sched.add_request(Request("x", [2], SamplingOptions(max_tokens=1)))
    assert len(sched.waiting) == 1


def test_the_overlap_benchmarks_simulated_worker_serves_the_real_engine(tiny_model_dir):
    """`make bench-overlap`'s worker process (the real WorkerServer over a runner of fixed step
    time) takes plans from the real engine, overlap off and on, and every timed step completes.
    """
    import argparse
    import asyncio

    from deploy.bench.overlap import measure_overlap

    args = argparse.Namespace(
        model=str(tiny_model_dir),
        seqs=4,
        context=20,
        steps=0,
        step_ms=2.0,
        block_size=16,
        window=0.3,
    )
    for overlap in (False, True):
        per = asyncio.run(measure_overlap(args, overlap))
        assert per["period"] > 0 and per["worker_forward"] > 0


def test_a_hybrids_sequences_each_hold_one_state_slot_given_back_with_their_blocks():
    """Slots as the worker sees them (tests/support/simulated.py): each holds exactly its
    sequence's tokens, so a slot shared, reused mid-sequence or kept by a preempted sequence fails.
    Samples of n = 2 compute their prompt each: no state sits at the prompt's last token to share.
    """
    block_size, num_blocks = 4, 24
    config = SchedulerConfig(
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
        speculative="off",
        state_slots=4,
        debug_invariants=True,
    )
    sched = Scheduler(config, num_blocks, max_model_len=512)
    worker = SimulatedWorker(num_blocks, block_size, num_state_slots=4)
    reqs = make_requests(10, seed=4)
    reqs[3].sampling = SamplingOptions(max_tokens=12, n=2)
    trace = run_to_completion(sched, worker, {0: reqs[:5], 4: reqs[5:]})
    assert sched.num_preemptions > 0 and max(r for r, _ in trace) == 4
    for r in reqs:
        for seq in r.seqs:
            assert seq.output_token_ids == expected_output(
                r.prompt_token_ids, r.sampling.max_tokens
            )
            assert seq.state_slot == -1
    assert sched.pool_stats().num_used_state_slots == 0 and worker.states
    with pytest.raises(ValueError, match="speculative decoding off"):
        SchedulerConfig(state_slots=4)


def hybrid_scheduler(num_blocks=64, slots=6, max_num_seqs=4, budget=32):
    config = SchedulerConfig(
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        speculative="off",
        state_slots=slots,
        debug_invariants=True,
    )
    sched = Scheduler(config, num_blocks, max_model_len=512)
    return sched, SimulatedWorker(num_blocks, 4, num_state_slots=slots)


def answer(sched, worker, request, step=0):
    run_to_completion(sched, worker, {step: [request]})
    assert request.seqs[0].output_token_ids == expected_output(
        request.prompt_token_ids, request.sampling.max_tokens
    )
    return request.cached_prompt_tokens


def test_a_returning_conversation_resumes_a_hybrid_from_its_last_snapshot():
    """The worker's view checks every slot holds exactly its sequence's tokens: a resume from a
    snapshot taken at the wrong place, or a slot reused while a snapshot in it is read, fails.
    """
    sched, worker = hybrid_scheduler()
    rng = random.Random(7)
    prompt = [rng.randrange(1, 1000) for _ in range(30)]
    # 30 prompt tokens in 32-token steps and in 8-token chunks: the snapshot after 28 (its last
    # full block short of the last token) is taken inside a chunk either way; its decode takes
    # one where its answer ends a block (after 32: the answer's second token)
    first = Request("turn1", prompt, SamplingOptions(max_tokens=6))
    assert answer(sched, worker, first) == 0 and worker.snapshots_taken == 2
    # the next turn holds the answer: it resumes after it, not after the prompt
    follow = prompt + first.seqs[0].output_token_ids + [5, 6, 7, 8, 9]
    assert answer(sched, worker, Request("turn2", follow, SamplingOptions(max_tokens=6))) == 32
    # the same prompt again reads the snapshot after its last full block
    assert (
        answer(sched, worker, Request("again", list(prompt), SamplingOptions(max_tokens=3))) == 28
    )
    # a prompt that shares blocks but no snapshot recomputes, snapshotting where it leaves the
    # cached prompt; the next one sharing that prefix resumes there
    other = prompt[:20] + [1, 2, 3, 4, 5, 6, 7]
    assert answer(sched, worker, Request("branch", other, SamplingOptions(max_tokens=3))) == 0
    third = prompt[:20] + [9, 9, 9, 9, 9, 9]
    assert answer(sched, worker, Request("third", third, SamplingOptions(max_tokens=3))) == 20
    stats = sched.pool_stats()
    assert stats.num_state_snapshots >= 3 and stats.num_used_state_slots == 0
    # a flushed cache forgets the snapshots with the blocks
    sched.kv.reset_prefix_cache()
    assert answer(sched, worker, Request("flushed", third, SamplingOptions(max_tokens=3))) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_hybrids_answer_keeps_its_last_block_boundary_for_the_next_turn(overlap):
    """A decode that ends a block snapshots its state, keyed once the step's result makes the
    block's tokens known (with overlap its input is still in flight when it is planned); a
    sequence keeps only its latest, and the next turn, which holds the answer, resumes after it.
    """
    sched, worker = hybrid_scheduler()
    pipe = Pipeline(sched, worker, overlap=overlap)

    def run(request):
        pipe.submit(request)
        while pipe.busy:
            pipe.step()
        assert request.seqs[0].output_token_ids == expected_output(
            request.prompt_token_ids, request.sampling.max_tokens
        )
        return request.cached_prompt_tokens

    prompt = [random.Random(11).randrange(1, 1000) for _ in range(30)]
    first = Request("t1", prompt, SamplingOptions(max_tokens=23))
    assert run(first) == 0
    # 30 + 22 tokens computed: the prompt's snapshot after 28, its decodes' after 32, 36 ... 52
    assert worker.snapshots_taken == 7 and sched.pool_stats().num_state_snapshots == 2
    follow = prompt + first.seqs[0].output_token_ids + [5, 6, 7]
    assert run(Request("t2", follow, SamplingOptions(max_tokens=4))) == 52
    # a prompt of the first answer's tokens cut short reads the prompt's snapshot: the decodes'
    # earlier ones were given back as the next came
    short = prompt + first.seqs[0].output_token_ids[:8]
    assert run(Request("t3", short, SamplingOptions(max_tokens=2))) == 28
    pipe.close()
    assert sched.pool_stats().num_used_state_slots == 0


def test_a_failed_step_keeps_none_of_its_snapshots_and_gives_their_slots_back():
    """A step that gives no result took no snapshot: neither the prompt's (keyed when planned) nor
    a decode's (keyed at the result that never came); their slots are free again.
    """
    sched, worker = hybrid_scheduler()
    prompt = [random.Random(13).randrange(1, 1000) for _ in range(30)]

    def fail_at(request, planned):
        sched.add_request(request)
        while not planned(out := sched.schedule()):
            worker.step(sched, out)
        sched.kv.step_failed(out.step_id, out.state_saves)
        sched.abort_request(request.request_id)  # what the engine does to a failed step's requests
        sched.check_invariants()
        assert sched.pool_stats().num_used_state_slots == 0

    fail_at(Request("p", prompt, SamplingOptions(max_tokens=4)), lambda out: out.state_saves)
    assert sched.pool_stats().num_state_snapshots == 0
    fail_at(Request("d", prompt, SamplingOptions(max_tokens=8)), lambda out: out.state_trails)
    assert sched.pool_stats().num_state_snapshots == 1  # the prompt's, from a step that ran
    # the same prompt and its answer resume after the prompt only, and answer right
    again = Request("again", prompt + [5, 6, 7], SamplingOptions(max_tokens=4))
    assert answer(sched, worker, again) == 28


@pytest.mark.parametrize("chunk", [8, 64])
def test_hybrid_conversations_under_pressure_resume_only_from_true_snapshots(chunk):
    """Twelve conversations over three shared openings, on a small pool and a state pool six
    slots past max_num_seqs (three of them for decodes' snapshots): preemptions, snapshot evictions
    and resumes, every answer right.
    """
    sched, worker = hybrid_scheduler(num_blocks=20, slots=10, budget=chunk)
    rng = random.Random(3)
    openings = [[rng.randrange(1, 1000) for _ in range(rng.randint(9, 24))] for _ in range(3)]
    reqs = []
    for i in range(12):
        tail = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))]
        reqs.append(
            Request(f"c{i}", openings[i % 3] + tail, SamplingOptions(max_tokens=rng.randint(2, 16)))
        )
    run_to_completion(sched, worker, {0: reqs[:6], 5: reqs[6:9], 12: reqs[9:]})
    for r in reqs:
        assert r.seqs[0].output_token_ids == expected_output(
            r.prompt_token_ids, r.sampling.max_tokens
        )
    assert sched.num_preemptions > 0 and worker.snapshots_taken > 3
    assert sum(bool(r.cached_prompt_tokens) for r in reqs) >= 2
    assert sched.pool_stats().num_used_state_slots == 0
