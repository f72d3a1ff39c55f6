"""One run: the requests in flight, each one's timings, the cache sampled beside them."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from deploy.loadtest.targets import TargetError
from deploy.loadtest.workload import Item, arrival_gaps


@dataclass
class Outcome:
    input_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None  # gRPC status code name
    aborted: bool = False
    start: float = 0.0


@dataclass
class Settings:
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    abort_fraction: float = 0.0
    timeout: float = 600.0
    # or "embeddings": each request one input's vector (no output tokens)
    endpoint: str = "completions"


class Run:
    """One load pattern against one target; samples GetCacheStats while it runs."""

    def __init__(
        self, target, items: list[Item], settings: Settings, label: str, progress: bool = True
    ) -> None:
        self.target = target
        self.items = items
        self.settings = settings
        self.label = label
        self.progress = progress
        self.outcomes: list[Outcome] = []
        self.samples: list[dict] = []  # time series: t, output tokens so far, utilization
        self.rng = random.Random(settings.seed + 1)
        self.t0 = 0.0
        self.tokens_so_far = 0

    async def one(self, index: int, item: Item) -> None:
        s = self.settings
        out = Outcome(input_len=len(item.prompt_token_ids or ()), start=time.perf_counter())
        self.outcomes.append(out)
        abort_at = None
        if self.rng.random() < s.abort_fraction:
            abort_at = self.rng.randint(1, max(1, item.output_len - 1))
        messages = self.target.stream(item, index, s)
        last = None
        try:
            async for tokens, prompt_tokens, timed in messages:
                now = time.perf_counter()
                if prompt_tokens is not None:
                    out.input_len = prompt_tokens
                if timed:
                    if out.ttft is None:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last)
                    last = now
                out.output_tokens += tokens
                self.tokens_so_far += tokens
                if abort_at is not None and out.output_tokens >= abort_at:
                    out.aborted = True
                    return
            if out.ttft is None:
                out.error = "NO_TOKENS"
                return
            out.e2el = (last or time.perf_counter()) - out.start
        except asyncio.CancelledError:
            out.aborted = True
            raise
        except TargetError as e:
            out.error = str(e)
        except OSError as e:  # the connection itself (HTTP targets)
            out.error = type(e).__name__
        finally:
            await messages.aclose()

    async def sample_once(self) -> None:
        row = {"t": time.perf_counter() - self.t0, "output_tokens": self.tokens_so_far}
        stats = await self.target.cache_stats()
        if stats is not None:
            row.update(stats)
        self.samples.append(row)

    async def sample_cache(self, interval: float = 0.25) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(interval)

    async def report_progress(self, total: int) -> None:
        last_tokens, last_t = 0, time.perf_counter()
        while True:
            await asyncio.sleep(1.0)
            now = time.perf_counter()
            done = sum(1 for o in self.outcomes if o.e2el is not None or o.error or o.aborted)
            failed = sum(1 for o in self.outcomes if o.error)
            rate = (self.tokens_so_far - last_tokens) / (now - last_t)
            last_tokens, last_t = self.tokens_so_far, now
            end = "\r" if sys.stderr.isatty() else "\n"
            print(
                f"[{self.label}] {now - self.t0:6.1f}s  done {done}/{total}  failed {failed}  "
                f"{rate:8.1f} tok/s",
                end=end,
                file=sys.stderr,
                flush=True,
            )

    async def closed_loop(self, concurrency: int, deadline: float) -> None:
        queue = list(enumerate(self.items))
        queue.reverse()

        async def client():
            while queue and time.perf_counter() < deadline:
                i, item = queue.pop()
                await self.one(i, item)

        await asyncio.gather(*(client() for _ in range(concurrency)))

    async def open_loop(self, rate: float, burstiness: float, deadline: float) -> None:
        tasks = []
        for (i, item), gap in zip(
            enumerate(self.items),
            arrival_gaps(len(self.items), rate, burstiness, self.settings.seed),
            strict=True,
        ):
            await asyncio.sleep(gap)
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(self.one(i, item)))
        await asyncio.gather(*tasks)

    async def execute(self, mode: str, value: float, burstiness: float, duration: float) -> float:
        self.t0 = time.perf_counter()
        deadline = self.t0 + duration
        helpers = [asyncio.ensure_future(self.sample_cache())]
        if self.progress:
            helpers.append(asyncio.ensure_future(self.report_progress(len(self.items))))
        try:
            if mode == "concurrency":
                await self.closed_loop(int(value), deadline)
            else:
                await self.open_loop(value, burstiness, deadline)
        finally:
            for h in helpers:
                h.cancel()
            if self.progress and sys.stderr.isatty():
                print(file=sys.stderr)
        duration = time.perf_counter() - self.t0
        # the closing counters (preemptions, prefix hits over the whole run)
        await self.sample_once()
        return duration
