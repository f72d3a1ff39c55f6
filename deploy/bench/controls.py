"""What request controls cost: the fixed workload's prompts through one server, plain and with each
control, rounds interleaved (plain, control, plain, control...) so every ratio compares readings of
the same minutes.

    python -m deploy.bench.controls --model .models/smollm2-135m-instruct      # make bench-controls

Modes: logprobs (K = 5 with every token), penalties (repetition 1.1, presence and frequency 0.5),
bias (logit_bias on 20 tokens, min_p 0.05, min_tokens), regex (a pattern no output can finish within
max_tokens, so every token of every row is masked), json (a JSON Schema; outputs end when the object
is complete). Each prints output tokens/s and its ratio to the plain rounds around it. In process,
it also times the scheduler's mask computation for a batch of constrained rows (llguidance's
parallel executor).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, load_workload

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
}

MODES = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "bias": {"logit_bias": {t: 1.5 for t in range(100, 120)}, "min_p": 0.05, "min_tokens": 16},
    "regex": {"regex": "[a-z ,.]{2000}"},
    "json": {"json_schema": json.dumps(PERSON)},
}


async def drive(
    address: str, prompts: list[list[int]], max_tokens: int, controls: dict, temperature: float
) -> tuple[float, int]:
    import grpc

    from protos import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()

        async def one(i, prompt):
            sampling = generation_pb2.SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                seed=i,
                ignore_eos="json_schema" not in controls,
                **controls,
            )
            resp = await stub.Generate(
                generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling),
                timeout=3600,
            )
            return len(resp.choices[0].token_ids)

        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, sum(counts)


def mask_timing(model: str, rows: int, kind: str) -> float:
    """Mean seconds a step for `rows` constrained rows' masks, a new state per row each step."""
    from scheduler_service.core.config import ModelSpec
    from scheduler_service.text.structured import GrammarEngine
    from scheduler_service.text.tokenizer import Tokenizer

    spec = ModelSpec.from_folder(model)
    tok = Tokenizer(model)
    engine = GrammarEngine(tok.to_json(), spec.vocab_size, spec.eos_token_ids)
    field = "json_schema" if kind == "json" else "regex"
    compiled = engine.compile(**{field: MODES[kind][field]})
    words = ["ada", "grace", "linus", "barbara", "ken", "margaret", "dennis", "frances"]
    texts = []
    for i in range(rows):
        if kind == "json":
            texts.append(
                json.dumps(
                    {
                        "name": f"{words[i % 8].title()} {words[(i + 3) % 8].title()}",
                        "age": 20 + i,
                        "hobbies": [words[(i + k) % 8] for k in range(3)],
                    }
                )
            )
        else:
            texts.append(" ".join(words[(i + k) % 8] for k in range(40)) + ", " + words[i % 8])
    streams = [tok.encode_prompt(t, raw=True) for t in texts]
    steps = min(len(s) for s in streams)
    matchers = [engine.matcher(compiled) for _ in range(rows)]
    total = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        engine.fill_masks(matchers)
        total += time.perf_counter() - t0
        for m, stream in zip(matchers, streams, strict=True):
            m.consume_token(stream[step])
    return total / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_controls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "plain"))
    p.add_argument("--kv-cache-memory", default="1GiB")
    args = p.parse_args(argv)
    prompts = load_workload(args.workload)[: args.num_requests]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(MODES)}")

    from tests.support.server import ServerProcess

    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-controls-")) / "server.log"
    server = ServerProcess(
        Path(args.model),
        log,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-model-len",
        "4096",
        "--log-format",
        "json",
    ).start()
    rates: dict[str, list[float]] = {m: [] for m in modes}
    beside: dict[str, list[float]] = {m: [] for m in modes}  # the plain rounds next to each mode's
    try:
        # a whole round to warm
        asyncio.run(drive(server.address, prompts, args.max_tokens, {}, args.temperature))
        for _ in range(args.rounds):
            for mode in modes:
                for name in ("plain", mode):
                    wall, tokens = asyncio.run(
                        drive(
                            server.address, prompts, args.max_tokens, MODES[name], args.temperature
                        )
                    )
                    (rates if name == mode else beside)[mode].append(tokens / wall)
                    print(
                        f"  {name:<10} {tokens:6d} tokens in {wall:6.2f} s = {tokens / wall:7.1f} "
                        "tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        server.stop()
    print(
        f"{len(prompts)} requests x up to {args.max_tokens} tokens, temperature "
        f"{args.temperature}, {args.rounds} round(s) each"
    )
    print(f"{'mode':<10} {'tok/s':>8} {'plain beside it':>16} {'ratio':>6}")
    for mode in modes:
        rate, plain = statistics.median(rates[mode]), statistics.median(beside[mode])
        print(f"{mode:<10} {rate:8.1f} {plain:16.1f} {rate / plain:6.2f}")
    for kind in ("json", "regex"):
        for rows in (1, 16, 64):
            print(
                f"masks of {rows:>2} {kind} rows, mean per step (scheduler, in process): "
                f"{mask_timing(args.model, rows, kind) * 1e3:.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
