"""KV tiers through real servers: greedy answers identical with tiers off, a host tier and a disk
tier while a small pool evicts every document; the disk tier read back after a restart and after a
worker is killed (cached tokens in usage), never by another model; returning turns all at once under
preemption; corrupt and truncated files computed instead; the disk within its size; a folder that
cannot be written refused at start in one line; TP=2 with each rank's share on disk.
"""

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos import generation_pb2
from tests.support.server import greedy_request
from tests.support.serving import assert_all_blocks_back, wait_health
from tests.support.tiny import make_tiny_llama
from worker.model.kv_tiers import HEADER

pytestmark = pytest.mark.slow

SMALL = (
    "--block-size",
    "4",
    "--num-blocks",
    "48",
    "--max-model-len",
    "160",
    "--max-num-batched-tokens",
    "64",
)


def chats(seed=0, docs=5, turns=2):
    """Turn by turn, each document (60 tokens, more than the pool holds beside the others) with a
    new tail.
    """
    rng = random.Random(seed)
    texts = [[rng.randrange(3, 380) for _ in range(60)] for _ in range(docs)]
    return [
        [doc + [rng.randrange(3, 380) for _ in range(3 * (t + 1))] for doc in texts]
        for t in range(turns)
    ]


def run(server, prompts, max_tokens=6):
    """Each prompt alone, in order: (tokens, cached prompt tokens) each."""
    out = []
    for p in prompts:
        resp = server.stub.Generate(greedy_request(p, max_tokens), timeout=120)
        out.append((list(resp.choices[0].token_ids), resp.usage.cached_prompt_tokens))
    return out


@pytest.fixture(scope="module")
def off(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, *SMALL)
    yield server
    server.stop()  # (not at the session's end: the suite's other servers need the memory)


@pytest.fixture
def serve(server_factory):
    """server_factory's servers, stopped when the test ends."""
    started = []

    def start(*args):
        started.append(server_factory(*args))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference(off):
    return {t: run(off, prompts) for t, prompts in enumerate(chats())}


def files(folder):
    return sorted(p for p in folder.rglob("*.kv"))


def test_host_and_disk_tiers_give_the_same_answers_and_serve_returning_turns(
    serve, tiny_model_dir, reference, tmp_path
):
    host = serve(tiny_model_dir, *SMALL, "--kv-offload-size", "4MiB")
    disk = serve(tiny_model_dir, *SMALL, "--kv-offload-dir", str(tmp_path / "kv"))
    for server in (host, disk):
        for t, prompts in enumerate(chats()):
            got = run(server, prompts)
            assert [g for g, _ in got] == [g for g, _ in reference[t]]
            # a returning turn finds its document below the pool, not in it (others evicted it)
            if t:
                assert all(cached >= 56 for _, cached in got), got
                assert all(cached == 0 for _, cached in reference[t]), reference[t]
        stats = server.stats()
        assert stats.host_tier_loaded + stats.disk_tier_loaded >= 5 * 14
        assert stats.kv_load_failures == 0
        assert_all_blocks_back(server)
    assert host.stats().host_tier_capacity > 0 and disk.stats().disk_tier_blocks == len(
        files(tmp_path)
    )


def test_the_disk_tier_survives_a_restart_and_faults_are_misses(
    serve, tiny_model_dir, reference, tmp_path
):
    folder = tmp_path / "kv"
    first = serve(tiny_model_dir, *SMALL, "--kv-offload-dir", str(folder))
    assert [g for g, _ in run(first, chats()[0])] == [g for g, _ in reference[0]]
    first.stop()
    written = files(folder)
    assert len(written) >= 5 * 15
    with open(written[0], "r+b") as f:  # a flipped byte
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(written[1], "r+b") as f:  # a file cut short
        f.truncate(100)
    again = serve(tiny_model_dir, *SMALL, "--kv-offload-dir", str(folder))
    got = run(again, chats()[1])
    assert [g for g, _ in got] == [g for g, _ in reference[1]]
    assert sum(cached >= 56 for _, cached in got) >= 3, got  # read back after the restart
    assert again.stats().kv_load_failures >= 1
    assert_all_blocks_back(again)
    # another model on the same folder reads none of it
    other = make_tiny_llama(tmp_path / "other", seed=11)
    changed = serve(other, *SMALL, "--kv-offload-dir", str(folder))
    got = run(changed, chats()[1][:2])
    assert all(cached == 0 for _, cached in got) and changed.stats().disk_tier_loaded == 0


def test_the_disk_tier_stays_within_its_size(serve, tiny_model_dir, reference, tmp_path):
    folder = tmp_path / "kv"
    small = serve(
        tiny_model_dir, *SMALL, "--kv-offload-dir", str(folder), "--kv-offload-disk-size", "40KB"
    )
    for t, prompts in enumerate(chats()):
        assert [g for g, _ in run(small, prompts)] == [g for g, _ in reference[t]]
    stats = small.stats()
    # header, K/V, the block's four token ids
    per_file = HEADER.size + stats.bytes_per_block + 4 * 4
    cap = 40_000 // per_file
    assert stats.disk_tier_capacity == cap and stats.disk_tier_blocks <= cap
    assert stats.disk_tier_stored > 2 * cap and len(files(folder)) <= cap


def test_a_folder_that_cannot_be_written_is_refused_in_one_line(tiny_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--kv-offload-dir",
            str(blocker / "kv"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--kv-offload-dir" in proc.stderr and "cannot be written" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tensor_parallel_ranks_write_and_read_their_own_shares(
    serve, tiny_model_dir, reference, tmp_path
):
    folder = tmp_path / "kv"
    tp = serve(tiny_model_dir, *SMALL, "--tp", "2", "--kv-offload-dir", str(folder))
    for t, prompts in enumerate(chats()):
        got = run(tp, prompts)
        assert [g for g, _ in got] == [g for g, _ in reference[t]]
    assert len({p.parent for p in files(folder)}) == 2  # one folder a rank
    assert tp.stats().disk_tier_loaded > 0
    assert isinstance(tp.stats(), generation_pb2.CacheStats)


def test_a_killed_worker_reads_the_documents_back_from_disk_and_turns_at_once_preempt(
    serve, tiny_model_dir, off, reference, tmp_path
):
    # the smallest pool a full context fits: two answers at once outgrow it
    server = serve(
        tiny_model_dir,
        *SMALL,
        "--num-blocks",
        "40",
        "--kv-offload-size",
        "4MiB",
        "--kv-offload-dir",
        str(tmp_path / "kv"),
    )
    assert [g for g, _ in run(server, chats()[0])] == [g for g, _ in reference[0]]
    (first,) = server.stats().replicas[0].worker_pids
    os.kill(first, signal.SIGKILL)  # its pool and host tier are gone; the disk is not
    deadline = time.monotonic() + 60
    while server.stats().replicas[0].worker_pids in ([], [first]):
        assert time.monotonic() < deadline, "the worker was not replaced"
        time.sleep(0.05)
    wait_health(server, True, 60)
    turn = chats()[1]
    want = [g for g, _ in run(off, turn, 30)]  # long enough that two answers outgrow the pool
    with server.queued_in_order(len(turn)) as delays, ThreadPoolExecutor(len(turn)) as pool:

        def one(i):
            time.sleep(delays[i])
            resp = server.stub.Generate(greedy_request(turn[i], 30), timeout=120)
            return list(resp.choices[0].token_ids), resp.usage.cached_prompt_tokens

        got = list(pool.map(one, range(len(turn))))
    assert [g for g, _ in got] == want
    stats = server.stats()
    assert stats.disk_tier_loaded >= 3 * 14 and sum(c >= 56 for _, c in got) >= 3, got
    assert stats.num_preemptions > 0  # five documents do not fit the pool at once
    assert_all_blocks_back(server)
    table = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "stats", "--server", server.address],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "host tier" in table and "disk tier" in table, table
