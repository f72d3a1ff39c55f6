"""Matmul libraries for the projections: chosen by measurement, packed results equal F.linear's."""

import pytest
import torch
import torch.nn.functional as F

from worker.model.linear import DenseMatmul, MKLMatmul, OneDNNMatmul, choose, measure

CPU = torch.device("cpu")


PACKING = [OneDNNMatmul] + ([MKLMatmul] if MKLMatmul.available(CPU, torch.float32) else [])


@pytest.mark.parametrize("cls", PACKING, ids=lambda c: c.name)
def test_packed_weights_give_f_linear_results_with_bias_and_any_row_count(cls):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lib = cls()
    packed = lib.prepare(w)
    del w  # the packed copy stands alone
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(lib(x, packed, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    # a strided view, as a slice of a fused projection is
    x = torch.randn(200, 64, generator=g)[:, 10:50]
    torch.testing.assert_close(lib(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 5, 40, generator=g)  # leading dimensions, as F.linear takes them
    torch.testing.assert_close(lib(x3, packed), F.linear(x3, w), atol=1e-4, rtol=1e-5)
    assert lib(torch.empty(0, 40), packed).shape == (0, 96)


def test_the_mkl_library_is_found_where_torch_carries_mkl():
    if "BLAS_INFO=mkl" not in torch.__config__.show():
        pytest.skip("torch without MKL here")
    assert MKLMatmul.available(CPU, torch.float32)
    assert not MKLMatmul.available(CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        choose("mkl", [(64, 32)], CPU, torch.bfloat16)


def test_choice_by_measurement_and_by_name():
    seconds = measure([(64, 32), (32, 64)], (4, 16), CPU, torch.float32, reps=1)
    assert set(seconds) == {"dense"} | {c.name for c in PACKING} and all(
        t > 0 for t in seconds.values()
    )
    assert choose("auto", [(64, 32)], CPU, torch.float32).name in set(seconds)
    assert isinstance(choose("dense", [(64, 32)], CPU, torch.float32), DenseMatmul)
    # oneDNN path is fp32 only
    assert isinstance(choose("auto", [(64, 32)], CPU, torch.bfloat16), DenseMatmul)
    with pytest.raises(ValueError, match="fp32"):
        choose("onednn", [(64, 32)], CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown matmul"):
        choose("blas", [(64, 32)], CPU, torch.float32)
