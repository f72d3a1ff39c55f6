"""pagedserve against llama.cpp's server on the same GGUF, same run: `make bench-cpu-peers`.

llama.cpp is built from the `llama-cpp-python` source distribution on PyPI (it vendors llama.cpp): the
sdist is fetched with pip once, `llama-server` built with cmake for this machine, both cached under
~/.cache/pagedserve-peers. Both servers serve the default model's own Q4_1 GGUF on both cores:
  - one stream: the workload's first prompt (64 tokens), 128 greedy tokens, ignore_eos (median of 3);
  - many streams: the fixed CPU workload (64 prompts of 64-256 token ids, 128 tokens each, all at once);
    llama.cpp gets 64 slots with continuous batching.
Prompts go to both as the same token ids (pagedserve.v1 over gRPC; llama.cpp's /v1/completions takes
token-id prompts). Prints output tokens/s and mean TTFT, and each ratio pagedserve / llama.cpp.

    python -m deploy.bench_cpu_peers --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from deploy.bench import DEFAULT_WORKLOAD, _drive, load_workload
from deploy.bench_gateway import _http_pass
from deploy.local_server import ServerProcess, free_port, stop_group
from deploy.prepare_model import find_embedded_gguf

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("PAGEDSERVE_PEERS", Path.home() / ".cache" / "pagedserve-peers"))


def build_llama_server() -> Path:
    """llama-server built from the pinned sdist (once: a few minutes on two cores)."""
    binary = CACHE / "llama.cpp" / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        LLAMA_CPP_PYTHON, "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        target = CACHE / "llama.cpp"
        if target.exists():
            subprocess.run(["rm", "-rf", str(target)], check=True)
        source.rename(target)
    build = target / "build"
    subprocess.run(["cmake", "-S", str(target), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True)
    return binary


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, slots: int, context_per_slot: int, threads: int, log: Path):
        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
             "-c", str(slots * context_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
             "--no-webui"], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 300) -> LlamaServer:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("llama-server did not become healthy")

    def stop(self) -> None:
        stop_group(self.proc, 20)
        self.log.close()


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False}


def llama_cpp(args, prompts) -> dict:
    binary = build_llama_server()
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-peer-llama-"))
    server = LlamaServer(binary, args.gguf, args.slots, 384, args.threads, folder / "llama-server.log").wait()
    try:
        asyncio.run(_http_pass(server.base_url, [_body(prompts[0], 4)], "/v1/completions"))
        one = []
        for _ in range(args.repeats):
            r = asyncio.run(_http_pass(server.base_url, [_body(prompts[0], args.max_tokens)], "/v1/completions"))
            one.append((r["tokens"] - 1) / (r["wall_s"] - r["ttfts"][0]))
        many = asyncio.run(_http_pass(server.base_url, [_body(p, args.max_tokens) for p in prompts], "/v1/completions"))
    finally:
        server.stop()
    return {"name": "llama.cpp llama-server (Q4_1 GGUF)", "one_tok_s": statistics.median(one),
            "many_tok_s": many["tokens"] / many["wall_s"], "many_ttft_s": statistics.mean(many["ttfts"])}


def pagedserve(args, prompts) -> dict:
    from protos import generation_pb2

    log = Path(tempfile.mkdtemp(prefix="pagedserve-peer-")) / "server.log"
    server = ServerProcess(Path(args.model), log, "--metrics-port", "0").start(timeout=600)
    try:
        asyncio.run(_drive(server.address, prompts[:2], 4))
        one = []
        for _ in range(args.repeats):
            req = generation_pb2.GenerateRequest(prompt_token_ids=prompts[0], sampling=generation_pb2.SamplingParams(
                max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
            first, n = None, 0
            for msg in server.stub.GenerateStream(req, timeout=600):
                if msg.token_ids and first is None:
                    first = time.perf_counter()
                n += len(msg.token_ids)
            one.append((n - 1) / (time.perf_counter() - first))
        wall, ttfts, tokens = asyncio.run(_drive(server.address, prompts, args.max_tokens))
    finally:
        server.stop()
    return {"name": "pagedserve (the GGUF's blocks)", "one_tok_s": statistics.median(one), "many_tok_s": tokens / wall,
            "many_ttft_s": statistics.mean(ttfts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the prepared folder of the GGUF below")
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded model's Q4_1 file")
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)
    args.gguf = args.gguf or find_embedded_gguf()
    prompts = load_workload(args.workload)
    ours = pagedserve(args, prompts)
    peer = llama_cpp(args, prompts)
    print(f"{'':38} {'1 stream decode':>16} {'64 streams':>11} {'mean TTFT':>10}")
    for r in (ours, peer):
        print(f"{r['name']:38} {r['one_tok_s']:10.1f} tok/s {r['many_tok_s']:11.1f} {r['many_ttft_s']:9.2f}s")
    print(f"{'pagedserve / llama.cpp':38} {ours['one_tok_s'] / peer['one_tok_s']:16.2f} "
          f"{ours['many_tok_s'] / peer['many_tok_s']:11.2f} {ours['many_ttft_s'] / peer['many_ttft_s']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
