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
    assert result["rss_mib"]["worker_planned"] > 0 and len(result["samples"]) >= 10
