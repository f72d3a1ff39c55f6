"""A person's mistakes at the command line: every bad flag, file or model path is one line saying
what is wrong, exit code 2, and never a traceback (each case a real process, as typed).
"""

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
    (
        ["generate", "--system", "@/nonexistent/system.txt", "Hi"],
        "cannot read /nonexistent/system.txt",
    ),
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


def write_gguf(path, arch: str) -> None:
    """A small GGUF file of an architecture, as llama.cpp's converter writes its header."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bad_models(tmp):
    from worker.weights.gguf_header import find_embedded_gguf

    (tmp / "not-a-model").mkdir()
    (tmp / "plain.txt").write_text("hello")
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(find_embedded_gguf().read_bytes()[:1_000_000])
    write_gguf(tmp / "starcoder-2.gguf", "starcoder2")
    write_gguf(tmp / "gpt-oss-20b.gguf", "gpt-oss")  # served, but this one has no tokenizer
    (tmp / "bad-config").mkdir()
    (tmp / "bad-config" / "config.json").write_text("{not json")
    (tmp / "bad-config" / "tokenizer.json").write_text("{}")
    deepseek_v4_folder(tmp / "deepseek-v4")
    return [
        (tmp / "nowhere", "no model at"),
        (tmp / "not-a-model", "has no config.json"),
        (tmp / "plain.txt", "is a file but not a .gguf one"),
        (tmp / "missing.gguf", "no such GGUF file"),
        (truncated, "the GGUF file is truncated or corrupt"),
        (
            tmp / "starcoder-2.gguf",
            "a GGUF of architecture 'starcoder2', which is not served (served: ",
        ),
        (tmp / "deepseek-v4", "deepseek_v4 is not served: it needs hyper-connections"),
        (tmp / "gpt-oss-20b.gguf", "holds no tokenizer (tokenizer.ggml.model)"),
        (tmp / "bad-config", "config.json cannot be read"),
    ]


def deepseek_v4_folder(folder):
    """A DeepSeek-V4 folder as it ships: its head saved as `head.weight`, which says nothing of
    whether it generates; the refusal must name the architecture's missing pieces.
    """
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    config = {"model_type": "deepseek_v4", "hidden_size": 8, "vocab_size": 16, "hc_mult": 4}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    weights = {"head.weight": torch.zeros(16, 8), "model.embed_tokens.weight": torch.zeros(16, 8)}
    save_file(weights, str(folder / "model.safetensors"))


def test_prepare_model_says_an_architecture_is_not_served_not_that_the_file_is_corrupt(
    tmp_path, capsys
):
    from deploy.prepare_model import main as prepare_main

    write_gguf(tmp_path / "starcoder-2.gguf", "starcoder2")
    write_gguf(tmp_path / "lfm3.gguf", "lfm3")
    write_gguf(tmp_path / "deepseek-v3.gguf", "deepseek2")
    truncated = tmp_path / "truncated.gguf"
    write_gguf(truncated, "llama")
    truncated.write_bytes(truncated.read_bytes()[:40])
    for path, message in (
        ("starcoder-2.gguf", "architecture 'starcoder2', which is not served (served: llama"),
        ("lfm3.gguf", "'lfm3', which is not served from a GGUF (its Hugging Face"),
        ("deepseek-v3.gguf", "'deepseek2', which is not served: it needs multi-head latent"),
        ("truncated.gguf", "the GGUF file is truncated or corrupt"),
    ):
        code = prepare_main(["--gguf", str(tmp_path / path), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (path, code, err)
        assert not (tmp_path / "out").exists()


@pytest.fixture
def logging_restored():
    """`pagedserve serve`'s main configures structlog to write to this test's captured stderr: put
    back what the process had, or later tests in it would log to a closed stream.
    """
    import structlog

    config, context = structlog.get_config(), structlog.contextvars.get_contextvars()
    yield
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)


def test_serve_says_what_is_wrong_with_a_model_path_or_a_flag(
    tmp_path, tiny_model_dir, capsys, monkeypatch, logging_restored
):
    """Each refused before anything is bound or started (in this process: `pagedserve serve`'s own
    main).
    """
    from deploy.launcher import main as serve_main

    monkeypatch.setenv("PAGEDSERVE_MODELS", str(tmp_path / "prepared"))
    cases = [(["--model", str(path)], message) for path, message in bad_models(tmp_path)] + [
        (
            ["--model", str(tiny_model_dir), "--port", "99999"],
            "--port: 99999 is outside [0, 65535]",
        ),
        (
            ["--model", str(tiny_model_dir), "--tls-cert", "x.pem"],
            "--tls-cert and --tls-key go together",
        ),
        (["--model", str(tiny_model_dir), "--block-size", "0"], "--block-size: 0 is below 1"),
        (
            ["--model", str(tiny_model_dir), "--kv-cache-memory", "lots"],
            "cannot read 'lots' as a size",
        ),
        (["--model", str(tiny_model_dir), "--num-blocks", "-1"], "--num-blocks: -1 is below 1"),
    ]
    failures = []
    for argv, message in cases:
        try:
            code = serve_main(
                [*argv, "--metrics-port", "0", "--http-port", "0", "--log-format", "json"]
            )
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        if code != 2 or not err or message not in err[-1]:
            failures.append(f"{argv}: exit {code}, last line {err[-1:]!r}")
    assert not failures, "\n".join(failures)


def test_a_running_serve_refuses_a_taken_port_or_a_worker_that_cannot_start(
    tiny_model_dir, taken_port
):
    """As typed, real processes: the last line says what is wrong, exit 2, no traceback."""
    model = str(tiny_model_dir)
    cases = [
        (
            ["--model", model, "--port", str(taken_port), "--metrics-port", "0"],
            f"cannot serve gRPC on 127.0.0.1:{taken_port}",
        ),
        (
            [
                "--model",
                model,
                "--port",
                "0",
                "--http-port",
                str(taken_port),
                "--metrics-port",
                "0",
            ],
            f"cannot serve HTTP on 127.0.0.1:{taken_port}",
        ),
        # a worker that refuses: its reason, then the server's one line naming it
        (
            [
                "--model",
                model,
                "--tp",
                "3",
                "--port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                "0",
            ],
            "a worker could not start",
        ),
    ]
    failures = []
    for argv, message in cases:
        r = run("serve", *argv)
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        if r.returncode != 2 or message not in last or "Traceback" in r.stderr + r.stdout:
            failures.append(f"{argv}: exit {r.returncode}, last line {last!r}")
        if "--tp" in argv and "cannot split the model's 4 query heads" not in r.stderr:
            failures.append(f"{argv}: the worker's reason is not said: {r.stderr[-500:]!r}")
    assert not failures, "\n".join(failures)
