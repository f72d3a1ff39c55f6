"""Multi-LoRA through a real server: three PEFT adapters and the base model in the same steps, each
answer equal to PEFT's own greedy decode, through chunked prefill, preemption, drafts and the prefix
cache; adapters loaded, replaced and unloaded while serving; the OpenAI `model` reaching an adapter.
"""

import random
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from protos import generation_pb2
from tests.support.lora import ALL, make_adapter, peft_greedy
from tests.support.server import greedy_request
from tests.support.serving import Streams, assert_all_blocks_back

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(
            tiny_model_dir, root / "attn", r=4, targets=["q_proj", "v_proj"], alpha=8, seed=1
        ),
        "all": make_adapter(
            tiny_model_dir, root / "all", r=8, targets=ALL, alpha=16, seed=2, use_rslora=True
        ),
        "mlp": make_adapter(
            tiny_model_dir,
            root / "mlp",
            r=2,
            targets=["o_proj", "up_proj", "down_proj"],
            alpha=4,
            seed=3,
        ),
        "other": make_adapter(
            tiny_model_dir, root / "other", r=4, targets=["q_proj", "v_proj"], alpha=8, seed=9
        ),
    }


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir, adapters):
    # a small pool (requests wait and are preempted) and a 32-token step (prompts go in chunks)
    modules = [f"{n}={adapters[n]}" for n in ("attn", "all", "mlp")]
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "56",
        "--max-model-len",
        "200",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "32",
        "--speculative",
        "ngram",
        "--lora-modules",
        *modules,
    )


def with_lora(prompt, max_tokens, lora, request_id=""):
    req = greedy_request(prompt, max_tokens, request_id)
    req.lora = lora
    return req


def all_at_once_equal_peft(
    server, tiny_model_dir, adapters, names, count, lengths, max_tokens, seed
):
    """`count` random prompts at once, prompt i under adapter names[i % len] ("" the base): each
    answer equals PEFT's own greedy decode of its adapter. -> the prompts.
    """
    rng = random.Random(seed)
    items = [
        ([rng.randrange(3, 380) for _ in range(rng.randint(*lengths))], names[i % len(names)])
        for i in range(count)
    ]
    with ThreadPoolExecutor(len(items)) as pool:
        got = list(
            pool.map(
                lambda it: list(
                    server.stub.Generate(with_lora(it[0], max_tokens, it[1]), timeout=120)
                    .choices[0]
                    .token_ids
                ),
                items,
            )
        )
    for (prompt, name), tokens in zip(items, got, strict=True):
        want = peft_greedy(tiny_model_dir, adapters[name] if name else None, prompt, max_tokens)
        assert tokens == want, name
    return items


def test_adapters_and_the_base_in_one_batch_each_equal_peft(server, tiny_model_dir, adapters):
    names = ["attn", "all", "mlp", ""]
    # 16 requests of 12-40 prompt tokens and 24 new ones: five at once outgrow the 56 blocks, so
    # sequences are preempted however the requests' arrivals spread
    items = all_at_once_equal_peft(
        server, tiny_model_dir, adapters, names, 16, (12, 40), 24, seed=3
    )
    assert server.stats().num_preemptions > 0, "the pool is small enough to preempt"
    # the adapters do change the answers
    prompt = items[0][0]
    base = peft_greedy(tiny_model_dir, None, prompt, 12)
    assert sum(peft_greedy(tiny_model_dir, adapters[n], prompt, 12) != base for n in names[:3]) >= 2
    assert_all_blocks_back(server)


def test_one_prompt_alternating_between_adapters_under_the_prefix_cache(
    server, tiny_model_dir, adapters
):
    # whole blocks the cache keeps after each request
    prompt = [(7 * i) % 370 + 5 for i in range(30)]
    names = ("attn", "all", "mlp", "")
    want = {n: peft_greedy(tiny_model_dir, adapters[n] if n else None, prompt, 8) for n in names}
    seen = set()
    for name in ["attn", "all", "", "mlp", "attn", "mlp", "", "all"] * 2:
        res = server.stub.Generate(with_lora(prompt, 8, name), timeout=60)
        assert list(res.choices[0].token_ids) == want[name], name
        # the first time under an adapter nothing is reused (another adapter's blocks hold other
        # K/V), then its own blocks are
        assert (res.usage.cached_prompt_tokens > 0) == (name in seen), name
        seen.add(name)


def test_drafts_samples_and_structured_output_hold_under_an_adapter(
    server, tiny_model_dir, adapters
):
    """The same request twice under an adapter: the second drafts from the first (n-gram) and both
    equal PEFT's greedy decode; n = 2 greedy samples forked from one prompt both equal it; a regex
    holds.
    """
    stub = server.stub
    prompt = [(13 * i) % 370 + 5 for i in range(24)]
    want = peft_greedy(tiny_model_dir, adapters["all"], prompt, 40)
    st = server.stats()
    before = (st.num_draft_tokens, st.num_accepted_draft_tokens)
    for _ in range(2):
        assert (
            list(stub.Generate(with_lora(prompt, 40, "all"), timeout=60).choices[0].token_ids)
            == want
        )
    st = server.stats()
    assert st.num_accepted_draft_tokens > before[1] and st.num_draft_tokens > before[0]
    req = with_lora(prompt[:11], 10, "mlp")
    req.sampling.n = 2
    choices = stub.Generate(req, timeout=60).choices
    assert [list(c.token_ids) for c in choices] == [
        peft_greedy(tiny_model_dir, adapters["mlp"], prompt[:11], 10)
    ] * 2
    req = with_lora(prompt[:9], 12, "attn")
    req.sampling.ignore_eos = False
    req.sampling.regex = r"[a-z]{2,5}\."
    done = stub.Generate(req, timeout=60).choices[0]
    assert re.fullmatch(r"[a-z]{2,5}\.", done.text) and done.finish_reason == generation_pb2.STOP
    assert_all_blocks_back(server)


def test_an_adapter_reloaded_under_its_name_answers_with_its_new_weights(
    server, tiny_model_dir, adapters
):
    prompt = [(11 * i) % 370 + 5 for i in range(20)]
    stub = server.stub
    old = stub.Generate(with_lora(prompt, 8, "attn"), timeout=60).choices[0].token_ids
    assert list(old) == peft_greedy(tiny_model_dir, adapters["attn"], prompt, 8)
    with pytest.raises(grpc.RpcError) as e:  # a name in use is not replaced unless asked
        stub.LoadLoraAdapter(
            generation_pb2.LoadLoraAdapterRequest(name="attn", path=str(adapters["other"]))
        )
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    try:
        loaded = stub.LoadLoraAdapter(
            generation_pb2.LoadLoraAdapterRequest(
                name="attn", path=str(adapters["other"]), replace=True
            ),
            timeout=30,
        )
        assert loaded.rank == 4 and loaded.path == str(adapters["other"].resolve())
        new = stub.Generate(with_lora(prompt, 8, "attn"), timeout=60).choices[0].token_ids
        assert list(new) == peft_greedy(tiny_model_dir, adapters["other"], prompt, 8) != list(old)
    finally:
        stub.LoadLoraAdapter(
            generation_pb2.LoadLoraAdapterRequest(
                name="attn", path=str(adapters["attn"]), replace=True
            ),
            timeout=30,
        )
    again = stub.Generate(with_lora(prompt, 8, "attn"), timeout=60).choices[0].token_ids
    assert list(again) == list(old)


def test_unknown_and_unloaded_adapters_are_invalid_argument_and_running_ones_finish(
    server, tiny_model_dir, adapters
):
    stub = server.stub
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(with_lora([5, 6, 7], 4, "nope"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown LoRA adapter 'nope' (loaded: all, attn, mlp)" in e.value.details()
    stub.LoadLoraAdapter(
        generation_pb2.LoadLoraAdapterRequest(name="late", path=str(adapters["other"])), timeout=30
    )
    names = [
        a.name for a in stub.ListLoraAdapters(generation_pb2.ListLoraAdaptersRequest()).adapters
    ]
    assert names == ["all", "attn", "late", "mlp"]
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]
    streams = Streams(stub, [with_lora(prompt, 60, "late")])
    assert streams.started.wait(60)
    unloaded = stub.UnloadLoraAdapter(
        generation_pb2.UnloadLoraAdapterRequest(name="late"), timeout=30
    )
    streams.join()
    assert streams.errors == [None] and streams.tokens[0] == peft_greedy(
        tiny_model_dir, adapters["other"], prompt, 60
    )
    assert unloaded.num_running in (0, 1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(with_lora(prompt, 4, "late"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.UnloadLoraAdapter(generation_pb2.UnloadLoraAdapterRequest(name="late"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:  # a bad folder: refused by name, nothing loaded
        stub.LoadLoraAdapter(
            generation_pb2.LoadLoraAdapterRequest(name="bad", path=str(tiny_model_dir))
        )
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "adapter_config.json" in e.value.details()
    )
    assert_all_blocks_back(server)


def test_openai_model_names_an_adapter_and_models_lists_it(server, tiny_model_dir, adapters):
    client = openai.OpenAI(base_url=server.http_url, api_key="none", max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    base = tiny_model_dir.name
    assert set(models) == {base, "attn", "all", "mlp"}
    assert models["all"].model_extra["parent"] == base
    prompt = [(5 * i) % 370 + 5 for i in range(15)]
    texts = {}
    for name in ("all", base):
        done = client.completions.create(
            model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        grpc_text = (
            server.stub.Generate(with_lora(prompt, 8, "" if name == base else name), timeout=60)
            .choices[0]
            .text
        )
        texts[name] = done.choices[0].text
        assert texts[name] == grpc_text
    assert texts["all"] != texts[base]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    r = httpx.post(
        server.http_url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}
    )
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    metrics = httpx.get(server.http_url.removesuffix("/v1") + "/metrics").text
    assert re.search(r'pagedserve_lora_requests_total\{adapter="all"\} [1-9]', metrics)
    assert re.search(r'pagedserve_lora_generation_tokens_total\{adapter="mlp"\} [1-9]', metrics)


@pytest.mark.parametrize(
    "layout", [["--tensor-parallel-size", "2"], ["--data-parallel-size", "2"]], ids=["tp2", "dp2"]
)
def test_adapters_over_two_ranks_and_two_replicas_equal_peft(
    server_factory, tiny_model_dir, adapters, layout
):
    """TP: each rank holds its slice of A and B; DP: every replica reads the adapters it is sent."""
    modules = [f"{n}={adapters[n]}" for n in ("attn", "all", "mlp")]
    server = server_factory(
        tiny_model_dir,
        *layout,
        "--block-size",
        "4",
        "--num-blocks",
        "160",
        "--max-num-batched-tokens",
        "64",
        "--lora-modules",
        *modules,
    )
    try:
        all_at_once_equal_peft(
            server, tiny_model_dir, adapters, ["all", "", "mlp", "attn"], 8, (5, 30), 10, seed=5
        )
        assert_all_blocks_back(server)
    finally:
        server.stop()
