"""The wire codec: plans and results survive the trip through protobuf bytes exactly; wrong sizes
are refused.
"""

import numpy as np
import pytest

from protos import wire_pb2
from protos.codec import CodecError, PlanArrays, decode_plan, encode_plan, resolve_tokens
from protos.result_codec import decode_result, encode_result


def sample_plan(num_seqs=3, max_blocks=4, seed=0):
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, 6, num_seqs)
    t = int(q_lens.sum())
    return PlanArrays(
        step_id=int(rng.integers(1, 2**40)),
        token_ids=rng.integers(0, 50000, t, dtype=np.int32),
        positions=rng.integers(0, 4000, t, dtype=np.int32),
        slot_mapping=rng.integers(-1, 2**40, t, dtype=np.int64),  # slots past 2^31 need the int64
        block_tables=rng.integers(-1, 10000, (num_seqs, max_blocks), dtype=np.int32),
        seq_lens=rng.integers(1, 64, num_seqs, dtype=np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        do_sample=rng.integers(0, 2, num_seqs).astype(bool),
        sample_index=rng.integers(0, 100, num_seqs, dtype=np.int32),
        temperature=rng.random(num_seqs, dtype=np.float32),
        top_p=rng.random(num_seqs, dtype=np.float32),
        top_k=rng.integers(0, 50, num_seqs, dtype=np.int32),
        seed=rng.integers(0, 2**63, num_seqs, dtype=np.uint64) * 2
        + 1,  # uses the top bit of a uint64
        block_copies=rng.integers(0, 10000, (2, 2), dtype=np.int32),
        prev_step_id=int(rng.integers(1, 2**40)),
        prev_rows=rng.integers(-1, 8, t, dtype=np.int32),
    )


def with_controls(plan, seed=0):
    """Every request-control array filled (ragged ones with uneven rows)."""
    rng = np.random.default_rng(seed)
    s = plan.num_seqs
    plan.repetition_penalty = rng.uniform(0.5, 2, s).astype(np.float32)
    plan.presence_penalty = rng.uniform(-2, 2, s).astype(np.float32)
    plan.frequency_penalty = rng.uniform(-2, 2, s).astype(np.float32)
    plan.min_p = rng.random(s, dtype=np.float32)
    counts = rng.integers(0, 4, s)
    plan.bias_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    plan.bias_token_ids = rng.integers(0, 50000, int(counts.sum()), dtype=np.int32)
    plan.bias_values = np.where(
        rng.random(int(counts.sum())) < 0.3, -np.inf, rng.normal(size=int(counts.sum()))
    )
    plan.bias_values = plan.bias_values.astype(np.float32)
    plan.logprobs = rng.integers(-1, 21, s, dtype=np.int32)
    plan.prompt_logprobs = rng.integers(-1, 21, s, dtype=np.int32)
    plan.prompt_logprob_counts = rng.integers(0, 3, s, dtype=np.int32)
    plan.prompt_logprob_targets = rng.integers(
        0, 50000, int(plan.prompt_logprob_counts.sum()), dtype=np.int32
    )
    plan.mask_rows = rng.integers(-1, 2, s, dtype=np.int32)
    plan.token_bitmask = rng.integers(-(2**31), 2**31, (2, 1536), dtype=np.int32)
    return plan


@pytest.mark.parametrize("num_seqs,max_blocks", [(1, 1), (3, 4), (64, 17)])
@pytest.mark.parametrize("controls", [False, True])
def test_plan_round_trip_through_bytes_is_exact(num_seqs, max_blocks, controls):
    plan = sample_plan(num_seqs, max_blocks, seed=num_seqs)
    if controls:
        with_controls(plan, seed=num_seqs)
    wire = wire_pb2.StepPlan.FromString(encode_plan(plan).SerializeToString())
    back = decode_plan(wire)
    assert back.step_id == plan.step_id and (back.num_seqs, back.num_tokens) == (
        plan.num_seqs,
        plan.num_tokens,
    )
    assert back.prev_step_id == plan.prev_step_id and back.mask_follows == plan.mask_follows
    for name in PlanArrays.__dataclass_fields__:
        if name not in ("step_id", "prev_step_id", "mask_follows"):
            a, b = getattr(plan, name), getattr(back, name)
            if a is None:  # an unused control stays unused (a ragged one comes back empty)
                assert b is None or b.size == 0, name
                continue
            assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_pending_tokens_come_from_the_previous_steps_rows_and_nowhere_else():
    plan = sample_plan(4, 2, seed=3)
    plan.prev_step_id = 41
    plan.prev_rows = np.full(plan.num_tokens, -1, dtype=np.int32)
    plan.prev_rows[[0, plan.num_tokens - 1]] = [2, 0]
    back = decode_plan(encode_plan(plan))
    last = np.array([11, -1, 22], dtype=np.int32)
    tokens = resolve_tokens(back, 41, last)
    assert tokens[0] == 22 and tokens[-1] == 11
    assert np.array_equal(tokens[1:-1], plan.token_ids[1:-1])
    with pytest.raises(CodecError, match="step 41"):  # a worker whose last step was another one
        resolve_tokens(back, 40, last)
    # a worker that has no tokens (its last step failed)
    with pytest.raises(CodecError, match="step 41"):
        resolve_tokens(back, 41, None)
    plan.prev_rows[0] = 1  # a row that sampled nothing
    with pytest.raises(CodecError, match="sampled no token"):
        resolve_tokens(decode_plan(encode_plan(plan)), 41, last)
    plan.prev_rows = None  # no pending tokens: no prev_rows on the wire, tokens as sent
    assert encode_plan(plan).prev_rows == b""
    assert resolve_tokens(decode_plan(encode_plan(plan)), 0, None) is not None


def test_a_plan_with_a_wrong_sized_array_is_refused():
    wire = encode_plan(sample_plan())
    wire.seed = wire.seed[:-1]
    with pytest.raises(CodecError, match="seed"):
        decode_plan(wire)
    wire = encode_plan(sample_plan())
    wire.block_copies = b"\x00" * 12
    with pytest.raises(CodecError, match="pairs"):
        decode_plan(wire)


def test_result_round_trip_and_count_check():
    tokens = np.array([5, -1, 49151], dtype=np.int32)
    msg = wire_pb2.StepResult.FromString(
        encode_result(7, tokens, time_forward=0.5).SerializeToString()
    )
    assert msg.step_id == 7 and msg.time_forward == 0.5
    assert decode_result(msg, 3).tolist() == [5, -1, 49151]
    with pytest.raises(CodecError, match="2 sequences"):
        decode_result(msg, 2)


def test_logprobs_round_trip_and_wrong_counts_are_refused():
    from protos.result_codec import Logprobs, decode_logprobs

    lp = Logprobs(
        np.array([-0.5, -3.25], np.float32),
        np.array([7, 8, 9], np.int32),
        np.array([-0.1, -0.2, -0.3], np.float32),
    )
    msg = wire_pb2.StepResult.FromString(
        encode_result(
            5, np.array([1, 2], np.int32), logprobs=lp, prompt_logprobs=lp
        ).SerializeToString()
    )
    for which in ("logprobs", "prompt_logprobs"):
        back = decode_logprobs(msg, which, 2, 3)
        assert np.array_equal(back.chosen, lp.chosen) and np.array_equal(back.top_ids, lp.top_ids)
        assert np.array_equal(back.top_values, lp.top_values)
    assert decode_logprobs(msg, "logprobs", 0, 0) is None  # the plan asked for none
    with pytest.raises(CodecError, match="top_token_ids"):
        decode_logprobs(msg, "logprobs", 2, 4)
    with pytest.raises(CodecError, match="logprobs"):
        decode_logprobs(msg, "logprobs", 3, 3)


def test_ragged_controls_of_the_wrong_size_are_refused():
    plan = with_controls(sample_plan(3, 2, seed=1), seed=1)
    wire = encode_plan(plan)
    wire.repetition_penalty = wire.repetition_penalty[:-4]
    with pytest.raises(CodecError, match="repetition_penalty"):
        decode_plan(wire)
    wire = encode_plan(plan)
    wire.bitmask_words = 7
    with pytest.raises(CodecError, match="token_bitmask"):
        decode_plan(wire)
