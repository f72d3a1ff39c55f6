"""Memory management at full strength, against the simulated worker (paging-sensitive outputs):
prefix caching, copy-on-write for n samples, eviction, and a hypothesis state machine over it all.
"""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_service.core.sequence import FinishReason, Request, SamplingOptions
from tests.support.simulated import Pipeline, drain, expected, expected_output, make, step


def test_second_request_with_a_shared_prefix_reuses_cached_blocks():
    sched, worker = make(64)
    system = list(range(100, 130))  # 30 tokens: 7 full blocks of 4
    first = Request("a", system + [1, 2, 3], SamplingOptions(max_tokens=3))
    sched.add_request(first)
    drain(sched, worker)
    assert sched.allocator.num_cached_blocks >= 7
    second = Request("b", system + [7, 8], SamplingOptions(max_tokens=3))
    sched.add_request(second)
    out = sched.schedule()
    assert out.scheduled[0].start == 28 and out.scheduled[0].num_new_tokens == 4  # 7 blocks reused
    assert second.cached_prompt_tokens == 28
    worker.step(sched, out)
    drain(sched, worker)
    assert second.seqs[0].output_token_ids == expected_output(system + [7, 8], 3)
    assert sched.prefix_cache_hits == 28


def test_a_fully_cached_prompt_still_recomputes_its_last_token():
    sched, worker = make(64)
    prompt = list(range(200, 216))  # exactly 4 full blocks
    for rid in ("a", "b"):
        sched.add_request(Request(rid, prompt, SamplingOptions(max_tokens=2)))
        out = sched.schedule()
        if rid == "b":
            # 3 blocks reused; the 4th holds the last prompt token, which is computed again
            assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (12, 4)
        worker.step(sched, out)
        drain(sched, worker)


def test_n_samples_share_prompt_blocks_and_copy_the_partial_block():
    sched, worker = make(64)
    prompt = list(range(300, 310))  # 2 full blocks + a partial one
    req = Request("n", prompt, SamplingOptions(max_tokens=6, n=4, temperature=1.0, seed=50))
    sched.add_request(req)
    out = sched.schedule()
    # sample 0 prefilled, the others forked
    worker.step(sched, out)
    assert all(s.block_ids[:3] == req.seqs[0].block_ids[:3] for s in req.seqs)
    assert sched.allocator.refcount(req.seqs[0].block_ids[0]) == 4
    partial = req.seqs[0].block_ids[2]
    out = sched.schedule()
    # the shared partial block is copied before each write, but the last holder writes it in place
    assert [src for src, _ in out.block_copies] == [partial] * 3
    assert len({dst for _, dst in out.block_copies}) == 3
    worker.step(sched, out)
    shared = sched.request_blocks(req)
    assert shared < 4 * 3, "samples must share their prompt's full blocks"
    drain(sched, worker)
    outputs = [s.output_token_ids for s in req.seqs]
    assert outputs == [expected_output(prompt, 6, seed=50 + i) for i in range(4)]
    # the samples diverged, and none saw another's tokens
    assert len({tuple(o) for o in outputs}) == 4
    assert sched.allocator.num_available_blocks == 64


def test_n_samples_use_fewer_blocks_than_separate_requests():
    prompt = list(range(400, 441))  # 41 tokens: 10 full blocks
    used = {}
    for label, reqs in (
        ("n=4", [Request("n", prompt, SamplingOptions(max_tokens=20, n=4))]),
        (
            "4 requests",
            [Request(f"s{i}", prompt, SamplingOptions(max_tokens=20)) for i in range(4)],
        ),
    ):
        sched, worker = make(256, caching=False)
        for r in reqs:
            sched.add_request(r)
        for _ in range(6):
            step(sched, worker)
        used[label] = sched.allocator.num_used_blocks
        drain(sched, worker)
    assert used["n=4"] < used["4 requests"] / 2, used


def test_evicted_blocks_are_never_read_in_a_long_run_with_a_tiny_pool():
    """Many requests over a few shared prefixes through a pool that forces eviction and preemption,
    drafting in every step (a prompt asked again drafts its earlier answer; other drafts mostly
    fail).
    """
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 1000) for _ in range(rng.randint(4, 30))] for _ in range(5)]
    sched, worker = make(30, budget=24, speculative="ngram")
    live = []
    for i in range(120):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 8))]
        if i >= 10 and i % 4 == 0:  # asked before
            prompt = list(live[rng.randrange(i // 2)].prompt_token_ids)
        n = rng.choice([1, 1, 2])
        req = Request(
            f"r{i}",
            prompt,
            SamplingOptions(
                max_tokens=rng.randint(1, 12), n=n, temperature=1.0 if n > 1 else 0.0, seed=i
            ),
        )
        sched.add_request(req)
        live.append(req)
        for _ in range(rng.randint(0, 4)):
            if sched.has_work:
                out = step(sched, worker)
    while sched.has_work:
        out = step(sched, worker)
        assert not out.is_empty, "work left but nothing scheduled"
    assert (
        sched.allocator.num_evictions > 0
        and sched.prefix_cache_hits > 0
        and sched.num_preemptions > 0
    )
    assert worker.num_drafted > worker.num_accepted > 0  # drafts stood and drafts were rejected
    for req in live:
        for s in req.seqs:
            assert s.output_token_ids == expected(req, s), req.request_id
    assert sched.allocator.num_available_blocks == 30


def expected_until_stop(req, seq, window=0):
    """The simulated model's output, cut after the first of the request's stop tokens."""
    tokens = expected(req, seq, window)
    for i, t in enumerate(tokens):
        if t in req.sampling.stop_token_ids:
            return tokens[: i + 1]
    return tokens


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (shared prefixes, n samples, stop tokens), steps, aborts, with and without
    overlap (step N+1 planned before step N's result); invariants after every step; every sample
    that finished on its own produced exactly the simulated model's output up to its stop, an
    aborted one a prefix of it, and none a token after its stop; nothing leaks.
    """

    @initialize(
        num_blocks=st.integers(24, 60),
        block_size=st.sampled_from([2, 4, 8]),
        budget=st.integers(16, 64),
        caching=st.booleans(),
        chunked=st.booleans(),
        overlap=st.booleans(),
        window=st.sampled_from([0, 0, 3, 7, 12]),
        speculative=st.sampled_from(["off", "auto", "ngram"]),
    )
    def setup(self, num_blocks, block_size, budget, caching, chunked, overlap, window, speculative):
        self.max_len = num_blocks * block_size // 3  # every request fits the pool on its own
        # without chunked prefill the budget holds the longest sequence (a preempted one is
        # recomputed whole): a prompt of at most max_len // 2 tokens and 10 more
        budget = budget if chunked else max(budget, self.max_len // 2 + 10)
        self.window = (
            window  # > 0: a sliding-window model, whose blocks behind every window are given back
        )
        # speculative: drafts (from the shared prefixes' earlier answers, mostly) accepted and
        # rejected, their slots and blocks given back
        self.sched, self.worker = make(
            num_blocks,
            block_size,
            budget,
            caching,
            chunked,
            max_seqs=8,
            window=window,
            speculative=speculative,
        )
        self.pipe = Pipeline(self.sched, self.worker, overlap)
        self.prefixes = [
            [(i * 37 + j * 11) % 997 + 1 for j in range(3 * block_size + i)] for i in range(3)
        ]
        self.requests = []
        self.ids = 0

    @rule(
        prefix=st.integers(0, 2),
        extra=st.lists(st.integers(1, 999), max_size=6),
        max_tokens=st.integers(1, 10),
        n=st.integers(1, 3),
        sampled=st.booleans(),
        stops=st.lists(st.integers(0, 999), max_size=40),
    )
    def arrive(self, prefix, extra, max_tokens, n, sampled, stops):
        prompt = (self.prefixes[prefix] + extra)[: self.max_len // 2]
        shared = len(prompt) // self.sched.block_size
        per_seq = self.sched.allocator.blocks_for_tokens(len(prompt) + max_tokens) - shared
        if shared + n * per_seq > self.sched.num_blocks:
            n = 1
        self.ids += 1
        params = SamplingOptions(
            max_tokens=max_tokens,
            n=n,
            temperature=1.0 if sampled else 0.0,
            seed=self.ids,
            stop_token_ids=tuple(stops),
        )
        req = Request(f"q{self.ids}", prompt, params)
        self.pipe.submit(req)
        self.requests.append(req)

    @precondition(lambda self: self.pipe.busy)
    @rule(times=st.integers(1, 5))
    def run(self, times):
        for _ in range(times):
            if self.pipe.busy:
                self.pipe.step()
                self.sched.check_invariants()

    @precondition(lambda self: self.sched.requests)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        ids = sorted(self.sched.requests)
        self.pipe.abort(ids[pick % len(ids)])

    @invariant()
    def accounting_holds(self):
        self.sched.check_invariants()

    def teardown(self):
        for _ in range(20_000):
            if not self.pipe.busy:
                break
            assert self.pipe.step(), "work left but nothing scheduled"
        assert not self.pipe.busy, "did not finish"
        self.pipe.close()
        assert self.sched.allocator.num_available_blocks == self.sched.num_blocks, "a block leaked"
        assert not self.sched.requests
        for req in self.requests:
            for s in req.seqs:
                want = expected_until_stop(req, s, self.window)
                if s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                    assert s.output_token_ids == want
                else:
                    assert s.output_token_ids == want[: s.num_output_tokens]


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_sliding_window_gives_back_the_blocks_behind_it():
    """A sliding-window model (every layer over 8 keys) runs an 80-token sequence in a pool of 10
    blocks of 4: blocks wholly behind the window go back as it advances (full ones into the prefix
    cache), the table marks them -1, at most window + a step's tokens are held, and the output is
    the windowed model's.
    """
    sched, worker = make(10, block_size=4, budget=8, max_seqs=4, window=8)
    prompt = list(range(300, 330))
    req = Request("w", prompt, SamplingOptions(max_tokens=50))
    sched.add_request(req)
    held, dropped = 0, 0
    while sched.has_work:
        assert not step(sched, worker).is_empty
        seq = req.seqs[0]
        if not seq.is_finished:
            held = max(held, sum(1 for b in seq.block_ids if b >= 0))
            dropped = max(dropped, seq.num_dropped_blocks)
            assert seq.block_ids[: seq.num_dropped_blocks] == [-1] * seq.num_dropped_blocks
    assert req.seqs[0].output_token_ids == expected_output(prompt, 50, window=8)
    # the window mattered
    assert expected_output(prompt, 50, window=8) != expected_output(prompt, 50)
    assert held <= (8 + 8) // 4 + 2 and dropped >= 15
    assert sched.allocator.num_available_blocks == 10 and sched.allocator.num_cached_blocks > 0


def test_a_cached_prefix_longer_than_the_window_shares_only_what_the_window_reads():
    sched, worker = make(40, block_size=4, budget=64, window=6)
    system = list(range(500, 540))  # 10 full blocks
    for rid in ("a", "b"):
        sched.add_request(Request(rid, system + [7, 8, 9], SamplingOptions(max_tokens=4)))
        out = sched.schedule()
        if rid == "b":
            seq = out.scheduled[0].seq
            assert out.scheduled[0].start == 40  # the whole cached prefix counts as computed
            assert seq.num_dropped_blocks == (40 - 6) // 4 and seq.block_ids[:8] == [-1] * 8
        worker.step(sched, out)
        drain(sched, worker)
    assert not sched.requests and sched.allocator.num_available_blocks == 40


def test_penalized_samples_keep_every_block_and_forks_share_the_window():
    """Penalties read a sequence's whole context through its table: nothing is given back for them.
    n samples fork from the prompt's blocks with the leader's given-back ones already gone.
    """
    sched, worker = make(64, block_size=4, budget=16, max_seqs=8, window=5)
    penalized = Request(
        "p", list(range(600, 630)), SamplingOptions(max_tokens=12, repetition_penalty=1.2)
    )
    forked = Request(
        "n", list(range(700, 731)), SamplingOptions(max_tokens=12, n=3, temperature=1.0, seed=4)
    )
    for req in (penalized, forked):
        sched.add_request(req)
    while sched.has_work:
        assert not step(sched, worker).is_empty
        seq = penalized.seqs[0]
        if not seq.is_finished:
            assert seq.num_dropped_blocks == 0 and -1 not in seq.block_ids
    for s in forked.seqs:
        assert s.output_token_ids == expected(forked, s, window=5)
    assert penalized.seqs[0].output_token_ids == expected(penalized, penalized.seqs[0], window=5)
    assert sched.allocator.num_available_blocks == 64


def test_a_windowed_prefix_stays_findable_after_its_sequence_finishes():
    """Blocks given back behind a window enter the cache's LRU early; at the end of their sequence
    they are made the most recent again, root last, so an unrelated request evicts the sequence's
    own late blocks first and a later request with the same prompt still finds the prefix from its
    root.
    """
    sched, worker = make(16, block_size=4, budget=8, max_seqs=4, window=6)
    prompt = list(range(800, 840))  # 10 full blocks, far longer than the window
    sched.add_request(Request("a", prompt, SamplingOptions(max_tokens=20)))
    drain(sched, worker)
    # a's 15 blocks fill the cache: every block c takes evicts one, the oldest first
    sched.add_request(Request("c", list(range(900, 930)), SamplingOptions(max_tokens=10)))
    drain(sched, worker)
    hits = sched.prefix_cache_hits
    b = Request("b", prompt + [1, 2, 3], SamplingOptions(max_tokens=4))
    sched.add_request(b)
    drain(sched, worker)
    # a's late blocks went first; its prompt's root is still there
    assert sched.prefix_cache_hits - hits >= 16
    assert b.seqs[0].output_token_ids == expected(b, b.seqs[0], window=6)
