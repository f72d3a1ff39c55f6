"""Embeddings end to end: an embedding model's vectors equal sentence-transformers' `encode`
(last-token and mean pooling, prompts, Matryoshka dimensions), alone, batched with generation in the
same steps, through the prefix cache; bad input refused by name; every block back.
"""

import concurrent.futures
import threading

import grpc
import numpy as np
import pytest

from protos import generation_pb2 as pb
from tests.support.tiny import CORPUS, make_tiny_embedder

pytestmark = pytest.mark.slow

INSTRUCTION = "Instruct: given a question, find the passage that answers it\nQuery: "
TEXTS = [
    "the quick brown fox",
    "What is the capital of France?",
    "paged attention stores keys and values",
    CORPUS[:300],
    "a",
    CORPUS[100:170],
]


def reference(folder, texts, **kwargs):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=4, **kwargs)


def vectors(response):
    return np.array([list(d.values) for d in response.data], dtype=np.float32)


def assert_same_vectors(ours, ref):
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def no_leak(server):
    st = server.stats()
    assert st.num_running == 0 and st.num_waiting == 0
    assert st.num_free_blocks + st.num_cached_blocks == st.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def last_model(tmp_path_factory):
    """Last-token pooling, normalized, a tied head (as Qwen3-Embedding), an instruction to name."""
    return make_tiny_embedder(
        tmp_path_factory.mktemp("embed-last"),
        "lasttoken",
        seed=3,
        tied=True,
        prompts={"query": INSTRUCTION},
    )


@pytest.fixture(scope="module")
def both(server_factory, last_model):
    """The embedding model serving generation too (--task both), in steps of 48 tokens: long texts
    take several chunks, and embeddings share steps with the decodes (one token a step each: a
    verifying step carries no embeddings, tests/unit/test_embed_scheduling.py).
    """
    return server_factory(
        last_model, "--task", "both", "--max-num-batched-tokens", "48", "--speculative", "off"
    )


def test_vectors_equal_sentence_transformers_with_prompts_and_dimensions(both, last_model):
    info = both.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.task, info.pooling, info.embedding_dimension, info.normalized) == (
        "both",
        "last",
        64,
        True,
    )
    assert list(info.prompt_names) == ["query"]
    response = both.stub.Embed(pb.EmbedRequest(request_id="e1", texts=TEXTS), timeout=60)
    assert response.request_id == "e1" and [d.index for d in response.data] == list(
        range(len(TEXTS))
    )
    assert_same_vectors(vectors(response), reference(last_model, TEXTS))
    assert response.usage.prompt_tokens == sum(d.prompt_tokens for d in response.data) > len(TEXTS)

    named = both.stub.Embed(pb.EmbedRequest(texts=TEXTS[:3], prompt_name="query"), timeout=60)
    assert_same_vectors(vectors(named), reference(last_model, TEXTS[:3], prompt_name="query"))
    own = both.stub.Embed(pb.EmbedRequest(texts=TEXTS[:3], prompt=INSTRUCTION), timeout=60)
    np.testing.assert_allclose(vectors(own), vectors(named), atol=1e-6)

    short = vectors(both.stub.Embed(pb.EmbedRequest(texts=TEXTS, dimensions=16), timeout=60))
    ref = reference(last_model, TEXTS)[:, :16]
    # truncated, then unit
    assert_same_vectors(short, ref / np.linalg.norm(ref, axis=1, keepdims=True))

    from sentence_transformers import SentenceTransformer

    ids = SentenceTransformer(str(last_model), device="cpu").tokenizer(TEXTS[1])["input_ids"]
    by_ids = both.stub.Embed(pb.EmbedRequest(inputs=[pb.TokenIds(ids=ids)]), timeout=60)
    assert_same_vectors(vectors(by_ids), reference(last_model, TEXTS[1:2]))
    no_leak(both)


def test_embeddings_share_steps_with_a_generation_and_change_nothing(both, last_model):
    prompt = list(range(5, 25))
    greedy = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    alone = both.stub.Generate(
        pb.GenerateRequest(prompt_token_ids=prompt, sampling=greedy), timeout=120
    )
    texts = [f"{t} {i}" for i in range(6) for t in TEXTS[:4]]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = threading.Event()

        def stream():
            tokens = []
            for msg in both.stub.GenerateStream(
                pb.GenerateRequest(prompt_token_ids=prompt, sampling=greedy), timeout=120
            ):
                tokens += msg.token_ids
                started.set()
            return tokens

        generation = pool.submit(stream)
        assert started.wait(60)
        embedded = both.stub.Embed(pb.EmbedRequest(texts=texts), timeout=120)
        assert not generation.done(), "the embeddings waited for the generation to end"
        beside = generation.result()
    assert beside == list(alone.choices[0].token_ids)
    assert_same_vectors(vectors(embedded), reference(last_model, texts))
    st = both.stats()
    assert st.num_embeddings >= len(texts)
    no_leak(both)


def test_a_shared_instruction_is_computed_once(both, last_model):
    texts = [f"question {i}: what does the scheduler batch?" for i in range(4)]
    both.stub.Embed(pb.EmbedRequest(texts=texts[:1], prompt_name="query"), timeout=60)
    rest = both.stub.Embed(pb.EmbedRequest(texts=texts[1:], prompt_name="query"), timeout=60)
    assert all(d.cached_prompt_tokens >= 16 for d in rest.data), (
        "the instruction's blocks were recomputed"
    )
    assert rest.usage.cached_prompt_tokens == sum(d.cached_prompt_tokens for d in rest.data)
    assert_same_vectors(vectors(rest), reference(last_model, texts[1:], prompt_name="query"))


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(texts=["fine", ""]), "text 1 is empty"),
        (dict(), "no input to embed"),
        (dict(texts=["x"], inputs=[pb.TokenIds(ids=[5])]), "exactly one of texts and inputs"),
        (dict(inputs=[pb.TokenIds(ids=[5, 4000])]), "outside the vocabulary"),
        (dict(texts=["the fox " * 400]), "the model's context is 512"),
        (dict(texts=["x"], dimensions=65), "dimensions is 65"),
        (
            dict(texts=["x"], prompt_name="passage"),
            "prompt_name 'passage' is not one of the model's prompts",
        ),
        (dict(texts=["x"], truncate_prompt_tokens=-2), "truncate_prompt_tokens must be"),
    ],
)
def test_bad_input_is_refused_by_name(both, request_kwargs, message):
    with pytest.raises(grpc.RpcError) as e:
        both.stub.Embed(pb.EmbedRequest(**request_kwargs), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    no_leak(both)


def test_truncation_keeps_the_last_tokens(both, last_model):
    long = "the fox " * 400
    response = both.stub.Embed(
        pb.EmbedRequest(texts=[long], truncate_prompt_tokens=100), timeout=60
    )
    assert response.data[0].prompt_tokens == 100
    whole = both.stub.Embed(pb.EmbedRequest(texts=[long], truncate_prompt_tokens=-1), timeout=60)
    assert whole.data[0].prompt_tokens == 512


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory):
    return make_tiny_embedder(tmp_path_factory.mktemp("embed-mean"), "mean_tokens", seed=5)


def test_mean_pooling_over_chunks_equals_sentence_transformers(server_factory, mean_model):
    """A head-less model (embed only; it refuses generation), a pool of 24 blocks of 16 and steps of
    32 tokens: four calls at once, texts of up to ~80 tokens summed over several chunks, waiting for
    room. (Preempted embeddings pooling again: tests/unit/test_embed_scheduling.py.)
    """
    server = server_factory(
        mean_model, "--num-blocks", "24", "--max-num-batched-tokens", "32", "--max-model-len", "256"
    )
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.task, info.pooling) == ("embed", "mean")
    texts = [CORPUS[i * 37 : i * 37 + 150 + 40 * (i % 4)] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        calls = [
            pool.submit(server.stub.Embed, pb.EmbedRequest(texts=texts[i::4]), timeout=120)
            for i in range(4)
        ]
        results = [c.result() for c in calls]
    ours = np.zeros((len(texts), 64), dtype=np.float32)
    for i, r in enumerate(results):
        ours[i::4] = vectors(r)
    assert_same_vectors(ours, reference(mean_model, texts))
    assert server.stats().num_embeddings == len(texts)
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)), timeout=30
        )
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "does not generate" in e.value.details()
    )
    no_leak(server)


def test_the_terminal_and_the_load_tester_embed(both, last_model, capsys, tmp_path):
    import json

    from deploy.cli import main as cli_main
    from deploy.loadtest import main as loadtest_main

    assert (
        cli_main(["embed", TEXTS[0], TEXTS[1], "--dimensions", "8", "--server", both.address]) == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and all(len(r["embedding"]) == 8 for r in rows)
    ref = reference(last_model, TEXTS[:2])[:, :8]
    np.testing.assert_allclose(
        np.array([r["embedding"] for r in rows]),
        ref / np.linalg.norm(ref, axis=1, keepdims=True),
        atol=1e-4,
    )
    assert cli_main(["embed", "", "--server", both.address]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    out = tmp_path / "run.json"
    assert (
        loadtest_main(
            [
                "--target",
                both.address,
                "--endpoint",
                "embeddings",
                "--num-requests",
                "12",
                "--concurrency",
                "4",
                "--input-len",
                "40",
                "--output",
                str(out),
                "--no-progress",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["completed"] == 12 and r["failed"] == 0 and r["leaked_blocks"] == 0
    assert r["total_input_tokens"] == 12 * 40 and r["request_throughput"] > 0


def test_the_http_api_embeds_a_list_equal_to_grpc_with_dimensions_and_base64(both):
    """/v1/embeddings through the openai SDK: three inputs give three vectors, each the gRPC
    Embed's, cut to `dimensions`; base64 carries the same float32 values; bad options are 400s
    naming them.
    """
    import base64

    import httpx
    import openai

    client = openai.OpenAI(base_url=both.http_url, api_key="none", max_retries=0)
    texts = TEXTS[:3]
    got = client.embeddings.create(model=both.model_dir.name, input=texts, dimensions=8)
    want = both.stub.Embed(pb.EmbedRequest(texts=texts, dimensions=8), timeout=60)
    assert [d.index for d in got.data] == [0, 1, 2]
    for g, w in zip(got.data, want.data, strict=True):
        np.testing.assert_allclose(g.embedding, w.values, atol=1e-6)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    raw = httpx.post(
        f"{both.http_url}/embeddings",
        json={"input": texts, "dimensions": 8, "encoding_format": "base64"},
    ).json()
    for g, w in zip(raw["data"], want.data, strict=True):
        values = np.frombuffer(base64.b64decode(g["embedding"]), "<f4")
        np.testing.assert_allclose(values, w.values, atol=1e-6)
    ids = [[5, 6, 7], [8, 9]]
    by_ids = client.embeddings.create(model=both.model_dir.name, input=ids)
    want_ids = both.stub.Embed(
        pb.EmbedRequest(inputs=[pb.TokenIds(ids=i) for i in ids]), timeout=60
    )
    np.testing.assert_allclose(by_ids.data[1].embedding, want_ids.data[1].values, atol=1e-6)
    for body, message in (
        ({"input": texts, "dimensions": 100000}, "dimensions is 100000"),
        ({"input": texts, "dimensions": 0}, "dimensions must be at least 1"),
        ({"input": []}, "no input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ):
        r = httpx.post(f"{both.http_url}/embeddings", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    no_leak(both)
