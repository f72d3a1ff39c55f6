"""Text output: incremental detokenization, chat template, stop conditions, stream hold-back."""

import pytest

from scheduler_service.output import SampleOutput
from scheduler_service.sequence import FinishReason, Request, SamplingOptions, Sequence
from scheduler_service.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def run(tok, text_out, **params):
    ids = tok.encode(text_out, add_special_tokens=False)
    request = Request("r", tok.encode("prompt here", add_special_tokens=False),
                      SamplingOptions(max_tokens=params.pop("max_tokens", 100), **params))
    seq = Sequence(0, request, 0)
    out = SampleOutput(tok, seq, eos_token_ids=(2,), max_context=512)
    deltas = []
    for t in ids:
        seq.token_ids.append(t)
        delta, reason = out.add_token(t)
        deltas.append(delta)
        if reason:
            return deltas, reason, out
    return deltas, None, out


def test_incremental_detokenizer_matches_full_decode(tok):
    for text in ["the quick brown fox", "Paris is the capital of France.", "naïve café — ünïcode 日本 ✓"]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("context", add_special_tokens=False))
        pieces = [detok.add(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)


def test_chat_template_wraps_a_text_prompt(tok):
    ids = tok.encode_prompt("hello", raw=False)
    assert tok.decode(ids, skip_special_tokens=False) == "<s>user: hello</s><s>assistant:"
    assert tok.decode(tok.encode_prompt("hello", raw=True), skip_special_tokens=False) == "hello"


def test_stop_string_cuts_the_text_and_is_never_streamed(tok):
    deltas, reason, out = run(tok, "the quick brown fox jumps over", stop=("brown",))
    assert reason is FinishReason.STOP
    assert out.text == "the quick "
    streamed = "".join(d.text for d in deltas)
    assert streamed == "the quick " and "bro" not in streamed


def test_stop_string_spanning_tokens(tok):
    deltas, reason, out = run(tok, "paged attention stores keys", stop=("on sto",))
    assert reason is FinishReason.STOP and out.text == "paged attenti"
    assert "".join(d.text for d in deltas) == "paged attenti"


def test_stop_token_id_is_kept_in_tokens(tok):
    ids = tok.encode(" fox jumps", add_special_tokens=False)
    deltas, reason, _ = run(tok, "the quick brown fox jumps", stop_token_ids=(ids[0],))
    assert reason is FinishReason.STOP and deltas[-1].token_ids == [ids[0]]


def test_eos_stops_unless_ignored(tok):
    request = Request("r", [5], SamplingOptions(max_tokens=10))
    seq = Sequence(0, request, 0)
    out = SampleOutput(tok, seq, eos_token_ids=(2,), max_context=512)
    seq.token_ids.append(2)
    assert out.add_token(2)[1] is FinishReason.STOP
    request = Request("r", [5], SamplingOptions(max_tokens=10, ignore_eos=True))
    seq = Sequence(0, request, 0)
    out = SampleOutput(tok, seq, eos_token_ids=(2,), max_context=512)
    seq.token_ids.append(2)
    assert out.add_token(2)[1] is None


def test_max_tokens_is_length(tok):
    deltas, reason, _ = run(tok, "the quick brown fox jumps over the lazy dog", max_tokens=3)
    assert reason is FinishReason.LENGTH and len(deltas) == 3
    assert deltas[-1].finish_reason is FinishReason.LENGTH
