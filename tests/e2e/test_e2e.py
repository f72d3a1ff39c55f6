"""End to end through real processes and sockets: scheduler process
+ worker process, gRPC + ZeroMQ.
"""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import generation_pb2
from tests.support.server import greedy_request
from tests.support.serving import (
    CONTROLS,
    assert_all_blocks_back,
    run_stream,
    sampled_request,
    submit_all,
    workload,
)
from tests.support.tiny import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    # block size 4 and a per-step budget of 32 tokens: long prompts go in chunks, tables grow often
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "256",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
        "--metrics-port",
        "-1",
    )


@pytest.fixture(scope="module")
def tight_server(server_factory, tiny_model_dir):
    # 40 blocks of 4 tokens: the workload below needs far more at once, so requests wait and are
    # preempted
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "40",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "160",
    )


def test_concurrent_requests_equal_solo_transformers_greedy(server, tiny_model_dir):
    items = workload(10, seed=1)
    unary = submit_all(server, items, stream=False)
    for rid, prompt, max_tokens, _ in items:
        tokens, _, finish, usage = unary[rid]
        assert tokens == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
        assert finish == generation_pb2.LENGTH
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), max_tokens)
    assert_all_blocks_back(server)


def test_streamed_tokens_equal_unary_tokens(server):
    items = workload(8, seed=2)
    items_by_id = {rid: prompt for rid, prompt, _, _ in items}
    streamed = submit_all(server, items, stream=True)
    unary = submit_all(server, [(rid + "-u", p, m, d) for rid, p, m, d in items], stream=False)
    for rid, *_ in items:
        s_tokens, s_text, s_finish, s_usage = streamed[rid]
        u_tokens, u_text, u_finish, u_usage = unary[rid + "-u"]
        assert s_tokens == u_tokens
        assert s_text == u_text
        assert s_finish == u_finish
        assert (s_usage.prompt_tokens, s_usage.completion_tokens) == (
            u_usage.prompt_tokens,
            u_usage.completion_tokens,
        )
        # the unary round came second: its full prompt blocks were cached by the streamed round
        assert u_usage.cached_prompt_tokens == (len(items_by_id[rid]) - 1) // 4 * 4
    assert_all_blocks_back(server)


def test_tight_pool_preempts_and_outputs_stay_identical(tight_server, tiny_model_dir):
    # all queued before the first step: with staggered arrivals a fast machine finishes early
    # requests before the pool fills
    before = tight_server.stats().num_preemptions
    with tight_server.queued_in_order(10) as delays:
        items = [
            (rid, p, m, delay)
            for (rid, p, m, _), delay in zip(workload(10, seed=3), delays, strict=True)
        ]
        results = submit_all(tight_server, items, stream=True)
    for rid, prompt, max_tokens, _ in items:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
    assert tight_server.stats().num_preemptions > before, (
        "this pool is small enough that it must preempt"
    )
    assert_all_blocks_back(tight_server)


def test_text_prompt_goes_through_the_chat_template_and_stops(server):
    req = generation_pb2.GenerateRequest(
        prompt="What is the capital of France?",
        sampling=generation_pb2.SamplingParams(max_tokens=12),
    )
    resp = server.stub.Generate(req, timeout=60)
    assert resp.usage.prompt_tokens > 5
    assert 1 <= resp.usage.completion_tokens <= 12
    assert resp.request_id  # the server assigned one


BAD = [
    ("empty prompt", dict(), "empty"),
    (
        "both prompt kinds",
        dict(prompt="hi", prompt_token_ids=[5, 6]),
        "not prompt and prompt_token_ids",
    ),
    ("prompt longer than context", dict(prompt_token_ids=[5] * 600), "context"),
    ("max_tokens 0", dict(prompt_token_ids=[5, 6], sampling=dict(max_tokens=0)), "max_tokens"),
    (
        "max_tokens beyond context",
        dict(prompt_token_ids=[5, 6], sampling=dict(max_tokens=600)),
        "context",
    ),
    ("token id outside vocab", dict(prompt_token_ids=[5, 384]), "vocabulary"),
    (
        "negative temperature",
        dict(prompt_token_ids=[5], sampling=dict(max_tokens=2, temperature=-0.5)),
        "temperature",
    ),
    ("top_p zero", dict(prompt_token_ids=[5], sampling=dict(max_tokens=2, top_p=0.0)), "top_p"),
    (
        "top_p above one",
        dict(prompt_token_ids=[5], sampling=dict(max_tokens=2, top_p=1.5)),
        "top_p",
    ),
    (
        "empty stop string",
        dict(prompt_token_ids=[5], sampling=dict(max_tokens=2, stop=[""])),
        "stop",
    ),
]


@pytest.mark.parametrize("name,fields,needle", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    server, name, fields, needle, rpc
):
    fields = dict(fields)
    sampling = fields.pop("sampling", dict(max_tokens=2))
    req = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(**sampling), **fields
    )
    with pytest.raises(grpc.RpcError) as err:
        call = getattr(server.stub, rpc)(req, timeout=30)
        if rpc == "GenerateStream":
            list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert needle in err.value.details()
    ok = server.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30)
    assert len(ok.choices[0].token_ids) == 3


def test_request_that_could_never_fit_the_pool(tight_server):
    # 40 blocks of 4 tokens: 4 samples of 50 prompt tokens (12 full blocks, shared) and 60 new
    # tokens each need 12 + 4 x 16 = 76 blocks, more than the whole pool
    req = greedy_request([5] * 50, 60)
    req.sampling.n = 4
    with pytest.raises(grpc.RpcError) as err:
        tight_server.stub.Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pool" in err.value.details()


def test_cancelled_stream_frees_its_blocks_and_others_finish(server, tiny_model_dir):
    others = workload(3, seed=5)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(submit_all, server, others, False)
        call = server.stub.GenerateStream(
            greedy_request([9, 8, 7, 6], 400, "to-cancel"), timeout=120
        )
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 5:
                break
        assert any(r.request_id == "to-cancel" for r in server.stats().requests)
        call.cancel()
        deadline = time.monotonic() + 5
        while any(r.request_id == "to-cancel" for r in server.stats().requests):
            assert time.monotonic() < deadline, "a cancelled request kept its blocks"
            time.sleep(0.02)
        results = fut.result()
    for rid, prompt, max_tokens, _ in others:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens)
    assert_all_blocks_back(server)


def test_abort_rpc_ends_a_request_and_frees_blocks_at_once(server):
    pids = server.worker_pids()
    for attempt in range(3):  # tried again where a fast stream finished before the hold
        rid, first, box = f"to-abort-{attempt}", threading.Event(), {}

        def consume(rid=rid, first=first, box=box):
            box["result"] = run_stream_with_signal(
                server.stub, greedy_request([4, 4, 4], 400, rid), first
            )

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        # no step runs: the request is still decoding when the Abort comes
        with server.held_still(3.0, pids):
            if not any(r.request_id == rid for r in server.stats().requests):
                t.join(30)
                continue
            resp = server.stub.Abort(generation_pb2.AbortRequest(request_id=rid), timeout=10)
            assert resp.aborted
            stats = server.stats()  # no waiting: Abort returns after the blocks are back
            assert not any(r.request_id == rid for r in stats.requests)
        break
    else:
        raise AssertionError("every stream finished before the Abort")
    t.join(30)
    tokens, finish, usage = box["result"]
    assert finish == generation_pb2.ABORT
    assert 1 <= len(tokens) < 400 and usage.completion_tokens == len(tokens)
    assert not server.stub.Abort(generation_pb2.AbortRequest(request_id=rid), timeout=10).aborted
    assert_all_blocks_back(server)


def run_stream_with_signal(stub, req, first):
    tokens, finish, usage = [], None, None
    for msg in stub.GenerateStream(req, timeout=120):
        tokens.extend(msg.token_ids)
        first.set()
        if msg.finish_reason:
            finish = msg.finish_reason
        if msg.HasField("usage"):
            usage = msg.usage
    return tokens, finish, usage


def test_model_info_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    info = server.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.vocab_size, info.max_context, info.block_size, info.num_blocks) == (
        384,
        512,
        4,
        256,
    )
    assert list(info.eos_token_ids) == [2]
    health = health_pb2_grpc.HealthStub(server.channel)
    status = health.Check(
        health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=10
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_duplicate_live_request_id_is_refused(server):
    """Live means admitted and not finished, waiting or running; the workers are held still so the
    first request cannot finish before the second arrives, however slowly this machine runs the
    test.
    """
    first = threading.Event()
    t = threading.Thread(
        target=run_stream_with_signal, args=(server.stub, greedy_request([1, 2], 300, "dup"), first)
    )
    with server.held_still(3.5):
        t.start()
        deadline = time.monotonic() + 2.5
        while server.stats().num_waiting + server.stats().num_running == 0:
            assert time.monotonic() < deadline, "the first request never reached the scheduler"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Generate(greedy_request([1, 2], 3, "dup"), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already in use" in err.value.details()
    assert first.wait(30), "the first request did not go on after the refusal"
    server.stub.Abort(generation_pb2.AbortRequest(request_id="dup"), timeout=10)
    t.join(30)
    assert_all_blocks_back(server)


def scrape_metrics(server) -> dict[str, float]:
    """/metrics as {series: value}."""
    import urllib.request

    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_bytes_that_are_no_message_get_invalid_argument_on_every_service(server):
    """Corrupt bytes sent to every service the port serves (health's Check, Watch and List,
    reflection, Generation) end INVALID_ARGUMENT naming the method, never UNKNOWN or INTERNAL,
    and the server goes on serving.
    """
    corrupt = b"\x0a\xff\x01"  # field 1, 255 bytes long, three bytes sent
    for method, streaming in (
        ("/grpc.health.v1.Health/Check", False),
        ("/grpc.health.v1.Health/List", False),
        ("/grpc.health.v1.Health/Watch", True),
        ("/pagedserve.v1.Generation/Generate", False),
        ("/pagedserve.v1.Generation/GenerateStream", True),
        ("/pagedserve.v1.Generation/GetCacheStats", False),
    ):
        call = (server.channel.unary_stream if streaming else server.channel.unary_unary)(method)
        with pytest.raises(grpc.RpcError) as e:
            answer = call(corrupt, timeout=10)
            if streaming:
                list(answer)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        assert "not a valid" in e.value.details(), method
    reflect = server.channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    )
    with pytest.raises(grpc.RpcError) as e:
        list(reflect(iter([corrupt]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        len(server.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30).choices[0].token_ids)
        == 3
    )


def test_prometheus_metrics_count_requests_and_tokens(server):
    """The series a dashboard graphs, per replica where they are a replica's (deploy/grafana draws
    them).
    """

    def scrape():
        return scrape_metrics(server)

    before = scrape()
    # more than two blocks: its second run finds them in the prefix cache
    prompt = list(range(3, 40))
    for _ in range(2):
        server.stub.Generate(greedy_request(prompt, 5), timeout=30)
    after = scrape()

    def grew(key):
        return after[key] - before.get(key, 0.0)

    assert grew('pagedserve_requests_total{finish_reason="length"}') == 2
    assert grew('pagedserve_generation_tokens_total{replica="0"}') == 10
    assert grew("pagedserve_prompt_tokens_total") == 2 * len(prompt)
    assert grew("pagedserve_prefix_cache_hit_tokens_total") >= 32  # the second run's cached blocks
    assert after['pagedserve_kv_blocks_total{replica="0"}'] == 256
    assert 0.0 <= after['pagedserve_kv_usage_ratio{replica="0"}'] <= 1.0
    for series in (
        "pagedserve_time_to_first_token_seconds_count",
        "pagedserve_time_per_output_token_seconds_count",
        'pagedserve_inter_token_latency_seconds_count{replica="0"}',
        'pagedserve_queue_time_seconds_count{replica="0"}',
    ):
        assert grew(series) >= 2, series
    # 4 gaps a request
    assert grew('pagedserve_inter_token_latency_seconds_count{replica="0"}') == 8


def test_metrics_pool_gauges_say_what_cache_stats_says_busy_and_idle(server):
    """/metrics' pool gauges (running, waiting, free and total blocks, usage) agree with
    GetCacheStats while a request decodes, after an Abort, and on the idle server (they had kept
    the last step's figures once nothing ran: sequences running, blocks held, on an idle pool).
    """
    first = threading.Event()
    box = {}

    def consume():
        box["result"] = run_stream_with_signal(
            server.stub, greedy_request([7, 7, 7], 400, "gauged"), first
        )

    def agree() -> dict[str, float]:
        # a step the workers ended just before the hold may still land in the scheduler (it plans
        # the next one, a block more): counted once the stats read on both sides of it agree
        for _ in range(50):
            before = server.stats().replicas[0]
            m, row = scrape_metrics(server), server.stats().replicas[0]
            if row == before:
                break
            time.sleep(0.02)
        got = {
            k: m[f'pagedserve_{k}{{replica="0"}}']
            for k in ("num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total")
        }
        assert got == {
            "num_running": row.num_running,
            "num_waiting": row.num_waiting,
            "kv_blocks_free": row.num_free_blocks + row.num_cached_blocks,
            "kv_blocks_total": row.num_blocks,
        }
        assert m['pagedserve_kv_usage_ratio{replica="0"}'] == pytest.approx(row.utilization)
        return got

    t = threading.Thread(target=consume)
    pids = server.worker_pids()
    # held before the request arrives: it is scheduled, and no step runs between the two reads
    # (a looping greedy answer drafts several tokens a step: 400 can end within a blink)
    with server.held_still(3.0, pids):
        t.start()
        deadline = time.monotonic() + 2.5
        while server.stats().num_running == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        busy = agree()
        assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
        assert server.stub.Abort(generation_pb2.AbortRequest(request_id="gauged"), timeout=10)
        assert agree()["num_running"] == 0
    t.join(30)
    assert_all_blocks_back(server)
    idle = agree()
    assert idle["num_running"] == 0 and idle["kv_blocks_free"] == idle["kv_blocks_total"]
    server.stub.Generate(greedy_request([3, 1, 4, 1, 5], 6), timeout=30)  # one that finishes
    assert_all_blocks_back(server)
    assert agree()["num_running"] == 0


def test_n_samples_each_get_their_own_choice_and_stream_index(server):
    req = sampled_request([11, 12, 13, 14], 12, seed=5, n=3)
    resp = server.stub.Generate(req, timeout=60)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in resp.choices)
    assert len({tuple(c.token_ids) for c in resp.choices}) == 3, (
        "samples with different seeds all agreed"
    )
    assert resp.usage.completion_tokens == 36 and resp.usage.prompt_tokens == 4
    tokens, _, finish, usage = run_stream(server.stub, req)
    assert {i: tokens[i] for i in range(3)} == {c.index: list(c.token_ids) for c in resp.choices}
    assert set(finish) == {0, 1, 2} and usage.completion_tokens == 36
    assert_all_blocks_back(server)


@pytest.mark.parametrize("controls", [{}, CONTROLS], ids=["plain", "controls"])
def test_seeded_sampling_is_reproducible_even_across_preemption(server, tight_server, controls):
    """A seeded request draws the same tokens alone on a roomy pool and preempted on a tight one;
    with penalties too, whose context a recompute rewrites into fresh blocks.
    """
    items = workload(10, seed=9)
    roomy = {
        rid: server.stub.Generate(sampled_request(p, m, seed=i, **controls), timeout=120)
        .choices[0]
        .token_ids
        for i, (rid, p, m, _) in enumerate(items)
    }
    before = tight_server.stats().num_preemptions

    def one(i):
        rid, p, m, delay = items[i]
        time.sleep(delay)
        return rid, tight_server.stub.Generate(
            sampled_request(p, m, seed=i, **controls), timeout=120
        ).choices[0].token_ids

    # all queued in a fixed order before the first step: the pool overflows however fast the machine
    with tight_server.queued_in_order(len(items)) as delays:
        items = [(rid, p, m, delay) for (rid, p, m, _), delay in zip(items, delays, strict=True)]
        with ThreadPoolExecutor(len(items)) as pool:
            tight = dict(pool.map(one, range(len(items))))
    assert tight_server.stats().num_preemptions > before
    assert tight == roomy
    assert_all_blocks_back(tight_server)


@pytest.mark.kernels
def test_triton_backend_gives_the_same_greedy_outputs(server_factory, tiny_model_dir):
    """The worker with --attention-backend triton (interpreted without
    a GPU) against transformers.
    """
    triton_server = server_factory(
        tiny_model_dir, "--block-size", "16", "--num-blocks", "64", "--attention-backend", "triton"
    )
    items = [(f"tri-{i}", p, 6, 0.1 * i) for i, (_, p, _, _) in enumerate(workload(3, seed=11))]
    results = submit_all(triton_server, items, stream=True)
    for rid, prompt, max_tokens, _ in items:
        assert results[rid][0] == hf_greedy(tiny_model_dir, prompt, max_tokens), rid
    assert_all_blocks_back(triton_server)


@pytest.fixture(scope="module")
def plain_server(server_factory, tiny_model_dir):
    # no prefix caching, no chunked prefill, no overlap: whole prompts in one step, each step
    # planned after the previous one's result
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "256",
        "--no-prefix-caching",
        "--no-chunked-prefill",
        "--max-num-batched-tokens",
        "512",
        "--no-overlap",
    )


def shared_prefix_workload(seed, n=10):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 384) for _ in range(rng.randint(9, 40))] for _ in range(3)]
    return [
        (
            f"sp-{seed}-{i}",
            rng.choice(prefixes) + [rng.randrange(3, 384) for _ in range(rng.randint(1, 6))],
            rng.randint(3, 20),
            rng.uniform(0, 0.3),
        )
        for i in range(n)
    ]


def test_outputs_identical_with_prefix_caching_chunking_and_preemption_on_or_off(
    server, plain_server, tight_server, tiny_model_dir
):
    items = shared_prefix_workload(seed=21)
    expected = {rid: hf_greedy(tiny_model_dir, p, m) for rid, p, m, _ in items}
    hits_before = server.stats().prefix_cache_hits
    # the second round on `server` hits its cache
    for srv in (
        plain_server,
        server,
        server,
        tight_server,
    ):
        results = submit_all(srv, items, stream=True)
        assert {rid: r[0] for rid, r in results.items()} == expected
        assert_all_blocks_back(srv)
    assert server.stats().prefix_cache_hits > hits_before
    assert (
        plain_server.stats().prefix_cache_hits == 0 and plain_server.stats().num_cached_blocks == 0
    )


def test_overlap_on_and_off_give_identical_sampled_outputs_cut_at_their_stops(
    server, plain_server, tight_server
):
    """Seeded sampling with stop tokens: a request stops at the same token whether its steps were
    planned one by one (plain_server) or while the previous step ran (server, and tight_server,
    which preempts), and no token after its stop reaches the client.
    """
    items = shared_prefix_workload(seed=23, n=8)

    def request(i, prompt, max_tokens, stop=()):
        return generation_pb2.GenerateRequest(
            request_id=f"ov-{i}",
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(
                max_tokens=max_tokens,
                temperature=0.8,
                seed=100 + i,
                stop_token_ids=list(stop),
                ignore_eos=True,
            ),
        )

    free = [
        plain_server.stub.Generate(request(i, p, m + 8), timeout=120).choices[0].token_ids
        for i, (_, p, m, _) in enumerate(items)
    ]
    # a token from the middle of each free-running output
    stops = [(out[len(out) // 2],) for out in free]
    want = [
        list(out[: list(out).index(stop[0]) + 1]) for out, stop in zip(free, stops, strict=True)
    ]
    for srv in (plain_server, server, tight_server):
        with ThreadPoolExecutor(len(items)) as pool:
            got = list(
                pool.map(
                    lambda i, srv=srv: run_stream(
                        srv.stub, request(i, items[i][1], items[i][2] + 8, stops[i])
                    ),
                    range(len(items)),
                )
            )
        assert [g[0][0] for g in got] == want
        assert all(g[2][0] == generation_pb2.STOP for g in got)
        assert_all_blocks_back(srv)


def test_n4_holds_its_prompt_once_fewer_blocks_than_four_separate_sequences(server):
    prompt = list(range(20, 60))  # 40 tokens: 10 full blocks of 4

    def blocks_while_running(requests):
        """The requests' blocks, bytes and tokens read while they decode: the workers are held still
        from their first token on, so a fast machine cannot finish them before the reading (tried
        again where one finished between its first token and the hold).
        """
        pids = server.worker_pids()
        for _ in range(3):
            first = threading.Event()

            def consume(req, first=first):
                try:
                    for msg in server.stub.GenerateStream(req, timeout=60):
                        if len(msg.token_ids):
                            first.set()
                except grpc.RpcError:
                    pass

            threads = [threading.Thread(target=consume, args=(r,)) for r in requests]
            for t in threads:
                t.start()
            assert first.wait(30)
            ids = {r.request_id for r in requests}
            with server.held_still(2.0, pids):  # no step runs: what decodes now is still decoding
                rows = [r for r in server.stats().requests if r.request_id in ids]
                for rid in ids:
                    server.stub.Abort(generation_pb2.AbortRequest(request_id=rid), timeout=10)
            for t in threads:
                t.join(30)
            if len(rows) == len(ids) and all(r.num_tokens > len(prompt) for r in rows):
                return (
                    sum(r.num_blocks for r in rows),
                    sum(r.num_bytes for r in rows),
                    sum(r.num_tokens for r in rows),
                )
        raise AssertionError(f"not all of {sorted(ids)} decoding when held: {rows}")

    n4 = sampled_request(prompt, 100, seed=1, n=4, request_id="n4")  # 10 + 4 x 25 blocks at most
    n4_blocks, n4_bytes, n4_tokens = blocks_while_running([n4])
    # four separate sequences of the same tokens hold the prompt four times: n4_tokens / 4 blocks at
    # least, whenever the reading is taken (a comparison with four separate requests read at another
    # moment is not)
    assert n4_blocks < n4_tokens // 4, (n4_blocks, n4_tokens)
    # one copy of the prompt's 10 blocks, then each sample's own tokens (however far a loaded
    # machine let them get before the reading) with a partly filled block and its copy of the
    # prompt's last block each
    generated = n4_tokens - 4 * len(prompt)
    assert n4_blocks <= 10 + generated // 4 + 4 * 2, (n4_blocks, generated)
    assert n4_bytes == n4_blocks * server.stats().bytes_per_block
    assert_all_blocks_back(server)


def test_samples_never_see_each_others_tokens(server):
    """Sample i of an n=3 request draws exactly what a lone request with seed + i draws."""
    prompt = [31, 41, 59, 26, 53, 58, 97]
    together = server.stub.Generate(sampled_request(prompt, 15, seed=100, n=3), timeout=60)
    alone = [
        list(
            server.stub.Generate(sampled_request(prompt, 15, seed=100 + i), timeout=60)
            .choices[0]
            .token_ids
        )
        for i in range(3)
    ]
    assert [list(c.token_ids) for c in together.choices] == alone
    assert len({tuple(a) for a in alone}) == 3
