"""The terminal surface: `pagedserve generate / stats / top`, console or JSON logs, the start-up
line.
"""

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from deploy.processes import ROOT
from protos import generation_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-blocks",
        "200",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_terminal(argv: list[str], seconds: float, columns: int = 120, rows: int = 50) -> str:
    """Run argv with a pseudo-terminal as its stdout/stderr and return everything it drew."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": str(rows), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return out.decode("utf-8", errors="replace")


def plain(text: str) -> str:
    """Terminal output without its escape sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]", "", text)


def test_top_draws_the_pool_the_rates_and_the_requests_holding_most_blocks(server):
    stop = threading.Event()

    def load():
        i = 0
        while not stop.is_set():
            try:
                server.stub.Generate(
                    generation_pb2.GenerateRequest(
                        request_id=f"busy-{i}",
                        prompt_token_ids=list(range(3, 60)),
                        sampling=generation_pb2.SamplingParams(max_tokens=150, ignore_eos=True),
                    ),
                    timeout=60,
                )
            except Exception:  # noqa: BLE001 - the test reads the screen, not these answers
                pass
            i += 1

    workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)
        screen = in_terminal(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "top",
                "--server",
                server.address,
                "--iterations",
                "4",
                "--interval",
                "0.5",
                "--no-screen",
            ],
            seconds=60,
        )
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    text = plain(screen)
    assert "pagedserve top" in text and "@ " + server.address in text
    assert "█" in text  # the pool's bar
    for word in (
        "held",
        "shared",
        "cached",
        "free",
        "running",
        "waiting",
        "prefix hit rate",
        "tokens/s",
        "requests holding the most blocks",
    ):
        assert word in text, word
    assert re.search(r"busy-\d+", text)  # a request holding blocks, by id (--expose-request-ids)
    rates = [float(x.replace(",", "")) for x in re.findall(r"tokens/s\s+([\d,]+\.\d)", text)]
    assert rates and max(rates) > 0  # tokens were generated between two refreshes


def test_top_into_a_pipe_prints_each_frame_whole(server):
    out = cli("top", "--server", server.address, "--iterations", "2", "--interval", "0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pagedserve top") == 2 and "blocks" in out.stdout
    assert "\x1b[?1049h" not in out.stdout  # no full-screen switch written to a file


def test_a_client_with_no_server_there_is_told_to_start_one():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    out = cli("generate", "--server", f"127.0.0.1:{port}", "hi", "--timeout", "5")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"no pagedserve server answers at 127.0.0.1:{port}: start one (`make run`" in out.stderr


def test_stats_is_a_table_and_json_for_machines(server):
    table = cli("stats", "--server", server.address)
    assert table.returncode == 0, table.stderr
    for word in ("blocks", "utilization", "prefix hit rate", "preemptions", "KiB"):
        assert word in table.stdout, word
    machine = cli("stats", "--json", "--server", server.address)
    data = json.loads(machine.stdout)
    assert data["numBlocks"] == 200 and data["blockSize"] == 4
    assert int(data["numFreeBlocks"]) + int(data["numCachedBlocks"]) <= 200


def test_generate_passes_every_control_and_prints_json_or_text(server):
    out = cli(
        "generate",
        "--server",
        server.address,
        "--raw",
        "hello",
        "--greedy",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--logprobs",
        "2",
        "--logit-bias",
        "7=100",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    choice = resp["choices"][0]
    assert choice["tokenIds"] == [7] * 5 and len(choice["logprobs"]) == 5
    assert all(len(lp["topLogprobs"]) == 2 for lp in choice["logprobs"])
    text = cli(
        "generate",
        "--server",
        server.address,
        "--raw",
        "hello",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--seed",
        "1",
        "--logprobs",
        "1",
        "-v",
    )
    assert (
        text.returncode == 0 and "logprobs:" in text.stderr and "completion 4 tokens" in text.stderr
    )
    bad = cli("generate", "--server", server.address, "hi", "--repetition-penalty", "9")
    assert bad.returncode == 2 and "--repetition-penalty: 9.0 is outside (0.0, 2.0]" in bad.stderr
    refused = cli("generate", "--server", server.address, "hi", "--max-tokens", "100000")
    assert (
        refused.returncode == 1
        and "INVALID_ARGUMENT" in refused.stderr
        and "context" in refused.stderr
    )


def test_the_server_log_ends_start_up_with_where_it_serves_and_how_to_try_it(
    server, tiny_model_dir
):
    lines = server.log_path.read_text().splitlines()
    ready = [i for i, line in enumerate(lines) if line.startswith("pagedserve is serving")]
    assert len(ready) == 1
    head, grpc_line, http_line = lines[ready[0] : ready[0] + 3]
    # the name /v1/models lists
    assert head.startswith(f"pagedserve is serving {tiny_model_dir.name} (")
    assert "Authorization" not in http_line  # no key asked for, none shown
    assert "KV pool 200 blocks x 4 tokens" in head
    assert "requests without max_tokens stop at 1,024 tokens" in head
    assert "a decoding stream waits at most ~500 ms beside prompts" in head  # the default gap
    assert grpc_line.split()[:2] == ["gRPC", server.address]
    assert re.search(
        r"try: (\S*/)?pagedserve generate --server " + re.escape(server.address), grpc_line
    )
    assert http_line.split()[:2] == ["OpenAI", server.http_url]
    assert f"curl {server.http_url}/chat/completions" in http_line
    # not a terminal: every other line is a JSON event
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(e.get("event") == "serving" for e in events)


def test_logs_are_console_lines_on_a_terminal_and_json_when_asked():
    code = (
        "import structlog; from protos.base.logs import configure_logging; import sys;"
        "configure_logging('info', 'probe', sys.argv[1]);"
        "structlog.get_logger('t').info('hello_event', request_id='r-1', n=3)"
    )
    console = plain(in_terminal([sys.executable, "-c", code, "auto"], seconds=30))
    assert (
        "hello_event" in console
        and "request_id=r-1" in console
        and not console.lstrip().startswith("{")
    )
    forced = subprocess.run(
        [sys.executable, "-c", code, "json"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    event = json.loads(forced.stderr.strip().splitlines()[-1])
    assert (
        event["event"] == "hello_event"
        and event["request_id"] == "r-1"
        and event["process"] == "probe"
    )


def test_top_shows_each_replica_and_a_lost_one_in_red_words():
    """With data parallelism the view has a row per replica; a replica whose workers are lost says
    why.
    """
    import io

    from rich.console import Console

    from deploy.console import Reading, top_view

    s = generation_pb2.CacheStats(
        block_size=16,
        num_blocks=200,
        num_free_blocks=150,
        num_cached_blocks=20,
        num_shared_blocks=5,
        bytes_per_block=1 << 20,
        used_bytes=30 << 20,
        total_bytes=200 << 20,
        utilization=0.15,
        num_running=7,
        num_generated_tokens=900,
    )
    s.replicas.add(
        replica=0,
        serving=True,
        status="serving",
        num_blocks=200,
        num_free_blocks=150,
        num_cached_blocks=20,
        utilization=0.15,
        num_running=7,
        num_requests=12,
    )
    s.replicas.add(replica=1, serving=False, status="worker rank 0 of replica 1 exited")
    s.requests.add(request_id="", num_blocks=9, num_tokens=140, num_bytes=9 << 20)
    before = Reading(generation_pb2.CacheStats(num_generated_tokens=400), 10.0)
    out = io.StringIO()
    Console(file=out, width=120).print(top_view(Reading(s, 12.0), before, "host:1", "tiny"))
    text = out.getvalue()
    assert "replicas" in text and "worker rank 0 of replica 1 exited" in text
    assert "250.0" in text  # (900 - 400) tokens over 2 s
    assert "held 25" in text and "shared 5" in text and "30.0 MiB" in text
    assert "ids shown with --expose-request-ids" in text

    from deploy.console import stats_view

    for r in s.replicas:  # the largest figures a replica shows still fit an 80-column terminal
        r.num_blocks, r.num_free_blocks, r.num_requests, r.num_waiting = (
            1_234_567,
            1_000_000,
            9_876_543,
            4096,
        )
    narrow = io.StringIO()
    Console(file=narrow, width=80).print(stats_view(s))
    lines = narrow.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in narrow.getvalue()
    assert "9,876,543" in narrow.getvalue()
    assert "replica 1: worker rank 0 of replica 1 exited" in narrow.getvalue()


def test_generate_with_a_system_prompt_equals_the_same_messages(server):
    out = cli(
        "generate",
        "--server",
        server.address,
        "the fox",
        "--system",
        "you are terse",
        "--greedy",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["choices"][0]["tokenIds"]
    want = (
        server.stub.Generate(
            generation_pb2.GenerateRequest(
                messages=[
                    generation_pb2.ChatMessage(role="system", content="you are terse"),
                    generation_pb2.ChatMessage(role="user", content="the fox"),
                ],
                sampling=generation_pb2.SamplingParams(
                    max_tokens=6, temperature=0, ignore_eos=True
                ),
            ),
            timeout=30,
        )
        .choices[0]
        .token_ids
    )
    assert got == list(want)


def test_chat_keeps_the_conversation_resets_and_ctrl_c_stops_an_answer(server):
    """Two turns, /reset, then an answer stopped with Ctrl-C: the conversation each turn sends is
    what the server saw (its prompt grows with the history and starts over after /reset), and the
    stopped request is gone from the server at once.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "chat",
            "--server",
            server.address,
            "--greedy",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--system",
            "be brief",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate("the fox\nand the dog\n/reset\nthe fox\n/exit\n", timeout=60)
        assert proc.returncode == 0 and "conversation forgotten" in err

        def answer(*turns):
            roles = ["system"] + ["user", "assistant"] * (len(turns) // 2) + ["user"]
            msgs = [
                generation_pb2.ChatMessage(role=r, content=c)
                for r, c in zip(roles, ["be brief", *turns], strict=True)
            ]
            return (
                server.stub.Generate(
                    generation_pb2.GenerateRequest(
                        messages=msgs,
                        sampling=generation_pb2.SamplingParams(
                            max_tokens=4, temperature=0, ignore_eos=True
                        ),
                    ),
                    timeout=30,
                )
                .choices[0]
                .text
            )

        first = answer("the fox")
        second = answer("the fox", first, "and the dog")
        # the history went with the second turn, not the third
        assert out == f"{first}\n{second}\n{first}\n"
    finally:
        if proc.poll() is None:
            proc.kill()
    # started with SIGINT blocked, as a parent may leave it (a CI run's test process once did: the
    # Ctrl-C never reached the chat): the chat takes it back
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        long = subprocess.Popen(
            [
                *(sys.executable, "-m", "deploy.cli", "chat", "--server", server.address),
                *("--greedy", "--max-tokens", "450", "--ignore-eos"),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    pids = server.worker_pids()
    try:
        # the workers held still from before the question, so the answer cannot end before the
        # Ctrl-C lands (held from after it was seen running, a whole answer once came first)
        with server.held_still(5.0, pids):
            long.stdin.write("tell me everything\n")
            long.stdin.flush()
            deadline = time.monotonic() + 4
            while server.stats().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.stats().num_running == 1
            long.send_signal(2)  # Ctrl-C
            long.stdin.close()
        out = long.stdout.read()
        assert long.wait(timeout=30) == 0 and "[stopped]" in out
        deadline = time.monotonic() + 10
        while server.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.stats()
        assert stats.num_running == 0 and not stats.requests
    finally:
        if long.poll() is None:
            long.kill()


def test_a_second_start_of_a_model_finds_what_the_first_measured(
    server_factory, tiny_model_dir, tmp_path, monkeypatch
):
    """The matmul library is timed at the first start and read back at the second (a warm start)."""
    import shutil

    from protos.base import env

    kernels = env.cache_dir() / "kernels"
    if kernels.is_dir():  # the native build is kept, as on any second start
        shutil.copytree(kernels, tmp_path / "kernels")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    logs = []
    for _ in range(2):
        started = server_factory(tiny_model_dir, "--matmul", "auto")
        logs.append(
            [
                json.loads(line)
                for line in started.log_path.read_text().splitlines()
                if line.startswith("{") and '"matmul_chosen"' in line
            ]
        )
        started.stop()
    if not logs[0]:
        pytest.skip("this machine has one matmul library only: nothing to choose between")
    assert len(logs[0]) == 1 and "measured" not in logs[0][0]  # timed: each library's milliseconds
    assert len(logs[1]) == 1 and logs[1][0]["measured"] == "at an earlier start"
    assert logs[1][0]["library"] == logs[0][0]["library"]
    assert list((tmp_path / "choices").glob("*.json"))
