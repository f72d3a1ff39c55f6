"""Embedding requests in the scheduler, against the simulated worker (whose pooled "hidden state" is
the sum of the token ids a row reads and their count): prefill-only, pooled per chunk as the pooling
asks, in the same steps as decodes, finished with their blocks back, and pooled from scratch after a
preemption even while a step of the old admission is still in flight; and generation prompts beside
a decoding stream, chunked to keep its gap.
"""

from collections import deque

import numpy as np
import pytest

from protos.codec import POOL_FIRST, POOL_LAST, POOL_SUM, encode_plan
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.pacing import PromptPacer
from scheduler_service.core.pooling import PoolingSpec
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import EmbedOptions, FinishReason, Request, SamplingOptions
from tests.support.simulated import SimulatedWorker


def embed_request(rid, prompt, pooling="mean", dimensions=None):
    return Request(
        rid,
        prompt,
        SamplingOptions(max_tokens=1),
        embed=EmbedOptions(PoolingSpec(pooling=pooling, normalize=False, dimension=2), dimensions),
    )


def expected(prompt, pooling):
    """The vector the simulated worker's states finish as: a mean of the ids, the last token's (its
    whole context), the first token's.
    """
    if pooling == "mean":
        return [np.mean(prompt), 1.0]
    if pooling == "last":
        return [float(sum(prompt)), float(len(prompt))]
    return [float(prompt[0]), 1.0]


def step_seconds(out):
    """A simulated step's time: a decode-bound base and a cost per prompt token."""
    return 0.05 + 0.002 * out.num_prefill_tokens


def run_overlapped(sched, worker, arrivals, max_steps=2000, seconds=step_seconds):
    """Two steps in flight, as the replica runs them: step N+1 is scheduled and run before step N's
    result is applied, and its time (step_seconds) told to the pacers. arrivals: {step:
    [Request]}. Returns every SchedulerOutput.
    """
    inflight, outs, step = deque(), [], 0
    while step < max_steps:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        step += 1
        if sched.has_work:
            out = sched.schedule()
            if not out.is_empty:
                tokens = worker.execute(encode_plan(sched.build_plan(out)))
                inflight.append((out, tokens, worker.last_accepted, worker.last_pooled))
                outs.append(out)
        if len(inflight) == 2 or (inflight and not sched.has_work) or (inflight and out.is_empty):
            done, tokens, accepted, pooled = inflight.popleft()
            sched.update(done, tokens, accepted, pooled)
            sched.observe(done, seconds(done), 0.0)
        sched.check_invariants()
        if not sched.has_work and not inflight and not arrivals:
            return outs
    raise AssertionError("did not finish")


@pytest.mark.parametrize(
    "pooling,kinds",
    [("mean", [POOL_SUM] * 3), ("last", [0, 0, POOL_LAST]), ("cls", [POOL_FIRST, 0, 0])],
)
def test_a_long_input_pools_per_chunk_and_finishes_with_its_blocks_back(pooling, kinds):
    config = SchedulerConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=16, debug_invariants=True
    )
    sched = Scheduler(config, num_blocks=32, max_model_len=128)
    worker = SimulatedWorker(32, 4)
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16, 8
    request = embed_request("e", prompt, pooling)
    outs = run_overlapped(sched, worker, {0: [request]})
    pooled = [int(o.read.pooling[0]) if o.read.pooling is not None else 0 for o in outs]
    assert pooled == kinds
    assert not any(s.do_sample for o in outs for s in o.scheduled), "an embedding samples nothing"
    seq = request.seqs[0]
    assert seq.finish_reason is FinishReason.STOP and seq.num_output_tokens == 0
    np.testing.assert_allclose(seq.pooling.vector, expected(prompt, pooling), rtol=1e-6)
    a = sched.allocator
    assert a.num_free_blocks + a.num_cached_blocks == a.num_blocks and not sched.requests


def test_embeddings_share_steps_with_decodes_paced_to_keep_them_going():
    """Steps cost 50 ms and 2 ms a prompt token (step_seconds): beside a decoding stream, embeddings
    take what keeps its steps within 1 / 0.8 of a decode's time on average (about 6 tokens a step);
    a generation's own prompt is not held back, and with no decode running they take the whole
    budget.
    """
    config = SchedulerConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, debug_invariants=True
    )
    sched = Scheduler(config, num_blocks=256, max_model_len=256)
    worker = SimulatedWorker(256, 4)
    generation = Request("g", [5, 6, 7], SamplingOptions(max_tokens=200))
    embeddings = [
        embed_request(f"e{i}", list(range(10 + i, 110 + i)), "last", dimensions=1) for i in range(4)
    ]
    late = Request("late", list(range(3, 43)), SamplingOptions(max_tokens=3))
    outs = run_overlapped(sched, worker, {0: [generation], 3: embeddings, 60: [late]})
    beside = [o for o in outs if o.num_decodes and o.num_embed_tokens]
    assert beside, "the embeddings never ran beside the decodes"
    # while embeddings ran beside the stream
    first, last = (
        outs.index(beside[0]),
        outs.index(beside[-1]),
    )
    decoding = [
        o for o in outs[first : last + 1] if not (o.num_prefill_tokens - o.num_embed_tokens)
    ]
    slowdown = np.mean([step_seconds(o) for o in decoding]) / 0.05
    assert slowdown <= 1 / 0.8 + 0.05, f"decoding steps ran {slowdown:.2f}x a decode's time"
    assert max(o.num_embed_tokens for o in beside) < 64
    admitted = next(
        i for i, o in enumerate(outs) if any(s.seq.request is late for s in o.scheduled)
    )
    assert admitted <= 62, "a generation waited behind the paced embeddings"
    assert generation.seqs[0].num_output_tokens == 200 and late.seqs[0].num_output_tokens == 3
    for e in embeddings:
        # dimensions=1
        np.testing.assert_allclose(e.seqs[0].pooling.vector, [float(sum(e.prompt_token_ids))])
    alone = Scheduler(config, num_blocks=256, max_model_len=256)
    first = run_overlapped(
        alone, SimulatedWorker(256, 4), {0: [embed_request("x", list(range(10, 110)))]}
    )
    assert first[0].num_embed_tokens == 64, (
        "with nothing decoding, an embedding takes the whole budget"
    )


def test_a_preempted_embedding_pools_again_from_scratch():
    """A pool of 12 blocks of 4: two generations grow into it and preempt the embedding (the most
    recently admitted) mid-prompt, while a step that already summed a chunk of it is in flight; that
    sum must not count, and the vector equals the one computed without preemption.
    """
    config = SchedulerConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=12, debug_invariants=True
    )
    sched = Scheduler(config, num_blocks=12, max_model_len=64)
    worker = SimulatedWorker(12, 4)
    generations = [Request(f"g{i}", [5 + i] * 7, SamplingOptions(max_tokens=17)) for i in range(2)]
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 300, 30)]
    embedding = embed_request("e", prompt, "mean")
    run_overlapped(sched, worker, {0: generations, 1: [embedding]})
    assert embedding.seqs[0].num_preemptions > 0, "the pool was meant to preempt the embedding"
    np.testing.assert_allclose(
        embedding.seqs[0].pooling.vector, expected(prompt, "mean"), rtol=1e-6
    )
    assert all(g.seqs[0].num_output_tokens == 17 for g in generations)
    a = sched.allocator
    assert a.num_free_blocks + a.num_cached_blocks == a.num_blocks


def test_where_the_model_also_generates_an_embedding_step_is_bounded():
    """--embed-step-tokens: a step without decodes takes at most that many embedding tokens, so a
    generation request arriving meanwhile waits behind short steps; it is admitted in the next one.
    """
    config = SchedulerConfig(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        embed_step_tokens=16,
        debug_invariants=True,
    )
    sched = Scheduler(config, num_blocks=256, max_model_len=256)
    embeddings = [embed_request(f"e{i}", list(range(10 + i, 110 + i))) for i in range(3)]
    late = Request("late", [5, 6, 7], SamplingOptions(max_tokens=2))
    outs = run_overlapped(sched, SimulatedWorker(256, 4), {0: embeddings, 2: [late]})
    assert max(o.num_embed_tokens for o in outs) <= 16
    admitted = next(
        i for i, o in enumerate(outs) if any(s.seq.request is late for s in o.scheduled)
    )
    assert admitted <= 3 and late.seqs[0].num_output_tokens == 2
    assert all(e.seqs[0].pooling.vector is not None for e in embeddings)


@pytest.mark.parametrize("gap", [0.0, 0.2])
def test_long_prompts_beside_a_stream_come_in_chunks_that_keep_its_gap(gap):
    """Steps cost 50 ms and 2 ms a prompt token (step_seconds). With --max-decode-gap-ms 200 the
    scheduler learns a token's cost and gives prompts beside a decoding stream what keeps its steps
    within the gap (about 65 tokens: 90% of it), the rest in later steps; without a decode a prompt
    takes the whole budget; with no gap, 512-token chunks hold the stream for a second each.
    """
    config = SchedulerConfig(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_decode_gap=gap,
        speculative="off",
        debug_invariants=True,
    )
    sched = Scheduler(config, num_blocks=1024, max_model_len=2048)
    worker = SimulatedWorker(1024, 4)
    stream = Request("s", [5, 6, 7], SamplingOptions(max_tokens=300))
    prompts = [
        Request(f"p{i}", list(range(10 + i, 1210 + i)), SamplingOptions(max_tokens=2))
        for i in range(2)
    ]
    alone = Request("alone", list(range(40, 1040)), SamplingOptions(max_tokens=2))
    outs = run_overlapped(sched, worker, {0: [stream], 4: prompts, 400: [alone]})
    assert stream.seqs[0].num_output_tokens == 300
    assert all(p.seqs[0].num_output_tokens == 2 for p in (*prompts, alone))
    beside = [o for o in outs if o.num_decodes and o.num_prefill_tokens]
    longest = max(step_seconds(o) for o in beside)
    if not gap:
        assert longest > 1.0  # the budget less the decode's token: 511 prompt tokens
    else:
        # the first step beside the stream probes with 32 tokens; from then on each fits the gap
        assert longest <= gap and sum(o.num_prefill_tokens for o in beside) >= 2 * 1200
        assert max(o.num_prefill_tokens for o in beside) <= 0.8 * gap / 0.002
    # alone, a prompt is not held back
    assert max(o.num_prefill_tokens for o in outs if not o.num_decodes) == 512


def paced_scheduler(gap: float = 0.2, seqs: int = 8, blocks: int = 1024) -> Scheduler:
    """A scheduler pacing prompts beside decodes to a 200 ms gap (or `gap`), 512 tokens a step."""
    config = SchedulerConfig(
        block_size=4,
        max_num_seqs=seqs,
        max_num_batched_tokens=512,
        max_decode_gap=gap,
        speculative="off",
    )
    return Scheduler(config, num_blocks=blocks, max_model_len=4096)


def test_on_a_noisy_machine_the_plan_shrinks_by_the_misses_and_the_gap_holds():
    """Each step runs 0.8-1.4x its cost (a busy host): the pacer learns how far its plans miss and
    plans under the gap by that margin, so beside a stream nearly every step keeps the 200 ms gap
    (a plan at a fixed 80% of it would overrun on a quarter of them) and the prompts still finish.
    """
    rng, times = np.random.default_rng(7), {}

    def noisy(out):
        if out.step_id not in times:
            times[out.step_id] = step_seconds(out) * rng.uniform(0.8, 1.4)
        return times[out.step_id]

    sched = paced_scheduler()
    # as many streams as prompts: the gap is theirs (more prompts would take a larger share)
    streams = [Request(f"s{i}", [5 + i, 6, 7], SamplingOptions(max_tokens=400)) for i in range(2)]
    prompts = [
        Request(f"p{i}", list(range(10 + i, 1510 + i)), SamplingOptions(max_tokens=2))
        for i in range(2)
    ]
    outs = run_overlapped(sched, SimulatedWorker(1024, 4), {0: streams, 4: prompts}, seconds=noisy)
    assert all(p.seqs[0].num_output_tokens == 2 for p in prompts)
    beside = [noisy(o) for o in outs if o.num_decodes and o.num_prefill_tokens]
    over = sum(t > 0.2 for t in beside)
    assert len(beside) > 40 and over <= 0.02 * len(beside)


def test_chunks_deeper_into_a_prompt_shrink_as_its_tokens_cost_more():
    """Steps cost 50 ms, 1 ms a prompt token and 2 us a token for each key it attends to: the
    pacer fits a token's cost against its position, so the chunks of a 2,000-token prompt beside
    a stream shrink as they go deeper and every step stays within the 200 ms gap.
    """

    def attending(out):
        rows = [s for s in out.scheduled if s.num_new_tokens > 1]
        keys = sum(s.num_new_tokens * (s.start + s.num_new_tokens / 2) for s in rows)
        return 0.05 + 0.001 * out.num_prefill_tokens + 2e-6 * keys

    sched = paced_scheduler()
    stream = Request("s", [5, 6, 7], SamplingOptions(max_tokens=300))
    long = Request("long", list(range(10, 2010)), SamplingOptions(max_tokens=2))
    outs = run_overlapped(
        sched, SimulatedWorker(1024, 4), {0: [stream], 4: [long]}, seconds=attending
    )
    chunks = [o for o in outs if o.num_decodes and o.num_prefill_tokens]
    assert sum(o.num_prefill_tokens for o in chunks) == 2000
    assert max(attending(o) for o in chunks) <= 0.2
    assert chunks[-2].num_prefill_tokens < chunks[3].num_prefill_tokens * 0.6


def test_a_fresh_servers_first_long_prompt_keeps_the_gap_while_its_cost_is_learned():
    """A small model: steps cost 30 ms, 0.2 ms a prompt token and 0.2 us a token for each key it
    attends to, beside a 500 ms gap. The probe's 32 tokens near position 0 say nothing of the
    attention: planned from them alone, the next chunks (two, planned before the probe lands) ran
    2,000 tokens deep at 0.8 s each. Each chunk reaches at most REACH times deeper than any token
    measured, so a fresh server's first prompts keep the gap too, and the prompt still finishes.
    """

    def attending(out):
        rows = [s for s in out.scheduled if s.num_new_tokens > 1]
        keys = sum(s.num_new_tokens * (s.start + s.num_new_tokens / 2) for s in rows)
        return 0.03 + 2e-4 * out.num_prefill_tokens + 2e-7 * keys

    config = SchedulerConfig(
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        max_decode_gap=0.5,
        speculative="off",
    )
    sched = Scheduler(config, num_blocks=1024, max_model_len=8192)
    streams = [Request(f"s{i}", [5 + i, 6, 7], SamplingOptions(max_tokens=200)) for i in range(4)]
    prompts = [
        Request(f"p{i}", list(range(10 + i, 2510 + i)), SamplingOptions(max_tokens=2))
        for i in range(4)
    ]
    outs = run_overlapped(
        sched, SimulatedWorker(1024, 16), {0: streams, 4: prompts}, seconds=attending
    )
    assert all(p.seqs[0].num_output_tokens == 2 for p in prompts)
    beside = [attending(o) for o in outs if o.num_decodes and o.num_prefill_tokens]
    assert max(beside) <= 0.5


@pytest.mark.parametrize("decode", [0.1, 0.3])
def test_in_a_burst_the_prompts_waiting_take_their_share_and_the_streams_keep_theirs(decode):
    """Steps cost `decode` seconds to decode and 2 ms a prompt token, beside a 500 ms gap: one
    stream, then 24 requests at once. Each step gives the prompts at least a decode step's seconds,
    and that for each prompt per stream while more wait than stream, so the burst's TTFT stays
    within 1.5x of unpaced (the gap alone held it to ~50-token sips: over 2x). Once the streams
    outnumber what waits, the gap is theirs where a decode step takes under half of it (100 ms);
    a 300 ms one gives the prompts as much again, short of the whole budget's 1.3 s.
    """

    def slow(out):
        return decode + 0.002 * out.num_prefill_tokens

    def burst_ttft(gap):
        sched = paced_scheduler(gap, seqs=64, blocks=4096)
        stream = Request("s", [5, 6, 7], SamplingOptions(max_tokens=300))
        burst = [
            Request(f"b{i}", list(range(10 + i, 210 + i)), SamplingOptions(max_tokens=40))
            for i in range(24)
        ]
        outs = run_overlapped(
            sched, SimulatedWorker(4096, 4), {0: [stream], 6: burst}, seconds=slow
        )
        assert all(r.seqs[0].num_output_tokens == 40 for r in burst)
        clock, first = 0.0, {}
        for o in outs:
            clock += slow(o)
            for s in o.scheduled:
                if s.start + s.num_new_tokens == 200 and s.seq.request in burst:
                    first.setdefault(s.seq.request.request_id, clock)
        return float(np.mean(list(first.values()))), outs

    unpaced, _ = burst_ttft(0.0)
    paced, outs = burst_ttft(0.5)
    assert paced <= 1.5 * unpaced, (paced, unpaced)
    # the streams outnumber what waits by the end
    beside = [o for o in outs if o.num_decodes and o.num_prefill_tokens]
    late = [o for o in beside if o.num_decodes > 16]
    longest = max(slow(o) for o in late)
    if decode < 0.25:
        assert longest <= 0.5
    else:
        assert 0.5 < longest <= 2 * decode + 0.01


def test_a_decode_steps_seconds_are_learned_against_its_rows_and_the_prompts_share_follows():
    """Decode-only steps cost 50 ms and 4 ms a stream: measured at 8-48 streams, the pacer prices
    one of 64 as a line in its rows (306 ms), not as the recent steps' mean, so prompts beside 64
    streams get at least that time (the recent steps' mean gave them half of it).
    """
    pacer = PromptPacer(0.5)
    for d in (8, 16, 32, 48):
        pacer.observe(d, 0, 0, 0.05 + 0.004 * d, 0)
    assert pacer.base(64) == pytest.approx(0.306, rel=0.02)
    pacer.observe(48, 100, 100 * 50, 0.05 + 0.004 * 48 + 0.002 * 100, 100)  # a token: 2 ms
    pacer.begin(64, 64)
    assert pacer.fit(0, 4096) * 0.002 >= 0.306 * 0.97
