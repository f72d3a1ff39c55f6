"""The native elementwise tail (kernels/cpu/elementwise.c) against its torch definition
(worker/model/elementwise.py)."""

import pytest
import torch

from kernels import cpu_native
from worker.model.config import ModelConfig
from worker.model.elementwise import NativeOps, Rotary, TorchOps, default_ops

native = cpu_native.load()
needs_native = pytest.mark.skipif(native is None, reason="native CPU kernels did not build here")


def _config(head_dim: int, rotary_dim: int = 0) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rotary_dim=rotary_dim,
    )


def test_partial_rotary_turns_the_first_values_of_each_head_and_leaves_the_rest():
    """A partial_rotary_factor (Phi-3's configs): rotate-half over the
    first rotary_dim values only.
    """
    rotary = Rotary(_config(64, rotary_dim=48), torch.device("cpu"))
    assert rotary.cos.shape[1] == 24
    x = torch.randn(3, 2, 64)
    cos, sin = rotary.lookup(torch.tensor([0, 5, 900]), torch.float32)
    got = TorchOps().rope(x, x, (cos, sin))[0]
    assert torch.equal(got[..., 48:], x[..., 48:])
    full = Rotary(_config(48), torch.device("cpu"))  # the same 48 values as a head of their own
    want = TorchOps().rope(
        x[..., :48], x[..., :48], full.lookup(torch.tensor([0, 5, 900]), torch.float32)
    )[0]
    torch.testing.assert_close(got[..., :48], want)


@needs_native
@pytest.mark.parametrize("hidden", [576, 33, 1024])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(hidden, with_delta):
    g = torch.Generator().manual_seed(hidden)
    residual = torch.randn(7, hidden, generator=g) * 3
    delta = torch.randn(7, hidden, generator=g) if with_delta else None
    weight = torch.randn(hidden, generator=g)
    want_res, want = TorchOps().add_rms_norm(residual.clone(), delta, weight, 1e-5)
    got_res, got = NativeOps(native).add_rms_norm(residual.clone(), delta, weight, 1e-5)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bf16_out", [False, True])
def test_add_rms_norm_between_bf16_gemms_is_the_fp32_norm_rounded(delta_dtype, bf16_out):
    """A bf16 GEMM's product added to the fp32 residual and the norm handed to the next bf16 GEMM in
    bf16: the residual exactly the fp32 kernel's on the widened product, the output that kernel's
    rounded to nearest even (the rounding the GEMM applied to its input anyway), in one pass.
    """
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(9, 576, generator=g) * 3
    delta = None if delta_dtype is None else (torch.randn(9, 576, generator=g) * 2).to(delta_dtype)
    weight = torch.randn(576, generator=g)
    ops = NativeOps(native)
    wide = None if delta is None else delta.float()
    want_res, want = ops.add_rms_norm(residual.clone(), wide, weight, 1e-5)
    got_res, got = ops.add_rms_norm(residual.clone(), delta, weight, 1e-5, bf16_out)
    assert torch.equal(got_res, want_res)
    assert got.dtype == (torch.bfloat16 if bf16_out else torch.float32)
    assert torch.equal(got, want.to(got.dtype))
    ref_res, ref = TorchOps().add_rms_norm(residual.clone(), delta, weight, 1e-5, bf16_out)
    assert ref.dtype == got.dtype and torch.equal(ref_res, want_res)
    torch.testing.assert_close(ref.float(), got.float(), rtol=1e-2 if bf16_out else 1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("width", [1536, 17])
def test_silu_mul_matches_torch(width):
    # exp over a wide range
    gate_up = torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 8
    torch.testing.assert_close(
        NativeOps(native).silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=2e-6, atol=2e-6
    )


@needs_native
@pytest.mark.parametrize("shape", [(2048, 960), (3, 7), (0, 5)])
def test_widening_a_bf16_gemm_output_is_torchs_exact_conversion(shape):
    """A bf16 GEMM's product into the fp32 residual stream: every value, infinities and NaN
    included, as torch converts it (the bits shifted), at a prompt chunk's size and at sizes of no
    whole vector.
    """
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 1e3).to(
        torch.bfloat16
    )
    if x.numel():
        x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    got = native.widen_bf16(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.view(torch.int32), x.float().view(torch.int32))
    with pytest.raises(ValueError, match="contiguous bf16"):
        native.widen_bf16(x.float())


@needs_native
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 0), (128, 0), (40, 0), (64, 48), (96, 32)])
@pytest.mark.parametrize("fused_row", [True, False])
def test_rope_matches_torch(head_dim, rotary_dim, fused_row):
    config = _config(head_dim, rotary_dim)
    rotary = Rotary(config, torch.device("cpu"))
    heads, kv_heads, tokens = 4, 2, 9
    positions = torch.tensor([0, 1, 2, 3, 700, 701, 4095, 17, 5])
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(head_dim)
    )

    def split(t):
        q = t[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = t[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        # e.g. after a per-head q/k norm (Qwen3): fresh tensors, not views of one row
        if not fused_row:
            q, k = q * 1.0, k * 1.0
        return q, k

    ref, ops = TorchOps(), NativeOps(native)
    want_q, want_k = ref.rope(
        *split(qkv.clone()), ref.rope_tables(rotary, positions, torch.float32)
    )
    rows = qkv.clone()
    got_q, got_k = ops.rope(*split(rows), ops.rope_tables(rotary, positions, torch.float32))
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    if fused_row:  # rotated in place in the QKV row; V untouched
        torch.testing.assert_close(
            rows[:, : heads * head_dim].view(tokens, heads, head_dim), want_q
        )
        assert torch.equal(
            rows[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
        )


@needs_native
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_head_norms_normalize_q_and_k_in_place_on_the_fused_row_as_torch(head_dim):
    """Qwen3's per-head q and k norms: in place on the QKV row (V untouched), so RoPE then still
    finds q and k adjacent there; tensors that are not such views (a copy, another dtype) go through
    torch.
    """
    heads, kv_heads, tokens = 4, 2, 9
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3
    qw, kw = torch.rand(head_dim, generator=g) + 0.5, torch.rand(head_dim, generator=g) + 0.5

    def split(t):
        return (
            t[:, : heads * head_dim].view(tokens, heads, head_dim),
            t[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim),
        )

    want_q, want_k = TorchOps().head_norms(*split(qkv), qw, kw, 1e-6)
    rows = qkv.clone()
    got_q, got_k = NativeOps(native).head_norms(*split(rows), qw, kw, 1e-6)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert got_q.data_ptr() == rows.data_ptr()  # the row itself
    torch.testing.assert_close(split(rows)[1], want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        rows[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
    )
    copies = [t.contiguous().clone() * 1.0 for t in split(qkv)]
    # head values not at unit stride
    copies[0] = copies[0].transpose(1, 2).contiguous().transpose(1, 2)
    got_q, got_k = NativeOps(native).head_norms(*copies, qw, kw, 1e-6)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 49157])
def test_greedy_argmax_is_the_first_largest_and_never_nan(vocab):
    """The sampler's all-greedy pass: torch's argmax with NaN as -inf, ties to the first index
    (across the vector lanes and into the tail past the last full vector), -1 for a row with nothing
    above -inf.
    """
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        x = torch.randn(4, vocab, generator=g)
        top = float(x.max()) + 1
        x[0, torch.randint(0, vocab, (3,), generator=g)] = top  # a tie somewhere (or one cell)
        x[0, -1] = (
            top  # ... and at the very end: never chosen over an earlier equal value unless alone
        )
        x[1] = float("-inf")
        if trial % 2:
            x[1, vocab // 2] = float("nan")  # NaN and -inf only: nothing to choose
        x[2, ::3] = float("nan")
        x[3, trial % vocab] = float("inf")
        ref = x.masked_fill(x.isnan(), float("-inf"))
        want = torch.where(ref.amax(-1) == float("-inf"), -1, ref.argmax(-1))
        assert native.argmax_rows(x).tolist() == want.tolist()
        # one row: no parallel region
        assert native.argmax_rows(x[2:3]).tolist() == want[2:3].tolist()


@needs_native
def test_non_contiguous_inputs_fall_back_to_torch():
    x = torch.randn(6, 128)[:, :64]  # strided rows
    weight = torch.randn(64)
    want = TorchOps().add_rms_norm(x, None, weight, 1e-6)[1]
    torch.testing.assert_close(NativeOps(native).add_rms_norm(x, None, weight, 1e-6)[1], want)
    gate_up = torch.randn(4, 64).t()
    torch.testing.assert_close(NativeOps(native).silu_mul(gate_up), TorchOps().silu_mul(gate_up))


def test_default_ops_by_device_and_dtype(monkeypatch):
    assert isinstance(default_ops(torch.device("cpu"), torch.bfloat16), TorchOps)
    assert not isinstance(default_ops(torch.device("cpu"), torch.bfloat16), NativeOps)
    monkeypatch.setenv("PAGEDSERVE_NATIVE", "0")
    monkeypatch.setattr(cpu_native, "_TRIED", False)
    monkeypatch.setattr(cpu_native, "_LOADED", None)
    ops = default_ops(torch.device("cpu"), torch.float32)
    assert type(ops) is TorchOps


# --- the Triton kernels (kernels/triton_elementwise.py): natively on CUDA, in the interpreter
# elsewhere ---
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_DTYPES = (
    [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
)
TRITON_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def _triton_ops():
    pytest.importorskip("triton")
    from worker.model.elementwise import TritonOps

    return TritonOps()


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("hidden,with_delta", [(576, True), (33, False), (1024, True)])
def test_triton_add_rms_norm_matches_torch(dtype, hidden, with_delta):
    ops = _triton_ops()
    g = torch.Generator().manual_seed(hidden)
    residual = (torch.randn(5, hidden, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(5, hidden, generator=g).to(DEVICE, dtype) if with_delta else None
    weight = torch.randn(hidden, generator=g).to(DEVICE, dtype)
    want_res, want = TorchOps().add_rms_norm(residual.clone(), delta, weight, 1e-5)
    got_res, got = ops.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    # the residual add rounds once, as torch's
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **TRITON_TOL[dtype])


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("width", [1536, 17, 2304])
def test_triton_silu_mul_matches_torch(dtype, width):
    ops = _triton_ops()
    gate_up = (torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(width)) * 6).to(
        DEVICE, dtype
    )
    torch.testing.assert_close(
        ops.silu_mul(gate_up), TorchOps().silu_mul(gate_up), **TRITON_TOL[dtype]
    )


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 0), (40, 0), (64, 32)])
def test_triton_rope_in_place_on_the_fused_row_matches_torch(dtype, head_dim, rotary_dim):
    ops = _triton_ops()
    rotary = Rotary(_config(head_dim, rotary_dim), torch.device(DEVICE))
    heads, kv_heads, tokens = 4, 2, 6
    positions = torch.tensor([0, 1, 700, 4095, 17, 5], device=DEVICE)
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(1)
    )
    qkv = qkv.to(DEVICE, dtype)

    def split(t):
        return (
            t[:, : heads * head_dim].view(tokens, heads, head_dim),
            t[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim),
        )

    ref = TorchOps()
    want_q, want_k = ref.rope(*split(qkv.clone()), ref.rope_tables(rotary, positions, dtype))
    rows = qkv.clone()
    got_q, got_k = ops.rope(*split(rows), ops.rope_tables(rotary, positions, dtype))
    torch.testing.assert_close(got_q, want_q, **TRITON_TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TRITON_TOL[dtype])
    # V
    assert torch.equal(
        rows[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
    )


def test_default_ops_on_cuda_are_the_triton_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from worker.model.elementwise import TritonOps

    assert isinstance(default_ops(torch.device("cuda"), torch.bfloat16), TritonOps)
