"""Corrections to the memory path, each pinned by a test that fails without it: eviction order of
cached chains, samples on a block boundary, forks and max_num_seqs, request identity across aborts,
and a request that can never be scheduled.
"""

import asyncio

import pytest

from protos import generation_pb2
from scheduler_service.api.validation import InvalidRequest, request_from_proto
from scheduler_service.core.config import ModelSpec, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Request, SamplingOptions
from scheduler_service.text.limits import Limits
from tests.support.simulated import drain, expected, make


def test_eviction_takes_a_cached_chain_from_its_leaf_so_its_prefix_still_hits():
    sched, worker = make(4, budget=64)
    prompt = list(range(100, 112))  # 3 full blocks of 4
    sched.add_request(Request("a", prompt, SamplingOptions(max_tokens=1)))
    drain(sched, worker)
    assert sched.allocator.num_cached_blocks == 3
    # evicts one cached block
    sched.add_request(Request("b", [7, 7, 7, 7, 7], SamplingOptions(max_tokens=1)))
    drain(sched, worker)
    again = Request("c", prompt, SamplingOptions(max_tokens=1))
    sched.add_request(again)
    drain(sched, worker)
    # the chain lost its leaf, not its root: the first two blocks still hit (the third holds the
    # last token)
    assert again.cached_prompt_tokens == 8


def limits(num_blocks):
    return Limits(vocab_size=1000, max_context=4096, num_blocks=num_blocks, block_size=4)


def n_request(prompt_len, max_tokens, n):
    return generation_pb2.GenerateRequest(
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=3),
    )


def test_samples_of_a_prompt_on_a_block_boundary_count_their_copied_block():
    # 8 prompt tokens = 2 full blocks; 4 samples of 12 tokens. Sample 0 holds 3 blocks; each other
    # sample shares block 0, copies block 1 (it recomputes the last prompt token there) and grows
    # one: 3 + 3 x 2.
    with pytest.raises(InvalidRequest, match="needs up to 9 KV blocks"):
        request_from_proto(n_request(8, 4, 4), None, limits(8))
    req = request_from_proto(n_request(8, 4, 4), None, limits(9))
    sched, worker = make(9)
    sched.add_request(req)
    drain(sched, worker)
    assert sched.num_preemptions == 0, "a request judged to fit preempted itself"
    assert [s.output_token_ids for s in req.seqs] == [expected(req, s) for s in req.seqs]


def test_a_sliding_window_model_takes_requests_longer_than_its_pool():
    """Every layer sliding over 12 keys, a step of 16 tokens: a sample holds at most (12 + 16) / 4 +
    2 = 9 blocks, so 600 tokens pass a 10-block pool, two samples do not; a penalized request keeps
    every block and must fit whole. The scheduler then runs it to the windowed model's output
    without preemption.
    """
    windowed = Limits(
        vocab_size=1000, max_context=4096, num_blocks=10, block_size=4, kv_window=12, step_tokens=16
    )
    long = generation_pb2.GenerateRequest(
        prompt_token_ids=list(range(10, 310)),
        sampling=generation_pb2.SamplingParams(max_tokens=300, ignore_eos=True),
    )
    req = request_from_proto(long, None, windowed)
    with pytest.raises(InvalidRequest, match="needs up to 18 KV blocks"):
        request_from_proto(n_request(300, 300, 2), None, windowed)
    long.sampling.repetition_penalty = 1.2
    with pytest.raises(InvalidRequest, match="needs up to 150 KV blocks"):
        request_from_proto(long, None, windowed)
    sched, worker = make(10, budget=16, max_seqs=4, window=12)
    sched.add_request(req)
    drain(sched, worker)
    assert sched.num_preemptions == 0
    assert req.seqs[0].output_token_ids == expected(req, req.seqs[0], window=12)


def test_forks_respect_max_num_seqs():
    sched, worker = make(64, max_seqs=2)
    req = Request(
        "n", list(range(50, 63)), SamplingOptions(max_tokens=5, n=4, temperature=1.0, seed=9)
    )
    sched.add_request(req)
    for _ in range(200):
        if not sched.has_work:
            break
        out = sched.schedule()
        assert len(sched.running) <= 2 and len(out.scheduled) <= 2
        worker.step(sched, out)
    assert not sched.has_work
    assert [s.output_token_ids for s in req.seqs] == [expected(req, s) for s in req.seqs]


# --- the engine, with a scheduler and no workers --------------------------------------------------
class NoWorkers:
    """Just enough of a WorkerClient for an engine that is driven by hand."""

    def __init__(self):
        from scheduler_service.runtime.worker_client import WorkerGroup

        self.groups = [WorkerGroup(0, 1)]
        self.tp_size = 1


def hand_engine(tiny_model_dir, num_blocks=64):
    from scheduler_service.runtime.engine import Engine
    from scheduler_service.text.tokenizer import Tokenizer

    spec = ModelSpec.from_folder(tiny_model_dir)
    config = SchedulerConfig(block_size=4, max_num_batched_tokens=64)
    engine = Engine(config, spec, Tokenizer(tiny_model_dir), NoWorkers())
    engine.limits = Limits(spec.vocab_size, spec.max_context, num_blocks, 4)
    replica = engine.replicas[0]
    replica._sched = Scheduler(config, num_blocks, spec.max_context)
    replica.down_reason = None
    return engine, replica


async def first_item(gen):
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    return task


def test_a_failed_step_fails_the_request_it_held_not_a_new_one_with_the_same_id(tiny_model_dir):
    from scheduler_service.runtime.errors import StepFailed

    async def run():
        engine, replica = hand_engine(tiny_model_dir)
        old = Request("same-id", [5, 6, 7], SamplingOptions(max_tokens=4))
        old_stream = engine.generate(old)
        old_next = await first_item(old_stream)
        out = replica._sched.schedule()  # the step holding the old request is "in flight"
        assert engine.abort("same-id")
        assert (await old_next).finish_reason is not None  # the old stream ended with ABORT
        new = Request("same-id", [8, 9], SamplingOptions(max_tokens=4))
        new_next = await first_item(engine.generate(new))
        engine.on_step_failed(replica, out, "boom")  # the old step fails after the id was reused
        await asyncio.sleep(0)
        assert not new_next.done(), "the new request was failed for the old one's step"
        assert engine.streams["same-id"].request is new
        new_next.cancel()
        # while the request that was in the step does get the failure
        with pytest.raises(StepFailed):
            req = Request("other", [1, 2], SamplingOptions(max_tokens=2))
            task = await first_item(engine.generate(req))
            out = replica._sched.schedule()
            engine.on_step_failed(replica, out, "boom")
            await task

    asyncio.run(run())


def test_a_request_that_can_never_be_scheduled_gets_an_error_not_a_retry_forever(tiny_model_dir):
    from scheduler_service.runtime.errors import Unschedulable

    async def run():
        engine, replica = hand_engine(tiny_model_dir, num_blocks=2)  # 8 tokens of pool
        # bypasses validation
        req = Request("too-big", list(range(5, 25)), SamplingOptions(max_tokens=2))
        task = await first_item(engine.generate(req))
        loop = asyncio.ensure_future(replica._steps())
        with pytest.raises(Unschedulable, match="cannot be scheduled"):
            await asyncio.wait_for(task, 5)
        loop.cancel()
        assert not replica.live_requests() and replica.pool_stats().num_available_blocks == 2

    asyncio.run(run())
