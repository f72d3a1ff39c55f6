"""The sampler: greedy, temperature, top-k, top-p, and per-request
seeds that make draws repeatable.
"""

import pytest
import torch

from worker.step.sampler import SamplingBatch, mix_seed, sample


def batch(rows, temperature=1.0, top_p=1.0, top_k=0, seeds=None, index=None):
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_p=torch.full((rows,), top_p),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        seeds=seeds or list(range(rows)),
        sample_index=index or [0] * rows,
    )


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, batch(5, temperature=0.0)), logits.argmax(-1))


def test_same_seed_and_index_give_the_same_token_different_index_varies():
    logits = torch.zeros(1, 1000)  # uniform: any token is possible
    a = [int(sample(logits, batch(1, seeds=[42], index=[i]))) for i in range(20)]
    b = [int(sample(logits, batch(1, seeds=[42], index=[i]))) for i in range(20)]
    c = [int(sample(logits, batch(1, seeds=[43], index=[i]))) for i in range(20)]
    assert a == b
    assert a != c
    assert len(set(a)) > 10


def test_rows_do_not_share_random_streams():
    logits = torch.zeros(3, 1000)
    together = sample(logits, batch(3, seeds=[1, 2, 3], index=[5, 5, 5])).tolist()
    alone = [
        int(sample(logits[i : i + 1], batch(1, seeds=[s], index=[5])))
        for i, s in enumerate([1, 2, 3])
    ]
    assert together == alone  # a row's draw does not depend on what else is in the batch


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, batch(4, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, batch(4, top_p=1e-6)), logits.argmax(-1))


def test_top_k_and_top_p_only_draw_from_the_allowed_set():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    drawn_k = {int(sample(logits, batch(1, top_k=2, seeds=[s]))) for s in range(200)}
    assert drawn_k == {0, 1}
    drawn_p = {int(sample(logits, batch(1, top_p=0.8, seeds=[s]))) for s in range(200)}
    assert drawn_p == {0, 1}  # 0.5 + 0.3 reaches 0.8: token 2 is outside the nucleus
    drawn_all = {int(sample(logits, batch(1, seeds=[s]))) for s in range(400)}
    assert drawn_all == {0, 1, 2, 3}


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    tokens = sample(logits, batch(4000, seeds=list(range(4000))))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(2000, 3).contiguous()
    cold = sample(logits, batch(2000, temperature=0.2, seeds=list(range(2000))))
    hot = sample(logits, batch(2000, temperature=2.0, seeds=list(range(2000))))
    assert (cold == 0).float().mean() > 0.95
    assert 0.3 < (hot == 0).float().mean() < 0.7


def test_mix_seed_spreads():
    seeds = {mix_seed(7, i) for i in range(1000)} | {mix_seed(i, 0) for i in range(100, 1100)}
    assert len(seeds) == 2000 and all(0 <= s < 2**63 for s in seeds)


def test_nan_and_inf_logits_never_yield_nan_draws():
    import pytest

    from worker.step.sampler import NonFiniteLogits

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    logits[0, :50] = float("nan")  # NaN never wins, greedy or sampled
    logits[1, 7] = float("inf")  # +inf always wins
    logits[2, ::2] = float("-inf")  # only odd tokens are possible
    for temperature in (0.0, 1e-38, 1e-6, 0.7, 5.0):
        for index in range(10):
            got = sample(logits, batch(4, temperature=temperature, index=[index] * 4)).tolist()
            assert got[0] >= 50 and got[1] == 7 and got[2] % 2 == 1 and 0 <= got[3] < 100
    tiny = sample(logits, batch(4, temperature=1e-38)).tolist()
    assert tiny == sample(logits, batch(4, temperature=0.0)).tolist()
    dead = torch.full((1, 10), float("nan"))
    with pytest.raises(NonFiniteLogits, match="no finite logits"):
        sample(dead, batch(1))


def test_counter_noise_is_splitmix64_of_key_and_position():
    """The batched generator computes, with wrapping int64 tensor arithmetic, exactly the 64-bit mix
    a plain integer reference does, so every device draws the same noise.
    """
    import math

    from worker.step.sampler import exponential_noise

    mask = (1 << 64) - 1

    def reference(key: int, v: int) -> float:
        z = (key + (v + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        return -math.log(((z >> 41) + 0.5) / (1 << 23))

    keys = [mix_seed(7, 0), mix_seed(7, 1), mix_seed(123456789, 99), (1 << 63) - 1]
    noise = exponential_noise(torch.tensor(keys, dtype=torch.int64), 50)
    for r, key in enumerate(keys):
        for v in (0, 1, 17, 49):
            assert abs(float(noise[r, v]) - reference(key, v)) < 1e-5 * max(1.0, reference(key, v))
    big = exponential_noise(torch.tensor([mix_seed(1, 2)]), 200_000)[0]
    assert abs(float(big.mean()) - 1.0) < 0.01 and abs(float(big.var()) - 1.0) < 0.03  # Exp(1)
    assert bool((big > 0).all()) and bool(torch.isfinite(big).all())


def test_no_draw_makes_a_filtered_token_win():
    """The largest uniform stays below 1, so the noise is never 0: a token of probability 0 (masked,
    top-k'd) never meets 0 / 0 = NaN, which argmax would take. Found with structured output: one
    draw in 2^24 per token had it.
    """
    from worker.step.sampler import UNIFORM_BITS, uniform_from_bits

    top = uniform_from_bits(torch.tensor([(1 << UNIFORM_BITS) - 1, 0]))
    assert float(top[0]) < 1.0 and float(top[1]) > 0.0
    assert bool((-torch.log(top) > 0).all())
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 3] = 0.0
    for seed in range(50):  # the one finite token, whatever the noise
        assert int(sample(logits, batch(1, seeds=[seed], index=[seed]))[0]) == 3


def test_sampler_takes_host_parameters_for_device_logits():
    """The batch's parameters come from the plan on the host; logits live on the worker's device.
    Rows are indexed on the device they index (on CUDA a host index into device logits, or the
    reverse, fails).
    """
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3))
    b = batch(6, seeds=[1, 2, 3, 4, 5, 6], index=[0, 1, 2, 3, 4, 5])
    b.temperature[::2] = 0.0  # mixed greedy and sampled rows
    on_gpu = sample(logits.cuda(), b)
    assert on_gpu.device.type == "cuda"
    # counter-based: the same draws on both
    assert on_gpu.cpu().tolist() == sample(logits, b).tolist()


def test_top_k_keeps_ties_with_the_kth_token_whatever_else_is_in_the_batch():
    """Top-k alone takes a partial selection, top-k beside top-p a full sort; both keep every token
    tied with the k-th largest, so a row's draw does not depend on its neighbours' parameters.
    """
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    alone, beside = [], []
    for seed in range(300):
        b = batch(2, seeds=[seed, 0], top_k=2)
        alone.append(int(sample(logits, b)[0]))
        b.top_p[1] = 0.5  # the other row turns on top-p: the sorted path
        beside.append(int(sample(logits, b)[0]))
    assert alone == beside  # draw for draw
    assert set(alone) == {0, 1, 2, 3}


def test_sampling_never_reads_the_device_back():
    """Every path (greedy, temperature, min-p, top-k, top-p) is chosen from the batch's host
    parameters: run on meta tensors, which have no values, any read of a device value on the host
    would raise.
    """
    from worker.step.sampler import sample_async

    logits = torch.empty(4, 300, device="meta")
    b = batch(4, seeds=[1, 2, 3, 4])
    b.temperature[0] = 0.0
    b.top_k[1] = 5
    b.top_p[2] = 0.9
    b.min_p = torch.tensor([0.0, 0.0, 0.1, 0.05])
    tokens = sample_async(logits, b)
    assert tokens.shape == (4,) and tokens.device.type == "meta"


def test_top_p_keeps_exactly_the_tokens_with_less_than_top_p_mass_above_them():
    """The floor found by bisection on the float bits equals the one a full sort gives, on rows of
    every shape: peaked, flat, with ties at the boundary (all tied tokens stay).
    """
    from kernels.reference import top_p_floor_torch

    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(1000, generator=g) * s for s in (0.1, 1.0, 4.0, 12.0)]
    rows.append(torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0] + [-30.0] * 995))  # ties around the boundary
    probs = torch.softmax(torch.stack(rows), dim=-1)
    for top_p in (1e-6, 0.3, 0.5, 0.9, 0.99, 0.999999):
        tp = torch.full((probs.shape[0],), top_p)
        floor = top_p_floor_torch(probs, tp)
        for r in range(probs.shape[0]):
            p = probs[r].double()
            above = torch.stack([p[p > x].sum() for x in p])  # mass strictly above each token
            differ = (probs[r] >= floor[r]) != (above < top_p)
            # fp32 sums: only a token whose mass above lies within rounding of top_p may fall either
            # way
            assert bool(((above - top_p).abs()[differ] < 1e-5).all()), (r, top_p)
    assert bool((top_p_floor_torch(probs, torch.ones(probs.shape[0])) == 0).all())  # top_p 1: off


def test_a_row_without_finite_logits_comes_back_as_minus_one_without_raising():
    from worker.step.sampler import sample_async

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    for temperature in (0.0, 0.8):
        got = sample_async(logits, batch(3, temperature=temperature)).tolist()
        assert got[1] == -1 and got[0] >= 0 and got[2] >= 0


@pytest.mark.parametrize("native", [True, False])
def test_an_all_greedy_batch_takes_the_first_maximum_as_a_mixed_batch_does(native, monkeypatch):
    """All-greedy host batches take one pass (the native kernel's, or torch's max where it is
    missing) instead of the masked general path: same tokens, ties to the first index, -1 for a row
    with nothing finite, and a NaN anywhere still never wins.
    """
    import worker.step.sampler
    from worker.step.sampler import sample_async

    if not native:
        monkeypatch.setattr(worker.step.sampler, "_native", lambda: None)
    elif worker.step.sampler._native() is None:
        pytest.skip("no native CPU kernels here")

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    logits[0, [5, 9, 40]] = 9.0  # a tie: the first index
    logits[1] = float("-inf")  # nothing possible
    logits[2, 11] = float("inf")
    logits[3, 0] = float("nan")  # takes the general path, which masks it
    greedy = sample_async(logits, batch(5, temperature=0.0)).tolist()
    some_sampled = batch(5, temperature=0.0)
    some_sampled.temperature[4] = 0.9  # one sampled row: every row through the general path
    mixed = sample_async(logits, some_sampled).tolist()
    assert greedy[:4] == mixed[:4] and greedy[:3] == [5, -1, 11]
    assert greedy[3] == int(logits[3, 1:].argmax()) + 1
    no_nan = logits[[0, 1, 2, 4]]
    assert sample_async(no_nan, batch(4, temperature=0.0)).tolist() == [
        5,
        -1,
        11,
        int(no_nan[3].argmax()),
    ]
