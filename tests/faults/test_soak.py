"""`make soak` kept working: a short soak on a tiny model with a worker SIGKILLed midway loses no
request, leaks no block and reports its memory."""

import json

import pytest

from deploy.loadtest import soak

pytestmark = pytest.mark.slow


def test_slope_is_mib_per_minute():
    points = [(t, 100 + 2 * t / 60) for t in range(0, 600, 10)]
    assert soak.slope(points) == pytest.approx(2.0)
    assert soak.slope([(0, 5.0), (60, 5.0), (120, 5.0)]) == 0


def test_with_kills_the_slope_is_taken_over_the_levels_before_each_kill():
    """A killed worker starts again from nothing: the creep is how the level reached before each
    kill moves, not the refill after it."""
    samples = []
    for t in range(0, 1800, 10):
        since = t % 300  # killed at 300, 600, ...; refills over two minutes; 1 MiB/min creep
        worker = (0 if since == 0 and t else min(3000, 1000 + 2000 * since / 120)) + t / 60
        samples.append({"t": t, "worker": worker, "scheduler": 150, "total": worker + 150})
    kills = [300.2, 600.2, 900.2, 1200.2, 1500.2]
    m = soak.memory_figures(samples, kills, warm=300, loaded=1790)
    assert m["slope_mib_per_min"]["worker"] == pytest.approx(1.0, abs=0.05)
    assert m["slope_mib_per_min"]["scheduler"] == 0
    assert all(x > 3000 for x in m["rss_mib"]["before_each_kill"])


def test_a_short_soak_with_a_worker_killed_loses_nothing(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--model", str(tiny_model_dir), "--minutes", "0.6", "--kill-every", "0.3",
            "--warmup", "0.1", "--idle-s", "2", "--sample-s", "2", "--streams", "4",
            "--timeout", "120", "--log", str(tmp_path / "server.log"), "--output", str(out),
            "--", "--threads", "1", "--kv-cache-memory", "64MiB",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert len(result["kills_at_s"]) == 1
    assert result["leaked_blocks"] == 0 and result["running_after"] == 0
    kinds = {k.split()[0] for k in result["fates"]}
    assert kinds == {"grpc", "engine", "chat", "completion"}
    assert not any("failed" in k for k in result["fates"]) and result["greedy_mismatches"] == 0
    assert result["worker_planned_mib"] > 0 and len(result["samples"]) >= 10
