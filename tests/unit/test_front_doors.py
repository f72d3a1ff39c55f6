"""The front doors as a user meets them before any request: a port given and taken, the default one
taken, a fleet's ports, the one served name, a warning where ranks outnumber cores, a CPU pool that
--tp does not multiply, and a client's failure said with what to do.
"""

import asyncio
import socket
from argparse import Namespace
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from deploy.client import rpc_failure
from deploy.fleet import build_parser as fleet_parser
from deploy.fleet import scheduler_program, summary
from deploy.launcher import warn_if_oversubscribed
from protos.base import ConfigError
from scheduler_service import options
from scheduler_service.api import front_doors
from scheduler_service.core.config import ModelSpec


@pytest.fixture
def held_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def http_args(port):
    return Namespace(http_port=port, host="127.0.0.1", tls_cert=None, tls_key=None, api_key=None)


def test_a_port_given_and_taken_is_an_error_and_the_default_taken_is_said(held_port, monkeypatch):
    with pytest.raises(ConfigError, match=f"cannot serve HTTP on 127.0.0.1:{held_port}"):
        front_doors.bind_http(http_args(held_port))
    monkeypatch.setattr(front_doors, "DEFAULT_HTTP_PORT", held_port)  # the default, taken
    why = front_doors.bind_http(http_args(None))
    assert why.startswith(f"off: 127.0.0.1:{held_port} is taken by another process (--http-port N")
    assert asyncio.run(front_doors.start_http(None, ["m"], [], http_args(None), why)) == why
    assert front_doors.bind_http(http_args(0)) == "off (--http-port 0)"
    with pytest.raises(ConfigError, match=f"cannot serve gRPC on 127.0.0.1:{held_port}"):
        front_doors.check_grpc_port(Namespace(host="127.0.0.1", port=held_port))


def test_a_fleet_of_two_takes_consecutive_ports_and_says_each_http_api():
    args = fleet_parser().parse_args(["--model", "m", "--servers", "2", "--port", "50061"])
    argvs = [scheduler_program(args, "tcp://127.0.0.1:0", Path("/tmp"), i).argv for i in (0, 1)]
    ports = [(a[a.index("--port") + 1], a[a.index("--http-port") + 1]) for a in argvs]
    assert ports == [("50061", "8000"), ("50062", "8001")]

    class Unit:
        programs, procs = [], []

    text = summary(
        ["127.0.0.1:50061", "127.0.0.1:50062"],
        Namespace(units=[Unit()]),
        Path("run/deploy"),
        http_urls=["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"],
    )
    assert (
        "OpenAI API: http://127.0.0.1:8001/v1" in text
        and "OpenAI API: http://127.0.0.1:8000/v1" in text
    )
    gated = fleet_parser().parse_args(["--model", "m", "--servers", "2", "--gateway"])
    argv = scheduler_program(gated, "tcp://127.0.0.1:0", Path("/tmp"), 1).argv
    assert argv[argv.index("--http-port") + 1] == "-1"  # the gateway has 8000


def test_one_name_is_served_and_a_prepared_ggufs_hash_is_not_part_of_it(tmp_path):
    folder = tmp_path / "llama8b-q4km-aade0a0acd1d"
    folder.mkdir()
    (folder / "pagedserve_model.json").write_text("{}")
    spec = ModelSpec(
        name="Llama-3-8B", vocab_size=10, max_context=16, eos_token_ids=(1,), path=str(folder)
    )
    args = Namespace(served_model_name=None, model=str(folder))
    assert options.served_names(args, spec) == ["llama8b-q4km"]
    plain = tmp_path / "my-model-aade0a0acd1d"
    plain.mkdir()
    assert options.served_names(
        Namespace(served_model_name=None, model=str(plain)),
        ModelSpec(name="x", vocab_size=1, max_context=2, eos_token_ids=(1,), path=str(plain)),
    ) == [plain.name]
    assert options.served_names(Namespace(served_model_name=["a", "b"], model="x"), spec) == [
        "a",
        "b",
    ]


def test_more_cpu_ranks_than_cores_is_said_at_start(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with capture_logs() as logs:
        warn_if_oversubscribed(
            Namespace(tensor_parallel_size=3, data_parallel_size=1, device="cpu")
        )
        warn_if_oversubscribed(
            Namespace(tensor_parallel_size=2, data_parallel_size=1, device="cpu")
        )
    assert [e["event"] for e in logs] == ["more_ranks_than_cores"] and logs[0]["cores"] == 2


def test_the_cpu_pool_holds_as_many_tokens_at_any_tp():
    from worker.serve.choices import cpu_default_kv_bytes

    assert cpu_default_kv_bytes(1) == 2 * 2**30 and cpu_default_kv_bytes(3) == 2 * 2**30 // 3


@pytest.mark.parametrize("available_gib,grown", [(24, True), (4, False)])
def test_a_128k_model_s_default_cpu_pool_holds_its_full_context_where_memory_allows(
    monkeypatch, available_gib, grown
):
    """LFM2-1.2B's shape (six attention layers of 8 KV heads, 128,000 tokens: 3.1 GB of fp32 K/V)
    is not refused at the default pool on a machine that holds its context beside the weights;
    where memory does not, the pool stays 2 GiB (and the scheduler says how to start it).
    """
    import torch

    from tests.support.families import LFM2_1B
    from worker.model.config import ModelConfig
    from worker.serve import choices, memory_plan
    from worker.serve.config import WorkerConfig

    shape = LFM2_1B
    config = ModelConfig.from_dict(shape)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: available_gib * 2**30)
    monkeypatch.setattr(choices, "_DEFAULT_POOL", {})
    cfg = WorkerConfig(model=f"lfm2-{available_gib}", scheduler="tcp://127.0.0.1:1")
    one = choices.one_request_bytes(cfg, config, torch.float32)
    assert one == 128000 // cfg.block_size * cfg.block_size * 6 * 2 * 8 * 64 * 4
    budget = choices.kv_budget_bytes(cfg, config, torch.float32, weights=2**30)
    assert budget == (one + 2**30 if grown else 2 * 2**30)
    # what the start chose is what every later phase reads, whatever memory shows by then
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 2**30)
    assert choices.kv_budget_bytes(cfg, config, torch.float32) == budget
    capped = WorkerConfig(model="c", scheduler="tcp://127.0.0.1:1", max_model_len=8192)
    assert choices.kv_budget_bytes(capped, config, torch.float32) == 2 * 2**30


class Failed(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_failed_call_says_what_to_do():
    refused = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to "
        "connect to remote host: Connection refused"
    )
    gone = rpc_failure(Failed(grpc.StatusCode.UNAVAILABLE, refused), "h:1")
    assert gone.startswith("no pagedserve server answers at h:1: start one (`make run`")
    tls = rpc_failure(
        Failed(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: "
            "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
        ),
        "h:1",
    )
    assert tls.startswith("UNAVAILABLE: ") and "--tls-ca" in tls
    draining = rpc_failure(Failed(grpc.StatusCode.UNAVAILABLE, "the server is draining"), "h:1")
    assert draining == "UNAVAILABLE: the server is draining"
    assert "--timeout" in rpc_failure(
        Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:1"
    )


def test_a_keyed_fleet_behind_the_gateway_is_refused_in_one_line(
    tiny_model_dir, capsys, monkeypatch
):
    """SMG 1.13 sends no key over gRPC: its servers would refuse it every call, so the pair is
    refused.
    """
    import structlog

    from deploy.fleet import main as deploy_main

    config = structlog.get_config()
    try:
        code = deploy_main(
            ["--model", str(tiny_model_dir), "--gateway", "--api-key", "k", "--log-format", "json"]
        )
    finally:
        structlog.configure(**config)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("pagedserve deploy: error: --api-key with --gateway")


def test_a_header_context_the_default_pool_cannot_hold_is_served_shorter_on_a_cpu():
    """A Nemotron-H GGUF says 1,048,576 tokens (llama.cpp's converter writes 2^20 for Mamba2
    hybrids): at every default the worker serves what its pool holds, said in the log; a context
    or a pool the user chose is kept, and the scheduler refuses what cannot be met.
    """
    import torch

    from worker.model.config import ModelConfig
    from worker.serve.assembly import served_context
    from worker.serve.config import WorkerConfig

    config = ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=64,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=2**20,
        )
    )
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = WorkerConfig(model="m", scheduler="tcp://127.0.0.1:1")
    with capture_logs() as logs:
        assert served_context(cfg, config, cpu, 4096) == 4096 * cfg.block_size
    assert logs[0]["event"] == "context_capped" and logs[0]["model_context"] == 2**20
    assert served_context(cfg, config, cpu, 2**17) == 2**20  # the pool holds it all
    assert served_context(cfg, config, cuda, 4096) == 2**20
    for chosen in (dict(max_model_len=2**20), dict(kv_cache_memory="1GiB"), dict(num_blocks=9)):
        explicit = WorkerConfig(model="m", scheduler="tcp://127.0.0.1:1", **chosen)
        assert served_context(explicit, config, cpu, 4096) == 2**20
