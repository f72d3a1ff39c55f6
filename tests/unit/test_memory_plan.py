"""Host memory: a model or a KV pool the machine cannot hold is refused at start with the bytes it
needs (not killed by the OOM killer halfway), prefill's dense copy of quantized weights is kept only
where it fits, and what the worker holds is reported.
"""

import json

import pytest

from worker.model.layer_kinds import parameter_count
from worker.serve.memory_plan import (
    DENSE_COPY_LIMIT,
    MARGIN,
    GiB,
    check_fits,
    choose_quantized_prefill,
)


def test_the_parameter_count_is_the_models_own(tiny_model_dir):
    """What the config implies equals what the checkpoint holds (norms apart: a vector a layer)."""
    from safetensors import safe_open

    from worker.weights.loader import load_config

    config = load_config(str(tiny_model_dir), "auto")
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        held = sum(f.get_tensor(k).numel() for k in f.keys() if "norm" not in k)
    assert parameter_count(config) == held


def test_prefill_keeps_a_dense_copy_only_for_a_small_model_and_where_it_fits():
    dense, kv = DENSE_COPY_LIMIT, 2 * GiB
    chosen, why = choose_quantized_prefill("auto", dense, kv, dense + kv + MARGIN)
    assert chosen == "dense" and "available" in why
    chosen, why = choose_quantized_prefill("auto", dense, kv, dense + kv + MARGIN - 1)
    assert chosen == "dequantize" and "cannot hold" in why and "1.0 GiB" in why
    # the system does not say
    assert choose_quantized_prefill("auto", dense, kv, None)[0] == "dense"
    # a 1B model's copy (5 GiB) is never taken by default, however much the machine has: the server
    # holds its file and its pool, as llama.cpp does
    chosen, why = choose_quantized_prefill("auto", 5 * GiB, kv, 100 * GiB)
    assert chosen == "dequantize" and "5.0 GiB" in why and "--quantized-prefill dense" in why
    assert choose_quantized_prefill("dense", 5 * GiB, kv, 0)[0] == "dense"  # asked for: as asked


def test_a_bf16_copy_takes_half_the_bytes_and_the_same_limits():
    """Where the CPU multiplies bf16 in tiles the copy is bf16: a model twice the fp32 limit's size
    still gets one, and a copy that cannot fit even at half the bytes is not taken; an explicit
    choice stays.
    """
    kv = 2 * GiB
    chosen, why = choose_quantized_prefill(
        "auto", 2 * DENSE_COPY_LIMIT, kv, DENSE_COPY_LIMIT + kv + MARGIN, bf16=True
    )
    assert chosen == "bf16" and "AMX" in why
    assert choose_quantized_prefill("auto", 2 * DENSE_COPY_LIMIT, kv, 100 * GiB)[0] == "dequantize"
    chosen, why = choose_quantized_prefill("auto", 5 * GiB, kv, 100 * GiB, bf16=True)
    assert chosen == "dequantize" and "2.5 GiB" in why
    chosen, _ = choose_quantized_prefill("auto", GiB, kv, GiB // 2 + kv + MARGIN - 1, bf16=True)
    assert chosen == "dequantize"
    assert choose_quantized_prefill("dense", GiB, kv, 100 * GiB, bf16=True)[0] == "dense"


def test_the_refusal_names_what_is_needed_and_what_there_is():
    assert check_fits("this model", 10 * GiB, 12 * GiB, "fix") is None
    message = check_fits("this model", 30 * GiB, 22 * GiB, "serve a smaller model")
    assert "30.0 GiB" in message and "22.0 GiB" in message and "serve a smaller model" in message


def test_preparing_a_gguf_too_large_for_the_machine_is_refused_before_it_starts(tmp_path):
    from deploy.prepare_model import find_embedded_gguf, preparation_refusal

    try:
        path = find_embedded_gguf()
    except FileNotFoundError:
        pytest.skip("the default model's wheel is not installed")
    message = preparation_refusal(path, tmp_path, available=256 << 20, free_disk=1 << 40)
    assert "0.13B values" in message and "0.2 GiB available" in message
    assert "GiB of memory" in message
    message = preparation_refusal(path, tmp_path, available=64 * GiB, free_disk=100 << 20)
    assert "writes an fp32 copy" in message and "PAGEDSERVE_MODELS" in message
    assert preparation_refusal(path, tmp_path, available=64 * GiB, free_disk=1 << 40) is None


@pytest.mark.slow
def test_a_kv_pool_larger_than_the_machine_is_refused_with_the_bytes_it_needs(
    tmp_path, tiny_model_dir
):
    """Asking for more KV pool than the machine has available: the worker says so and exits 2,
    instead of allocating until the OOM killer ends it.
    """
    from tests.support.server import ServerProcess

    server = ServerProcess(
        tiny_model_dir, tmp_path / "log", "--kv-cache-memory", "100000GiB", "--threads", "1"
    )
    with pytest.raises(RuntimeError, match="exited"):
        server.start(timeout=120)
    server.stop()
    log = (tmp_path / "log").read_text()
    assert "model_too_large" in log and "GiB of memory" in log and "--kv-cache-memory" in log
    for line in log.splitlines():
        if '"model_too_large"' in line:
            assert "available" in json.loads(line)["error"]


@pytest.mark.slow
def test_the_worker_reports_what_it_holds(server_factory, tiny_model_dir):
    """At start: the model as loaded (at least its fp32 weights), the KV pool it reserved, their
    sum, and the peak resident memory so far.
    """
    from worker.weights.loader import load_config

    server = server_factory(tiny_model_dir, "--kv-cache-memory", "64MiB")
    memory = [
        json.loads(line)
        for line in server.log_path.read_text().splitlines()
        if '"host_memory"' in line
    ]
    assert len(memory) == 1
    m = memory[0]
    config = load_config(str(tiny_model_dir), "auto")
    assert m["model_resident_bytes"] >= 4 * parameter_count(config)
    assert 63 << 20 <= m["kv_pool_bytes"] <= 64 << 20
    assert m["planned_bytes"] == m["model_resident_bytes"] + m["kv_pool_bytes"]
    assert m["peak_resident_bytes"] >= m["resident_bytes"] >= m["model_resident_bytes"] // 2
