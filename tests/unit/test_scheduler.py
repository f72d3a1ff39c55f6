"""The scheduler with a fake worker: admission under a small pool, preemption, every block back."""

import random

import pytest

from scheduler_service.core.batch import DuplicateRequestId
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import FinishReason, Request, SamplingOptions
from tests.support.simulated import SimulatedWorker, expected_output


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
    worker = SimulatedWorker(num_blocks, block_size)
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
    with pytest.raises(ValueError, match="prefix caching and speculative decoding off"):
        SchedulerConfig(state_slots=4)
