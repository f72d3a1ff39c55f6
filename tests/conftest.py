import os

import pytest
import torch

# Triton kernels run natively on CUDA and in the interpreter everywhere else; the variable must be set
# before triton is first imported (it is imported lazily, by the kernel tests and the triton backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deploy.local_server import ServerProcess
from tests.tiny import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=7)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """Start servers on the tiny model; all are stopped at the end of the session."""
    started = []

    def start(model_dir, *args):
        log = tmp_path_factory.mktemp("server") / "server.log"
        # invariants checked every step; one torch thread each, since tests run servers beside each other
        server = ServerProcess(model_dir, log, "--debug-invariants", "--expose-request-ids", "--threads", "1",
                               *args).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()
