"""The whole surface fuzzed as an outside client would: every HTTP operation of /openapi.json by
schemathesis (bodies that fit the schema and bodies that do not), every gRPC method by random bytes
and by hypothesis-built messages. Whatever arrives: no 5xx, no UNKNOWN or INTERNAL, no traceback in
the server's log, no block held after, the server still serving. `make fuzz` runs the same tests
with many more examples (`--fuzz-examples`).
"""

import json
import random
import socket
import time

import grpc
import pytest
import requests
import schemathesis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.support.fuzz import messages, rpc_methods

pytestmark = pytest.mark.slow

ROUTES = {
    ("/v1/chat/completions", "post"),
    ("/v1/completions", "post"),
    ("/v1/embeddings", "post"),
    ("/v1/responses", "post"),
    ("/v1/responses/{response_id}", "get"),
    ("/v1/responses/{response_id}", "delete"),
    ("/v1/messages", "post"),
    ("/v1/messages/count_tokens", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model}", "get"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/v1/load_lora_adapter", "post"),
    ("/v1/unload_lora_adapter", "post"),
    ("/health", "get"),
    ("/metrics", "get"),
    ("/openapi.json", "get"),
}


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    # a short context keeps each generated request short; embeddings served beside generation
    return server_factory(
        tiny_model_dir, "--max-model-len", "96", "--num-blocks", "256", "--task", "both"
    )


@pytest.fixture(scope="module")
def base_url(server):
    return server.http_url.removesuffix("/v1")


def quiet_and_whole(server) -> None:
    """Nothing running or held once the fuzzing ends, no traceback logged, still serving."""
    deadline = time.monotonic() + 20
    while (
        (st_ := server.stats()).num_running
        or st_.num_waiting
        or (st_.num_free_blocks + st_.num_cached_blocks != st_.num_blocks)
    ):
        assert time.monotonic() < deadline, f"still held after the fuzzing: {st_}"
        time.sleep(0.1)
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000) :][:6000]
    health = health_pb2_grpc.HealthStub(server.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving


def test_openapi_json_documents_every_route_with_the_models_it_checks_with(base_url):
    spec = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    assert spec["openapi"].startswith("3.1")
    ops = {(path, method) for path, item in spec["paths"].items() for method in item}
    assert ops == ROUTES
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    ref = chat["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    body = spec["components"]["schemas"][ref]
    assert body["required"] == ["messages"] and body["additionalProperties"] is False
    assert {"messages", "tools", "guided_json", "max_completion_tokens"} <= set(body["properties"])
    # a refusal's shape is said, and the document is one schemathesis can load and walk
    schema = schemathesis.openapi.from_dict(spec)
    assert len([op for op in schema.get_all_operations() if op.ok()]) == len(ROUTES)


@pytest.fixture(scope="module")
def schema(base_url):
    loaded = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return loaded


@pytest.mark.parametrize("path,method", sorted(ROUTES), ids=[f"{m} {p}" for p, m in sorted(ROUTES)])
def test_schemathesis_finds_no_server_error(server, base_url, schema, fuzz_examples, path, method):
    op = schema[path][method.upper()]
    session = requests.Session()

    @settings(
        max_examples=fuzz_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def run(case):
        response = case.call(base_url=base_url, session=session, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])

    run()
    if method == "post":
        quiet_and_whole(server)


def _raw(base_url: str, data: bytes, then_close: bool = False) -> bytes:
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        if then_close:
            return b""
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "head, says",
    [
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", "Duplicate Content-Length"),
        (b"Content-Length: -1\r\n", "Invalid character in Content-Length"),
        (b"X-Note: a\x01b\r\n", "Invalid header value char"),
    ],
)
def test_bytes_no_http_parser_reads_get_openai_json(server, base_url, head, says):
    """Requests the HTTP parser itself refuses are answered in OpenAI's error shape (they had been
    a plain-text "Invalid HTTP request received.")."""
    answer = _raw(base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\nhello")
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in status
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]


def test_a_client_gone_before_its_body_is_whole_leaves_no_trace(server, base_url):
    """Headers promising 1,000 bytes, 14 sent, the socket closed: nothing runs, nothing is held,
    the log says 499 in one line (it had logged a 500 with a traceback)."""
    cut = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"messages": ['
    )
    _raw(base_url, cut, then_close=True)
    deadline = time.monotonic() + 10
    while b"before its request body was complete" not in server.log_path.read_bytes():
        assert time.monotonic() < deadline, "the cut request was never logged"
        time.sleep(0.1)
    quiet_and_whole(server)


# --- gRPC -----------------------------------------------------------------------------------------

BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
METHODS = rpc_methods()


ENDLESS = ("/Watch", "/SubscribeKvEvents")  # streams that wait for news: cut after the first


def _call(channel, method: str, streamed: bool, payload: bytes):
    """The status an RPC of raw bytes ends with (OK for an endless stream cut by the client, or
    one with nothing to say within its short deadline)."""
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    endless = method.endswith(ENDLESS)
    try:
        if not streamed:
            channel.unary_unary(method, ident, ident)(payload, timeout=60)
        else:
            call = channel.unary_stream(method, ident, ident)(payload, timeout=2 if endless else 60)
            for _ in call:
                if endless:
                    call.cancel()
                    break
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED or (
            endless and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ):
            return grpc.StatusCode.OK, ""
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_every_rpc_is_fuzzed(server):
    assert len(METHODS) == 24
    assert {"/grpc.health.v1.Health/Watch", "/vllm.grpc.engine.VllmEngine/Generate"} <= {
        m for m, _, _ in METHODS
    }


def test_random_bytes_on_every_rpc_end_with_a_client_status(server, fuzz_examples):
    rng = random.Random(66)
    seen = []
    for method, _, streamed in METHODS:
        for _ in range(fuzz_examples):
            n = rng.choice([1, 2, 7, 64, 900])
            payload = bytes(rng.getrandbits(8) for _ in range(n))
            code, details = _call(server.channel, method, streamed, payload)
            seen.append(code)
            assert code not in BAD, f"{method} {payload!r}: {code} {details}"
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    quiet_and_whole(server)


@pytest.mark.parametrize("method,request_type,streamed", METHODS, ids=[m[0] for m in METHODS])
def test_hypothesis_messages_on_every_rpc_end_with_a_client_status(
    server, fuzz_examples, method, request_type, streamed
):
    @settings(
        max_examples=fuzz_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(msg=messages(request_type.DESCRIPTOR))
    def run(msg):
        code, details = _call(server.channel, method, streamed, msg.SerializeToString())
        assert code not in BAD, f"{method} {msg}: {code} {details}"

    run()
    if method.endswith("Generate") or method.endswith("GenerateStream"):
        quiet_and_whole(server)
