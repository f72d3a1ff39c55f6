"""pagedserve behind SMG: the OpenAI SDK through the gateway against our own API, on real processes.

The default model serves both the engine protocol SMG drives and pagedserve.v1 on one port; SMG
(`smg launch --worker-urls grpc://...`) renders the chat template, tokenizes and serves OpenAI HTTP.
KV events, refusals and two servers behind one gateway run on a tiny random Llama.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import grpc
import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from deploy.gateway import GatewayProcess, registered_models
from deploy.processes import ROOT, free_port, read_port_file
from protos import generation_pb2 as pb
from scheduler_service.core.block_allocator import block_hash
from scheduler_service.runtime.kv_events import event_hash
from scheduler_service.text.tokenizer import Tokenizer
from tests.support.server import ServerProcess
from tests.support.tiny import make_tiny_embedder

pytestmark = pytest.mark.slow
MODEL_DIR = Path(
    os.environ.get(
        "PAGEDSERVE_MODEL_DIR",
        Path(__file__).resolve().parents[2] / ".models" / "smollm2-135m-instruct",
    )
)

CONVERSATION = [
    {"role": "system", "content": "you answer in one line"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "and the quick brown fox?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default model, stopped when this module ends (the session's servers stay up until the
    end).
    """
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip(f"default model not prepared in {MODEL_DIR} (run `make setup`)")
    s = ServerProcess(
        MODEL_DIR,
        tmp_path_factory.mktemp("server") / "server.log",
        "--expose-request-ids",
        "--threads",
        "1",
        "--num-blocks",
        "320",
        "--max-model-len",
        "2048",
    ).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, "--block-size", "4", "--num-blocks", "160")


def start_gateway(servers, model_dir, tmp_path_factory, policy="cache_aware"):
    for attempt in range(3):  # SMG takes a port number: another process may take it first
        try:
            return GatewayProcess(
                [s.address for s in servers],
                model_dir,
                tmp_path_factory.mktemp("smg") / "smg.log",
                free_port(),
                policy,
            ).start()
        except RuntimeError:
            if attempt == 2:
                raise


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    g = start_gateway([server], MODEL_DIR, tmp_path_factory)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return OpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def own(server, messages, **sampling):
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling=pb.SamplingParams(temperature=0.0, **sampling),
    )
    return server.stub.Generate(req, timeout=60)


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if not stats.requests and stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"requests still live: {server.stats()}")


def test_a_chat_through_the_gateway_equals_our_own_api(server, client, model):
    theirs = client.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=24, temperature=0
    )
    ours = own(server, CONVERSATION, max_tokens=24)
    assert theirs.choices[0].message.content == ours.choices[0].text
    assert theirs.usage.completion_tokens == len(ours.choices[0].token_ids)
    # the same chat template, rendered by SMG
    assert theirs.usage.prompt_tokens == ours.usage.prompt_tokens
    expected = "length" if ours.choices[0].finish_reason == pb.LENGTH else "stop"
    assert theirs.choices[0].finish_reason == expected


def test_streamed_deltas_add_up_to_the_unary_answer(client, model):
    unary = client.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=20, temperature=0
    )
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=20, temperature=0, stream=True
    ):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == unary.choices[0].message.content
    assert finish == unary.choices[0].finish_reason


def test_stop_strings_end_the_answer_and_name_the_match(server, client, model):
    messages = CONVERSATION[:2]
    full = own(server, messages, max_tokens=24, ignore_eos=True).choices[0].text
    stop = full[8:12]
    assert stop.strip(), f"no usable stop string in {full!r}"
    cut = full[: full.index(stop)]
    ours = own(server, messages, max_tokens=24, ignore_eos=True, stop=[stop])
    assert ours.choices[0].text == cut and ours.choices[0].stop_str == stop
    theirs = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert theirs.choices[0].message.content == cut
    assert theirs.choices[0].finish_reason == "stop"
    assert theirs.choices[0].model_extra.get("matched_stop") == stop


def test_n_samples_and_max_tokens(client, model):
    resp = client.chat.completions.create(
        model=model,
        messages=CONVERSATION,
        max_tokens=6,
        temperature=1.0,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 12


def test_logprobs_match_our_own(server, client, model):
    theirs = client.chat.completions.create(
        model=model,
        messages=CONVERSATION,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    ours = own(server, CONVERSATION, max_tokens=6, ignore_eos=True, logprobs=3).choices[0].logprobs
    assert len(ours) == 6
    # A random model draws bytes that are no whole character; the gateway shows such a run of tokens
    # as one entry. Every entry it shows is one of our tokens, in order, with the same logprob and
    # top 3.
    entries = theirs.choices[0].logprobs.content
    assert 2 <= len(entries) <= 6
    j = 0
    for got in entries:
        while j < len(ours) and abs(ours[j].logprob - got.logprob) > 1e-4:
            j += 1
        assert j < len(ours), f"entry {got} is none of our tokens"
        expected = [t.logprob for t in ours[j].top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(expected, abs=1e-4)
        j += 1


def test_response_format_json_schema_parses_and_validates(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "weather as JSON"}],
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema},
        },
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_a_bad_request_is_a_400_with_the_engines_message(client, model):
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=5000)
    assert "max_tokens is 5000" in str(info.value) and "context" in str(info.value)


def test_closing_a_stream_mid_answer_frees_its_blocks(server, gateway, model):
    """The worker is held still once the answer streams (released whatever happens, well within the
    heartbeat deadline), so the answer is still running when looked at however fast the machine or
    its drafts; the stream closed, the gateway aborts it on the engine.
    """
    wait_idle(server)
    # 1500 tokens: seconds of work even when earlier answers to this conversation draft most of it
    body = {
        "model": model,
        "messages": CONVERSATION,
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            # kept: dropping the iterator would close the connection (and the
            lines = resp.iter_lines()
            for line in lines:  # gateway would abort the answer) before it is looked at
                if line.startswith("data:"):
                    break
            # the first line may come before the engine has the request
            deadline = time.monotonic() + 30
            while server.stats().num_running == 0:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.01)
            (worker,) = subprocess.run(
                ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
            ).stdout.split()
            os.kill(int(worker), signal.SIGSTOP)
            try:
                assert server.stats().num_running == 1
            finally:
                os.kill(int(worker), signal.SIGCONT)
    stats = wait_idle(server)
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks


def test_kv_events_report_stored_and_removed_blocks_with_the_allocators_hashes(
    tiny_server, tiny_model_dir
):
    server = tiny_server
    tok = Tokenizer(tiny_model_dir)
    stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel)
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    stored, removed = {}, set()
    last = [0]

    def read_until(done):
        for batch in stream:
            # a heartbeat repeats the last number this stream carried, with the load
            if batch.load.load_only:
                assert not batch.events and batch.sequence_number == last[0]
                assert batch.load.max_running_requests > 0
            else:
                assert batch.sequence_number > last[0]
                last[0] = batch.sequence_number
            for e in batch.events:
                if e.HasField("stored"):
                    for b in e.stored.blocks:
                        stored[b.block_hash] = (
                            list(b.token_ids),
                            e.stored.parent_block_hash
                            if e.stored.HasField("parent_block_hash")
                            else None,
                        )
                elif e.HasField("removed"):
                    removed.update(e.removed.block_hashes)
            if done():
                return

    prompt = tok.encode(
        "paged attention stores keys and values in blocks of four tokens each", False
    )[:24]
    server.stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0)
        ),
        timeout=60,
    )
    hashes = []
    for i in range(len(prompt) // 4):
        hashes.append(block_hash(hashes[-1] if hashes else None, prompt[4 * i : 4 * i + 4]))
    expected = [event_hash(h) for h in hashes]
    read_until(lambda: all(h in stored for h in expected))
    for i, h in enumerate(expected):
        assert stored[h][0] == prompt[4 * i : 4 * i + 4]
        assert stored[h][1] == (expected[i - 1] if i else None)
    # Fill the pool with other prompts until the first prompt's blocks are evicted.
    filler = 0
    deadline = time.monotonic() + 60
    while not set(expected) <= removed and time.monotonic() < deadline:
        for _ in range(4):
            filler += 1
            ids = [(filler * 7 + j) % (tok.vocab_size - 10) + 5 for j in range(120)]
            server.stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=1, temperature=0)
                ),
                timeout=60,
            )
        read_until(lambda: set(expected) <= removed or True)
    stream.cancel()
    assert set(expected) <= removed


def test_engine_protocol_refuses_what_it_cannot_serve(tiny_server):
    server = tiny_server
    stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel)
    bad = [
        (vllm_engine_pb2.SamplingParams(structural_tag="{}"), "structural_tag"),
        (vllm_engine_pb2.SamplingParams(logprobs=-1), "logprobs must lie in [0, 20]"),
        (vllm_engine_pb2.SamplingParams(top_p=1.5), "top_p must lie in (0, 1]"),
    ]
    for params, message in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Generate(
                    vllm_engine_pb2.GenerateRequest(
                        request_id="bad",
                        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
                        sampling_params=params,
                    ),
                    timeout=30,
                )
            )
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and message in info.value.details()
        )
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                vllm_engine_pb2.GenerateRequest(
                    request_id="mm",
                    tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5]),
                    mm_inputs=vllm_engine_pb2.MultimodalInputs(),
                ),
                timeout=30,
            )
        )
    assert "mm_inputs" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # a generative model serves no embeddings
        stub.Embed(
            vllm_engine_pb2.EmbedRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5])),
            timeout=10,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "serves no embeddings" in info.value.details()
    choice = list(
        stub.Generate(
            vllm_engine_pb2.GenerateRequest(
                request_id="choice",
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
                sampling_params=vllm_engine_pb2.SamplingParams(
                    temperature=0,
                    max_tokens=20,
                    choice=vllm_engine_pb2.ChoiceConstraint(choices=["yes (a)", "no.b"]),
                ),
            ),
            timeout=30,
        )
    )
    tok_ids = choice[-1].complete.output_ids
    assert Tokenizer(server.model_dir).decode(list(tok_ids)) in ("yes (a)", "no.b")
    info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
    ours = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_context_length == ours.max_context
    assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10).healthy
    zipped = b"".join(
        c.data for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10)
    )
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(zipped)).namelist()


def test_two_servers_behind_one_gateway_route_a_shared_prefix_to_its_holder(
    server_factory, tiny_model_dir, tmp_path_factory
):
    servers = [
        server_factory(tiny_model_dir, "--block-size", "4", "--num-blocks", "160") for _ in range(2)
    ]
    g = start_gateway(servers, tiny_model_dir, tmp_path_factory, policy="cache_aware")
    try:
        client = OpenAI(base_url=f"{g.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        prefix = "paged attention stores keys and values in blocks; " * 6
        first = client.completions.create(
            model=model, prompt=prefix + "the fox", max_tokens=2, temperature=0
        )
        assert first.usage.prompt_tokens > 40
        second = client.completions.create(
            model=model, prompt=prefix + "the dog", max_tokens=2, temperature=0
        )
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        held = [s.stats().prefix_cache_hits for s in servers]
        assert sorted(held)[0] == 0 and sorted(held)[1] > 0  # both landed on the same server
    finally:
        g.stop()


def test_a_gateway_started_before_the_servers_workers_serves_once_they_join(
    tmp_path, tiny_model_dir
):
    """Servers and gateway start side by side (a Kubernetes rollout): the gateway registers the
    server while it still waits for its workers, and routes to it once it serves.
    """
    log = open(tmp_path / "scheduler.log", "w")
    ports = tmp_path / "scheduler.port"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler_service.main",
                "--model",
                str(tiny_model_dir),
                "--port",
                "0",
                "--port-file",
                str(ports),
                "--worker-endpoint",
                "tcp://127.0.0.1:0",
                "--metrics-port",
                "0",
                "--block-size",
                "4",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ]
    g = None
    try:
        deadline = time.monotonic() + 60
        while (bound := read_port_file(ports)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert bound is not None
        g = GatewayProcess(
            [f"127.0.0.1:{bound['port']}"], tiny_model_dir, tmp_path / "smg.log", free_port()
        )
        g.start(wait=False)
        deadline = time.monotonic() + 30
        while not registered_models(g.base_url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert registered_models(g.base_url) == [tiny_model_dir.name], g.log_tail()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker.serve.main",
                    "--model",
                    str(tiny_model_dir),
                    "--scheduler",
                    bound["worker_endpoint"],
                    "--block-size",
                    "4",
                    "--num-blocks",
                    "200",
                    "--threads",
                    "1",
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        client = OpenAI(base_url=f"{g.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = client.chat.completions.create(
                    model=tiny_model_dir.name,
                    max_tokens=3,
                    temperature=0,
                    messages=[{"role": "user", "content": "the fox"}],
                    extra_body={"ignore_eos": True},
                )
                break
            # noqa: BLE001 - 503 until the gateway's health probe finds the server serving
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert resp.usage.completion_tokens == 3
    finally:
        if g is not None:
            g.stop()
        for p in reversed(procs):
            p.kill()
            p.wait()
        log.close()


def test_the_load_test_client_drives_the_gateway(gateway, server, tmp_path):
    from deploy import loadtest

    out = tmp_path / "gateway.json"
    assert (
        loadtest.main(
            [
                "--target",
                gateway.base_url,
                "--tokenizer",
                str(MODEL_DIR),
                "--num-requests",
                "6",
                "--concurrency",
                "3",
                "--input-len",
                "32",
                "--output-len",
                "8",
                "--warmup",
                "1",
                "--no-progress",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["total_output_tokens"] == 48 and 6 * 16 <= r["total_input_tokens"] <= 6 * 64
    assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p50"] > 0
    wait_idle(server)


@pytest.fixture(scope="module")
def embedder(server_factory, tmp_path_factory):
    folder = make_tiny_embedder(tmp_path_factory.mktemp("embedder"), "lasttoken", seed=11)
    return folder, server_factory(folder)


def test_openai_embeddings_through_the_gateway_equal_our_embed(embedder, tmp_path_factory):
    """Each text's vector through SMG (the SDK's default base64 request, and float) equals Embed's.
    SMG 1.13's gRPC embeddings path sends an `input` list as one text (its items joined by spaces)
    and answers one vector: pinned here, so a gateway that sends them apart is noticed; a batch goes
    as one call per text, or to Embed itself.
    """
    import numpy as np

    folder, server = embedder
    gateway = start_gateway([server], folder, tmp_path_factory)
    try:
        client = OpenAI(
            base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0, timeout=60
        )
        model = client.models.list().data[0].id
        texts = [
            "the quick brown fox",
            "What is the capital of France?",
            "paged attention stores keys",
        ]
        ours = server.stub.Embed(pb.EmbedRequest(texts=texts), timeout=60)
        want = np.array([list(d.values) for d in ours.data], dtype=np.float32)
        got = [client.embeddings.create(model=model, input=t) for t in texts]
        np.testing.assert_allclose(np.array([g.data[0].embedding for g in got]), want, atol=1e-6)
        assert [g.usage.prompt_tokens for g in got] == [d.prompt_tokens for d in ours.data]
        floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
        # (the SDK's own: base64)
        np.testing.assert_allclose(floats.data[0].embedding, want[0], atol=1e-6)
        # what SMG 1.13 drops, said in docs/serving.md (the server's own /v1/embeddings serves
        # each): `dimensions` (the whole vector comes back) and base64 (floats come back)
        cut = client.embeddings.create(
            model=model, input=texts[0], dimensions=4, encoding_format="float"
        )
        assert len(cut.data[0].embedding) == want.shape[1]
        import httpx

        raw = httpx.post(
            f"{gateway.base_url}/v1/embeddings",
            timeout=60,
            json={"model": model, "input": texts[0], "encoding_format": "base64"},
        ).json()
        assert isinstance(raw["data"][0]["embedding"], list)
        joined = server.stub.Embed(pb.EmbedRequest(texts=[" ".join(texts)]), timeout=60)
        batch = client.embeddings.create(model=model, input=texts)
        assert len(batch.data) == 1
        np.testing.assert_allclose(batch.data[0].embedding, joined.data[0].values, atol=1e-6)
        for bad, reason in (("", "empty"), ("the fox " * 400, "maximum context length is 512")):
            with pytest.raises(BadRequestError) as e:
                client.embeddings.create(model=model, input=bad)
            assert reason in str(e.value)
        wait_idle(server)
        stats = server.stats()
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    finally:
        gateway.stop()


def test_completion_logprobs_are_dropped_by_the_gateway_and_served_by_our_own_http(
    server, client, model
):
    """SMG 1.13 validates a completion's `logprobs` and returns none (said in docs/serving.md); the
    server's own OpenAI API returns them.
    """
    through = client.completions.create(
        model=model, prompt="the quick brown", max_tokens=3, logprobs=2, temperature=0
    )
    assert through.choices[0].logprobs is None
    own_api = OpenAI(base_url=server.http_url, api_key="none", max_retries=0, timeout=60)
    direct = own_api.completions.create(
        prompt="the quick brown",
        max_tokens=3,
        logprobs=2,
        temperature=0,
        model=own_api.models.list().data[0].id,
    )
    assert len(direct.choices[0].logprobs.token_logprobs) == 3


def test_a_generative_model_refuses_embeddings_through_the_gateway(client, model):
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model=model, input=["the quick brown fox"])
    assert "serves no embeddings" in str(e.value)


def test_an_adapter_is_out_of_the_gateways_reach_and_in_our_own_https(
    server_factory, tiny_model_dir, tmp_path, tmp_path_factory
):
    """SMG 1.13 knows a worker by its one model id and its engine protocol has no LoRA field (said
    in docs/serving.md): `model=<adapter>` through it is a 404 (never the base model's answer under
    the adapter's name); the server's own OpenAI API serves the adapter.
    """
    from openai import NotFoundError

    from tests.support.lora import ALL, make_adapter

    adapter = make_adapter(tiny_model_dir, tmp_path / "sql", r=4, targets=ALL, alpha=16, seed=4)
    s = server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "160",
        "--lora-modules",
        f"sql={adapter}",
    )
    g = start_gateway([s], tiny_model_dir, tmp_path_factory)
    try:
        through = OpenAI(base_url=f"{g.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        listed = [m.id for m in through.models.list().data]
        assert "sql" not in listed
        prompt = "the quick brown fox"
        with pytest.raises(NotFoundError):
            through.completions.create(model="sql", prompt=prompt, max_tokens=6, temperature=0)
        base = through.completions.create(
            model=listed[0], prompt=prompt, max_tokens=6, temperature=0
        )
        own = OpenAI(base_url=s.http_url, api_key="none", max_retries=0, timeout=60)
        with_adapter = own.completions.create(
            model="sql", prompt=prompt, max_tokens=6, temperature=0
        )
        assert with_adapter.model == "sql" and with_adapter.choices[0].text != base.choices[0].text
    finally:
        g.stop()
