"""uvicorn serving the OpenAI routes in the scheduler's event loop, on a socket bound at start."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _Uvicorn(uvicorn.Server):
    """uvicorn in the scheduler's loop: the scheduler owns SIGINT/SIGTERM (drain), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


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
            http="httptools" if _has_httptools() else "h11",
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
