import os

import pytest
import torch

# Triton kernels run natively on CUDA and in the interpreter everywhere else; the variable must be
# set before triton is first imported (it is imported lazily, by the kernel tests and the triton
# backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.server import ServerProcess
from tests.support.tiny import make_tiny_llama

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=12,
        help="examples per operation and RPC in tests/faults/test_fuzz.py (make fuzz: 300)",
    )


@pytest.fixture(scope="session")
def fuzz_examples(request) -> int:
    return request.config.getoption("--fuzz-examples")


def pytest_collection_modifyitems(config, items):
    """Model-level tests run the triton backend on host tensors, which only the interpreter can do:
    where a GPU is present (no interpreter) they are skipped — tests/kernels/test_kernels.py and the
    CUDA tests run it there.
    """
    if INTERPRETED:
        return
    skip = pytest.mark.skip(
        reason="the triton backend on host tensors needs TRITON_INTERPRET=1; on this GPU "
        "machine the kernel and CUDA tests cover it"
    )
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "triton" in (
            params.get("backend"),
            params.get("backend_name"),
        ) and item.module.__name__ in ("tests.models.test_model", "tests.kernels.test_attention"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=7)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """Start servers on the tiny model; each is stopped at the end of the module that started it."""
    started = []

    def start(model_dir, *args):
        log = tmp_path_factory.mktemp("server") / "server.log"
        # invariants checked every step (a pass over the pool: a tiny model's pool is kept small, or
        # 2 GiB of it would be 700k blocks checked twice a step); one torch thread each, since tests
        # run servers beside each other
        extra = []
        sized = {"--kv-cache-memory", "--num-blocks", "--gpu-memory-utilization"} & set(args)
        if torch.cuda.is_available():
            # on a GPU the tests' exact comparisons hold in fp32 (the default there is bf16), and
            # each server takes a fixed pool rather than 90% of a GPU its neighbours share
            if "--dtype" not in args:
                extra += ["--dtype", "float32"]
            if not sized:
                extra += ["--kv-cache-memory", "1GiB"]
        elif not sized:
            extra += ["--kv-cache-memory", "64MiB"]
        server = ServerProcess(
            model_dir,
            log,
            "--debug-invariants",
            "--expose-request-ids",
            "--threads",
            "1",
            *extra,
            *args,
        ).start()
        started.append(server)
        return server

    start.started = started
    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module", autouse=True)
def servers_stop_with_their_module(server_factory):
    """The servers a test module started are stopped when it ends: dozens held to the session's end
    (a few hundred MB each) would take the memory later modules' servers check for at start.
    """
    first = len(server_factory.started)
    yield
    for server in server_factory.started[first:]:
        server.stop()
    del server_factory.started[first:]


@pytest.fixture(scope="session")
def native():
    """The native CPU kernels (kernels/cpu_native.py); the test is skipped where they cannot be
    built.
    """
    from kernels import cpu_native

    k = cpu_native.load()
    if k is None:
        pytest.skip("no native CPU kernels on this machine")
    return k
