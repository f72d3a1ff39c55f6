"""A person's mistakes at the command line: every bad flag, file or model path is one line saying what is
wrong, exit code 2, and never a traceback (each case a real process, as typed)."""

import socket
import subprocess
import sys

import pytest

from deploy.processes import ROOT

pytestmark = pytest.mark.slow


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "PAGEDSERVE_MODELS": "/tmp/pagedserve-bad"},
    )


CLIENT = [
    (["generate", "--max-tokens", "-5", "Hi"], "--max-tokens: -5 is below 1"),
    (["generate", "--seed", "-1", "Hi"], "--seed: -1 is outside"),
    (["generate", "--min-tokens", "-1", "Hi"], "--min-tokens: -1 is below 0"),
    (["generate", "-n", "0", "Hi"], "0 is outside [1, 16]"),
    (["generate", "--temperature", "nan", "Hi"], "not a finite number"),
    (["generate", "--top-p", "0", "Hi"], "--top-p: 0.0 is outside (0.0, 1.0]"),
    (["generate", "--logit-bias", "5=x", "Hi"], "wants TOKEN_ID=BIAS"),
    (["generate", "--json-schema", "@missing.json", "Hi"], "cannot read missing.json"),
    (["generate", "--system", "@/nonexistent/system.txt", "Hi"], "cannot read /nonexistent/system.txt"),
    (["generate", "--logprobs", "99", "Hi"], "--logprobs: 99 is outside [0, 20]"),
    (["embed", "x", "--dimensions", "-1"], "--dimensions: -1 is below 0"),
    (["top", "--interval", "0"], "--interval: 0.0 is outside"),
    (["generate"], "the following arguments are required: prompt"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv, message", CLIENT, ids=[" ".join(a) for a, _ in CLIENT])
def test_a_bad_client_flag_is_one_line_and_exit_2(argv, message):
    r = run(*argv)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve_cases(tmp, model, taken):
    from worker.gguf_weights import find_embedded_gguf

    (tmp / "not-a-model").mkdir()
    (tmp / "plain.txt").write_text("hello")
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(find_embedded_gguf().read_bytes()[:1_000_000])
    (tmp / "bad-config").mkdir()
    (tmp / "bad-config" / "config.json").write_text("{not json")
    (tmp / "bad-config" / "tokenizer.json").write_text("{}")
    return [
        (["--model", str(tmp / "nowhere")], "no model at"),
        (["--model", str(tmp / "not-a-model")], "has no config.json"),
        (["--model", str(tmp / "plain.txt")], "is a file but not a .gguf one"),
        (["--model", str(tmp / "missing.gguf")], "no such GGUF file"),
        (["--model", str(truncated)], "the GGUF file is truncated or corrupt"),
        (["--model", str(tmp / "bad-config")], "config.json cannot be read"),
        (["--model", str(model), "--port", "99999"], "--port: 99999 is outside [0, 65535]"),
        (
            ["--model", str(model), "--port", str(taken), "--metrics-port", "0"],
            f"cannot serve gRPC on 127.0.0.1:{taken}",
        ),
        (
            ["--model", str(model), "--port", "0", "--http-port", str(taken), "--metrics-port", "0"],
            f"cannot serve HTTP on 127.0.0.1:{taken}",
        ),
        (["--model", str(model), "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["--model", str(model), "--block-size", "0"], "--block-size: 0 is below 1"),
    ]


def test_serve_refuses_what_cannot_work_in_one_line_and_exit_2(tmp_path, tiny_model_dir, taken_port):
    failures = []
    for argv, message in serve_cases(tmp_path, tiny_model_dir, taken_port):
        r = run("serve", *argv)
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        if r.returncode != 2 or message not in last or "Traceback" in r.stderr + r.stdout:
            failures.append(f"{argv}: exit {r.returncode}, last line {last!r}")
    assert not failures, "\n".join(failures)
