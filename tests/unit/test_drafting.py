import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.drafting import (
    SHARED_DISCOUNT,
    DraftCost,
    DraftLength,
    NgramIndex,
    SequenceDrafter,
    SharedNgrams,
)


def lookup_by_scanning(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n tokens) that occurred earlier with a
    token after it; its latest such occurrence proposes the k tokens that followed.
    """
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=60),
    st.integers(1, 6),
    st.integers(1, 2),
    st.integers(0, 2),
)
def test_prompt_lookup_proposes_what_followed_the_longest_suffix_seen_before(
    tokens, k, min_n, extra
):
    index = NgramIndex(min_n, min_n + extra)
    for i, t in enumerate(tokens):  # drafting as the sequence grows, one accepted token at a time
        index.append(t)
        assert index.propose(k) == lookup_by_scanning(tokens[: i + 1], k, min_n, min_n + extra)


def test_an_edit_drafts_the_rest_of_the_line_it_is_copying():
    prompt = [5, 6, 7, 8, 9, 10, 11, 3, 4]
    index = NgramIndex(1, 3)
    index.extend(prompt + [6, 7])  # the answer started copying the prompt's run
    assert index.propose(4) == [8, 9, 10, 11]
    assert NgramIndex().propose(3) == [] and index.propose(0) == []


def test_shared_ngrams_propose_what_followed_in_an_earlier_request_and_forget_the_oldest():
    shared = SharedNgrams(max_entries=50, min_n=2, max_n=3, span=4)
    shared.learn([1, 2, 3, 4, 5, 6, 7])
    assert shared.propose([9, 9, 2, 3], 3) == [4, 5, 6]  # longest suffix found: (2, 3)
    assert shared.propose([9, 8], 3) == []
    for i in range(40):  # newer requests push the first one out
        shared.learn([100 + i, 200 + i, 300 + i, 400 + i])
    assert len(shared) <= 50
    assert shared.propose([2, 3], 3) == []


def test_a_longer_match_drafts_further_and_failing_short_drafts_stop_until_they_may_pay_again():
    length = DraftLength(max_k=10)
    assert [length.for_match(n) for n in (0, 1, 2, 3, 4, 6, 8, 40)] == [0, 1, 2, 3, 6, 10, 10, 10]
    assert DraftLength(max_k=4).for_match(7) == 4  # never past --num-speculative-tokens
    for _ in range(12):  # nothing to copy: one-token matches keep guessing wrong
        if length.for_match(1) == 0:
            break
        length.record(1, 1, 0)
    assert length.for_match(1) == 0 and length.for_match(2) == 0
    assert length.for_match(3) == 3  # a copy under way drafts whatever short guesses did
    length.record(3, 3, 0)
    assert length.for_match(1) == 0
    gated = 0
    while length.for_match(1) == 0:  # steps without a short draft bring it back, after a while
        length.skipped(1)
        gated += 1
        assert gated < 100
    assert gated > 3 and length.for_match(1) == 1
    for _ in range(5):  # and standing short drafts keep it
        length.record(2, 2, 1)
    assert length.for_match(2) == 2
    with pytest.raises(ValueError):
        length.record(1, 2, 3)


def test_a_sequence_drafts_from_its_own_copy_before_a_shorter_shared_match():
    shared = SharedNgrams(max_entries=100, min_n=2, max_n=8, span=6)
    shared.learn([1, 2, 3, 4, 50, 51, 52, 53])  # an earlier request went 3, 4 -> 50
    d = SequenceDrafter([9, 3, 4, 60, 61, 62, 63, 64, 1, 2], 10, shared)
    d.append([3, 4])  # own: (3, 4) -> 60 ... (a 2-token match); shared: (1, 2, 3, 4), 4 tokens long
    # the shared match counts SHARED_DISCOUNT shorter
    assert d.match(5) == (
        2,
        [60, 61, 62, 63, 64],
    )
    d.append([60, 61])
    assert d.propose(10) == [62, 63, 64, 1, 2, 3]  # a 4-token own match: six tokens
    assert d.matched == 4
    d2 = SequenceDrafter([7, 1, 2, 3, 4, 5], 10, shared)
    d2.append([8, 1, 2, 3, 4])
    # its own (1, 2, 3, 4) beats the shared one of equal length
    assert d2.match(3) == (
        4,
        [5, 8, 1],
    )
    fresh = SequenceDrafter([70, 71], 10, shared)
    fresh.append([1, 2, 3, 4])  # nothing of its own: the shared continuation
    assert fresh.match(4) == (4 - SHARED_DISCOUNT, [50, 51, 52, 53])


@pytest.mark.parametrize("mode", ["auto", "ngram"])
def test_auto_drafts_in_small_steps_only_never_beside_a_prompt_to_compute(mode):
    """A prompt asked again drafts its earlier answer; once another request's prompt is being
    computed (its chunks fill the steps), `auto` drafts nothing until it is done, `ngram` drafts on;
    the answers are the same either way.
    """
    from scheduler_service.core.sequence import Request, SamplingOptions
    from tests.support.simulated import drain, expected, make, step

    sched, worker = make(200, budget=16, speculative=mode)
    prompt = list(range(100, 110))
    sched.add_request(Request("first", prompt, SamplingOptions(max_tokens=30)))
    drain(sched, worker)
    again = Request("again", prompt, SamplingOptions(max_tokens=30))
    sched.add_request(again)
    step(sched, worker)  # its prompt
    alone = step(sched, worker)
    assert alone.scheduled[0].draft  # alone: it drafts what the first answer went on with
    long = Request("long", list(range(500, 560)), SamplingOptions(max_tokens=2))
    sched.add_request(long)
    beside = []
    while long.seqs[0].num_computed_tokens < 60 and sched.has_work:
        out = step(sched, worker)
        beside += [s.draft for s in out.scheduled if s.seq.request is again]
    assert beside  # the first answer's copy was decoding while the prompt's chunks ran
    assert any(beside) == (mode == "ngram")
    drain(sched, worker)
    for req in (again, long):
        assert req.seqs[0].output_token_ids == expected(req, req.seqs[0])


def test_a_drafted_row_is_drafted_only_where_what_stands_repays_its_measured_cost():
    cost = DraftCost()
    assert cost.worth(1, 3, rows=1) == 3  # no step of two row counts seen yet: rows are free
    dense = DraftCost()  # a memory-bound dense step: a row adds 12%
    for rows, t in [(1, 0.100), (2, 0.112), (3, 0.124)] * 5:
        dense.observe(rows, t)
    assert dense.worth(1, 1, rows=1) == 1 and dense.worth(6, 10, rows=1) == 10
    moe = DraftCost()  # a MoE's drafted token reads other experts: a row adds ~60%
    for rows, t in [(1, 0.13), (2, 0.20), (3, 0.29), (4, 0.37)] * 5:
        moe.observe(rows, t)
    assert moe.worth(1, 1, rows=1) == 0  # a one-token match's guess does not repay a row
    assert 1 <= moe.worth(6, 10, rows=1) < 10  # a long match: a few tokens
    for _ in range(30):  # a copy under way: every drafted token stands
        moe.record(6, 10, 10)
    assert moe.worth(6, 10, rows=1) == 10
    for _ in range(30):  # three-token matches keep failing
        moe.record(3, 2, 0)
    assert moe.worth(3, 3, rows=1) == 0
    skipped = 0
    while moe.worth(3, 3, rows=1) == 0:  # what they stood is forgotten: they are tried again
        moe.skipped(3)
        skipped += 1
        assert skipped < 1000
    assert skipped > 10


@pytest.mark.parametrize("row_cost", [0.001, 0.08])
def test_auto_prices_a_drafted_row_from_the_steps_and_drafts_guesses_only_where_rows_are_cheap(
    row_cost,
):
    """A step takes 0.13 s and `row_cost` more a row. A random answer's short matches are guesses;
    an answer asked again is a copy: where rows cost ~60% of a step (a MoE's drafted tokens read
    other experts) auto stops guessing and still drafts the copy; the answers are the same.
    """
    from scheduler_service.core.sequence import Request, SamplingOptions
    from tests.support.simulated import expected, make, step

    sched, worker = make(400, budget=64, speculative="auto")

    def run(req: Request) -> int:
        drafted = worker.num_drafted
        sched.add_request(req)
        while sched.has_work:
            out = step(sched, worker)
            sched.observe(out, 0.13 + row_cost * (out.num_tokens - 1), 0.0)
        assert req.seqs[0].output_token_ids == expected(req, req.seqs[0])
        return worker.num_drafted - drafted

    prompt = [(7 * i) % 1000 for i in range(300)]  # short matches everywhere
    guesses = run(Request("first", prompt, SamplingOptions(max_tokens=80)))
    copied = run(Request("again", prompt, SamplingOptions(max_tokens=80)))
    assert copied >= 40  # the earlier answer, drafted in long runs either way
    if row_cost > 0.01:
        assert guesses <= 3  # priced after the first draft or two, and no longer worth a row
    else:
        assert guesses >= 5
