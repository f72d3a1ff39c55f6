"""Every flag of every command says what it does, and every flag of `pagedserve serve` is in
docs/serving.md: nothing a user needs is only in the code."""

import argparse
from pathlib import Path

import pytest

from deploy.cli import build_parser as cli_parser
from deploy.fleet import build_parser as deploy_parser
from deploy.launcher import build_parser as serve_parser
from deploy.loadtest.cli import build_parser as loadtest_parser
from worker.serve.main import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {
    "pagedserve": cli_parser,
    "pagedserve serve": serve_parser,
    "pagedserve deploy": deploy_parser,
    "pagedserve-worker": worker_parser,
    "pagedserve-loadtest": loadtest_parser,
}


def actions(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from actions(subparser, f"{name} {sub}")
        elif action.option_strings != ["-h", "--help"]:
            yield name, action


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help(command):
    silent = [
        f"{name}: {action.option_strings or action.dest}"
        for name, action in actions(PARSERS[command](), command)
        if not action.help and action.dest != "command"
    ]
    assert not silent, "flags without help:\n" + "\n".join(silent)


def test_every_serve_flag_is_in_the_serving_guide():
    guide = (ROOT / "docs" / "serving.md").read_text()
    missing = [
        max(a.option_strings, key=len)
        for _, a in actions(serve_parser(), "serve")
        if a.option_strings and f"`{max(a.option_strings, key=len)}`" not in guide
    ]
    assert not missing, "docs/serving.md does not say: " + ", ".join(missing)


def test_make_help_says_the_values_a_target_uses():
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    out = subprocess.run(
        ["make", "--no-print-directory", "help", "PORT=50077", "RUN_DIR=run/elsewhere"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "gRPC on 50077, OpenAI HTTP on 8000" in out and "logs in run/elsewhere" in out
    assert "$(" not in out
