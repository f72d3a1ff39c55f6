"""The Triton LoRA kernels (kernels/triton_lora.py) against the grouped matmuls of
worker/model/lora.py they stand in for on a GPU: a step of adapters of different ranks and
projections and base rows, natively on CUDA, under TRITON_INTERPRET=1 elsewhere.
"""

import pytest
import torch

from worker.model.lora import LoraWeights, Projection, StepLora

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
HIDDEN, QKV = 48, 80  # q 48, k and v 16 each


def _projection(g, dtype, parts, rank):
    """A fused projection's update changing `parts` output spans (each its own rank-`rank` rows of
    A).
    """
    a = torch.randn(rank * len(parts), HIDDEN, generator=g) * HIDDEN**-0.5
    bs = tuple(torch.randn(hi - lo, rank, generator=g).to(DEVICE, dtype) for lo, hi in parts)
    spans = tuple((j * rank, (j + 1) * rank, lo, hi) for j, (lo, hi) in enumerate(parts))
    return Projection(a.to(DEVICE, dtype), bs, spans)


def _adapters(dtype):
    g = torch.Generator().manual_seed(0)
    every = LoraWeights("all", [{"qkv": _projection(g, dtype, [(0, 48), (48, 64), (64, 80)], 8)}])
    v_only = LoraWeights("v", [{"qkv": _projection(g, dtype, [(64, 80)], 2)}])
    none = LoraWeights("mlp", [{}])  # changes other projections: its rows here get nothing
    q_v = LoraWeights("qv", [{"qkv": _projection(g, dtype, [(0, 48), (64, 80)], 4)}])
    return [every, v_only, none, q_v]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [[0, 1, -1, 2, 3, 3, 0, -1, 1], [3], [-1, -1], [1] * 11])
def test_the_triton_update_is_the_grouped_matmuls(dtype, index):
    adapters = _adapters(dtype)
    token_index = torch.tensor(index, device=DEVICE)
    x = torch.randn(len(index), HIDDEN, generator=torch.Generator().manual_seed(1)).to(
        DEVICE, dtype
    )
    base = torch.randn(len(index), QKV, generator=torch.Generator().manual_seed(2)).to(
        DEVICE, dtype
    )
    grouped = StepLora.of(adapters, token_index)
    if grouped is None:  # every row on the base model: nothing to add
        assert all(i < 0 for i in index)
        return
    grouped.gpu = False
    want = grouped.apply(0, "qkv", x, base.clone())
    kernel = StepLora.of(adapters, token_index)
    kernel.gpu, kernel.gpu_index = True, token_index.to(torch.int32)
    got = kernel.apply(0, "qkv", x, base.clone())
    torch.testing.assert_close(got, want, **TOL[dtype])
    # rows whose adapter leaves the projection alone keep the base output
    for row, i in enumerate(index):
        if i in (-1, 2):
            torch.testing.assert_close(got[row], base[row], rtol=0, atol=0)
    assert not torch.equal(got, base)


def test_the_update_reads_rows_of_a_strided_input_and_writes_into_a_view():
    from kernels.triton_lora import lora_update

    g = torch.Generator().manual_seed(3)
    x_wide = torch.randn(5, 2 * HIDDEN, generator=g).to(DEVICE)
    x = x_wide[:, :HIDDEN]  # row stride 2 * HIDDEN
    a = torch.randn(2, 4, HIDDEN, generator=g).to(DEVICE)
    b = torch.randn(2, 10, 4, generator=g).to(DEVICE)
    out_wide = torch.zeros(5, 3 * QKV, device=DEVICE)
    out = out_wide[:, QKV : 2 * QKV]
    index = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([3, 60], dtype=torch.int32, device=DEVICE)
    span = torch.tensor([10, 7], dtype=torch.int32, device=DEVICE)
    lora_update(x, a, b, lo, span, index, out)
    want = torch.zeros(5, QKV, device=DEVICE)
    for row, i in enumerate(index.tolist()):
        if i >= 0:
            want[row, lo[i] : lo[i] + span[i]] = x[row] @ a[i].t() @ b[i, : span[i]].t()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert out_wide[:, :QKV].abs().sum() == 0 and out_wide[:, 2 * QKV :].abs().sum() == 0
