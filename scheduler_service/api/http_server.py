"""uvicorn serving the OpenAI routes in the scheduler's event loop, on a socket bound at start; a
request its HTTP parser cannot read is refused in OpenAI's JSON error shape, not plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys

import uvicorn

from scheduler_service.api.openai_responses import dumps, error_body


class _Uvicorn(uvicorn.Server):
    """uvicorn in the scheduler's loop: the scheduler owns SIGINT/SIGTERM (drain), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class _JsonRefusal:
    """Mixed into uvicorn's HTTP protocol: its 400 for bytes that are no HTTP request (two
    Content-Lengths, a negative one, a control character in a header) said as JSON, naming what the
    parser found (the parser's error is being handled when this is called).
    """

    def send_400_response(self, msg: str) -> None:
        found = sys.exc_info()[1]
        why = str(found).strip() if found is not None and str(found).strip() else msg
        body = dumps(error_body(f"the HTTP request is malformed: {why}", "invalid_request_error"))
        head = (
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def _protocol() -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11) refusing in JSON."""
    if _has_httptools():
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"JsonRefusing{base.__name__}", (_JsonRefusal, base), {})


def bind(host: str, port: int) -> socket.socket:
    """Bound now, so a port in use is said at start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """uvicorn serving an OpenAIServer on a socket bound beforehand."""

    def __init__(self, app, sock: socket.socket, tls: tuple[str, str] | None = None) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.tls = tls is not None
        ssl = {"ssl_keyfile": tls[0], "ssl_certfile": tls[1]} if tls else {}
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            http=_protocol(),
            **ssl,
        )
        self.server = _Uvicorn(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10)


def _has_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True
