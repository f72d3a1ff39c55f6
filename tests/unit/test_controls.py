"""The worker's batched request controls against a plain per-row reference, and the plan's control
arrays.
"""

import numpy as np
import pytest
import torch

from protos.codec import PlanArrays
from worker.model.config import ModelConfig
from worker.model.kv_pool import KVPool
from worker.step.controls import apply_controls, gather_controls, top_logprobs, unpack_bitmask
from worker.step.plan_checks import PlanError, validate_controls
from worker.step.sampler import SamplingBatch, sample

VOCAB, BS = 50, 4


def pool_with(contexts: list[list[int]], num_blocks=32, seed=0):
    """A pool whose token record holds each context in scattered blocks; returns (pool, block
    tables).
    """
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    pool = KVPool(cfg, num_blocks, BS, torch.float32, torch.device("cpu"))
    free = list(np.random.default_rng(seed).permutation(num_blocks))
    width = max(-(-len(c) // BS) for c in contexts)
    tables = np.full((len(contexts), width), -1, dtype=np.int32)
    for r, ctx in enumerate(contexts):
        blocks = [free.pop() for _ in range(-(-len(ctx) // BS))]
        tables[r, : len(blocks)] = blocks
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(len(ctx))])
        pool.record_tokens(slots, torch.tensor(ctx))
    pool.record_tokens(torch.tensor([-1, -1]), torch.tensor([3, 4]))  # writes nothing
    return pool, tables


def reference(logits, contexts, prompt_lens, rep, pres, freq, bias, masks):
    """The controls one row at a time, as the docstrings say."""
    out = logits.clone()
    for r in range(out.shape[0]):
        for t, v in bias.get(r, []):
            out[r, t] += v
        if r in masks:
            out[r, [t for t in range(VOCAB) if t not in masks[r]]] = float("-inf")
        for t in set(contexts[r]):
            if rep[r] != 1.0:
                out[r, t] = out[r, t] / rep[r] if out[r, t] > 0 else out[r, t] * rep[r]
        generated = contexts[r][prompt_lens[r] :]
        for t in set(generated):
            out[r, t] -= freq[r] * generated.count(t) + pres[r]
    return out


def test_batched_controls_equal_the_per_row_reference():
    rng = np.random.default_rng(1)
    contexts = [list(rng.integers(0, VOCAB, n)) for n in (3, 9, 14, 1, 7)]
    prompt_lens = [3, 4, 10, 1, 2]
    pool, tables = pool_with(contexts)
    s = len(contexts)
    rep = np.array([1.3, 1.0, 0.7, 1.0, 2.0], np.float32)
    pres = np.array([0.0, 0.5, -1.0, 0.0, 2.0], np.float32)
    freq = np.array([0.0, 1.5, 0.25, 0.0, -2.0], np.float32)
    bias = {0: [(5, 3.0), (7, -100.0)], 2: [(1, float("-inf"))], 4: [(5, 1.0), (6, 2.0), (0, -1.0)]}
    allowed = {1: {2, 3, 5, 40}, 4: {0, 5, 6, 49}}
    bitmask = np.zeros((2, 2), dtype=np.uint32)
    for i, r in enumerate((1, 4)):
        for t in allowed[r]:
            bitmask[i, t // 32] |= np.uint32(1 << (t % 32))
    offsets = np.zeros(s + 1, np.int32)
    for r in range(s):
        offsets[r + 1] = offsets[r] + len(bias.get(r, []))
    lens = np.array([len(c) for c in contexts], np.int32)
    plan = PlanArrays(
        step_id=1,
        token_ids=np.zeros(s, np.int32),
        positions=lens - 1,
        slot_mapping=np.zeros(s, np.int64),
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=np.arange(s + 1, dtype=np.int32),
        do_sample=np.ones(s, bool),
        sample_index=lens - np.array(prompt_lens, np.int32),
        temperature=np.zeros(s, np.float32),
        top_p=np.ones(s, np.float32),
        top_k=np.zeros(s, np.int32),
        seed=np.zeros(s, np.uint64),
        block_copies=np.zeros((0, 2), np.int32),
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        bias_offsets=offsets,
        bias_token_ids=np.array([t for r in range(s) for t, _ in bias.get(r, [])], np.int32),
        bias_values=np.array([v for r in range(s) for _, v in bias.get(r, [])], np.float32),
        mask_rows=np.array([-1, 0, -1, -1, 1], np.int32),
        token_bitmask=bitmask.view(np.int32),
    )
    validate_controls(plan, np.ones(s, np.int64), VOCAB)
    logits = torch.randn(s, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    rows = np.arange(s)
    got = apply_controls(
        logits, gather_controls(plan, rows, torch.from_numpy(tables), torch.device("cpu")), pool
    )
    want = reference(logits, contexts, prompt_lens, rep, pres, freq, bias, allowed)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)  # the raw logits are left as they were (logprobs read them)
    # a subset of rows sampling: each gets its own controls, nothing of the others'
    some = np.array([1, 4])
    got = apply_controls(
        logits[some],
        gather_controls(plan, some, torch.from_numpy(tables), torch.device("cpu")),
        pool,
    )
    torch.testing.assert_close(got, want[some])


def test_a_row_its_controls_leave_without_any_token_falls_back_to_its_raw_logits():
    pool, tables = pool_with([[1, 2]])
    logits = torch.randn(1, VOCAB)
    # nothing allowed
    plan = PlanArrays(
        step_id=1,
        token_ids=np.zeros(1, np.int32),
        positions=np.ones(1, np.int32),
        slot_mapping=np.zeros(1, np.int64),
        block_tables=tables,
        seq_lens=np.array([2], np.int32),
        query_start_loc=np.array([0, 1], np.int32),
        do_sample=np.ones(1, bool),
        sample_index=np.zeros(1, np.int32),
        temperature=np.zeros(1, np.float32),
        top_p=np.ones(1, np.float32),
        top_k=np.zeros(1, np.int32),
        seed=np.zeros(1, np.uint64),
        block_copies=np.zeros((0, 2), np.int32),
        mask_rows=np.zeros(1, np.int32),
        token_bitmask=np.zeros((1, 2), np.int32),
    )
    got = apply_controls(
        logits,
        gather_controls(plan, np.arange(1), torch.from_numpy(tables), torch.device("cpu")),
        pool,
    )
    assert torch.equal(got, logits)


def test_copy_on_write_copies_the_token_record_with_the_kv():
    pool, tables = pool_with([[7, 8, 9, 10, 11]])
    src = int(tables[0, 1])
    dst = next(b for b in range(32) if b not in tables[0])
    pool.copy_blocks(torch.tensor([[src, dst]]))
    assert pool.tokens[dst].tolist() == pool.tokens[src].tolist() == [11, -1, -1, -1]


def test_unpack_bitmask_reads_bit_v_mod_32_of_word_v_div_32():
    words = np.zeros((1, 3), np.uint32)
    for t in (0, 31, 32, 63, 70):
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    allowed = unpack_bitmask(torch.from_numpy(words.view(np.int32)), 80)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 31, 32, 63, 70]
    # short mask: rest off
    assert unpack_bitmask(torch.from_numpy(words.view(np.int32)), 100).shape == (1, 100)


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    drawn = set()
    for seed in range(200):
        batch = SamplingBatch(
            temperature=torch.tensor([1.0]),
            top_p=torch.tensor([1.0]),
            top_k=torch.tensor([0]),
            seeds=[seed],
            sample_index=[0],
            min_p=torch.tensor([0.25]),
        )
        drawn.add(int(sample(logits, batch)[0]))
    assert drawn == {0, 1}  # 0.1 < 0.25 x 0.5


def test_top_logprobs_flattens_each_rows_own_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 5.0]])
    lp = top_logprobs(logits, torch.tensor([0, 0, 3]), np.array([2, 0, 3]))
    ref = torch.log_softmax(logits, -1)
    assert lp.chosen.tolist() == pytest.approx(
        [ref[0, 0].item(), ref[1, 0].item(), ref[2, 3].item()]
    )
    assert (
        lp.top_ids.tolist()[:2] == [3, 2] and lp.top_ids.tolist()[2] == 3 and len(lp.top_ids) == 5
    )


def decode_rows(n: int) -> PlanArrays:
    """A plan of n one-token rows at position 0, each sampling greedily."""
    return PlanArrays(
        step_id=1,
        token_ids=np.zeros(n, np.int32),
        positions=np.zeros(n, np.int32),
        slot_mapping=np.zeros(n, np.int64),
        block_tables=np.zeros((n, 1), np.int32),
        seq_lens=np.ones(n, np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        do_sample=np.ones(n, bool),
        sample_index=np.zeros(n, np.int32),
        temperature=np.zeros(n, np.float32),
        top_p=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        seed=np.zeros(n, np.uint64),
        block_copies=np.zeros((0, 2), np.int32),
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("repetition_penalty", np.array([0.0], np.float32), "repetition_penalty must be > 0"),
        ("min_p", np.array([1.5], np.float32), "min_p"),
        ("logprobs", np.array([99], np.int32), "logprobs must lie"),
        ("mask_rows", np.array([3], np.int32), "mask_rows"),
        ("bias_offsets", np.array([0, 5], np.int32), "bias_offsets"),
    ],
)
def test_malformed_control_arrays_are_refused(field, value, message):
    plan = decode_rows(1)
    if field == "repetition_penalty":
        plan.presence_penalty = plan.frequency_penalty = np.zeros(1, np.float32)
    if field == "bias_offsets":
        plan.bias_token_ids, plan.bias_values = np.array([1], np.int32), np.array([1.0], np.float32)
    setattr(plan, field, value)
    with pytest.raises(PlanError, match=message):
        validate_controls(plan, np.ones(1, np.int64), VOCAB)


def test_a_drafting_rows_positions_take_its_masks_in_turn_and_its_biases_each():
    """In a drafting step a row repeats once a drafted position (worker/step/speculation.py): each
    repeat gets the row's biases and its own position's mask, the masks of the row following one
    another.
    """
    pool, tables = pool_with([[1, 2, 3], [4, 5]])
    bitmask = np.arange(4 * 2, dtype=np.int32).reshape(4, 2)  # four distinct masks
    plan = PlanArrays(
        step_id=1,
        token_ids=np.zeros(4, np.int32),
        positions=np.array([0, 1, 2, 1], np.int32),
        slot_mapping=np.zeros(4, np.int64),
        block_tables=tables,
        seq_lens=np.array([3, 2], np.int32),
        query_start_loc=np.array([0, 3, 4], np.int32),
        do_sample=np.ones(2, bool),
        sample_index=np.array([2, 1], np.int32),
        temperature=np.zeros(2, np.float32),
        top_p=np.ones(2, np.float32),
        top_k=np.zeros(2, np.int32),
        seed=np.zeros(2, np.uint64),
        block_copies=np.zeros((0, 2), np.int32),
        bias_offsets=np.array([0, 1, 1], np.int32),
        bias_token_ids=np.array([5], np.int32),
        bias_values=np.array([2.0], np.float32),
        mask_rows=np.array([0, 3], np.int32),
        token_bitmask=bitmask,
        num_draft=np.array([2, 0], np.int32),
    )
    c = gather_controls(
        plan,
        np.array([0, 0, 0, 1]),
        torch.from_numpy(tables),
        torch.device("cpu"),
        offsets=np.array([0, 1, 2, 0]),
    )
    assert c.mask_rows.tolist() == [0, 1, 2, 3] and torch.equal(
        c.bitmask, torch.from_numpy(bitmask)
    )
    assert c.bias_rows.tolist() == [0, 1, 2] and c.bias_ids.tolist() == [5, 5, 5]


def test_a_hybrids_plan_gives_each_row_its_own_state_slot():
    from worker.step.plan_checks import validate_states

    plan = decode_rows(2)
    with pytest.raises(PlanError, match="must give each row a state slot"):
        validate_states(plan, 4)
    for slots, message in (([1, 1], "distinct"), ([0, 4], r"in \[0, 4\)"), ([-1, 0], "distinct")):
        plan.state_slots = np.array(slots, np.int32)
        with pytest.raises(PlanError, match=message):
            validate_states(plan, 4)
    plan.state_slots = np.array([3, 0], np.int32)
    validate_states(plan, 4)
    with pytest.raises(PlanError, match="keeps no recurrent state"):
        validate_states(plan, 0)
    plan.num_draft = np.array([0, 2], np.int32)
    with pytest.raises(PlanError, match="cannot draft"):
        validate_states(plan, 4)


def test_a_hybrids_snapshots_copy_into_resuming_rows_and_save_inside_rows():
    from worker.step.plan_checks import validate_states

    plan = decode_rows(2)
    plan.state_slots = np.array([3, 0], np.int32)
    plan.positions = np.array([0, 8], np.int32)  # row 0 starts afresh, row 1 resumes at 8
    # a snapshot read before the forward may be overwritten in it
    good = [
        (np.array([5, 0]), None),
        (None, np.array([0, 1, 6])),
        (np.array([5, 0]), np.array([1, 1, 5])),
    ]
    for copies, saves in good:
        plan.state_copies, plan.state_saves = copies, saves
        validate_states(plan, 8)
    bad = (
        (np.array([5]), None, "pairs"),
        (np.array([5, 3]), None, "resuming row's slot"),  # row 0 is not resuming
        (np.array([0, 0]), None, "from a snapshot slot"),  # a live state is no snapshot
        (np.array([9, 0]), None, "from a snapshot slot"),
        (np.array([5, 0, 6, 0]), None, "once"),
        (None, np.array([0, 2, 6]), "outside it"),  # row 0 has one token
        (None, np.array([2, 1, 6]), "outside it"),
        (None, np.array([0, 1, 3]), "which a row runs in"),
        (np.array([5, 0]), np.array([1, 1, 0]), "once"),
    )
    for copies, saves, message in bad:
        plan.state_copies, plan.state_saves = copies, saves
        with pytest.raises(PlanError, match=message):
            validate_states(plan, 8)
