"""Logprobs, penalties, biases, min_p, min_tokens and structured output through the whole server.

On the default model (the references are transformers' own forward and generate) and on the tiny
model (validation, and controls whose effect on any model is certain).
"""

import json
import math

import grpc
import jsonschema
import pytest
import torch

from protos import generation_pb2
from tests.support.default_model import MODEL_DIR, PERSON, has_model
from tests.support.tiny import load_hf_cached

pytestmark = pytest.mark.slow

SP = generation_pb2.SamplingParams


@pytest.fixture(scope="module")
def real(server_factory):
    # fp32 activations: these tests hold logprobs to transformers' within 2e-3; the default 16-bit
    # rounding of the packed kernel moves a logprob by ~1e-3 on average (test_quantized holds that
    # path to the dequantized model's greedy answers and logprobs)
    # transformers' fp32 arithmetic, prompts too
    return server_factory(
        MODEL_DIR,
        "--kv-cache-memory",
        "192MiB",
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "256",
        "--quantized-activations",
        "fp32",
        "--quantized-prefill",
        "dense",
    )


@pytest.fixture(scope="module")
def tiny(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "128",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )


def hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits at every position of ids: [len(ids), vocab]."""
    model = load_hf_cached(str(folder))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def chat_ids(text: str) -> list[int]:
    from scheduler_service.text.tokenizer import Tokenizer

    return Tokenizer(MODEL_DIR).encode_prompt(text, raw=False)


# --- logprobs -------------------------------------------------------------------------------------
@has_model
@pytest.mark.real_model
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_transformers_log_softmax_of_the_tokens_drawn(real, temperature):
    prompt = chat_ids("Write one sentence about the sea.")
    resp = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=SP(
                max_tokens=12,
                temperature=temperature,
                seed=3,
                logprobs=5,
                prompt_logprobs=2,
                ignore_eos=True,
            ),
        ),
        timeout=120,
    )
    choice = resp.choices[0]
    assert len(choice.logprobs) == len(choice.token_ids) == 12
    ref = hf_logprobs(MODEL_DIR, prompt + list(choice.token_ids))
    for i, (token, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=2e-3)
        assert [t.token_id for t in lp.top_logprobs][:2] == row.topk(5).indices.tolist()[:2]
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(
            row.topk(5).values.tolist(), abs=2e-3
        )
        assert all(
            a.logprob >= b.logprob
            for a, b in zip(lp.top_logprobs, lp.top_logprobs[1:], strict=False)
        )
        if temperature == 0.0:  # greedy draws the most likely token: its logprob is the top one
            assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-5)
    # the prompt: one entry per token from the second, with its own log-probability and the top 2
    assert [p.token_id for p in resp.prompt_logprobs] == prompt[1:]
    for j, p in enumerate(resp.prompt_logprobs, start=1):
        assert p.logprob == pytest.approx(float(ref[j - 1][prompt[j]]), abs=2e-3)
        assert len(p.top_logprobs) == 2


@has_model
@pytest.mark.real_model
def test_streamed_logprobs_match_the_unary_ones(real):
    req = generation_pb2.GenerateRequest(
        prompt="Count to five.", sampling=SP(max_tokens=8, logprobs=0, prompt_logprobs=1)
    )
    unary = real.stub.Generate(req, timeout=120)
    whole = unary.choices[0]
    messages = list(real.stub.GenerateStream(req, timeout=120))
    streamed = [lp for m in messages for lp in m.logprobs]
    assert [len(m.prompt_logprobs) for m in messages][0] == len(unary.prompt_logprobs) > 0
    assert all(len(m.prompt_logprobs) == 0 for m in messages[1:])  # on the first message only
    assert [p.logprob for p in messages[0].prompt_logprobs] == pytest.approx(
        [p.logprob for p in unary.prompt_logprobs], abs=1e-6
    )
    assert [lp.token_id for lp in streamed] == list(whole.token_ids)
    assert [lp.logprob for lp in streamed] == pytest.approx(
        [lp.logprob for lp in whole.logprobs], abs=1e-6
    )
    assert all(len(lp.top_logprobs) == 0 for lp in streamed)  # K = 0: the drawn token's alone


# --- penalties ------------------------------------------------------------------------------------
@has_model
@pytest.mark.real_model
def test_greedy_repetition_penalty_equals_transformers_generate(real):
    from transformers import AutoModelForCausalLM

    prompt = chat_ids("List the days of the week, again and again.")
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR)).eval()
    for penalty in (1.3, 0.8):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :]
        resp = real.stub.Generate(
            generation_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=SP(max_tokens=24, repetition_penalty=penalty, ignore_eos=True),
            ),
            timeout=120,
        )
        assert list(resp.choices[0].token_ids) == ref.tolist(), penalty
    plain = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=SP(max_tokens=24, ignore_eos=True)
        ),
        timeout=120,
    )
    # the penalty did change what greedy picks
    assert list(plain.choices[0].token_ids) != ref.tolist()


@pytest.mark.parametrize(
    "control",
    [dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=1.5)],
)
def test_penalties_change_greedy_exactly_where_a_token_would_repeat(tiny, control):
    """The tiny model's plain greedy output repeats a token; a penalized one agrees with it up to
    that token and takes another there: the penalty reads the right context, the right tokens, no
    others.
    """

    def run(**kw):
        return list(
            tiny.stub.Generate(
                generation_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], sampling=SP(max_tokens=24, ignore_eos=True, **kw)
                ),
                timeout=60,
            )
            .choices[0]
            .token_ids
        )

    plain = run()
    repeat = next(i for i, t in enumerate(plain) if t in plain[:i])
    penalized = run(**control)
    assert penalized[:repeat] == plain[:repeat]
    assert penalized[repeat] != plain[repeat] and penalized[repeat] not in penalized[:repeat]


def test_logit_bias_and_min_p_and_seeded_sampling_with_controls_replays(tiny):
    forced = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[9, 9, 9],
            sampling=SP(
                max_tokens=6, temperature=1.0, seed=1, logit_bias={42: 100.0}, ignore_eos=True
            ),
        ),
        timeout=60,
    )
    assert list(forced.choices[0].token_ids) == [42] * 6
    # min_p = 1 keeps only the most likely token: sampling at any temperature is greedy
    greedy = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[4, 8, 15, 16], sampling=SP(max_tokens=10, ignore_eos=True)
        ),
        timeout=60,
    )
    min_p = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[4, 8, 15, 16],
            sampling=SP(max_tokens=10, temperature=1.5, seed=5, min_p=1.0, ignore_eos=True),
        ),
        timeout=60,
    )
    assert list(min_p.choices[0].token_ids) == list(greedy.choices[0].token_ids)
    # every control at once, sampled: the same seed draws the same tokens again
    req = generation_pb2.GenerateRequest(
        prompt_token_ids=[3, 1, 4, 1, 5],
        sampling=SP(
            max_tokens=20,
            temperature=0.8,
            seed=77,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            min_p=0.05,
            logit_bias={7: 2.0, 8: -100.0},
            n=2,
            top_k=40,
            ignore_eos=True,
        ),
    )
    first = tiny.stub.Generate(req, timeout=60)
    again = tiny.stub.Generate(req, timeout=60)
    assert [list(c.token_ids) for c in first.choices] == [list(c.token_ids) for c in again.choices]
    assert all(8 not in c.token_ids for c in first.choices)


def test_min_tokens_holds_off_stop_ids_and_stop_strings(tiny):
    base = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[20, 21, 22], sampling=SP(max_tokens=12, ignore_eos=True)
        ),
        timeout=60,
    ).choices[0]
    first = base.token_ids[0]
    stopped = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[20, 21, 22],
            sampling=SP(max_tokens=12, stop_token_ids=[first], ignore_eos=True),
        ),
        timeout=60,
    ).choices[0]
    assert list(stopped.token_ids) == [first] and stopped.finish_reason == generation_pb2.STOP
    held = tiny.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt_token_ids=[20, 21, 22],
            sampling=SP(max_tokens=12, min_tokens=5, stop_token_ids=[first], ignore_eos=True),
        ),
        timeout=60,
    ).choices[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]
    if base.text:  # a stop string that the plain output starts with is ignored before min_tokens
        piece = base.text[:1]
        text = tiny.stub.Generate(
            generation_pb2.GenerateRequest(
                prompt_token_ids=[20, 21, 22],
                sampling=SP(max_tokens=12, stop=[piece], ignore_eos=True),
            ),
            timeout=60,
        ).choices[0]
        assert text.text == "" and text.finish_reason == generation_pb2.STOP


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("logprobs", 21, "logprobs must lie in [0, 20]"),
        ("prompt_logprobs", 100, "prompt_logprobs must lie in [0, 20]"),
        ("repetition_penalty", 0.0, "repetition_penalty must lie in (0, 2]"),
        ("repetition_penalty", float("nan"), "repetition_penalty"),
        ("presence_penalty", 2.5, "presence_penalty must lie in [-2, 2]"),
        ("frequency_penalty", -3.0, "frequency_penalty must lie in [-2, 2]"),
        ("min_p", 1.5, "min_p must lie in [0, 1]"),
        ("min_tokens", 50, "min_tokens (50) is more than max_tokens (10)"),
        ("logit_bias", {100000: 1.0}, "outside the vocabulary"),
        ("logit_bias", {3: 101.0}, "must lie in [-100, 100]"),
        ("json_schema", "{not json", "json_schema is not valid JSON"),
        ("json_schema", '{"type": "nonsense"}', "json_schema is not valid"),
        ("regex", "a(b", "regex is not valid"),
        ("grammar", "start: undefined_rule", "grammar is not valid"),
    ],
)
def test_bad_controls_are_invalid_argument_with_a_message(tiny, field, value, message):
    params = SP(max_tokens=10)
    if field == "logit_bias":
        params.logit_bias.update(value)
    else:
        setattr(params, field, value)
    with pytest.raises(grpc.RpcError) as err:
        tiny.stub.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=params), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    both = SP(max_tokens=10, regex="a+", json_schema='{"type": "integer"}')
    with pytest.raises(grpc.RpcError, match="at most one of json_schema, regex and grammar"):
        tiny.stub.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=both), timeout=60
        )
    assert tiny.stats().num_free_blocks + tiny.stats().num_cached_blocks == tiny.stats().num_blocks


@has_model
@pytest.mark.real_model
@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 11), (1.2, 12)])
def test_json_schema_output_parses_and_validates(real, temperature, seed):
    resp = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="Describe a person as JSON.",
            sampling=SP(
                max_tokens=120,
                temperature=temperature,
                seed=seed,
                json_schema=json.dumps(PERSON),
                n=2,
            ),
        ),
        timeout=180,
    )
    for choice in resp.choices:
        assert choice.finish_reason == generation_pb2.STOP, choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


@has_model
@pytest.mark.real_model
def test_regex_and_grammar_and_a_structure_that_cannot_finish(real):
    date = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="When was the moon landing?",
            sampling=SP(max_tokens=30, regex=r"(19|20)\d\d-[01]\d-[0-3]\d"),
        ),
        timeout=120,
    ).choices[0]
    import re

    assert (
        re.fullmatch(r"(19|20)\d\d-[01]\d-[0-3]\d", date.text)
        and date.finish_reason == generation_pb2.STOP
    )
    yes_no = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="Is the sky blue?",
            sampling=SP(
                max_tokens=10, temperature=1.0, seed=2, grammar='start: ("yes" | "no") "."'
            ),
        ),
        timeout=120,
    ).choices[0]
    assert yes_no.text in ("yes.", "no.") and yes_no.finish_reason == generation_pb2.STOP
    # 40 digits cannot fit 5 tokens: LENGTH, never STOP with incomplete text
    short = real.stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="Digits please.", sampling=SP(max_tokens=5, regex=r"\d{40}")
        ),
        timeout=120,
    ).choices[0]
    assert short.finish_reason == generation_pb2.LENGTH and len(short.token_ids) == 5
    assert short.text.isdigit() and len(short.text) < 40


@has_model
@pytest.mark.real_model
def test_constrained_and_free_requests_share_steps(real):
    """Constrained rows run beside free ones in the same batches; both stay right."""
    from concurrent.futures import ThreadPoolExecutor

    def constrained(i):
        return real.stub.Generate(
            generation_pb2.GenerateRequest(
                prompt=f"Person number {i} as JSON.",
                sampling=SP(
                    max_tokens=120, temperature=0.7, seed=i, json_schema=json.dumps(PERSON)
                ),
            ),
            timeout=180,
        )

    def free(i):
        return real.stub.Generate(
            generation_pb2.GenerateRequest(
                prompt=f"Tell me a fact about the number {i}.",
                sampling=SP(max_tokens=30, logprobs=1),
            ),
            timeout=180,
        )

    with ThreadPoolExecutor(8) as pool:
        shaped = list(pool.map(constrained, range(4)))
        loose = list(pool.map(free, range(4)))
    for r in shaped:
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    for r in loose:
        assert len(r.choices[0].logprobs) == len(r.choices[0].token_ids)
        assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in r.choices[0].logprobs)
