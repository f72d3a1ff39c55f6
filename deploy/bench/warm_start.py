"""How long `pagedserve serve` takes to serve, cold and warm: `make bench-start`.

Each round starts the server as `make run` does (the default model, default flags, a fresh process),
times the ready line on its stdout and the first chat answer after it, and stops it. A cold round
starts with an empty choices cache ($PAGEDSERVE_CACHE/choices: the matmul library and the quantized
kernel's threshold are measured); a warm round finds what the cold one kept. The native kernels'
build is kept in both (`make setup` built it). Medians over --rounds pairs, and warm / cold per
pair.

    python -m deploy.bench.warm_start --model .models/smollm2-135m-instruct --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from deploy.processes import ROOT, free_port, stop_group


def start_once(model: str, cache: Path, timeout: float = 300) -> tuple[float, float]:
    """(seconds to the ready line, seconds to the first answer) of one start."""
    port, http = free_port(), free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "deploy.launcher",
        "--model",
        model,
        "--port",
        str(port),
        "--http-port",
        str(http),
        "--metrics-port",
        "0",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("pagedserve is serving"):
                break
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError("no ready line")
        else:
            raise RuntimeError(f"the server exited with {proc.wait()} before serving")
        ready = time.perf_counter() - t0
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/chat/completions",
            body,
            {"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=120).read()
        return ready, time.perf_counter() - t0
    finally:
        stop_group(proc, 20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    kernels = (
        Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "kernels"
    )
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            if kernels.is_dir():  # the build `make setup` made: kept, as on any second start
                shutil.copytree(kernels, cache / "kernels")
            cold = start_once(args.model, cache)
            warm = start_once(args.model, cache)
        rows.append((cold, warm))
        print(
            f"round {r + 1}: cold ready {cold[0]:.1f} s, first answer {cold[1]:.1f} s; warm ready "
            f"{warm[0]:.1f} s, first answer {warm[1]:.1f} s; warm / cold {warm[0] / cold[0]:.2f}",
            flush=True,
        )
    med = [
        statistics.median(x) for x in zip(*[(c[0], c[1], w[0], w[1]) for c, w in rows], strict=True)
    ]
    print(
        f"median: cold ready {med[0]:.1f} s (answer {med[1]:.1f} s), warm ready {med[2]:.1f} s "
        f"(answer {med[3]:.1f} s), warm / cold "
        f"x{statistics.median(w[0] / c[0] for c, w in rows):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
