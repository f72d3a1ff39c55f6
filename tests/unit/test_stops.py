"""A sequence's end is the scheduler's: `update` stops it at a stop id or end-of-sequence (after
min_tokens), at max_tokens or the context, and drops a draft's tokens past the stop; its blocks go
back at once.
"""

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import FinishReason, Request, SamplingOptions
from tests.support.simulated import SimulatedWorker, drain, expected_output, make, step

PROMPT = list(range(100, 113))


def test_max_tokens_ends_the_sequence_in_the_update_that_brings_its_last_token():
    sched, worker = make(32, speculative="off")
    req = Request("r", PROMPT, SamplingOptions(max_tokens=5))
    sched.add_request(req)
    drain(sched, worker)
    seq = req.seqs[0]
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_token_ids == expected_output(
        PROMPT, 5
    )
    assert not sched.requests and sched.allocator.num_available_blocks == 32


def test_the_context_ends_a_sequence_before_max_tokens():
    config = SchedulerConfig(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        debug_invariants=True,
        speculative="off",
    )
    sched, worker = Scheduler(config, 16, max_model_len=20), SimulatedWorker(16, 4)
    req = Request("r", PROMPT, SamplingOptions(max_tokens=100))
    sched.add_request(req)
    drain(sched, worker)
    seq = req.seqs[0]
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 20


def test_end_of_sequence_stops_unless_ignored_and_no_stop_counts_before_min_tokens():
    out = expected_output(PROMPT, 12)
    eos = out[2]
    assert eos not in out[:2]
    for params, want, reason in (
        (SamplingOptions(max_tokens=12), 3, FinishReason.STOP),
        (SamplingOptions(max_tokens=12, ignore_eos=True), 12, FinishReason.LENGTH),
        (SamplingOptions(max_tokens=12, min_tokens=5), 12, FinishReason.LENGTH),
    ):
        config = SchedulerConfig(
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            debug_invariants=True,
            speculative="off",
        )
        sched, worker = Scheduler(config, 32, 4096, eos_token_ids=(eos,)), SimulatedWorker(32, 4)
        req = Request("r", PROMPT, params)
        sched.add_request(req)
        drain(sched, worker)
        assert req.seqs[0].output_token_ids == out[:want] and req.seqs[0].finish_reason is reason


def test_a_stop_id_inside_an_accepted_draft_ends_the_sample_there_and_drops_the_rest():
    """A first request's answer is drafted for a second with the same prompt (shared n-grams): the
    draft stands, and the stop id in its middle ends the sample with the tokens after it dropped.
    """
    sched, worker = make(64, speculative="ngram")
    first = Request("a", PROMPT, SamplingOptions(max_tokens=12))
    sched.add_request(first)
    drain(sched, worker)
    answer = first.seqs[0].output_token_ids
    stop = answer[3]
    assert stop not in answer[:3]
    second = Request("b", PROMPT, SamplingOptions(max_tokens=12, stop_token_ids=(stop,)))
    sched.add_request(second)
    outs = []
    while sched.has_work:
        outs.append(step(sched, worker))
    drafted = [s for out in outs for s in out.scheduled if s.draft]
    # the stop came inside a draft
    assert drafted and len(drafted[0].draft) > 3 and worker.num_accepted > 3
    seq = second.seqs[0]
    assert seq.output_token_ids == answer[:4] and seq.finish_reason is FinishReason.STOP
    assert sched.allocator.num_available_blocks == 64


def test_a_stop_string_on_the_last_allowed_token_restates_length_as_stop():
    sched, worker = make(32, speculative="off")
    req = Request("r", PROMPT, SamplingOptions(max_tokens=2))
    sched.add_request(req)
    drain(sched, worker)
    seq = req.seqs[0]
    assert seq.finish_reason is FinishReason.LENGTH
    sched.finish(seq, FinishReason.STOP)  # the text found a stop string in that last token
    assert seq.finish_reason is FinishReason.STOP
    sched.finish(seq, FinishReason.ABORT)  # nothing else changes an ended sample
    assert seq.finish_reason is FinishReason.STOP and sched.allocator.num_available_blocks == 32
