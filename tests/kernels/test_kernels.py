"""Triton kernels against their pure-torch references (`make test-kernels`).

Natively on CUDA; under TRITON_INTERPRET=1 elsewhere (set by conftest), with shapes kept small.
Interpreter: fp32 and fp16. CUDA: bf16 and fp16."""

import pytest
import torch

from kernels import reference
from tests.support.paged_case import make_case

pytestmark = pytest.mark.kernels

triton_attention = pytest.importorskip("kernels.triton_attention", reason="triton is not installed")
triton_configs = pytest.importorskip("kernels.triton_configs", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# (n_heads, n_kv_heads, head_dim, block_size): every GQA ratio, head dim and block size at least
# once
SHAPES = [
    (4, 4, 64, 16),  # 1:1
    (4, 2, 80, 32),  # 2:1, head dim padded to 128
    (8, 2, 96, 16),  # 4:1, head dim padded to 128
    (10, 2, 128, 32),  # 5:1, group padded
    (6, 2, 64, 32),  # 3:1
    (8, 8, 128, 16),
]


def lengths(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 7]


def close(out, ref, dtype):
    assert torch.isfinite(out).all(), "NaN or inf reached the output"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}b{}".format(*s))
def test_decode_matches_reference(shape, dtype):
    n_heads, n_kv, head_dim, block = shape
    seq_lens = lengths(block)
    case = make_case(
        [1] * len(seq_lens), seq_lens, n_heads, n_kv, head_dim, block, dtype, seed=1, device=DEVICE
    )
    out = triton_attention.paged_attention(*case.args)
    close(out, reference.paged_attention(*case.args), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "h{}kv{}d{}b{}".format(*s))
def test_mixed_prefill_decode_and_cached_prefix_match_reference(shape, dtype):
    n_heads, n_kv, head_dim, block = shape
    # decode rows, a fresh prefill, chunks over a cached prefix, lengths around block boundaries
    seq_lens = [1, block - 1, block + 1, 2 * block + 3, 3 * block + 7]
    q_lens = [1, block - 1, 1, 5, 2 * block + 1]
    case = make_case(q_lens, seq_lens, n_heads, n_kv, head_dim, block, dtype, seed=2, device=DEVICE)
    out = triton_attention.paged_attention(*case.args)
    close(out, reference.paged_attention(*case.args), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_reduction_for_any_number_of_splits(num_splits):
    dtype = DTYPES[0]
    case = make_case([1, 1, 1], [5, 70, 33], 8, 2, 64, 16, dtype, seed=3, device=DEVICE)
    out = triton_attention.paged_attention(*case.args, num_splits=num_splits)
    close(out, reference.paged_attention(*case.args), dtype)


def test_poisoned_scratch_is_never_read(monkeypatch):
    dtype = DTYPES[0]
    real = triton_attention.decode_workspace

    def poisoned(*args, **kwargs):
        mid_o, mid_lse = real(*args, **kwargs)
        return mid_o.fill_(float("nan")), mid_lse.fill_(float("nan"))

    monkeypatch.setattr(triton_attention, "decode_workspace", poisoned)
    # short sequences leave most splits unwritten
    case = make_case([1, 1], [3, 90], 4, 2, 64, 16, dtype, seed=4, device=DEVICE)
    out = triton_attention.paged_attention(*case.args, num_splits=6)
    close(out, reference.paged_attention(*case.args), dtype)


def test_write_kv_matches_reference_from_a_strided_view_and_padding_writes_nothing():
    dtype = DTYPES[0]
    n_kv, head_dim, block, num_blocks = 2, 80, 16, 6
    # fused projection output
    qkv = torch.randn(9, (4 + 2 * n_kv) * head_dim, device=DEVICE).to(dtype)
    k = qkv[:, 4 * head_dim : (4 + n_kv) * head_dim].view(9, n_kv, head_dim)  # a strided view
    v = qkv[:, (4 + n_kv) * head_dim :].view(9, n_kv, head_dim)
    slots = torch.tensor([0, 17, -1, 95, 40, -1, 41, 2, 63], device=DEVICE)
    shape = (num_blocks, block, n_kv, head_dim)
    pools = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    triton_attention.write_kv(k, v, pools[0], pools[1], slots)
    reference.write_kv(k, v, pools[2], pools[3], slots)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(pools[0].view(bits), pools[2].view(bits))  # NaN-aware, bit for bit
    assert torch.equal(pools[1].view(bits), pools[3].view(bits))
    untouched = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    before = untouched.clone()
    triton_attention.write_kv(
        k, v, untouched, untouched.clone(), torch.full((9,), -1, device=DEVICE)
    )
    assert torch.equal(untouched.view(bits), before.view(bits)), "a -1 slot wrote into the pool"


def test_one_kv_head_constant_proves_the_head_mapping():
    dtype = DTYPES[0]
    n_heads, n_kv, head_dim, block = 10, 2, 64, 16  # 5 query heads per KV head
    for q_lens in ([1, 1], [4, 9]):
        case = make_case(
            q_lens, [20, 37], n_heads, n_kv, head_dim, block, dtype, seed=5, device=DEVICE
        )
        case.v_cache[:, :, 1] = 3.0  # KV head 1 holds a constant value everywhere
        out = triton_attention.paged_attention(*case.args)
        torch.testing.assert_close(
            out[:, 5:].float(),
            torch.full_like(out[:, 5:].float(), 3.0),
            atol=1e-3,
            rtol=0,
            msg="query heads 5..9 must read KV head 1",
        )
        assert (out[:, :5].float() - 3.0).abs().min() > 0.5, "query heads 0..4 must read KV head 0"


def test_same_input_twice_is_bitwise_identical():
    dtype = DTYPES[0]
    for q_lens in ([1, 1, 1], [3, 1, 17]):
        case = make_case(q_lens, [9, 40, 17], 8, 2, 64, 16, dtype, seed=6, device=DEVICE)
        a = triton_attention.paged_attention(*case.args)
        b = triton_attention.paged_attention(*case.args)
        assert torch.equal(a, b)


def test_chunked_prefill_then_decode_equals_one_full_prefill():
    dtype = DTYPES[0]
    n_heads, n_kv, head_dim, block, total = 4, 2, 64, 16, 41
    case = make_case([total], [total], n_heads, n_kv, head_dim, block, dtype, seed=7, device=DEVICE)
    full = triton_attention.paged_attention(*case.args)
    pieces, done = [], 0
    # three chunks over the growing cached prefix, then one decode token
    for chunk in (
        16,
        15,
        9,
        1,
    ):
        done += chunk
        qsl = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([done], dtype=torch.int32, device=DEVICE)
        pieces.append(
            triton_attention.paged_attention(
                case.q[done - chunk : done],
                case.k_cache,
                case.v_cache,
                case.block_tables,
                lens,
                qsl,
                case.scale,
            )
        )
    close(torch.cat(pieces), full, dtype)


def test_prefill_kernel_handles_single_token_rows_in_a_mixed_batch():
    """A step with decodes and one prefill goes to the varlen kernel; its decode rows must agree
    with what the decode kernel gives for them.
    """
    dtype = DTYPES[0]
    mixed = make_case([1, 6, 1], [30, 6, 50], 8, 2, 64, 16, dtype, seed=8, device=DEVICE)
    out = triton_attention.paged_attention(*mixed.args)
    close(out, reference.paged_attention(*mixed.args), dtype)


def test_step_varying_arguments_are_not_specialized():
    """Every integer argument that changes between steps (the block-table row stride, the split
    scratch's strides, the split length) is named in do_not_specialize, and every name is one of the
    kernel's parameters (a misspelt name would be ignored by the interpreter and refused on a GPU).
    """
    import inspect

    varying = {
        "stride_bts",
        "stride_mos",
        "stride_moh",
        "stride_mop",
        "stride_mls",
        "stride_mlh",
        "split_len",
    }
    for name, listed in triton_configs.STEP_VARYING.items():
        kernel = getattr(triton_attention, name)
        params = set(inspect.signature(kernel.fn).parameters)
        assert set(listed) <= params, (name, set(listed) - params)
        assert varying & params <= set(listed), (name, (varying & params) - set(listed))


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(8, 1, 256), (4, 2, 64)])
def test_many_splits_over_a_long_context_among_short_ones(n_heads, n_kv_heads, head_dim):
    """One 8k-token sequence beside short ones, split 40 ways (the merge takes its splits 16 at a
    time, so three tiles, the last one partial; short sequences write and read only their own few
    splits).
    """
    dtype = DTYPES[0]
    case = make_case(
        [1, 1, 1, 1],
        [8200, 3, 700, 17],
        n_heads,
        n_kv_heads,
        head_dim,
        16,
        dtype,
        seed=11,
        device=DEVICE,
    )
    out = triton_attention.paged_attention(*case.args, num_splits=40)
    close(out, reference.paged_attention(*case.args), dtype)


def test_split_choice_caps_the_keys_of_a_split_and_fills_the_gpu(monkeypatch):
    monkeypatch.setattr(triton_configs, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    pick = triton_configs.default_num_splits
    assert pick(64, 8, 8192, 16, cuda) == 8192 // triton_configs.MAX_SPLIT_KEYS  # by length: 16
    assert pick(1, 8, 2048, 16, cuda) == 33  # few programs: split finer to fill 132 SMs twice
    assert pick(256, 8, 300, 16, cuda) == 1
    assert pick(1, 1, 40, 16, cuda) == 3  # never more splits than blocks
    assert pick(1, 8, 10**7, 16, cuda) == triton_configs.MAX_SPLITS


def test_split_scratch_is_allocated_once_per_step_and_stale_splits_are_never_read(monkeypatch):
    """A step's layers share one scratch (the caller's workspace): the second layer finds the first
    one's partial results in it, for splits its short sequences do not write, and must not read
    them.
    """
    dtype = DTYPES[0]
    calls = []
    real = triton_attention.decode_workspace
    monkeypatch.setattr(
        triton_attention, "decode_workspace", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    layer1 = make_case([1, 1, 1], [90, 3, 40], 4, 2, 64, 16, dtype, seed=5, device=DEVICE)
    layer2 = make_case([1, 1, 1], [90, 3, 40], 4, 2, 64, 16, dtype, seed=6, device=DEVICE)
    workspace = {}
    for case in (layer1, layer2):
        out = triton_attention.paged_attention(*case.args, num_splits=6, workspace=workspace)
        close(out, reference.paged_attention(*case.args), dtype)
    assert len(calls) == 1


def test_top_p_floor_kernel_matches_the_torch_bisection():
    """The sampler's Triton top-p search finds the floor the torch one does, rows of several shapes,
    a vocab that is not a multiple of the kernel's chunk, top_p 1 rows left alone.
    """
    from kernels.reference import top_p_floor_torch
    from kernels.triton_sampling import top_p_floor

    g = torch.Generator().manual_seed(9)
    vocab = 1000 if DEVICE == "cpu" else 128_256
    logits = (
        torch.randn(6, vocab, generator=g) * torch.tensor([0.1, 1.0, 3.0, 8.0, 20.0, 2.0])[:, None]
    )
    probs = torch.softmax(logits, dim=-1).to(DEVICE)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.3, 0.999, 1.0], device=DEVICE)
    got = top_p_floor(probs, top_p)
    want = top_p_floor_torch(probs, top_p)
    assert got[-1] == 0 and want[-1] == 0
    kept_got = probs >= got[:, None]
    kept_want = probs >= want[:, None]
    # the two sum in different orders: at most a token at the boundary may differ
    assert int((kept_got != kept_want).sum(dim=-1).max()) <= 1
