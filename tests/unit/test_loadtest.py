"""The load-test client measured against the arithmetic: a fake Generation service with known
timing, the arrival processes, and a run against the real server with cancels (no block may leak).
"""

import asyncio
import json
import statistics
import threading

import grpc
import pytest

from deploy.loadtest import main as loadtest_main
from deploy.loadtest.report import distribution
from deploy.loadtest.workload import arrival_gaps, load_dataset, synthetic
from protos import generation_pb2

FIRST_S, EVERY_S, TOKENS = 0.20, 0.05, 5
# a sleep never ends early, so no figure is below the arithmetic; above it, room for a machine busy
# with the suite's other process: what these checks catch is arithmetic off by a unit, a wave or a
# queue
SLACK = 1.6


class FakeService:
    """First token FIRST_S after the request, then one every EVERY_S; max_tokens tokens in all."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self):
        pb = generation_pb2

        async def stream(req, context):
            n = req.sampling.max_tokens
            await asyncio.sleep(FIRST_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(EVERY_S)
                msg = pb.GenerateStreamResponse(token_ids=[7])
                if i == n - 1:
                    msg.finish_reason = pb.LENGTH
                    msg.usage.prompt_tokens = len(req.prompt_token_ids)
                    msg.usage.completion_tokens = n
                yield msg

        async def info(req, context):
            return pb.ModelInfo(model_name="fake", vocab_size=1000, max_context=4096)

        async def stats(req, context):
            return pb.CacheStats(num_blocks=100, num_free_blocks=100, utilization=0.25)

        handlers = {
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateStreamResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                info,
                request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
            "GetCacheStats": grpc.unary_unary_rpc_method_handler(
                stats,
                request_deserializer=pb.GetCacheStatsRequest.FromString,
                response_serializer=pb.CacheStats.SerializeToString,
            ),
        }
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pagedserve.v1.Generation", handlers),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    service = FakeService()
    yield service
    service.close()


def run_json(tmp_path, *argv):
    out = tmp_path / "result.json"
    assert loadtest_main([*argv, "--output", str(out), "--no-progress", "--warmup", "0"]) == 0
    return json.loads(out.read_text())


def test_latencies_and_throughputs_match_the_arithmetic(fake, tmp_path):
    r = run_json(
        tmp_path,
        "--target",
        f"127.0.0.1:{fake.port}",
        "--num-requests",
        "12",
        "--concurrency",
        "4",
        "--input-len",
        "10",
        "--output-len",
        str(TOKENS),
        "--slo",
        "ttft_ms=150",
    )
    e2el = FIRST_S + (TOKENS - 1) * EVERY_S  # 0.4 s
    assert (r["completed"], r["failed"], r["aborted"]) == (12, 0, 0)
    for key, want in (
        ("ttft_ms", FIRST_S),
        ("tpot_ms", EVERY_S),
        ("itl_ms", EVERY_S),
        ("e2el_ms", e2el),
    ):
        # a sleep never ends early, so no figure is below the arithmetic; the middle of the
        # distribution is close to it, while the tail may carry one scheduling stall of a busy
        # machine (the exact percentile arithmetic is pinned by
        # test_percentiles_interpolate_between_ranks)
        for stat in ("mean", "p50", "p90", "p99", "max"):
            assert want * 1000 * 0.97 <= r[key][stat], (key, stat, r[key])
        for stat in ("mean", "p50"):
            assert r[key][stat] <= want * 1000 * SLACK, (key, stat, r[key])
        for stat in ("p90", "p99", "max"):
            assert r[key][stat] <= want * 1000 * SLACK + 150, (key, stat, r[key])
    # three waves of four closed-loop clients: the run takes about 3 x E2EL
    assert 3 * e2el <= r["duration_s"] <= 3 * e2el * 1.35
    assert r["request_throughput"] == pytest.approx(12 / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(12 * TOKENS / r["duration_s"])
    assert r["total_token_throughput"] == pytest.approx(12 * (10 + TOKENS) / r["duration_s"])
    assert r["goodput"] == 0.0  # nobody meets a 150 ms TTFT when the first token takes 200 ms
    assert r["cache"]["peak_utilization"] == pytest.approx(0.25)
    assert r["leaked_blocks"] == 0


def test_percentiles_interpolate_between_ranks():
    d = distribution([0.001 * v for v in (40, 10, 30, 20, 100)])  # seconds in, milliseconds out
    assert d["mean"] == pytest.approx(40.0)
    assert d["p50"] == pytest.approx(30.0)
    assert d["p90"] == pytest.approx(76.0)  # rank 3.6: 40 + 0.6 * (100 - 40)
    assert d["p99"] == pytest.approx(97.6)
    assert d["max"] == pytest.approx(100.0)
    assert distribution([]) == {k: 0.0 for k in ("mean", "p50", "p90", "p99", "max")}


def test_an_open_loop_at_a_set_rate_sends_at_that_rate(fake, tmp_path):
    r = run_json(
        tmp_path,
        "--target",
        f"127.0.0.1:{fake.port}",
        "--num-requests",
        "20",
        "--rate",
        "20",
        "--output-len",
        "2",
    )
    # 20 arrivals at 20/s take about a second, then the last request's 0.25 s
    assert r["completed"] == 20 and 0.5 < r["duration_s"] < 2.5
    # an open loop does not queue behind itself here
    assert r["ttft_ms"]["p50"] < FIRST_S * 1000 * SLACK


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness):
    gaps = arrival_gaps(40_000, rate=5.0, burstiness=burstiness, seed=3)
    mean = statistics.fmean(gaps)
    cv2 = statistics.pvariance(gaps) / mean**2
    assert mean == pytest.approx(1 / 5.0, rel=0.03)
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)  # Poisson: CV^2 = 1; gamma(k): 1/k
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_synthetic_prompts_share_their_prefix_and_keep_their_lengths():
    items = synthetic(
        200, input_len=100, output_len=50, range_ratio=0.2, shared_prefix_len=32, vocab=1000, seed=1
    )
    assert all(it.prompt_token_ids[:32] == items[0].prompt_token_ids[:32] for it in items)
    assert all(
        32 + 80 <= len(it.prompt_token_ids) <= 32 + 120 and 40 <= it.output_len <= 60
        for it in items
    )
    assert len({len(it.prompt_token_ids) for it in items}) > 10


def test_datasets_in_every_shape(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        '[1, 2, 3]\n"a text prompt"\n{"prompt_token_ids": [4, 5], "output_len": 9}\n{"prompt": '
        '"hi"}\n'
    )
    items = load_dataset(f, output_len=16, shared_prefix_len=0, vocab=1000, seed=0)
    assert [(i.prompt_token_ids, i.prompt, i.output_len) for i in items] == [
        ([1, 2, 3], None, 16),
        (None, "a text prompt", 16),
        ([4, 5], None, 9),
        (None, "hi", 16),
    ]


@pytest.mark.slow
def test_cancels_against_the_real_server_leak_no_block(server_factory, tiny_model_dir, tmp_path):
    server = server_factory(tiny_model_dir, "--block-size", "4", "--num-blocks", "200")
    r = run_json(
        tmp_path,
        "--target",
        server.address,
        "--num-requests",
        "16",
        "--concurrency",
        "6",
        "--input-len",
        "20",
        "--output-len",
        "40",
        "--range-ratio",
        "0.5",
        "--abort-fraction",
        "0.5",
        "--shared-prefix-len",
        "8",
        "--seed",
        "4",
    )
    assert r["aborted"] > 0 and r["failed"] == 0 and r["completed"] + r["aborted"] == 16
    assert r["leaked_blocks"] == 0
    assert r["cache"]["prefix_cache_hit_rate"] > 0  # the shared prefix is reused
    assert r["output_throughput"] > 0 and r["ttft_ms"]["p50"] > 0


def test_a_sweep_draws_its_curve_and_compares_with_an_earlier_run(fake, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = [
        "--target",
        f"127.0.0.1:{fake.port}",
        "--num-requests",
        "4",
        "--output-len",
        "3",
        "--sweep",
        "3",
        "--no-progress",
        "--warmup",
        "0",
        "--output",
        str(out),
        "--plot",
        str(tmp_path / "plots"),
    ]
    assert loadtest_main(argv) == 0
    runs = json.loads(out.read_text())
    assert [r["label"] for r in runs][:2] == ["synchronous", "saturating"] and len(runs) == 3
    assert runs[0]["request_throughput"] < runs[2]["value"] < runs[1]["request_throughput"]
    assert FIRST_S * 1000 * 0.97 <= runs[0]["ttft_ms"]["p50"] <= FIRST_S * 1000 * SLACK
    for name in ("latency_cdf.png", "timeline.png", "sweep.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    assert loadtest_main([*argv[:-4], "--compare", str(out)]) == 0
    text = capsys.readouterr().out
    assert "change against" in text and "output_throughput" in text and "synchronous:" in text


class FakeOpenAI:
    """An OpenAI-compatible /v1/completions with the same timing as FakeService, streamed as SSE;
    the final chunk carries usage. Records the bodies it was sent.
    """

    def __init__(self):
        import http.server
        import time as _time

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps(
                    {"object": "list", "data": [{"id": "fake-http", "object": "model"}]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(req)
                if req["max_tokens"] > 1000:
                    body = b'{"error": {"message": "max_tokens too large"}}'
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                n = req["max_tokens"]
                _time.sleep(FIRST_S)
                for i in range(n):
                    if i:
                        _time.sleep(EVERY_S)
                    chunk = {
                        "choices": [
                            {
                                "index": 0,
                                "text": "x",
                                "finish_reason": "length" if i == n - 1 else None,
                            }
                        ]
                    }
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": n}
                self.wfile.write(
                    f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: "
                    "[DONE]\n\n".encode()
                )
                self.wfile.flush()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.thread.join(10)


def test_an_openai_endpoint_is_measured_the_same_way(tmp_path):
    """--target http://...: the same figures from an OpenAI-compatible server's stream; token-id
    prompts, the model its /v1/models names; server-side figures left out; refusals counted by HTTP
    status.
    """
    fake = FakeOpenAI()
    try:
        r = run_json(
            tmp_path,
            "--target",
            f"http://127.0.0.1:{fake.port}",
            "--num-requests",
            "8",
            "--concurrency",
            "4",
            "--input-len",
            "10",
            "--output-len",
            str(TOKENS),
        )
        e2el = FIRST_S + (TOKENS - 1) * EVERY_S
        assert (r["completed"], r["failed"]) == (8, 0) and r["target_model"] == "fake-http"
        for key, want in (
            ("ttft_ms", FIRST_S),
            ("tpot_ms", EVERY_S),
            ("itl_ms", EVERY_S),
            ("e2el_ms", e2el),
        ):
            assert want * 1000 * 0.97 <= r[key]["p50"] <= want * 1000 * SLACK, (key, r[key])
        assert r["total_output_tokens"] == 8 * TOKENS and r["total_input_tokens"] == 8 * 10
        assert "cache" not in r and r["leaked_blocks"] is None
        sent = fake.bodies[-1]
        assert sent["model"] == "fake-http" and sent["stream"] and len(sent["prompt"]) == 10
        assert all(isinstance(t, int) and t < 32000 for t in sent["prompt"])
        r = run_json(
            tmp_path,
            "--target",
            f"http://127.0.0.1:{fake.port}",
            "--num-requests",
            "3",
            "--concurrency",
            "3",
            "--input-len",
            "10",
            "--output-len",
            "5000",
        )
        assert (r["completed"], r["failed"], r["errors"]) == (0, 3, {"HTTP_400": 3})
    finally:
        fake.close()
