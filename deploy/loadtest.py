"""pagedserve-loadtest: load-test any pagedserve endpoint, the way vLLM's `bench serve` does, plus what a
gRPC server with cache accounting allows (KV utilization, preemptions, prefix hits, leaked blocks).

    pagedserve-loadtest --target localhost:50051 --num-requests 200 --rate 4 --input-len 256 --output-len 128
    pagedserve-loadtest --target HOST:PORT --sweep 6 --output sweep.json --plot plots/
    pagedserve-loadtest --target HOST:PORT --dataset ../shared/bench/cpu-workload-prompts.json --concurrency 64
    pagedserve-loadtest --target http://127.0.0.1:8000 --concurrency 16     # any OpenAI-compatible server

An http(s):// target is driven through its OpenAI API (/v1/completions, streamed): synthetic prompts go as
token-id lists, or with --tokenizer FOLDER as their text (SMG takes text only; the prompt length is then
what the server counts); the same client-side figures; the server-side ones (KV utilization,
preemptions, prefix hits, leaked blocks) need pagedserve's own gRPC and are left out.

Closed loop (--concurrency C: C clients, each sends its next request when the last one ends), open loop
(--rate R requests/s: Poisson arrivals when --burstiness is 1, gamma-distributed gaps otherwise, CV^2 =
1/G), or a sweep (a synchronous pass, a saturating pass, then K-2 open-loop rates evenly between their
request rates). A run stops at --num-requests or --duration, whichever comes first; Ctrl-C ends it with
the partial result written.

Definitions (vLLM's): TTFT from send to the first token; TPOT = (E2EL - TTFT) / (output tokens - 1);
ITL = gaps between consecutive messages that carry tokens; E2EL from send to the last message. Cancelled
(--abort-fraction) requests count apart and are not in the latency figures. Times are milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import generation_pb2, generation_pb2_grpc


class TargetError(Exception):
    """A request the target refused or failed; str() is the status (a gRPC code name, or HTTP_<code>)."""


class GrpcTarget:
    """pagedserve.v1 over gRPC: streams, cache accounting, leak check."""

    def __init__(self, channel) -> None:
        self.stub = generation_pb2_grpc.GenerationStub(channel)

    async def info(self) -> tuple[str, int]:
        info = await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=60)
        return info.model_name, info.vocab_size

    async def stream(self, item, index: int, s):
        """Yields (new output tokens, prompt tokens or None, timed) per message that carries tokens."""
        sampling = generation_pb2.SamplingParams(max_tokens=item.output_len, temperature=s.temperature,
                                                 seed=s.seed + index, ignore_eos=s.ignore_eos)
        req = generation_pb2.GenerateRequest(sampling=sampling)
        if item.prompt_token_ids is not None:
            req.prompt_token_ids.extend(item.prompt_token_ids)
        else:
            req.prompt = item.prompt
        call = self.stub.GenerateStream(req, timeout=s.timeout)
        try:
            async for msg in call:
                prompt_tokens = msg.usage.prompt_tokens if msg.HasField("usage") else None
                if msg.token_ids or prompt_tokens is not None:
                    yield len(msg.token_ids), prompt_tokens, bool(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            raise TargetError(e.code().name) from e
        finally:
            call.cancel()

    async def cache_stats(self) -> dict | None:
        try:
            st = await self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return None
        return dict(utilization=st.utilization, preemptions=st.num_preemptions, prefix_hits=st.prefix_cache_hits,
                    prefix_queries=st.prefix_cache_queries, running=st.num_running, waiting=st.num_waiting)

    async def leaked_blocks(self, timeout: float = 30.0) -> int | None:
        """Once the server is idle: blocks neither free nor cached (0 unless blocks leaked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = await self.stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return None
            if st.num_running == 0 and st.num_waiting == 0:
                return st.num_blocks - st.num_free_blocks - st.num_cached_blocks
            await asyncio.sleep(0.2)
        return None


class OpenAITarget:
    """An OpenAI-compatible HTTP server (SMG in front of pagedserve, vLLM, llama.cpp's server, ...):
    streamed /v1/completions. Output tokens come from the final usage when the server sends one (each
    content chunk counts one until then); no server-side figures."""

    def __init__(self, base_url: str, model: str | None, vocab_size: int, api_key: str | None = None,
                 tokenizer: str | None = None) -> None:
        import httpx

        if tokenizer:
            from scheduler_service.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(tokenizer)
            vocab_size = min(vocab_size, self.tokenizer.vocab_size)
        else:
            self.tokenizer = None
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.vocab_size = vocab_size
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), headers=headers,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))

    async def info(self) -> tuple[str, int]:
        if self.model is None:
            resp = await self.http.get(f"{self.base_url}/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.model, self.vocab_size

    async def stream(self, item, index: int, s):
        prompt = item.prompt
        if item.prompt_token_ids is not None:
            prompt = self.tokenizer.decode(item.prompt_token_ids) if self.tokenizer else item.prompt_token_ids
        body = {"model": self.model, "max_tokens": item.output_len, "temperature": s.temperature,
                "seed": s.seed + index, "stream": True, "stream_options": {"include_usage": True}, "prompt": prompt}
        if s.ignore_eos:
            body["ignore_eos"] = True
        counted = 0
        async with self.http.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise TargetError(f"HTTP_{resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise TargetError("STREAM_ERROR")
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    counted += 1
                    yield 1, None, True
                usage = chunk.get("usage")
                if usage:
                    yield max(0, usage.get("completion_tokens", counted) - counted), usage.get("prompt_tokens"), False

    async def cache_stats(self) -> dict | None:
        return None

    async def leaked_blocks(self) -> int | None:
        return None

    async def close(self) -> None:
        await self.http.aclose()

PERCENTILES = (50, 90, 99)


# --- the workload -------------------------------------------------------------------------------------
@dataclass
class Item:
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    output_len: int = 128


def synthetic(n: int, input_len: int, output_len: int, range_ratio: float, shared_prefix_len: int, vocab: int,
              seed: int) -> list[Item]:
    """Token prompts of input_len +- range_ratio (uniform), every one starting with the same shared prefix."""
    rng = random.Random(seed)
    low_id = min(100, vocab // 2)
    prefix = [rng.randrange(low_id, vocab) for _ in range(shared_prefix_len)]

    def around(x: int) -> int:
        return max(1, rng.randint(math.floor(x * (1 - range_ratio)), math.ceil(x * (1 + range_ratio))))

    return [Item(prompt_token_ids=prefix + [rng.randrange(low_id, vocab) for _ in range(around(input_len))],
                 output_len=around(output_len)) for _ in range(n)]


def load_dataset(path: Path, output_len: int, shared_prefix_len: int, vocab: int, seed: int) -> list[Item]:
    """JSON (a list) or JSONL; each entry a list of token ids, a string, or an object with `prompt` or
    `prompt_token_ids` and optionally `output_len`."""
    text = path.read_text()
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = random.Random(seed)
    prefix = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(shared_prefix_len)]
    items = []
    for row in rows:
        if isinstance(row, list):
            item = Item(prompt_token_ids=[int(t) for t in row], output_len=output_len)
        elif isinstance(row, str):
            item = Item(prompt=row, output_len=output_len)
        else:
            ids = row.get("prompt_token_ids")
            item = Item(prompt_token_ids=[int(t) for t in ids] if ids is not None else None,
                        prompt=row.get("prompt"), output_len=int(row.get("output_len", output_len)))
        if item.prompt_token_ids is not None:
            item.prompt_token_ids = prefix + item.prompt_token_ids
        items.append(item)
    if not items:
        raise SystemExit(f"{path}: no prompts")
    return items


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between n arrivals of mean rate `rate`/s: gamma(shape=burstiness, scale=1/(rate x burstiness));
    burstiness 1 is Poisson, lower is burstier (CV^2 = 1/burstiness). Infinite rate: all at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# --- one run ------------------------------------------------------------------------------------------
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


class Run:
    """One load pattern against one target; samples GetCacheStats while it runs."""

    def __init__(self, target, items: list[Item], settings: Settings, label: str, progress: bool = True) -> None:
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
            print(f"[{self.label}] {now - self.t0:6.1f}s  done {done}/{total}  failed {failed}  "
                  f"{rate:8.1f} tok/s", end=end, file=sys.stderr, flush=True)

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
        for (i, item), gap in zip(enumerate(self.items), arrival_gaps(len(self.items), rate, burstiness,
                                                                       self.settings.seed), strict=True):
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
        await self.sample_once()  # the closing counters (preemptions, prefix hits over the whole run)
        return duration


# --- figures ------------------------------------------------------------------------------------------
def distribution(values_s: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max in milliseconds (linear interpolation between ranks, as numpy does)."""
    if not values_s:
        return {k: 0.0 for k in ("mean", "p50", "p90", "p99", "max")}
    xs = sorted(v * 1000.0 for v in values_s)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    out = {"mean": sum(xs) / len(xs)}
    out.update({f"p{p}": pct(p) for p in PERCENTILES})
    out["max"] = xs[-1]
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            raise SystemExit(f"--slo: unknown figure {key!r} (use ttft_ms, tpot_ms, itl_ms, e2el_ms)")
        slo[key] = float(value)
    return slo


def summarize(run: Run, duration: float, slo: dict[str, float], leaked: int | None, extra: dict) -> dict:
    done = [o for o in run.outcomes if o.e2el is not None and not o.error and not o.aborted]
    failed = [o for o in run.outcomes if o.error]
    errors: dict[str, int] = {}
    for o in failed:
        errors[o.error] = errors.get(o.error, 0) + 1
    tpots = [(o.e2el - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.input_len for o in done)

    def meets(o: Outcome) -> bool:
        figures = {"ttft_ms": o.ttft * 1000, "e2el_ms": o.e2el * 1000,
                   "tpot_ms": (o.e2el - o.ttft) / (o.output_tokens - 1) * 1000 if o.output_tokens > 1 else 0.0,
                   "itl_ms": max(o.itl, default=0.0) * 1000}
        return all(figures[k] <= v for k, v in slo.items())

    result = {
        **extra,
        "completed": len(done), "failed": len(failed), "aborted": sum(o.aborted for o in run.outcomes),
        "errors": errors, "duration_s": duration,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": distribution([o.ttft for o in done]), "tpot_ms": distribution(tpots),
        "itl_ms": distribution([g for o in done for g in o.itl]), "e2el_ms": distribution([o.e2el for o in done]),
    }
    if slo:
        result["slo"] = slo
        result["goodput"] = sum(meets(o) for o in done) / duration
    stats = [s for s in run.samples if "utilization" in s]
    if stats:
        dq = stats[-1]["prefix_queries"] - stats[0]["prefix_queries"]
        result["cache"] = {
            "peak_utilization": max(s["utilization"] for s in stats),
            "preemptions": stats[-1]["preemptions"] - stats[0]["preemptions"],
            "prefix_cache_hit_rate": (stats[-1]["prefix_hits"] - stats[0]["prefix_hits"]) / dq if dq else 0.0,
        }
    result["leaked_blocks"] = leaked
    result["timeline"] = run.samples
    return result


HEADLINE = [("completed", "{:.0f}"), ("failed", "{:.0f}"), ("aborted", "{:.0f}"), ("duration_s", "{:.1f}"),
            ("request_throughput", "{:.2f}"), ("output_throughput", "{:.1f}"), ("total_token_throughput", "{:.1f}"),
            ("goodput", "{:.2f}")]
LATENCIES = ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]


def block(r: dict) -> str:
    """One run, one figure a line (as vLLM's `bench serve` prints it)."""
    lines = [f"{'=' * 18} {r['label']} {'=' * 18}"]
    units = {"duration_s": "", "request_throughput": " req/s", "output_throughput": " tok/s",
             "total_token_throughput": " tok/s", "goodput": " req/s"}
    for key, fmt in HEADLINE:
        if key in r:
            name = key.removesuffix("_s").replace("_", " ") + (" (s)" if key == "duration_s" else "")
            lines.append(f"{name:<28}{fmt.format(r[key]) + units.get(key, ''):>20}")
    if r["errors"]:
        lines.append(f"{'errors':<28}{json.dumps(r['errors']):>14}")
    for key in LATENCIES:
        d = r[key]
        lines.append(f"{key.removesuffix('_ms').upper() + ' (ms)':<14}" + "".join(
            f"{name} {d[name]:>9.1f}   " for name in ("mean", "p50", "p90", "p99", "max")))
    cache = r.get("cache")
    if cache:
        lines.append(f"{'KV cache':<14}peak utilization {cache['peak_utilization']:.0%}, "
                     f"preemptions {cache['preemptions']}, prefix-cache hit rate {cache['prefix_cache_hit_rate']:.0%}")
    lines.append(f"{'leaked blocks':<28}{r['leaked_blocks'] if r['leaked_blocks'] is not None else 'unknown':>14}")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    if len(results) == 1:
        return block(results[0])
    lines = []
    header = f"{'run':<22}{'done':>6}{'fail':>6}{'req/s':>8}{'out tok/s':>11}" + "".join(
        f"{k.removesuffix('_ms') + ' p50/p99 ms':>22}" for k in LATENCIES) + f"{'peak KV':>9}{'leaked':>8}"
    lines.append(header)
    for r in results:
        row = (f"{r['label']:<22}{r['completed']:>6}{r['failed']:>6}{r['request_throughput']:>8.2f}"
               f"{r['output_throughput']:>11.1f}")
        for k in LATENCIES:
            row += f"{r[k]['p50']:>12.1f} /{r[k]['p99']:>8.1f}"
        cache = r.get("cache") or {}
        row += f"{cache.get('peak_utilization', 0) * 100:>8.0f}%{r['leaked_blocks'] if r['leaked_blocks'] is not None else '?':>8}"
        lines.append(row)
        if r.get("errors"):
            lines.append(f"{'':<22}errors: {r['errors']}")
        if "goodput" in r:
            lines.append(f"{'':<22}goodput {r['goodput']:.2f} req/s meeting {r['slo']}")
    return "\n".join(lines)


def compare(new: list[dict], old_path: Path) -> str:
    old = json.loads(old_path.read_text())
    old = old if isinstance(old, list) else [old]
    lines = [f"change against {old_path}:"]
    for a, b in zip(old, new, strict=False):
        parts = []
        for key, _ in HEADLINE:
            if key in a and key in b and isinstance(a[key], (int, float)) and a[key]:
                parts.append(f"{key} {b[key] / a[key] - 1:+.1%}")
        for key in LATENCIES:
            for p in ("p50", "p99"):
                if a[key][p]:
                    parts.append(f"{key.removesuffix('_ms')} {p} {b[key][p] / a[key][p] - 1:+.1%}")
        lines.append(f"  {b['label']}: " + ", ".join(parts))
    return "\n".join(lines)


def plot(results: list[dict], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), strict=True):
            xs = sorted(r["samples_ms"][key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["label"])
    for ax, key in zip(axes, ("TTFT", "TPOT", "E2E latency"), strict=True):
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        tl = r["timeline"]
        ts = [s["t"] for s in tl]
        rates = [0.0] + [(b["output_tokens"] - a["output_tokens"]) / max(b["t"] - a["t"], 1e-9)
                         for a, b in zip(tl, tl[1:], strict=False)]
        ax1.plot(ts, rates, label=r["label"])
        ax2.plot([s["t"] for s in tl if "utilization" in s], [s["utilization"] * 100 for s in tl if "utilization" in s])
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("KV pool used (%)")
    ax2.set_xlabel("seconds into the run")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "timeline.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    if len(results) > 1:
        curve = sorted(results, key=lambda r: r["output_throughput"])
        fig, ax = plt.subplots(figsize=(7, 5))
        ax.plot([r["output_throughput"] for r in curve], [r["e2el_ms"]["p50"] / 1000 for r in curve], "o-",
                label="p50 E2E latency")
        ax.plot([r["output_throughput"] for r in curve], [r["ttft_ms"]["p99"] / 1000 for r in curve], "s--",
                label="p99 TTFT")
        for r in curve:
            ax.annotate(r["label"], (r["output_throughput"], r["e2el_ms"]["p50"] / 1000), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_title("throughput against latency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(folder / "sweep.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


# --- main ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve-loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None,
                   help="HOST:PORT of a pagedserve, or http(s)://HOST:PORT of any OpenAI-compatible server "
                        "(default: start a pagedserve, see --model)")
    p.add_argument("--served-model", default=None, help="with an http target: the model name to ask for "
                   "(default: the first of its /v1/models)")
    p.add_argument("--vocab-size", type=int, default=32000, help="with an http target: synthetic prompts draw "
                   "token ids below this (every common vocabulary has at least 32000)")
    p.add_argument("--api-key", default=None, help="with an http target: sent as a bearer token")
    p.add_argument("--tokenizer", default=None, help="with an http target: a model folder whose tokenizer turns "
                   "synthetic prompts into text (needed where the server takes no token ids, as SMG)")
    p.add_argument("--model", default=None, help="with no --target: serve this model folder for the run")
    p.add_argument("--server-args", default="", help="with no --target: extra flags for the server it starts")
    p.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--duration", type=float, default=600.0, help="stop sending after this many seconds")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients")
    load.add_argument("--rate", type=float, default=None, help="open loop: requests per second (inf: all at once)")
    load.add_argument("--sweep", type=int, default=None, help="K runs: synchronous, saturating, K-2 rates between")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-X), L(1+X)]")
    p.add_argument("--dataset", type=Path, default=None, help="JSON/JSONL prompts (text or token ids, output_len)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="every prompt starts with the same P tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--abort-fraction", type=float, default=0.0, help="cancel this fraction of requests mid-way")
    p.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50")
    p.add_argument("--output", type=Path, default=None, help="write the result (a list for a sweep) as JSON")
    p.add_argument("--plot", type=Path, default=None, help="draw latency CDFs, timelines and the sweep curve here")
    p.add_argument("--compare", type=Path, default=None, help="print the change against an earlier --output")
    p.add_argument("--warmup", type=int, default=4,
                   help="requests sent one at a time (from the same workload) before measuring, not counted")
    p.add_argument("--no-progress", action="store_true")
    return p


async def run_all(args: argparse.Namespace, target: str, results: list[dict]) -> None:
    """Runs the plan, appending each run's result to `results` (so Ctrl-C keeps what was measured)."""
    if target.startswith(("http://", "https://")):
        http = OpenAITarget(target, args.served_model, args.vocab_size, args.api_key, args.tokenizer or args.model)
        try:
            await run_plan(args, http, results)
        finally:
            await http.close()
        return
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        channel = grpc.aio.secure_channel(target, creds)
    else:
        channel = grpc.aio.insecure_channel(target)
    async with channel:
        await run_plan(args, GrpcTarget(channel), results)


async def run_plan(args: argparse.Namespace, target, results: list[dict]) -> None:
    model_name, vocab_size = await target.info()

    def workload(k: int) -> list[Item]:
        """Run k's prompts: synthetic ones are fresh for every run of a sweep (a later run must not find
        an earlier run's prompts in the prefix cache); a dataset is what it is."""
        if args.dataset:
            rows = load_dataset(args.dataset, args.output_len, args.shared_prefix_len, vocab_size, args.seed)
            return (rows * math.ceil(args.num_requests / len(rows)))[: args.num_requests]
        return synthetic(args.num_requests, args.input_len, args.output_len, args.range_ratio,
                         args.shared_prefix_len, vocab_size, args.seed + 7919 * k)

    items = workload(0)
    settings = Settings(args.temperature, args.seed, args.ignore_eos, args.abort_fraction)
    slo = parse_slo(args.slo)
    if args.warmup:  # first requests pay one-time costs (allocations, kernel choices): not measured
        warm = synthetic(args.warmup, args.input_len, args.output_len, args.range_ratio, 0, vocab_size,
                         args.seed - 1) if not args.dataset else items[: args.warmup]
        await Run(target, warm, Settings(args.temperature, args.seed), "warm-up",
                  progress=False).execute("concurrency", 1, 1.0, args.duration)
    if args.sweep:
        if args.sweep < 2:
            raise SystemExit("--sweep needs at least 2 points (synchronous and saturating)")
        plan = [("concurrency", 1.0, "synchronous"), ("rate", math.inf, "saturating")]
    elif args.concurrency:
        plan = [("concurrency", float(args.concurrency), f"concurrency {args.concurrency}")]
    else:
        rate = args.rate if args.rate is not None else math.inf
        plan = [("rate", rate, f"rate {rate:g}/s" if not math.isinf(rate) else "all at once")]
    i = 0
    while i < len(plan):
        mode, value, label = plan[i]
        run = Run(target, workload(i), settings, label, progress=not args.no_progress)
        try:
            duration = await run.execute(mode, value, args.burstiness, args.duration)
        except asyncio.CancelledError:  # Ctrl-C: keep what was measured
            duration = time.perf_counter() - run.t0
            results.append(finish(run, duration, slo, None, mode, value, args, model_name))
            raise
        leaked = await target.leaked_blocks()
        results.append(finish(run, duration, slo, leaked, mode, value, args, model_name))
        if args.sweep and i == 1:  # K-2 open-loop rates evenly between the two passes' request rates
            lo, hi = results[0]["request_throughput"], results[1]["request_throughput"]
            for k in range(1, args.sweep - 1):
                r = lo + (hi - lo) * k / (args.sweep - 1)
                plan.append(("rate", r, f"rate {r:.2f}/s"))
        i += 1


def finish(run: Run, duration: float, slo, leaked, mode, value, args, model_name: str) -> dict:
    extra = {"label": run.label, "target_model": model_name, "mode": mode,
             "value": None if math.isinf(value) else value, "burstiness": args.burstiness}
    result = summarize(run, duration, slo, leaked, extra)
    done = [o for o in run.outcomes if o.e2el is not None and not o.error and not o.aborted]
    result["samples_ms"] = {"ttft_ms": [o.ttft * 1000 for o in done], "e2el_ms": [o.e2el * 1000 for o in done],
                            "tpot_ms": [(o.e2el - o.ttft) / (o.output_tokens - 1) * 1000 for o in done
                                        if o.output_tokens > 1]}
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = None
    target = args.target
    if target is None:
        if not args.model:
            raise SystemExit("give --target HOST:PORT, or --model FOLDER to serve one for the run")
        import shlex
        import tempfile

        from deploy.testing import ServerProcess

        log = Path(tempfile.mkdtemp(prefix="pagedserve-loadtest-")) / "server.log"
        print(f"starting a server on {args.model} (log: {log})", file=sys.stderr)
        server = ServerProcess(Path(args.model), log, *shlex.split(args.server_args)).start(timeout=600)
        target = server.address
    results: list[dict] = []
    loop = asyncio.new_event_loop()
    task = loop.create_task(run_all(args, target, results))
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    interrupted = False
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        interrupted = True
        print("\ninterrupted: writing the partial result", file=sys.stderr)
    finally:
        loop.close()
        if server is not None:
            server.stop()
    if interrupted and not results:
        return 130
    print(table(results))
    if args.output:
        args.output.write_text(json.dumps(results if args.sweep else results[0], indent=1))
        print(f"result written to {args.output}")
    if args.plot:
        for path in plot(results, args.plot):
            print(f"plot written to {path}")
    if args.compare:
        print(compare(results, args.compare))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
