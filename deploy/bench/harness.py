"""What the benchmarks share: the fixed workload, driving a server with it (gRPC or HTTP streams), a
step plan made by hand for in-process timing, and timers."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "bench" / "cpu-workload-prompts.json"


def load_workload(path: Path) -> list[list[int]]:
    if not path.exists():
        raise SystemExit(f"workload {path} not found (pass --workload)")
    return json.loads(path.read_text())


async def drive(
    address: str, prompts: list[list[int]], max_tokens: int, loras: list[str] | None = None
) -> tuple[float, list[float], int]:
    """Every prompt streamed at once -> (wall seconds, TTFTs, output tokens)."""
    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()

        async def one(prompt, lora):
            req = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                lora=lora,
                sampling=generation_pb2.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                ),
            )
            ttft, n = None, 0
            async for msg in stub.GenerateStream(req, timeout=3600):
                if msg.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(msg.token_ids)
            return ttft, n

        loras = loras or [""] * len(prompts)
        results = await asyncio.gather(
            *(one(p, lora) for p, lora in zip(prompts, loras, strict=True))
        )
        wall = time.perf_counter() - t0
    return wall, [r[0] for r in results], sum(r[1] for r in results)


async def http_pass(
    base_url: str, bodies: list[dict], path: str, concurrency: int | None = None
) -> dict:
    """Stream every body to base_url+path -> wall seconds, TTFTs, tokens."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits
    ) as http:
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(concurrency or len(bodies))

        async def one(body):
            async with gate:
                sent = time.perf_counter()
                ttft, tokens = None, 0
                async with http.stream("POST", base_url + path, json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(
                            f"{path}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                        )
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        # a token's chunk: text, or none (a token with no text of its own:
                        # llama-server sends a chunk a token)
                        if ttft is None and (
                            chunk.get("output_ids")
                            or any(
                                c.get("text") or c.get("finish_reason") is None
                                for c in chunk.get("choices") or ()
                            )
                        ):
                            ttft = time.perf_counter() - (sent if concurrency else t0)
                        if "meta_info" in chunk and chunk["meta_info"].get("finish_reason"):
                            tokens = chunk["meta_info"]["completion_tokens"]
                        elif chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                return ttft, tokens

        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttfts": [r[0] for r in results], "tokens": sum(r[1] for r in results)}


def step_plan(
    seqs: list[tuple[int, int]],
    block: int = 16,
    step_id: int = 1,
    vocab: int = 40000,
    hybrid: bool = False,
):
    """A StepPlan for each (new_tokens, seq_len), blocks in order -> (plan, blocks used); with
    hybrid, sequence i in state slot i.
    """
    import numpy as np

    from protos.codec import PlanArrays, encode_plan

    need = [-(-n // block) for _, n in seqs]
    tables = np.full((len(seqs), max(need)), -1, dtype="<i4")
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = np.arange(start, start + n)
        start += n
    q_lens = np.array([q for q, _ in seqs])
    seq_lens = np.array([n for _, n in seqs], dtype="<i4")
    rows = np.repeat(np.arange(len(seqs)), q_lens)
    pos = np.concatenate([np.arange(n - q, n) for q, n in seqs])
    slots = tables[rows, pos // block].astype("<i8") * block + pos % block
    k = len(seqs)
    qsl = np.zeros(k + 1, dtype="<i4")
    np.cumsum(q_lens, out=qsl[1:])
    rng = np.random.default_rng(0)
    plan = encode_plan(
        PlanArrays(
            step_id=step_id,
            token_ids=rng.integers(min(100, vocab - 1), vocab, len(pos)).astype("<i4"),
            positions=pos.astype("<i4"),
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            do_sample=np.ones(k, bool),
            sample_index=np.zeros(k, "<i4"),
            temperature=np.zeros(k, "<f4"),
            top_p=np.ones(k, "<f4"),
            top_k=np.zeros(k, "<i4"),
            seed=np.zeros(k, "<u8"),
            block_copies=np.empty((0, 2), "<i4"),
            state_slots=np.arange(k, dtype="<i4") if hybrid else None,
        )
    )
    return plan, start


def best(fn, reps: int) -> float:
    """The fastest of `reps` timed calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def median_time(fn, reps=3) -> float:
    """The median of `reps` timed calls."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Tally:
    """Wall time spent inside chosen methods of chosen objects while active (restored on exit)."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.targets = targets
        self.seconds: dict[str, float] = {}

    def __enter__(self):
        self.saved = []
        for label, (obj, name) in self.targets.items():
            real = getattr(obj, name)
            self.saved.append((obj, name, obj.__dict__.get(name)))

            def timed(*a, _real=real, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    self.seconds[_label] = self.seconds.get(_label, 0.0) + time.perf_counter() - t

            setattr(obj, name, timed)
        return self

    def __exit__(self, *exc):
        for obj, name, before in reversed(self.saved):
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


def paged_inputs(batch, context, n_heads, n_kv, head_dim, block, dtype, device):
    import torch

    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block, n_kv, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)  # scattered blocks
    tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, n_heads, head_dim, dtype=dtype, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def time_cuda(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
