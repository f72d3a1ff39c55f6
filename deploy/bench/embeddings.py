"""Embeddings per second: pagedserve against sentence-transformers' `encode` and vLLM's CPU pooling
runner, same run: `make bench-embeddings`.

The model is Qwen3-Embedding-0.6B's shape with random weights (28 layers, hidden 1024, 16 query and
8 KV heads of 128, MLP 3072, vocabulary 151669, tied; bf16 safetensors without the `model.` prefix,
as it ships), made once under ~/.cache/pagedserve-peers, with sentence-transformers' files
(last-token pooling, normalize). Its tokenizer is a tiny test BPE (nothing can be downloaded): every
system reads the same files, so every system sees the same token ids.

  - throughput: a batch of --texts texts of --tokens tokens (512) each, embedded per call: sentence-
    transformers `encode(batch_size=--st-batch)` in this process, vLLM's /v1/embeddings with the
    batch as token-id lists (`--runner pooling`, its server in its own process group, all cores
    bound), pagedserve's Embed with the same ids. Rounds take each system in turn (the first
    rotating), so a slow spell of a noisy machine falls on all alike: medians over rounds, ratios
    per round.
  - beside generation (--beside): pagedserve with --task both; one greedy stream of --gen-tokens
    tokens alone, then the same stream while clients keep Embed calls of the batch's texts coming:
    its tokens/s beside the load over its tokens/s alone, per round.
Precision: --dtype float32 (default; every system computes in fp32) or bfloat16 (each in bf16).

    python -m deploy.bench.embeddings --rounds 3 --beside
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deploy.processes import free_port, stop_group
from tests.support.server import ServerProcess

CACHE = Path(os.environ.get("PAGEDSERVE_PEERS", Path.home() / ".cache" / "pagedserve-peers"))
VLLM_VENV = CACHE / "vllm"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
SHAPE = dict(
    vocab_size=151669,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151643,
)


def make_model(folder: Path) -> Path:
    """The Qwen3-Embedding-0.6B-shaped random model with its sentence-transformers files (once)."""
    if (folder / "modules.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModel

    from tests.support.tiny import make_tiny_embedder

    make_tiny_embedder(folder, "lasttoken", tied=True)  # the files around the weights
    for f in folder.glob("*.safetensors"):
        f.unlink()
    config = AutoConfig.for_model("qwen3", **SHAPE)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's own config says
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
    pool["word_embedding_dimension"] = SHAPE["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    return folder


def make_batch(
    folder: Path, texts: int, tokens: int, salt: int
) -> tuple[list[str], list[list[int]]]:
    """`texts` texts of about `tokens` tokens, each opening on its own words, and their ids."""
    from scheduler_service.text.tokenizer import Tokenizer
    from tests.support.tiny import CORPUS

    tok = Tokenizer(folder)
    words = CORPUS.split()
    out_texts, out_ids = [], []
    for i in range(texts):
        body = " ".join(words[(i * 7 + j) % len(words)] for j in range(tokens))
        ids = tok.encode(f"{salt} {i} {body}")[:tokens]
        text = tok.decode(ids)
        out_texts.append(text)
        out_ids.append(tok.encode(text))
    return out_texts, out_ids


class SentenceTransformers:
    name = "sentence-transformers"

    def __init__(self, folder: Path, dtype: str, batch_size: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(os.cpu_count() or 1)
        self.model = SentenceTransformer(
            str(folder), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)}
        )
        self.batch_size = batch_size

    def embed(self, texts, ids) -> int:
        import torch

        with torch.inference_mode():
            return len(self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True))

    def stop(self) -> None:
        pass


class VllmPooling:
    name = "vLLM"

    def __init__(self, folder: Path, dtype: str, log: Path, max_len: int) -> None:
        if not (VLLM_VENV / "bin" / "python").exists():
            raise SystemExit(
                f"vLLM's CPU build is not in {VLLM_VENV}: run ../shared/bench/vllm-cpu.sh once"
            )
        import httpx

        self.port = free_port()
        threads = os.cpu_count() or 1
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        if Path(TCMALLOC).exists():
            env["LD_PRELOAD"] = TCMALLOC
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [
                str(VLLM_VENV / "bin" / "python"),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(folder),
                "--runner",
                "pooling",
                "--dtype",
                dtype,
                "--max-model-len",
                str(max_len),
                "--no-enable-prefix-caching",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.http = httpx.Client(timeout=3600)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"vLLM exited ({self.proc.returncode}); see {log}")
            try:
                if self.http.get(f"http://127.0.0.1:{self.port}/v1/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise SystemExit(f"vLLM not ready in 900 s; see {log}")

    def embed(self, texts, ids) -> int:
        resp = self.http.post(
            f"http://127.0.0.1:{self.port}/v1/embeddings",
            json={
                "model": self.http.get(f"http://127.0.0.1:{self.port}/v1/models").json()["data"][0][
                    "id"
                ],
                "input": ids,
            },
        )
        resp.raise_for_status()
        return len(resp.json()["data"])

    def stop(self) -> None:
        stop_group(self.proc, 30)
        self.log.close()


class Pagedserve:
    name = "pagedserve"

    def __init__(self, folder: Path, dtype: str, log: Path, max_len: int, *extra: str) -> None:
        args = ["--max-model-len", str(max_len), "--dtype", dtype, *extra]
        self.server = ServerProcess(folder, log, *args).start(timeout=900)

    def embed(self, texts, ids) -> int:
        from protos import generation_pb2 as pb

        request = pb.EmbedRequest(inputs=[pb.TokenIds(ids=i) for i in ids])
        return len(self.server.stub.Embed(request, timeout=3600).data)

    def stop(self) -> None:
        self.server.stop()


def throughput(systems, folder: Path, args) -> dict:
    """Embeddings a second per system, a round at a time, texts always new."""
    salt = iter(range(1000, 10**6))
    for s in systems:  # warm-up: first calls pay one-time costs
        s.embed(*make_batch(folder, 2, args.tokens, next(salt)))
    rates = {s.name: [] for s in systems}
    for r in range(args.rounds):
        for s in systems[r % len(systems) :] + systems[: r % len(systems)]:
            texts, ids = make_batch(folder, args.texts, args.tokens, next(salt))
            t0 = time.perf_counter()
            n = s.embed(texts, ids)
            rates[s.name].append(n / (time.perf_counter() - t0))
            print(f"round {r}: {s.name:<22} {rates[s.name][-1]:8.3f} embeddings/s", flush=True)
    return rates


async def stream_rate(server: ServerProcess, tokens: int, salt: int) -> tuple[float, float, float]:
    """(output tok/s, TTFT, prompt tok/s) of one greedy stream over 64 random prompt ids."""
    import random

    import grpc

    from protos import generation_pb2 as pb
    from protos import generation_pb2_grpc

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompt = [random.Random(salt).randrange(1000, 150000) for _ in range(64)]
        req = pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        first = last = computed = None
        count = 0
        t0 = time.perf_counter()
        async for msg in stub.GenerateStream(req, timeout=3600):
            if msg.token_ids:
                last = time.perf_counter()
                if first is None:
                    first = last
                    computed = (await asyncio.to_thread(server.stats)).num_prompt_tokens_computed
                count += len(msg.token_ids)
        computed = (await asyncio.to_thread(server.stats)).num_prompt_tokens_computed - computed
        return (count - 1) / (last - first), first - t0, computed / (last - first)


async def beside(
    server: ServerProcess, folder: Path, args, salt: int
) -> tuple[float, float, float]:
    """stream_rate's figures for a stream beside clients sending Embed calls."""
    import grpc

    from protos import generation_pb2 as pb
    from protos import generation_pb2_grpc

    done = asyncio.Event()

    async def load(channel, k):
        stub = generation_pb2_grpc.GenerationStub(channel)
        i = 0
        while not done.is_set():
            _, batch = make_batch(folder, 4, args.tokens, salt + 1000 * k + i)
            await stub.Embed(
                pb.EmbedRequest(inputs=[pb.TokenIds(ids=b) for b in batch]), timeout=3600
            )
            i += 1

    async with grpc.aio.insecure_channel(server.address) as channel:
        tasks = [asyncio.create_task(load(channel, k)) for k in range(args.clients)]
        await asyncio.sleep(2.0)  # the load is running
        figures = await stream_rate(server, args.gen_tokens, salt % 10**4 + 1)
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return figures


def main(argv: list[str] | None = None) -> int:

    # one function: a benchmark's script read top to bottom
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=CACHE / "qwen3-embedding-0.6b-random")
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--st-batch", type=int, default=32, help="sentence-transformers' encode batch size"
    )
    p.add_argument(
        "--without", action="append", default=[], choices=("vllm", "st"), help="leave a peer out"
    )
    p.add_argument("--serve-flags", default="", help="extra flags for pagedserve")
    p.add_argument(
        "--beside", action="store_true", help="also: a generation stream beside an embedding load"
    )
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=2, help="embedding clients beside the stream")
    args = p.parse_args(argv)
    folder = make_model(args.model)
    print(
        f"model {folder}, {args.texts} texts of {args.tokens} tokens a call, {args.dtype}",
        flush=True,
    )
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    max_len = 2048
    systems = [
        Pagedserve(
            folder,
            args.dtype,
            logs / "bench-embed-pagedserve.log",
            max_len,
            *args.serve_flags.split(),
        )
    ]
    try:
        if "vllm" not in args.without:
            systems.append(VllmPooling(folder, args.dtype, logs / "bench-embed-vllm.log", max_len))
        if "st" not in args.without:
            systems.append(SentenceTransformers(folder, args.dtype, args.st_batch))
        rates = throughput(systems, folder, args)
    finally:
        for s in systems:
            s.stop()
    print(
        f"\nembeddings/s, median of {args.rounds} rounds ({args.texts} x {args.tokens} tokens, "
        f"{args.dtype}):"
    )
    for name, r in rates.items():
        print(f"  {name:<22} {statistics.median(r):8.3f}")
    for name in rates:
        if name != "pagedserve":
            ratios = [a / b for a, b in zip(rates["pagedserve"], rates[name], strict=True)]
            print(
                f"  pagedserve / {name:<22} x{statistics.median(ratios):.2f} (rounds: "
                f"{', '.join(f'{x:.2f}' for x in ratios)})"
            )
    if args.beside:
        server = ServerProcess(
            folder,
            logs / "bench-embed-both.log",
            "--task",
            "both",
            "--max-model-len",
            str(max_len),
            "--dtype",
            args.dtype,
            *args.serve_flags.split(),
        ).start(timeout=900)
        try:
            asyncio.run(stream_rate(server, 8, 0))  # warm-up
            ratios = []
            for r in range(args.rounds):
                alone, ttft_alone, _ = asyncio.run(stream_rate(server, args.gen_tokens, 2 * r + 1))
                rate, ttft, tps = asyncio.run(
                    beside(server, folder, args, 10**7 * (r + 1) + 2 * r + 2)
                )
                ratios.append(rate / alone)
                print(
                    f"round {r}: stream alone {alone:.2f} tok/s (TTFT {ttft_alone:.2f} s), beside "
                    f"the load {rate:.2f} tok/s (x{rate / alone:.2f}, TTFT {ttft:.2f} s); "
                    f"embedding tokens computed while it streamed: {tps:.0f}/s",
                    flush=True,
                )
            print(
                f"generation beside embeddings / alone: x{statistics.median(ratios):.2f} (median)"
            )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
