"""Text output: incremental detokenization, chat template, stop conditions, stream hold-back."""

import pytest

from scheduler_service.core.results import stop_at
from scheduler_service.core.sequence import FinishReason, Request, SamplingOptions, Sequence
from scheduler_service.text.output import SampleOutput
from scheduler_service.text.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def sample(prompt, **params):
    """A sample as the scheduler holds it: its stop ids are its own and (unless ignored)
    end-of-sequence 2.
    """
    request = Request(
        "r", prompt, SamplingOptions(max_tokens=params.pop("max_tokens", 100), **params)
    )
    request.stop_ids = frozenset(request.sampling.stop_token_ids) | (
        frozenset() if request.sampling.ignore_eos else {2}
    )
    return Sequence(0, request, 0)


def feed(seq, out, token):
    """One token as a step brings it: the scheduler's stop
    check (core/results.py), then the text's.
    """
    _, reason = stop_at(seq, (token,), max_model_len=512)
    seq.token_ids.append(token)
    if reason is not None:
        seq.finish(reason)
    return out.add_token(token)


def run(tok, text_out, **params):
    ids = tok.encode(text_out, add_special_tokens=False)
    seq = sample(tok.encode("prompt here", add_special_tokens=False), **params)
    out = SampleOutput(tok, seq)
    deltas = []
    for t in ids:
        delta, reason = feed(seq, out, t)
        deltas.append(delta)
        if reason:
            return deltas, reason, out
    return deltas, None, out


def test_incremental_detokenizer_matches_full_decode(tok):
    for text in [
        "the quick brown fox",
        "Paris is the capital of France.",
        "naïve café — ünïcode 日本 ✓",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("context", add_special_tokens=False))
        pieces = [detok.add(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)


def test_byte_level_detokenizer_streams_any_token_sequence_as_its_decode(tok):
    """Random ids (split multi-byte characters, invalid bytes, special tokens): the streamed text is
    the full decode, but for an incomplete character at the very end, which is held back, not sent
    as U+FFFD.
    """
    import random

    # the tiny tokenizer is byte-level BPE, like the default model's
    assert tok.token_bytes is not None
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, [])
        streamed = "".join(detok.add(i) for i in ids)
        full = tok.decode(ids)
        assert full.startswith(streamed) and set(full[len(streamed) :]) <= {"\ufffd"}
    detok = IncrementalDetokenizer(tok, [])
    euro = "€".encode()  # three bytes, three byte tokens: nothing until the last
    pieces = [detok.add(tok.hf.token_to_id(tok_str)) for tok_str in _byte_tokens(euro)]
    assert pieces == ["", "", "€"]


def _byte_tokens(data: bytes) -> list[str]:
    """The single-character byte-level token of each byte of data."""
    from scheduler_service.text.tokenizer import _gpt2_byte_decoder

    to_char = {b: ch for ch, b in _gpt2_byte_decoder().items()}
    return [to_char[b] for b in data]


def test_other_decoders_stream_through_decode_stream(tmp_path):
    """A SentencePiece-style tokenizer (Metaspace: "▁" for spaces) has no byte table; its deltas
    come from DecodeStream and still add up to the decode.
    """
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog " * 20],
        trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False),
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    sp = Tokenizer(tmp_path)
    assert sp.token_bytes is None
    ids = sp.encode("the lazy fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp, sp.encode("over", add_special_tokens=False))
    assert "".join(detok.add(i) for i in ids).strip() == sp.decode(ids) == "the lazy fox jumps"


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
    seq = sample([5], max_tokens=10)
    assert feed(seq, SampleOutput(tok, seq), 2)[1] is FinishReason.STOP
    seq = sample([5], max_tokens=10, ignore_eos=True)
    assert feed(seq, SampleOutput(tok, seq), 2)[1] is None


def test_max_tokens_is_length(tok):
    deltas, reason, _ = run(tok, "the quick brown fox jumps over the lazy dog", max_tokens=3)
    assert reason is FinishReason.LENGTH and len(deltas) == 3
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_sample(tok):
    deltas, reason, out = run(tok, "the quick brown fox jumps over", stop=("fox", "brown"))
    assert (
        reason is FinishReason.STOP
        and deltas[-1].stop_reason == "brown"
        and out.text == "the quick "
    )
    ids = tok.encode(" fox jumps", add_special_tokens=False)
    deltas, _, _ = run(tok, "the quick brown fox jumps", stop_token_ids=(ids[0],))
    assert deltas[-1].stop_reason == ids[0]
    seq = sample([5], max_tokens=10)  # end of sequence: no stop_reason
    delta, reason = feed(seq, SampleOutput(tok, seq), 2)
    assert reason is FinishReason.STOP and delta.stop_reason is None
    deltas, reason, _ = run(tok, "the quick brown fox", max_tokens=2)
    assert reason is FinishReason.LENGTH and deltas[-1].stop_reason is None


def test_include_stop_str_in_output_keeps_the_stop_string(tok):
    deltas, reason, out = run(
        tok, "paged attention stores keys", stop=("on sto",), include_stop_str_in_output=True
    )
    assert reason is FinishReason.STOP and out.text == "paged attention sto"
    assert "".join(d.text for d in deltas) == "paged attention sto"


def test_special_tokens_are_in_the_text_only_when_asked(tok):
    eos = tok.hf.token_to_id("</s>")
    ids = (
        tok.encode("the fox", add_special_tokens=False)
        + [eos]
        + tok.encode(" dog", add_special_tokens=False)
    )
    for skip, expected in ((True, "the fox dog"), (False, "the fox</s> dog")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert (
            "".join(detok.add(i) for i in ids)
            == expected
            == tok.decode(ids, skip_special_tokens=skip)
        )


def test_chat_template_renders_messages_tools_and_continuation(tmp_path):
    import json
    import shutil

    from tests.support.tiny import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "m", seed=1)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if tools %}<s>tools: {{ tools | map(attribute='function') | map(attribute='name') "
        "| join(',') }}</s>{% endif %}{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}</s>"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
        "{% if greeting %}{{ greeting }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert t.apply_chat_template(messages) == "<s>system: be brief</s><s>user: hi</s><s>assistant:"
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert t.apply_chat_template(messages, tools=tools, add_generation_prompt=False).startswith(
        "<s>tools: get_weather</s>"
    )
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": {"city": "Zürich", "a": 1}},
        }
    ]
    text = t.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": calls}], False)
    # transformers' tojson: key order and non-ASCII kept
    assert '{"city": "Zürich", "a": 1}' in text
    cont = t.apply_chat_template(
        [*messages, {"role": "assistant", "content": "The answer is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.endswith("<s>assistant: The answer is")
    assert t.apply_chat_template(messages, template_kwargs={"greeting": "hey"}).endswith("hey")
    with pytest.raises(ValueError, match="exclude"):
        t.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    shutil.rmtree(folder)
