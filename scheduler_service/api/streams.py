"""Async plumbing of the HTTP front door: a request's work raced against its client's disconnect,
and several engine streams read as one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request


class ClientGone(Exception):
    """The client disconnected before its answer: nothing is sent, the request was aborted."""


async def disconnected(request: Request) -> None:
    """Returns when the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work):
    """Run work (a coroutine) to its end, or cancel it when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(which, item) from several async iterators as they come; one that fails ends them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
