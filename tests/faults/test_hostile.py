"""Requests that must never hurt other clients: huge prompts, malformed messages, invalid UTF-8,
absurd temperatures and long stop strings get clear errors (or sane behaviour) while everyone else
is served.
"""

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2
from tests.support.server import ServerProcess, greedy_request
from tests.support.serving import children_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_model_dir):
    """A server as users run it: request ids are not exposed in GetCacheStats."""
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    server = ServerProcess(
        tiny_model_dir, log, "--threads", "1", "--block-size", "4", "--num-blocks", "256"
    ).start()
    yield server
    server.stop()


def test_a_huge_prompt_is_refused_at_once_and_never_stalls_other_clients(plain):
    huge = generation_pb2.GenerateRequest(
        prompt="paged attention " * 2_500_000,  # 40 MB of text
        sampling=generation_pb2.SamplingParams(max_tokens=4),
    )
    health = health_pb2_grpc.HealthStub(plain.channel)
    errors, ok = [], []

    def flood():
        for _ in range(3):
            try:
                plain.stub.Generate(huge, timeout=60)
            except grpc.RpcError as e:
                errors.append(e)

    t = threading.Thread(target=flood)
    t0 = time.monotonic()
    t.start()
    while t.is_alive():  # meanwhile health answers and a normal request is served
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        ok.append(
            len(plain.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30).choices[0].token_ids)
        )
    t.join()
    assert len(errors) == 3 and all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
    assert "more than any 512-token context can hold" in errors[0].details()
    assert time.monotonic() - t0 < 30 and ok and set(ok) == {3}


def test_a_prompt_too_long_in_tokens_is_refused_after_tokenizing_off_the_loop(plain):
    req = generation_pb2.GenerateRequest(
        prompt="the quick brown fox " * 400,
        raw_prompt=True,
        sampling=generation_pb2.SamplingParams(max_tokens=4),
    )
    with pytest.raises(grpc.RpcError) as err:
        plain.stub.Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in err.value.details()


@pytest.mark.parametrize("kind", ["invalid utf-8", "garbage"])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Abort"])
def test_malformed_messages_and_invalid_utf8_are_invalid_argument(plain, kind, method):
    # a string field (prompt = field 2; Abort's request_id = field 1) holding bytes that are not
    # UTF-8
    field = b"\x0a" if method == "Abort" else b"\x12"
    raw = field + b"\x02\xff\xfe" if kind == "invalid utf-8" else b"\xff\xff\xff\xff not a protobuf"
    path = f"/pagedserve.v1.Generation/{method}"
    call = (
        plain.channel.unary_stream if method == "GenerateStream" else plain.channel.unary_unary
    )(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        result = call(raw, timeout=10)
        if method == "GenerateStream":
            list(result)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "not a valid pagedserve.v1." in err.value.details()
    assert len(plain.stub.Generate(greedy_request([5, 6], 2), timeout=30).choices[0].token_ids) == 2


def test_a_vanishing_temperature_is_greedy_not_nan(plain):
    greedy = plain.stub.Generate(greedy_request([9, 10, 11], 12), timeout=30).choices[0].token_ids
    req = greedy_request([9, 10, 11], 12)
    req.sampling.temperature = 1e-38
    assert plain.stub.Generate(req, timeout=30).choices[0].token_ids == greedy


def test_stop_strings_are_capped_in_length(plain):
    req = greedy_request([9, 10], 4)
    req.sampling.stop.append("x" * 257)
    with pytest.raises(grpc.RpcError) as err:
        plain.stub.Generate(req, timeout=30)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "256 characters" in err.value.details()
    )


def test_request_ids_are_not_exposed_and_logged_truncated(plain):
    rid = "secret-" + "z" * 240
    # the workers are held still before the request arrives, so it is scheduled and still running
    # when it is aborted, however fast the stream (a looping greedy answer drafts 4+ tokens a step:
    # 200 tokens once ended before the test could stop the workers) and however slow this process
    held = children_of(plain.proc.pid)
    for pid in held:
        os.kill(int(pid), signal.SIGSTOP)
    try:
        t = threading.Thread(
            target=lambda: list(
                plain.stub.GenerateStream(greedy_request([1, 2, 3], 200, rid), timeout=60)
            )
        )
        t.start()
        deadline, rows = time.monotonic() + 5, []
        while time.monotonic() < deadline and not (rows and rows[0].num_blocks > 0):
            time.sleep(0.02)
            rows = plain.stats().requests
        assert len(rows) == 1 and rows[0].request_id == "" and rows[0].num_blocks > 0
        assert plain.stub.Abort(
            generation_pb2.AbortRequest(request_id=rid), timeout=10
        ).aborted  # the owner can
    finally:
        for pid in held:
            os.kill(int(pid), signal.SIGCONT)
    t.join(30)
    assert not t.is_alive()
    log = plain.log_path.read_text()
    assert rid[:64] in log and rid not in log


def test_the_api_can_be_served_over_tls(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    from deploy.processes import ROOT, read_port_file

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    ports = tmp_path / "server.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.launcher",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--port-file",
            str(ports),
            "--threads",
            "1",
            "--block-size",
            "4",
            "--num-blocks",
            "200",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--http-port",
            "-1",
            "--metrics-port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (
            (bound := read_port_file(ports)) is None
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert bound is not None, "the server did not say which port it bound"
        generate = [
            sys.executable,
            "-m",
            "deploy.cli",
            "generate",
            "--raw",
            "the quick",
            "--max-tokens",
            "4",
            "--server",
            f"localhost:{bound['port']}",
            "--timeout",
            "10",
        ]
        deadline = time.monotonic() + 120
        while True:  # UNAVAILABLE while the worker loads
            out = subprocess.run(
                [*generate, "--tls-ca", str(cert)], cwd=ROOT, capture_output=True, text=True
            )
            if out.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out.returncode == 0, out.stderr
        plain = subprocess.run(generate, cwd=ROOT, capture_output=True, text=True)
        assert plain.returncode != 0 and "UNAVAILABLE" in plain.stderr  # no plaintext on a TLS port
        import ssl

        import httpx  # the OpenAI API: HTTPS with the same certificate, and no plain HTTP either

        trust = ssl.create_default_context(cafile=str(cert))
        https = httpx.post(
            f"https://localhost:{bound['http_port']}/v1/completions",
            verify=trust,
            timeout=30,
            json={"prompt": "the quick", "max_tokens": 3},
        )
        assert https.status_code == 200 and https.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{bound['http_port']}/v1/models", timeout=10)
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
