"""SMG (the Shepherd Model Gateway, PyPI `smg`) in front of pagedserve servers, each registered as a
vLLM worker (we serve its engine protocol); SMG serves OpenAI HTTP with its routing (cache_aware by
default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parent.parent


log = structlog.get_logger("deploy")


def smg_command(
    worker_addresses: list[str],
    host: str,
    port: int,
    model_dir: str | Path,
    policy: str = "cache_aware",
    metrics_port: int = 29000,
    extra: list[str] | None = None,
) -> list[str]:
    """worker_addresses: the servers' gRPC host:port; the model folder gives SMG its tokenizer and
    template.
    """
    return [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *[f"grpc://{a}" for a in worker_addresses],
        "--policy",
        policy,
        "--model-path",
        str(Path(model_dir).resolve()),
        "--log-level",
        "warn",
        "--log-json",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        # a restarted server is back in rotation within seconds
        "--health-check-interval-secs",
        "5",
        "--health-success-threshold",
        "1",
        *(extra or []),
    ]


def registered_models(base_url: str, timeout: float = 2.0) -> list[str]:
    """The model ids the gateway serves now ([] while none of its workers is registered)."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout) as resp:
            return [m["id"] for m in json.loads(resp.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError):
        return []


def gateway_workers(base_url: str, timeout: float = 2.0) -> list[dict]:
    """SMG's /workers listing ([] when it cannot be read)."""
    try:
        with urllib.request.urlopen(f"{base_url}/workers", timeout=timeout) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return []
    return body.get("workers", body) if isinstance(body, dict) else body


def ready_tokenizers(base_url: str, timeout: float = 2.0) -> set[str]:
    """Tokenizers SMG has loaded; it answers a model 503 until that model's tokenizer registers."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/tokenizers", timeout=timeout) as resp:
            listed = json.loads(resp.read()).get("tokenizers", [])
        ready = set()
        for t in listed:
            with urllib.request.urlopen(
                f"{base_url}/v1/tokenizers/{t['id']}/status", timeout=timeout
            ) as resp:
                if json.loads(resp.read()).get("status") == "completed":
                    ready.add(t["name"])
        return ready
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return set()


def wait_ready(base_url: str, num_workers: int, timeout: float, alive=lambda: True) -> None:
    """Until the gateway lists a model, its workers and tokenizers: so it answers at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the gateway exited while starting")
        models = registered_models(base_url)
        if models:
            workers = gateway_workers(base_url)
            healthy = [w for w in workers if w.get("is_healthy", True)]
            if len(healthy) >= num_workers and set(models) <= ready_tokenizers(base_url):
                return
        time.sleep(0.2)
    raise TimeoutError(
        f"the gateway at {base_url} did not register {num_workers} worker(s) and their "
        f"model's tokenizer within {timeout:g}s"
    )


class GatewayProcess:
    def __init__(
        self,
        worker_addresses: list[str],
        model_dir: str | Path,
        log_path: Path,
        port: int,
        policy: str = "cache_aware",
        extra: list[str] | None = None,
    ) -> None:
        self.worker_addresses = list(worker_addresses)
        self.model_dir = model_dir
        self.log_path = Path(log_path)
        self.port = port
        self.policy = policy
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0, wait: bool = True) -> GatewayProcess:
        """wait: until every server is registered and healthy (else
        return once the process runs).
        """
        self._log = open(self.log_path, "w")
        from deploy.processes import free_port

        cmd = smg_command(
            self.worker_addresses,
            "127.0.0.1",
            self.port,
            self.model_dir,
            self.policy,
            free_port(),
            self.extra,
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1"},
            start_new_session=True,
        )
        if not wait:
            return self
        try:
            wait_ready(
                self.base_url,
                len(self.worker_addresses),
                timeout,
                alive=lambda: self.proc.poll() is None,
            )
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from e
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        from deploy.processes import stop_group

        stop_group(self.proc, 15)
        if hasattr(self, "_log"):
            self._log.close()


def _python() -> str:
    """This interpreter as a newcomer would type it (.venv/bin/python from the checkout)."""
    try:
        inside = Path(sys.executable).is_relative_to(ROOT)
        return os.path.relpath(sys.executable) if inside else sys.executable
    except ValueError:
        return sys.executable


def gateway_banner(base_url: str, model: str, servers: int) -> list[str]:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    )
    return [
        f"SMG serves an OpenAI-compatible API for {model} on {base_url}/v1 "
        f"(in front of {servers} pagedserve server{'s' if servers > 1 else ''})",
        f"  try: curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d "
        f"'{body}'",
        f'   or: {_python()} -c "from openai import OpenAI; '
        f"print(OpenAI(base_url='{base_url}/v1', "
        f"api_key='none').chat.completions.create(model='{model}', "
        f"messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)\"",
    ]


def gateway_metrics_port(args: argparse.Namespace) -> int:
    if args.gateway_metrics_port is not None:
        return args.gateway_metrics_port
    import socket

    from deploy.processes import free_port

    with socket.socket() as s:
        try:
            s.bind((args.gateway_host, 29000))
            return 29000
        except OSError:
            port = free_port()
            log.warning("gateway_metrics_port_taken", port=29000, using=port)
            return port
