import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.drafting import DraftLength, NgramIndex, SharedNgrams


def lookup_by_scanning(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n tokens) that occurred earlier with a token
    after it; its latest such occurrence proposes the k tokens that followed."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 6), st.integers(1, 2), st.integers(0, 2))
def test_prompt_lookup_proposes_what_followed_the_longest_suffix_seen_before(tokens, k, min_n, extra):
    index = NgramIndex(min_n, min_n + extra)
    for i, t in enumerate(tokens):  # drafting as the sequence grows, one accepted token at a time
        index.append(t)
        assert index.propose(k) == lookup_by_scanning(tokens[:i + 1], k, min_n, min_n + extra)


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


def test_the_draft_length_follows_acceptance_and_pauses_when_drafts_do_not_pay():
    length = DraftLength(max_k=4, pause=3)
    assert length.next() == 4
    for _ in range(5):
        length.record(4, 4)
    assert length.next() == 4
    for _ in range(4):
        length.record(length.next() or 1, 0)
        if length.paused:
            break
    paused = []
    for _ in range(3):  # paused for the next three tokens, however often asked
        paused += [length.next(), length.next()]
        length.tick()
    assert paused == [0] * 6
    assert 1 <= length.next() <= 2  # then a short draft again
    with pytest.raises(ValueError):
        length.record(2, 3)
