"""The CUDA path's choices that can be checked without a GPU: graph buckets, the step's sequence
limit, the memory budget, what a worker says when its GPU is unusable, and what the kernels compile
to for sm_90.
"""

import os

import pytest
import torch

from worker.serve.sizing import (
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_SEQS,
    TOKENS_PER_SEQ,
    default_max_num_seqs,
)
from worker.step.graphs import bucket_sizes


def test_graph_buckets_come_from_the_sequence_limit_each_once():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    big = bucket_sizes(2000)
    assert big[-1] == 2000 and len(big) == len(set(big)) and big == sorted(big)
    assert 512 in big and big.count(512) == 1  # once, however far the limit lies past the list


def test_the_step_limit_a_worker_proposes():
    low, high = GPU_MAX_NUM_SEQS
    assert default_max_num_seqs("cpu", 10**6, 16, 2048) == CPU_MAX_NUM_SEQS
    # a GPU: room for every sequence to hold TOKENS_PER_SEQ tokens, within the bounds
    assert default_max_num_seqs("cuda", 300 * TOKENS_PER_SEQ // 16, 16, 8192) == 300
    assert default_max_num_seqs("cuda", 10, 16, 8192) == low
    assert default_max_num_seqs("cuda", 10**8, 16, 8192) == high
    assert default_max_num_seqs("cuda", 10**8, 16, 256) == 256  # never above the token budget


def test_the_scheduler_adopts_the_smallest_proposal_when_left_to_the_workers():
    from types import SimpleNamespace

    from scheduler_service.core.config import SchedulerConfig
    from scheduler_service.runtime.engine import Engine

    def group(*proposals):
        return SimpleNamespace(
            workers={
                i: SimpleNamespace(handshake=SimpleNamespace(max_num_seqs=p))
                for i, p in enumerate(proposals)
            }
        )

    for auto, want in ((True, 200), (False, 64)):
        engine = Engine.__new__(Engine)
        engine.config = SchedulerConfig(
            max_num_seqs=64, auto_max_num_seqs=auto, max_num_batched_tokens=4096
        )
        engine.replicas = [
            SimpleNamespace(config=engine.config),
            SimpleNamespace(config=engine.config),
        ]
        engine._adopt_max_num_seqs([group(256, 200), group(300)])
        assert engine.config.max_num_seqs == want
        assert all(r.config.max_num_seqs == want for r in engine.replicas)


def test_a_cpu_only_torch_on_a_host_with_an_nvidia_gpu_refuses_to_start(
    monkeypatch, capsys, tiny_model_dir
):
    """Serving on the CPU by accident, hundreds of times slower, with no word: refused with what to
    do.
    """
    import worker.serve.startup
    from protos.base import EXIT_CONFIG
    from tests.support.server import worker_main_code

    if torch.cuda.is_available():
        pytest.skip("torch sees the GPU here")
    monkeypatch.setattr(worker.serve.startup, "nvidia_gpu_present", lambda: True)
    code = worker_main_code(tiny_model_dir)
    assert code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "NVIDIA GPU" in err and "CPU-only build" in err and "--device cpu" in err


def test_without_triton_a_gpu_worker_says_so_and_uses_torch(monkeypatch):
    import worker.model.attention_native as attention

    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert attention.default_backend_name(torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="needs the triton package"):
        attention.make_backend("triton", torch.device("cuda"))


@pytest.mark.kernels
def test_no_kernel_spills_registers_when_compiled_for_an_h100():
    """Every attention kernel at the configuration its launcher picks for head_dim 64/128/256 and
    page sizes 16 and 256, compiled for sm_90 here (no GPU needed: Triton's own ptxas), uses no
    local memory.
    """
    pytest.importorskip("triton")
    import json
    import subprocess
    import sys

    # compiling, not interpreting
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernels.compile_report",
            "--head-dims",
            "64",
            "128",
            "256",
            "--block-sizes",
            "16",
            "256",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if done.returncode not in (0, 1):
        pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-500:]}")
    rows = json.loads(done.stdout)
    spilled = [
        (r["name"], r["spill_stores"], r["stack"]) for r in rows if r["spill_stores"] or r["stack"]
    ]
    assert not spilled
    assert {r["name"].split()[0] for r in rows} >= {
        "decode_split",
        "prefill",
        "decode_reduce",
        "write_kv",
        "rope",
    }


def test_the_worker_config_holds_every_flag_and_is_frozen():
    """Every worker flag reaches the start-up phases through one frozen WorkerConfig."""
    import dataclasses

    from worker.serve.config import WorkerConfig
    from worker.serve.main import build_parser

    parser = build_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert {f.name for f in dataclasses.fields(WorkerConfig)} == dests
    args = parser.parse_args(
        ["--model", "m", "--scheduler", "tcp://127.0.0.1:1", "--kv-cache-memory", "1GiB"]
    )
    cfg = WorkerConfig.from_args(args)
    assert cfg.kv_cache_memory == "1GiB" and cfg.tp == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32
