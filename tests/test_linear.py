"""Matmul libraries for the projections: chosen by measurement, packed results equal F.linear's."""

import pytest
import torch
import torch.nn.functional as F

from worker.linear import DenseMatmul, OneDNNMatmul, choose, measure

CPU = torch.device("cpu")


def test_packed_weights_give_f_linear_results_with_bias_and_any_row_count():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lib = OneDNNMatmul()
    packed = lib.prepare(w)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(lib(x, packed, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    x = torch.randn(200, 64, generator=g)[:, 10:50]  # a strided view, as a slice of a fused projection is
    torch.testing.assert_close(lib(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_choice_by_measurement_and_by_name():
    seconds = measure([(64, 32), (32, 64)], (4, 16), CPU, torch.float32, reps=1)
    assert set(seconds) == {"dense", "onednn"} and all(t > 0 for t in seconds.values())
    assert choose("auto", [(64, 32)], CPU, torch.float32).name in {"dense", "onednn"}
    assert isinstance(choose("dense", [(64, 32)], CPU, torch.float32), DenseMatmul)
    assert isinstance(choose("auto", [(64, 32)], CPU, torch.bfloat16), DenseMatmul)  # oneDNN path is fp32 only
    with pytest.raises(ValueError, match="fp32"):
        choose("onednn", [(64, 32)], CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown matmul"):
        choose("blas", [(64, 32)], CPU, torch.float32)
