"""Every example in the README, run as printed against a live server of the default model (its ports
put where the README says 50051 and 8000): each command exits 0, each snippet runs, each answer is
bounded.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.processes import ROOT

MODEL_DIR = Path(os.environ.get("PAGEDSERVE_MODEL_DIR", ROOT / ".models" / "smollm2-135m-instruct"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(
        not (MODEL_DIR / "config.json").exists(),
        reason=f"default model not prepared in {MODEL_DIR} (run `make setup`)",
    ),
]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.DOTALL)


def commands() -> list[str]:
    """The client commands of the README's bash blocks (not the
    servers, nor the interactive chat).
    """
    out = []
    for lang, body in BLOCKS:
        if lang != "bash":
            continue
        text = body.replace("\\\n", " ")
        for line in re.split(r"\n(?=\S)", text.strip()):
            line = line.split("  #")[0].strip()
            if (
                line.startswith(".venv/bin/pagedserve")
                and " serve " not in line + " "
                and " chat" not in line
            ):
                out.append(line)
            elif line.startswith("curl "):
                out.append(line)
    return out


@pytest.fixture(scope="module")
def server(server_factory):
    # the README's adapter, made by its own snippet first, then served as its serve line says
    made = [body for lang, body in BLOCKS if lang == "python" and "save_pretrained" in body]
    extra = []
    if made:
        subprocess.run(
            [sys.executable, "-c", made[0]], cwd=ROOT, check=True, capture_output=True, timeout=300
        )
        extra = ["--lora-modules", re.search(r"--lora-modules (\S+)", README)[1]]
    return server_factory(
        MODEL_DIR, "--max-model-len", "2048", "--kv-cache-memory", "256MiB", *extra
    )


def localize(text: str, server) -> str:
    """The README's addresses made this server's: `make run`'s ports, and the second server's of the
    LoRA example (this one serves its adapter too).
    """
    for grpc_address in ("localhost:50051", "localhost:50052"):
        text = text.replace(grpc_address, server.address)
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{server.http_port}")


def test_the_readme_has_its_examples():
    assert len(commands()) >= 7 and sum(lang == "python" for lang, _ in BLOCKS) >= 2
    assert len(README.splitlines()) <= 150


@pytest.mark.parametrize("command", commands())
def test_every_readme_command_runs(server, command):
    env = {**os.environ, "PAGEDSERVE_SERVER": server.address}
    if command.endswith(" top"):  # the live view, drawn twice instead of until Ctrl-C
        command += " --iterations 2 --interval 0.5 --no-screen"
    r = subprocess.run(
        localize(command, server),
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and "error" not in r.stdout[:200].lower(), (
        r.stdout + r.stderr
    )


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_every_readme_snippet_runs(server, index):
    code = localize(BLOCKS[index][1], server)
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
